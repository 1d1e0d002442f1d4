"""`TwoLevelCachePolicy`: software model of the hardware DRAM cache (Intel's 2LM memory mode).

Every object lives in the slowest level; a use copies it into the fastest
(insert on use, LRU replacement on every level, evictions cascading down);
dirty data is written back when evicted; and
frees carry no meaning, so dirty data of dead objects is written back too.
Hints (`prefetch`, `evict`, `softevict`) are ignored, as hardware would.
"""

from __future__ import annotations

from ..manager import Object, Region
from .lru import LRUPolicy


class TwoLevelCachePolicy(LRUPolicy):
    """The baseline the dissertation compares against; see the module docstring."""

    def __init__(self, collect_at: float | None = 0.8):
        super().__init__(local_alloc=False, honor_frees=False, prefetch=False, insert_on_use=True,
                         collect_at=collect_at)

    def __repr__(self) -> str:
        return "TwoLevelCachePolicy()"

    def evict(self, obj: Object, to=None) -> None:
        self.m.record("evicts_ignored")

    def on_softevict(self, obj: Object) -> None:
        pass

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        super().forget(obj_id, regions)
        chain = [regions[dev.name] for dev in self.levels if dev.name in regions]
        home = regions.get(self.slow.name)
        if home is not None and any(self.m.isdirty(r) for r in chain[:-1]):
            self.m.copyto(home, chain[0])  # hardware writes back dead dirty lines too
            self.m.record("dead_writebacks")
