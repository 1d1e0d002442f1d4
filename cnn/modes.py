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

On the GPU (``device="gpu"``) the fast level is a `GPU` heap of the budget (``dram`` then means
all in HBM) over host DRAM, with a PM file below only when host memory cannot hold the rest.

The program is annotated the same way in every mode; a policy without M or P
ignores those hints, as in the dissertation.  ``cap`` needs only the iteration
boundary, which the trainer marks (`Policy.mark_iteration`) at every step.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from cachedarrays import (DRAM, GPU, PM, CorrelationPrefetchPolicy, LRUPolicy, Manager, Policy, TwoLevelCachePolicy,
                          format_size, parse_size)

MODES = ("dram", "2lm", "ca0", "caL", "caLM", "caLMP", "cap")
CA_MODES = ("ca0", "caL", "caLM", "caLMP", "cap")
MIN_PM = 16 << 20


DEVICES = ("cpu", "gpu")


def make_policy(mode: str, stamps=None) -> Policy:
    """The policy of ``mode`` (see the module table); ``stamps``: the clock of ``cap``'s recorded gaps
    (on a GPU a `DeviceClock`, so they are device time)."""
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
        return CorrelationPrefetchPolicy(stamps=stamps)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


class ModelTooLargeError(ValueError):
    """The model does not fit in all the memory levels together."""


def host_memory_available() -> int:
    """Bytes of host memory the OS says are available now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _pm_free(pm_dir: str | None) -> int:
    return shutil.disk_usage(pm_dir or tempfile.gettempdir()).free


def make_manager(mode: str, fast_bytes: int, slow_bytes: int, pm_dir: str | None = None, device: str = "cpu",
                 stamps=None) -> Manager:
    """A manager under ``mode``'s policy whose fast level has ``fast_bytes`` and whose slower levels hold
    ``slow_bytes``: on the CPU DRAM over a PM file; on the GPU a GPU heap over host DRAM, with a PM file
    below when host memory cannot hold ``slow_bytes`` (`ModelTooLargeError` when all of them cannot).
    ``--device gpu`` without a GPU raises `DeviceUnavailableError` (from `GPU`)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    fast_bytes, slow_bytes = max(int(fast_bytes), 4096), max(int(slow_bytes), MIN_PM)
    policy = make_policy(mode, stamps)
    if device == "cpu":
        _check_capacity(slow_bytes, 0, _pm_free(pm_dir), "DRAM", fast_bytes)
        return Manager(DRAM(fast_bytes), PM(pm_dir, slow_bytes), policy=policy)
    fast = GPU(fast_bytes)
    try:
        host = int(0.8 * host_memory_available())
        if slow_bytes <= host:
            return Manager(fast, DRAM(slow_bytes), policy=policy)
        pm_free = _pm_free(pm_dir)
        _check_capacity(slow_bytes, host, pm_free, "GPU", fast_bytes)
        return Manager(fast, DRAM(host), PM(pm_dir, slow_bytes - host + MIN_PM), policy=policy)
    except BaseException:
        fast.close()
        raise


def fast_limit(device: str, share: float = 0.9) -> int | None:
    """The largest fast level ``device`` can have now: ``share`` of the free GPU memory, None on the CPU."""
    if device != "gpu":
        return None
    from cachedarrays.devices.gpu import memory_info
    free, _ = memory_info()
    return int(share * free) // 4096 * 4096


def _check_capacity(slow: int, host: int, pm_free: int, fast_name: str, fast_bytes: int) -> None:
    if slow > host + pm_free:
        raise ModelTooLargeError(
            f"the model needs {format_size(slow)} below the {format_size(fast_bytes)} {fast_name} budget, but host "
            f"memory ({format_size(host)} usable) and the PM file system ({format_size(pm_free)} free) hold only "
            f"{format_size(host + pm_free)} together: use a smaller batch, image or model, or --pm-dir on a larger "
            f"file system")


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
