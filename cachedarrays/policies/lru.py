"""`LRUPolicy`: least-recently-used eviction with the L, M and P switches of Table 4.7."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from ..manager import Object, Region
from .base import Policy


class LRUPolicy(Policy):
    """Keep recently used objects in the fast device; evict from the least recently used.

    - ``local_alloc`` (L): new objects start in the fast device.  Without it they
      start in the slow device and are moved in on first use (``insert_on_use``
      defaults to ``not local_alloc``), like a cache's compulsory misses.
    - ``honor_frees`` (M): `unsafe_free` (and so `cleanup`/`noescape`) frees
      memory now; without it frees are ignored and only the garbage collector
      reclaims memory.
    - ``prefetch`` (P): `prefetch` hints move data; without it they are ignored.

    `softevict` moves an object to the front of the eviction order.
    """

    def __init__(self, local_alloc: bool = True, honor_frees: bool = True, prefetch: bool = True,
                 insert_on_use: bool | None = None, collect_at: float | None = None):
        super().__init__(collect_at=collect_at)
        self.local_alloc = local_alloc
        self.honor_frees = honor_frees
        self.prefetch_hints = prefetch
        self.insert_on_use = (not local_alloc) if insert_on_use is None else insert_on_use
        self._order: OrderedDict[int, None] = OrderedDict()  # objects whose primary is fast, LRU first

    def __repr__(self) -> str:
        flags = "".join(f for f, on in (("L", self.local_alloc), ("M", self.honor_frees), ("P", self.prefetch_hints)) if on)
        return f"LRUPolicy({flags or '0'})"

    def placement(self, nbytes: int):
        return self.fast if self.local_alloc else self.slow

    def victims(self, nbytes: int) -> Iterator[Object]:
        for obj_id in list(self._order):
            obj = self.m.getobject(obj_id)
            if obj is not None:
                yield obj

    def on_use(self, obj: Object, write: bool) -> None:
        if obj.id in self._order:
            self._order.move_to_end(obj.id)
        elif self.insert_on_use:
            super().prefetch(obj, force=True)

    def on_fast(self, obj: Object) -> None:
        self._order[obj.id] = None

    def on_slow(self, obj: Object) -> None:
        self._order.pop(obj.id, None)

    def on_softevict(self, obj: Object) -> None:
        if obj.id in self._order:
            self._order.move_to_end(obj.id, last=False)

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        self._order.pop(obj_id, None)

    def unsafe_free(self, obj: Object) -> None:
        if self.honor_frees:
            super().unsafe_free(obj)
        else:
            self.m.record("frees_ignored")

    def prefetch(self, obj: Object, force: bool = False) -> bool:
        if not self.prefetch_hints:
            self.m.record("prefetches_ignored")
            return self.in_fast(obj)
        return super().prefetch(obj, force)

    def check(self) -> None:
        super().check()
        m = self.m
        in_fast = {o.id for o in m.objects() if m.in_device(m.primary(o), self.fast)}
        tracked = {i for i in self._order if m.getobject(i) is not None}
        if in_fast != tracked:
            from ..errors import InvariantError
            raise InvariantError(f"LRU order disagrees with the fast device: untracked {sorted(in_fast - tracked)[:5]}, "
                                 f"stale {sorted(tracked - in_fast)[:5]}")
