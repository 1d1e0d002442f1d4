"""The policy API (Table 4.5) built on the data management API only.

A `Policy` turns the program's hints into data movement.  Subclasses override
the hooks — `placement` (where a new object goes), `victims` (which objects to
start evicting from, in order), `on_use` (what a use does), and the tracking
hooks `on_fast` / `on_slow` / `forget` — and inherit correct implementations of
the operations: `alloc_fast`, `alloc_slow`, `new`, `in_fast`, `read_use`,
`write_use`, `unsafe_free`, `prefetch`, `evict`, `softevict`.

Invariant kept here (and verified by `check`): if an object has a region on the
fast device, that region is its primary.
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator

from ..errors import InvariantError, OutOfMemoryError, PinnedError
from ..manager import Manager, Object, Region


class Policy:
    """Base class for placement policies; see the module docstring for the hooks.

    ``collect_at``: when set (a fraction like 0.8), an allocation that finds the
    slow device this full first runs Python's garbage collector and drains the
    manager's free queue, as the dissertation's GC-reliant modes do.  (The fast
    device is full by design; running out of room there triggers eviction, and
    a collection only when eviction cannot make room.)
    """

    def __init__(self, collect_at: float | None = None):
        self.manager: Manager | None = None
        self.collect_at = collect_at

    # ------------------------------------------------------------------ wiring
    def attach(self, manager: Manager) -> None:
        if self.manager is not None and self.manager is not manager:
            raise ValueError("this policy is already attached to another manager")
        self.manager = manager
        self.fast = manager.fast
        self.slow = manager.slow

    @property
    def m(self) -> Manager:
        if self.manager is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a manager: Manager(fast, slow, policy=...)")
        return self.manager

    # ------------------------------------------------------------------ hooks for subclasses
    def placement(self, nbytes: int):
        """Device a new object of ``nbytes`` should go to (default: the fast device)."""
        return self.fast

    def victims(self, nbytes: int) -> Iterable[Object]:
        """Objects in the fast device to start evicting from, best first (default: none)."""
        return ()

    def on_use(self, obj: Object, write: bool) -> None:
        """Called on every read or write use, after the dirty bit is set for writes."""

    def on_fast(self, obj: Object) -> None:
        """``obj``'s primary has just become a fast region (allocated or prefetched)."""

    def on_slow(self, obj: Object) -> None:
        """``obj``'s primary has just left the fast device."""

    def on_softevict(self, obj: Object) -> None:
        """Hint that ``obj`` will not be used for a while (default: ignored)."""

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        """``obj_id`` is about to be freed (its ``regions`` are still live); drop any tracking."""

    # ------------------------------------------------------------------ the policy API (Table 4.5)
    def new(self, nbytes: int) -> Object:
        """Allocate an object where `placement` says; fall back to the slow device if the fast one cannot fit it."""
        with self.m.lock():
            if self.placement(nbytes) is self.fast and nbytes <= self.fast.capacity:
                region = self._fast_region(nbytes, force=True, required=False)
                if region is not None:
                    return self._adopt_fast(region)
            return self.alloc_slow(nbytes)

    def alloc_fast(self, nbytes: int) -> Object:
        """A new object in the fast device, evicting others if needed; raises `OutOfMemoryError` if impossible."""
        with self.m.lock():
            return self._adopt_fast(self._fast_region(nbytes, force=True, required=True))

    def alloc_slow(self, nbytes: int) -> Object:
        """A new object in the slow device."""
        with self.m.lock():
            self._maybe_collect(self.slow)
            region = self.m.allocate(self.slow, nbytes)
            if region is None:
                self._collect()
                region = self.m.allocate_or_raise(self.slow, nbytes)
            return self.m.new_object(region)

    def in_fast(self, obj: Object) -> bool:
        return self.m.in_device(self.m.primary(obj), self.fast)

    def read_use(self, obj: Object) -> None:
        with self.m.lock():
            self.m.primary(obj)  # raises on use after free
            self.on_use(obj, write=False)

    def write_use(self, obj: Object) -> None:
        """Mark the primary dirty (its linked copies are now stale) and tell the hooks."""
        with self.m.lock():
            self.on_use(obj, write=True)
            self.m.mark_dirty(self.m.primary(obj))

    def unsafe_free(self, obj: Object) -> None:
        """Free ``obj`` now, before the garbage collector would."""
        self.m.free(obj)

    def prefetch(self, obj: Object, force: bool = False) -> bool:
        """Move ``obj`` into the fast device (Listing 4.2); with ``force``, evict others to make room.

        Returns whether ``obj`` is in the fast device afterwards.
        """
        with self.m.lock():
            m = self.m
            x = m.primary(obj)
            if m.in_device(x, self.fast):
                return True
            if m.pinned(obj) or x.nbytes > self.fast.capacity:
                return False
            y = self._fast_region(x.nbytes, force=force, required=False)
            if y is None:
                return False
            m.copyto(y, x)
            m.mark_clean(x)
            m.link(x, y)
            m.set_primary(obj, y)
            m.record("prefetches")
            self.on_fast(obj)
            return True

    def evict(self, obj: Object) -> None:
        """Move ``obj`` out of the fast device now (Listing 4.1)."""
        with self.m.lock():
            x = self.m.primary(obj)
            if not self.m.in_device(x, self.fast):
                return
            if self.m.pinned(obj):
                raise PinnedError(f"cannot evict object {obj.id}: it is pinned by a live readable/writable view")
            self._evict(obj, x)

    def softevict(self, obj: Object) -> None:
        """Prioritise ``obj`` for eviction without moving it now."""
        with self.m.lock():
            self.m.primary(obj)
            self.m.record("softevictions")
            self.on_softevict(obj)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify the fast-primary invariant for every live object."""
        m = self.m
        for obj in m.objects():
            primary = m.primary(obj)
            fast = m.getlinked(primary, self.fast)
            if fast is not None and fast is not primary:
                raise InvariantError(f"object {obj.id} has a fast region {fast} that is not its primary {primary}")

    # ------------------------------------------------------------------ machinery
    def _adopt_fast(self, region: Region) -> Object:
        obj = self.m.new_object(region)
        self.on_fast(obj)
        return obj

    def _evict(self, obj: Object, x: Region) -> None:
        m = self.m
        y = m.getlinked(x, self.slow)
        fresh = y is None
        if fresh:
            y = m.allocate(self.slow, x.nbytes)
            if y is None:
                self._collect()
                y = m.allocate_or_raise(self.slow, x.nbytes)
        if fresh or m.isdirty(x):
            m.copyto(y, x)
            m.record("evictions_written_back")
        else:
            m.record("evictions_clean_elided")
            m.record("bytes_elided", x.nbytes)
        m.set_primary(obj, y)
        m.free(x)
        self.on_slow(obj)

    def _evict_callback(self, region: Region) -> bool:
        obj = self.m.parent(region)
        if obj is None:
            return self.m.reclaim(region)
        self._evict(obj, region)
        return True

    def _fast_region(self, nbytes: int, force: bool, required: bool) -> Region | None:
        """A fast region of ``nbytes``, evicting victims in `victims` order when ``force``."""
        m = self.m
        region = m.allocate(self.fast, nbytes)
        if region is not None or not force:
            if region is None and required:
                raise OutOfMemoryError(f"{self.fast.name} heap exhausted: {self.fast.heap.exhausted_message(nbytes)}")
            return region
        pinned_seen = 0
        for victim in self._candidates(nbytes):
            if m.pinned(victim):
                pinned_seen += 1
                continue
            start = m.primary(victim)
            if not m.in_device(start, self.fast):
                continue
            m.record("forced_evictfrom")
            if m.evictfrom(self.fast, start, nbytes, self._evict_callback):
                region = m.allocate(self.fast, nbytes)
                if region is not None:
                    return region
        self._collect(run_gc=self.collect_at is not None)
        region = m.allocate(self.fast, nbytes)
        if region is None and required:
            only_pinned = " (every object left in it is pinned by a live view)" if pinned_seen else ""
            raise OutOfMemoryError(f"{self.fast.name}: cannot make room even by forced eviction{only_pinned}: "
                                   f"{self.fast.heap.exhausted_message(nbytes)}")
        return region

    def _candidates(self, nbytes: int) -> Iterator[Object]:
        seen = set()
        for obj in list(self.victims(nbytes)):
            if obj.id not in seen and obj.alive:
                seen.add(obj.id)
                yield obj

    def _maybe_collect(self, device) -> None:
        if self.collect_at is not None and device.used_bytes >= self.collect_at * device.capacity:
            self._collect()

    def _collect(self, run_gc: bool = True) -> None:
        """Free objects whose last reference died; ``run_gc`` also runs Python's cycle collector first."""
        if run_gc:
            gc.collect()
            self.m.record("gc_collections")
        self.m.collect()
