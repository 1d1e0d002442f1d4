"""The operating modes of Table 4.7 plus learned prefetch (``cap``), and the devices sized for a fast-memory budget.

=======  ===========================================================  =============================
mode     policy                                                       meaning
=======  ===========================================================  =============================
dram     LRUPolicy(L, M, P), fast device big enough for everything     the baseline: no budget
2lm      TwoLevelCachePolicy(collect_at=0.8)                           hardware DRAM cache; frees
                                                                      ignored, GC at 80 % of PM
ca0      LRUPolicy(local_alloc=False, honor_frees=False,               everything starts slow and is
         prefetch=False, collect_at=0.8)                               moved in before use
caL      LRUPolicy(local_alloc=True, honor_frees=False, prefetch=False) new objects start fast
caLM     LRUPolicy(local_alloc=True, honor_frees=True, prefetch=False)  plus frees and cleanup
caLMP    LRUPolicy(local_alloc=True, honor_frees=True, prefetch=True)   plus prefetching
cap      CorrelationPrefetchPolicy()                                   learned prefetch: the order
                                                                      of one iteration's uses is
                                                                      prefetched ahead in the next,
                                                                      Belady eviction; frees
                                                                      honoured, prefetch hints and
                                                                      softevict ignored, misses
                                                                      fetched on use
=======  ===========================================================  =============================

The program is annotated the same way in every mode; a policy without M or P
ignores those hints, as in the dissertation.  ``cap`` needs only the iteration
boundary, which the trainer marks (`Policy.mark_iteration`) at every step.
"""

from __future__ import annotations

from cachedarrays import (DRAM, PM, CorrelationPrefetchPolicy, LRUPolicy, Manager, Policy, TwoLevelCachePolicy,
                          format_size, parse_size)

MODES = ("dram", "2lm", "ca0", "caL", "caLM", "caLMP", "cap")
CA_MODES = ("ca0", "caL", "caLM", "caLMP", "cap")
MIN_PM = 16 << 20


def make_policy(mode: str) -> Policy:
    """The policy of ``mode`` (see the module table)."""
    if mode == "dram":
        return LRUPolicy(local_alloc=True, honor_frees=True, prefetch=True)
    if mode == "2lm":
        return TwoLevelCachePolicy(collect_at=0.8)
    if mode == "ca0":
        return LRUPolicy(local_alloc=False, honor_frees=False, prefetch=False, collect_at=0.8)
    if mode == "caL":
        return LRUPolicy(local_alloc=True, honor_frees=False, prefetch=False)
    if mode == "caLM":
        return LRUPolicy(local_alloc=True, honor_frees=True, prefetch=False)
    if mode == "caLMP":
        return LRUPolicy(local_alloc=True, honor_frees=True, prefetch=True)
    if mode == "cap":
        return CorrelationPrefetchPolicy()
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def make_manager(mode: str, fast_bytes: int, slow_bytes: int, pm_dir: str | None = None) -> Manager:
    """A manager with a DRAM device of ``fast_bytes`` and a PM file of ``slow_bytes`` under ``mode``'s policy."""
    return Manager(DRAM(max(int(fast_bytes), 4096)), PM(pm_dir, max(int(slow_bytes), MIN_PM)), policy=make_policy(mode))


class BudgetTooSmallError(ValueError):
    """The fast-memory budget cannot hold the operands of the model's largest kernel."""


def parse_budget(spec: "str | int | float", footprint: int) -> int:
    """Bytes of fast memory for a budget given as a fraction (``"25%"``, ``0.25``) of ``footprint``
    or as a size (``"64MiB"``, ``"1e8"``, an int)."""
    if isinstance(spec, str):
        s = spec.strip()
        if s.endswith("%"):
            return int(float(s[:-1]) / 100.0 * footprint)
        try:
            value = float(s)
        except ValueError:
            return parse_size(s)
        spec = value
    if isinstance(spec, float) and 0 < spec <= 1.0:
        return int(spec * footprint)
    return int(spec)


def check_budget(budget: int, minimum: int, footprint: int, model: str) -> None:
    """Raise `BudgetTooSmallError` naming the smallest budget that works when ``budget < minimum``."""
    if budget < minimum:
        raise BudgetTooSmallError(
            f"fast budget {format_size(budget)} is too small for {model}: the smallest budget that works is "
            f"{format_size(minimum)} ({minimum} bytes, {100.0 * minimum / footprint:.1f}% of the "
            f"{format_size(footprint)} footprint) - the operands of its largest kernel must fit in fast memory "
            f"at once; pass --fast-budget {minimum} or more")
