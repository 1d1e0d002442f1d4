"""`LRUPolicy`: least-recently-used eviction with the L, M and P switches of Table 4.7."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator

from ..devices import Device
from ..errors import InvariantError
from ..manager import Manager, Object, Region
from .base import Policy


class LRUPolicy(Policy):
    """Keep recently used objects on the fast level; evict from the least recently used.

    - ``local_alloc`` (L): new objects start on the fast level.  Without it they
      start on the slowest level and are moved in on first use (``insert_on_use``
      defaults to ``not local_alloc``), like a cache's compulsory misses.
    - ``honor_frees`` (M): `unsafe_free` (and so `cleanup`/`noescape`) frees
      memory now; without it frees are ignored and only the garbage collector
      reclaims memory.
    - ``prefetch`` (P): `prefetch` hints move data; without it they are ignored.

    Every level but the slowest keeps its own recency order of the objects whose primary is
    there, so making room on any level (a cascade GPU -> DRAM -> PM) evicts that level's least
    recently used first; nothing is evicted from the slowest level, so objects there need no
    order (and other layers, e.g. a persistent pool, may create objects there directly).
    `softevict` moves an object to the front of its level's order.
    """

    victims_snapshot = True  # victims_on walks a copy of the order, taken when it is called

    def __init__(self, local_alloc: bool = True, honor_frees: bool = True, prefetch: bool = True,
                 insert_on_use: bool | None = None, collect_at: float | None = None):
        super().__init__(collect_at=collect_at)
        self.local_alloc = local_alloc
        self.honor_frees = honor_frees
        self.prefetch_hints = prefetch
        self.insert_on_use = (not local_alloc) if insert_on_use is None else insert_on_use
        self._orders: dict[str, OrderedDict[int, None]] = {}  # per level: ids whose primary is there, LRU first

    def __repr__(self) -> str:
        flags = "".join(f for f, on in (("L", self.local_alloc), ("M", self.honor_frees), ("P", self.prefetch_hints)) if on)
        return f"LRUPolicy({flags or '0'})"

    def attach(self, manager: Manager) -> None:
        super().attach(manager)
        self._orders = {dev.name: OrderedDict() for dev in self.levels[:-1]}

    @property
    def _order(self) -> OrderedDict[int, None]:
        """The fast level's recency order."""
        return self._orders[self.fast.name]

    def placement(self, nbytes: int) -> Device:
        return self.fast if self.local_alloc else self.slow

    def victims(self, nbytes: int) -> Iterator[Object]:
        return self.victims_on(self.fast, nbytes)

    def victims_on(self, device: Device, nbytes: int) -> Iterator[Object]:
        """The level's objects least recently used first, then (below the fast level) the other
        objects with a region there; of the order and the objects as they were at the call."""
        ids = list(self._orders.get(device.name, ()))
        others = self.m.objects_on(device) if device is not self.fast else ()  # copies below faster primaries
        return self._victims(ids, others)

    def _victims(self, ids: list[int], others: Iterable[Object]) -> Iterator[Object]:
        for obj_id in ids:
            obj = self.m.getobject(obj_id)
            if obj is not None:
                yield obj
        yield from others

    def on_use(self, obj: Object, write: bool) -> None:
        self._touch(obj)
        if self.insert_on_use and not self.in_fast(obj):
            super().prefetch(obj, force=True)

    def _touch(self, obj: Object) -> None:
        """Make ``obj`` the most recently used object of its level."""
        order = self._orders.get(self.m.primary(obj).device.name, {})
        if obj.id in order:
            order.move_to_end(obj.id)

    def on_move(self, obj: Object, old: Device | None, new: Device) -> None:
        if old is not None and old is not self.slow:
            self._orders[old.name].pop(obj.id, None)
        if new is not self.slow:
            self._orders[new.name][obj.id] = None
        super().on_move(obj, old, new)

    def on_softevict(self, obj: Object) -> None:
        order = self._orders.get(self.m.primary(obj).device.name, {})
        if obj.id in order:
            order.move_to_end(obj.id, last=False)

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        for order in self._orders.values():
            order.pop(obj_id, None)

    def unsafe_free(self, obj: Object) -> None:
        if self.honor_frees:
            super().unsafe_free(obj)
        else:
            self.m.record("frees_ignored")

    def prefetch(self, obj: Object, force: bool = False, to: Device | None = None) -> bool:
        if not self.prefetch_hints:
            self.m.record("prefetches_ignored")
            target = self.prefetch_target(obj) if to is None else to
            return self.m.level(self.m.primary(obj).device) <= self.m.level(target)
        return super().prefetch(obj, force, to)

    def check(self) -> None:
        super().check()
        m = self.m
        for dev in self.levels[:-1]:
            here = {o.id for o in m.objects() if m.in_device(m.primary(o), dev)}
            tracked = {i for i in self._orders[dev.name] if m.getobject(i) is not None}
            if here != tracked:
                raise InvariantError(f"LRU order of {dev.name} disagrees with the device: untracked "
                                     f"{sorted(here - tracked)[:5]}, stale {sorted(tracked - here)[:5]}")
