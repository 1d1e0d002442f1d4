"""The policy API (Table 4.5) built on the data management API only.

A `Policy` turns the program's hints into data movement.  Subclasses override
the hooks — `placement` (where a new object goes), `victims` (which objects to
start evicting from the fast level, in order; `victims_on` for any level), `on_use`
(what a use does), `prefetch_target` / `evict_target` (which level a prefetch
moves an object to, and which an eviction moves it to), and the tracking hooks
`on_fast` / `on_slow` / `on_move` / `forget`, and the hint `mark_iteration` (a new
iteration of a repeating program begins) — and inherit correct implementations
of the operations: `alloc_fast`, `alloc_slow`, `new`, `in_fast`, `read_use`,
`write_use`, `unsafe_free`, `prefetch`, `evict`, `softevict`.

Levels: the manager's devices, fastest first (``self.levels``; ``self.fast`` is the
first and ``self.slow`` the last, so a policy written for two levels works on any
number).  Making room on a level evicts its victims to the level below, which may
in turn make room there: eviction cascades GPU -> DRAM -> PM.  A clean object moves
no bytes at any level: its copy below is reused.  Prefetches and write-backs are
asynchronous copies (the manager orders every use after them).

Invariant kept here (and verified by `check`): an object's primary is its region on
the fastest level it has one on; in particular, a fast region is the primary.
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator

from ..devices import DeadEnds, Device
from ..errors import InvariantError, OutOfMemoryError, PinnedError
from ..manager import Manager, Object, Region
from ..units import format_size


class _Unattached:
    """``policy.m`` before `Policy.attach`, which sets the attribute itself (read dozens of times a
    kernel, so a plain attribute rather than a property): an error that says how to attach."""

    def __get__(self, policy, owner=None):
        if policy is None:
            return self
        raise RuntimeError(f"{type(policy).__name__} is not attached to a manager: Manager(fast, slow, policy=...)")


class Policy:
    """Base class for placement policies; see the module docstring for the hooks.

    ``collect_at``: when set (a fraction like 0.8), an allocation that finds the
    slow device this full first runs Python's garbage collector and drains the
    manager's free queue, as the dissertation's GC-reliant modes do.  (The faster
    levels are full by design; running out of room there triggers eviction, and
    a collection only when eviction cannot make room.)
    """

    #: Whether `victims_on` iterates over a snapshot of its own (as `LRUPolicy`'s, a copy of its
    #: order's ids), so that making room may take its candidates one at a time while evictions
    #: change the policy's order: only the candidates tried are looked up. Otherwise (the safe
    #: default for a policy that yields from its live structures) every candidate is listed
    #: before the first eviction, an object lookup each, however few are tried.
    victims_snapshot = False

    def __init__(self, collect_at: float | None = None):
        self.manager: Manager | None = None
        self.collect_at = collect_at

    # ------------------------------------------------------------------ wiring
    def attach(self, manager: Manager) -> None:
        if self.manager is not None and self.manager is not manager:
            raise ValueError("this policy is already attached to another manager")
        self.manager = self.m = manager
        self.levels: list[Device] = list(manager.levels)
        self.fast = manager.fast
        self.slow = manager.slow
        self._largest = max(dev.capacity for dev in self.levels)

    m: Manager = _Unattached()  # type: ignore[assignment]

    # ------------------------------------------------------------------ hooks for subclasses
    def placement(self, nbytes: int) -> Device:
        """Device a new object of ``nbytes`` should go to (default: the fast device)."""
        return self.fast

    def victims(self, nbytes: int) -> Iterable[Object]:
        """Objects in the fast device to start evicting from, best first (default: none)."""
        return ()

    def victims_on(self, device: Device, nbytes: int) -> Iterable[Object]:
        """Objects with a region on ``device`` to start evicting from, best first.

        Default: `victims` for the fast level; on other levels every object with a region
        there, in address order.
        """
        if device is self.fast:
            return self.victims(nbytes)
        return self.m.objects_on(device)

    def prefetch_target(self, obj: Object) -> Device:
        """Level a `prefetch` without ``to`` moves ``obj`` to (default: the fast level)."""
        return self.fast

    def evict_target(self, obj: Object) -> Device:
        """Level an eviction moves ``obj`` to (default: the level below its primary)."""
        below = self.m.below(self.m.primary(obj).device)
        return self.slow if below is None else below

    def on_use(self, obj: Object, write: bool) -> None:
        """Called on every read or write use, after the dirty bit is set for writes."""

    def on_fast(self, obj: Object) -> None:
        """``obj``'s primary has just become a fast region (allocated or prefetched)."""

    def on_slow(self, obj: Object) -> None:
        """``obj``'s primary has just left the fast device."""

    def on_move(self, obj: Object, old: Device | None, new: Device) -> None:
        """``obj``'s primary moved from level ``old`` (None: just allocated) to ``new``.

        Default: `on_fast` when it arrives on the fast level, `on_slow` when it leaves it.
        """
        if new is self.fast:
            self.on_fast(obj)
        elif old is self.fast:
            self.on_slow(obj)

    def on_softevict(self, obj: Object) -> None:
        """Hint that ``obj`` will not be used for a while (default: ignored)."""

    def mark_iteration(self) -> None:
        """Hint that the program starts another iteration of a repeating sequence of uses (a training
        step); a policy that learns the sequence records one iteration between two marks (default: ignored)."""

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        """``obj_id`` is about to be freed (its ``regions`` are still live); drop any tracking."""

    def restored(self, obj: Object, old: Device, new: Device) -> None:
        """The manager moved ``obj``'s primary back from ``old`` to ``new`` after a failed copy."""
        self.on_move(obj, old, new)

    # ------------------------------------------------------------------ the policy API (Table 4.5)
    def new(self, nbytes: int) -> Object:
        """Allocate an object where `placement` says; a level that cannot fit it passes it to the next."""
        with self.m.lock():
            self._fits_somewhere(nbytes)
            first = self.m.level(self.placement(nbytes))
            for device in self.levels[first:-1]:
                if nbytes <= device.capacity:
                    region = self._region_on(device, nbytes, force=True, required=False)
                    if region is not None:
                        return self._adopt(region)
            return self.alloc_slow(nbytes)

    def alloc_fast(self, nbytes: int) -> Object:
        """A new object in the fast device, evicting others if needed; raises `OutOfMemoryError` if impossible."""
        with self.m.lock():
            return self._adopt(self._region_on(self.fast, nbytes, force=True, required=True))

    def alloc_slow(self, nbytes: int) -> Object:
        """A new object in the slow device."""
        with self.m.lock():
            self._fits_somewhere(nbytes)
            return self._adopt(self._slow_region(nbytes))

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

    def prefetch(self, obj: Object, force: bool = False, to: Device | None = None) -> bool:
        """Start moving ``obj`` up to level ``to`` (default `prefetch_target`; Listing 4.2).

        Returns at once: the copy runs in the background and the next use waits for it.
        With ``force``, evict others to make room.  Returns whether ``obj`` is on that level
        (or a faster one) afterwards.
        """
        with self.m.lock():
            m = self.m
            target = self.prefetch_target(obj) if to is None else to
            x = m.primary(obj)
            if x.device is target or m.level(x.device) <= m.level(target):  # the first test: the common case
                return True
            if m.pinned(obj) or x.nbytes > target.capacity:
                return False
            m.pin(obj)  # making room below must not move obj itself
            try:
                y = self._region_on(target, x.nbytes, force=force, required=False)
            finally:
                m.unpin(obj)
            if y is None:
                return False
            x = m.primary(obj)
            try:
                m.copyto_async(y, x)
            except BaseException:
                m.free(y)
                raise
            if self._below(obj, x) is None:
                m.mark_clean(x)  # nothing below x: its dirty bit has nothing to be newer than
            m.link(x, y)
            m.set_primary(obj, y)
            m.record("prefetches")
            self.on_move(obj, x.device, target)
            return True

    def evict(self, obj: Object, to: Device | None = None) -> None:
        """Move ``obj`` down to level ``to`` (default `evict_target`) now (Listing 4.1).

        A dirty object is written back asynchronously; a clean one moves no bytes.
        """
        with self.m.lock():
            x = self.m.primary(obj)
            if x.device is self.slow or (to is not None and self.m.level(to) <= self.m.level(x.device)):
                return
            if self.m.pinned(obj):
                raise PinnedError(f"cannot evict object {obj.id}: it is pinned by a live readable/writable view")
            self._evict(obj, x, to)

    def softevict(self, obj: Object) -> None:
        """Prioritise ``obj`` for eviction without moving it now."""
        with self.m.lock():
            self.m.primary(obj)
            self.m.record("softevictions")
            self.on_softevict(obj)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify that every live object's primary is its region on the fastest level it has one on."""
        m = self.m
        for obj in m.objects():
            primary = m.primary(obj)
            fastest = m.regions_of(obj)[0]
            if fastest is not primary:
                raise InvariantError(f"object {obj.id} has a region {fastest} on a faster level that is not its "
                                     f"primary {primary}")

    # ------------------------------------------------------------------ machinery
    def _adopt(self, region: Region) -> Object:
        obj = self.m.new_object(region)
        self.on_move(obj, None, region.device)
        return obj

    def _below(self, obj: Object, region: Region) -> Region | None:
        """``obj``'s next region below ``region`` (None if there is none)."""
        regions = self.m.regions_of(obj)
        i = regions.index(region)
        return regions[i + 1] if i + 1 < len(regions) else None

    def _evict(self, obj: Object, x: Region, to: Device | None = None) -> None:
        """Move ``obj`` from its primary ``x`` down to ``to``, dropping the regions in between."""
        m = self.m
        target = self.evict_target(obj) if to is None else to
        y = m.getlinked(x, target)
        fresh = y is None
        if fresh:
            target, y = self._room_below(obj, target, x.nbytes)
            m.link(x, y)
        level = m.level(target)
        upper = [r for r in m.regions_of(obj) if m.level(r.device) < level]
        dirty = any(m.isdirty(r) for r in upper)
        if fresh or dirty:
            try:
                m.copyto_async(y, x)
            except BaseException:
                if fresh:
                    m.unlink(x, y)
                    m.free(y)
                raise
            if dirty:
                m.mark_dirty(y)
            m.record("evictions_written_back")
        else:
            m.record("evictions_clean_elided")
            m.record("bytes_elided", x.nbytes)
        m.set_primary(obj, y)
        for r in upper:
            m.free(r)
        self.on_move(obj, x.device, target)

    def _room_below(self, obj: Object, target: Device, nbytes: int) -> tuple[Device, Region]:
        """A region for ``obj`` on ``target``, or on the first level below it with room (a level too
        small, or full of pinned objects, passes the object further down)."""
        m = self.m
        m.pin(obj)  # making room must not move obj itself
        try:
            while True:
                if target is self.slow:
                    return target, self._slow_region(nbytes)
                if target.capacity >= nbytes:
                    region = self._region_on(target, nbytes, force=True, required=False)
                    if region is not None:
                        return target, region
                existing = m.getlinked(m.primary(obj), m.below(target))
                target = m.below(target)
                if existing is not None:
                    return target, existing
        finally:
            m.unpin(obj)

    def _evict_callback(self, region: Region) -> bool:
        m = self.m
        obj = m.parent(region)
        if obj is None:
            return m.reclaim(region)
        primary = m.primary(obj)
        if region is primary:
            target = self.evict_target(obj)
            if m.level(target) <= m.level(region.device):
                target = m.below(region.device)
            self._evict(obj, region, target)
        else:
            above = m.regions_of(obj)
            above = above[above.index(region) - 1]
            if m.isdirty(region):
                m.mark_dirty(above)  # region was newer than what is below it; now the one above is
            m.free(region)
            m.record("linked_dropped")
        return True

    def _region_on(self, device: Device, nbytes: int, force: bool, required: bool) -> Region | None:
        """A region of ``nbytes`` on ``device``, evicting victims in `victims_on` order when ``force``."""
        m = self.m
        if device is self.slow:
            return self._slow_region(nbytes)
        region = m.allocate(device, nbytes)
        if region is not None or not force:
            if region is None and required:
                raise OutOfMemoryError(f"{device.name} heap exhausted: {device.heap.exhausted_message(nbytes)}")
            return region
        pinned_seen = 0
        dead_ends = DeadEnds(nbytes)  # no pin changes while victims are tried
        for victim in self._candidates(device, nbytes):
            if m.pinned(victim):
                pinned_seen += 1
                continue
            start = m.getlinked(m.primary(victim), device)
            if start is None:
                continue
            if dead_ends.covers(start.offset):  # the heap would fail it too; this skips the manager's call
                m.record("forced_evictfrom_skipped")
                continue
            m.record("forced_evictfrom")
            if m.evictfrom(device, start, nbytes, self._evict_callback, dead_ends):
                region = m.allocate(device, nbytes)
                if region is not None:
                    return region
        self._collect(run_gc=self.collect_at is not None)
        region = m.allocate(device, nbytes)
        if region is None and required:
            only_pinned = " (every object left in it is pinned by a live view)" if pinned_seen else ""
            raise OutOfMemoryError(f"{device.name}: cannot make room even by forced eviction{only_pinned}: "
                                   f"{device.heap.exhausted_message(nbytes)}")
        return region

    def _slow_region(self, nbytes: int) -> Region:
        m = self.m
        self._maybe_collect(self.slow)
        region = m.allocate(self.slow, nbytes)
        if region is None:
            self._collect()
            region = m.allocate_or_raise(self.slow, nbytes)
        return region

    def _fits_somewhere(self, nbytes: int) -> None:
        if nbytes > self._largest:
            sizes = ", ".join(f"{dev.name} {format_size(dev.capacity)}" for dev in self.levels)
            raise OutOfMemoryError(f"requested {nbytes} bytes ({format_size(nbytes)}), larger than every level "
                                  f"({sizes})")

    def _candidates(self, device: Device, nbytes: int) -> Iterator[Object]:
        seen = set()
        victims = self.victims_on(device, nbytes)
        for obj in (victims if self.victims_snapshot else list(victims)):
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
