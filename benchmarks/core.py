"""Core benchmark: copy bandwidth, copy alignment sensitivity and allocator throughput.

What it measures, and how:

1. Copy bandwidth of ``Manager.copyto`` for the pairs DRAM->PM, PM->DRAM and
   DRAM->DRAM at 64 KiB, 1 MiB, 64 MiB and 512 MiB, against ``np.copyto``
   between the very same buffers (the views ``manager.bytes(region)``).  Each
   sample copies about 256 MiB (small sizes are repeated back to back); ours and
   numpy alternate inside every repeat and the median sample is reported.
   GB/s = bytes copied / seconds, each byte counted once (not read + write),
   1 GB = 1e9 bytes.  Target: ours/numpy >= 0.95 at 64 MiB and above.
2. Alignment: 64 MiB DRAM->DRAM copies whose (dst - src) address difference
   mod 4096 is 0, 16 or 64, where glibc's memmove (``np.copyto``) is known to
   slow down.  The manager only hands out page-aligned regions this large, so
   the views are taken at byte offsets inside two DRAM regions of 64 MiB + 4 KiB
   and copied with ``cachedarrays.copy.copy_bytes`` (the kernel behind
   ``Manager.copyto``) versus ``np.copyto``.  Target: at 16 and 64, ours is
   within 0.95x of numpy and of its own speed at difference 0.
3. Allocator throughput: a ``Heap`` (pure bookkeeping, 64 GiB) holding 100,000
   live objects of log-uniform random sizes in [64 B, 64 KiB], then timed pairs
   of (free a random live object, allocate a new random size); reported as
   pairs/s (median over repeats).  Target: >= 100,000 pairs/s.  The same churn
   through ``Manager.allocate``/``Manager.free`` on a real DRAM device (what
   users pay: lock, region records, telemetry) is reported alongside.
4. Overlap on the CPU: a prefetch of a 256 MiB object (``--quick``: 64 MiB) from PM into DRAM
   runs on the copy engine's worker thread while the main thread runs a numpy loop that takes
   about as long as the copy; against the same loop after a synchronous copy (prefetch, then
   wait for it).  Reported: both times, the speedup, and the hidden fraction of the copy time
   from the manager's telemetry (copy time a use did not wait for / copy time).

The numba copy kernel is warmed up before anything is timed.  Run
``python benchmarks/core.py`` (``--quick`` for a < 30 s smoke run, ``--out`` for
the JSON path, default ``results/core.json``).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np

from cachedarrays import DRAM, PM, Heap, Manager, Region
from cachedarrays.copy import copy_bytes, warmup
from cachedarrays.units import format_size

try:
    from benchmarks._common import environment, parser, print_table, print_targets, time_interleaved, verdict, write_json
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from _common import environment, parser, print_table, print_targets, time_interleaved, verdict, write_json

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
PAIRS = ("DRAM->PM", "PM->DRAM", "DRAM->DRAM")
TARGET_RATIO = 0.95
TARGET_FROM = 64 * MiB
TARGET_PAIRS_PER_S = 100_000
ALIGN_SIZE = 64 * MiB
ALIGN_DIFFS = (0, 16, 64)
BYTES_PER_SAMPLE = 256 * MiB
OBJ_MIN, OBJ_MAX = 64, 64 * KiB
GB = 1e9


@dataclass(frozen=True)
class Config:
    """Sizes and repeat counts of one run."""

    sizes: tuple[int, ...]
    repeats: int
    heap_live: int
    heap_pairs: int
    manager_live: int
    manager_pairs: int
    alloc_repeats: int
    overlap_bytes: int = 256 * MiB
    seed: int = 0


FULL = Config(sizes=(64 * KiB, MiB, 64 * MiB, 512 * MiB), repeats=7, heap_live=100_000, heap_pairs=50_000,
              manager_live=100_000, manager_pairs=20_000, alloc_repeats=5)
QUICK = Config(sizes=(64 * KiB, MiB, 64 * MiB), repeats=3, heap_live=100_000, heap_pairs=10_000,
               manager_live=10_000, manager_pairs=5_000, alloc_repeats=3, overlap_bytes=64 * MiB)


# ---------------------------------------------------------------------- copies
def make_copy_manager(max_size: int, pm_path: str | None) -> Manager:
    """DRAM with room for two regions of ``max_size`` (plus the alignment pair), PM for one, plus slack."""
    dram_cap = 2 * max(max_size, ALIGN_SIZE + PAGE) + 64 * MiB
    pm_cap = max_size + 64 * MiB
    return Manager(fast=DRAM(dram_cap, bandwidth="ddr4"), slow=PM(pm_path, pm_cap))


def fill(view: np.ndarray) -> None:
    """Write a non-trivial byte pattern (so copies cannot be short-cut on zero pages)."""
    view[:] = (np.arange(view.size, dtype=np.uint32) % 251).astype(np.uint8)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def time_copy_pair(copy_ours: Callable[[], None], dst: np.ndarray, src: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds per copy for ours and for ``np.copyto(dst, src)``, interleaved."""
    number = max(1, BYTES_PER_SAMPLE // src.size)
    times = time_interleaved({"ours": copy_ours, "numpy": lambda: np.copyto(dst, src)},
                             repeats=repeats, number=number)
    dst[:] = 0
    copy_ours()
    if not np.array_equal(dst, src):
        raise AssertionError("copy produced wrong bytes")
    return times


def copy_row(pair: str, size: int, times: dict[str, float], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    ours, numpy_ = gbps(size, times["ours"]), gbps(size, times["numpy"])
    return {"pair": pair, "size": size, "ours_gbps": ours, "numpy_gbps": numpy_, "ratio": ours / numpy_,
            "ours_seconds": times["ours"], "numpy_seconds": times["numpy"], **(extra or {})}


def bench_copies_at(manager: Manager, size: int, repeats: int) -> list[dict[str, Any]]:
    """All three pairs at one size; regions are allocated here and freed afterwards."""
    a = manager.allocate_or_raise(manager.fast, size)
    b = manager.allocate_or_raise(manager.fast, size)
    p = manager.allocate_or_raise(manager.slow, size)
    fill(manager.bytes(a))
    manager.copyto(p, a)
    regions: dict[str, tuple[Region, Region]] = {"DRAM->PM": (p, a), "PM->DRAM": (b, p), "DRAM->DRAM": (b, a)}
    rows = []
    for pair in PAIRS:
        dst, src = regions[pair]
        times = time_copy_pair(functools.partial(manager.copyto, dst, src),
                               manager.bytes(dst), manager.bytes(src), repeats)
        row = copy_row(pair, size, times)
        row["target"] = size >= TARGET_FROM
        row["pass"] = row["ratio"] >= TARGET_RATIO if row["target"] else None
        rows.append(row)
    for r in (a, b, p):
        manager.free(r)
    return rows


def bench_alignment(manager: Manager, repeats: int) -> list[dict[str, Any]]:
    """64 MiB DRAM->DRAM at (dst - src) mod 4096 in ALIGN_DIFFS, via views at byte offsets.

    All six contenders (ours and numpy at each difference) alternate inside every
    repeat, so that machine noise hits them alike.
    """
    rs = manager.allocate_or_raise(manager.fast, ALIGN_SIZE + PAGE)
    rd = manager.allocate_or_raise(manager.fast, ALIGN_SIZE + PAGE)
    src = manager.bytes(rs)[:ALIGN_SIZE]
    fill(src)
    dsts = {diff: manager.bytes(rd)[diff:diff + ALIGN_SIZE] for diff in ALIGN_DIFFS}
    fns: dict[str, Callable[[], None]] = {}
    for diff, dst in dsts.items():
        actual = (dst.ctypes.data - src.ctypes.data) % PAGE
        if actual != diff:
            raise AssertionError(f"wanted address difference {diff} mod {PAGE}, got {actual}")
        fns[f"ours@{diff}"] = functools.partial(copy_bytes, dst, src)
        fns[f"numpy@{diff}"] = functools.partial(np.copyto, dst, src)
    times = time_interleaved(fns, repeats=repeats, number=max(1, BYTES_PER_SAMPLE // ALIGN_SIZE))
    rows = []
    for diff, dst in dsts.items():
        dst[:] = 0
        copy_bytes(dst, src)
        if not np.array_equal(dst, src):
            raise AssertionError(f"copy at difference {diff} produced wrong bytes")
        t = {"ours": times[f"ours@{diff}"], "numpy": times[f"numpy@{diff}"]}
        rows.append(copy_row("DRAM->DRAM", ALIGN_SIZE, t, {"diff_mod_4096": diff}))
    base = rows[0]["ours_gbps"]
    for row in rows:
        row["vs_ours_at_0"] = row["ours_gbps"] / base
        row["pass"] = row["ratio"] >= TARGET_RATIO and row["vs_ours_at_0"] >= TARGET_RATIO
    manager.free(rs)
    manager.free(rd)
    return rows


# ---------------------------------------------------------------------- allocator
def random_sizes(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` sizes log-uniform in [OBJ_MIN, OBJ_MAX], as Python ints (the heap refuses numpy ints)."""
    logs = rng.uniform(math.log(OBJ_MIN), math.log(OBJ_MAX), n)
    return np.exp(logs).astype(np.int64).clip(OBJ_MIN, OBJ_MAX).tolist()


def churn(allocate: Callable[[int], Any], free: Callable[[Any], None], live: list, sizes: list[int],
          victims: list[int]) -> None:
    """For each step: free ``live[victim]`` and put a fresh allocation of ``size`` in its place."""
    for size, j in zip(sizes, victims):
        free(live[j])
        live[j] = allocate(size)


def time_churn(allocate: Callable[[int], Any], free: Callable[[Any], None], nlive: int, npairs: int,
               repeats: int, seed: int) -> dict[str, Any]:
    """Fill with ``nlive`` objects, then time ``repeats`` (+1 warm-up) batches of ``npairs`` pairs."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    live = [allocate(s) for s in random_sizes(rng, nlive)]
    fill_seconds = time.perf_counter() - t0
    if any(x is None for x in live):
        raise MemoryError("the allocator ran out of space while filling")
    rates = []
    for batch in range(repeats + 1):
        sizes = random_sizes(rng, npairs)
        victims = rng.integers(0, nlive, npairs).tolist()
        t0 = time.perf_counter()
        churn(allocate, free, live, sizes, victims)
        seconds = time.perf_counter() - t0
        if batch:  # batch 0 is the warm-up
            rates.append(npairs / seconds)
        if any(x is None for x in live):
            raise MemoryError("the allocator ran out of space during churn")
    return {"live": nlive, "pairs_per_batch": npairs, "batches": repeats, "fill_seconds": fill_seconds,
            "pairs_per_s": float(np.median(rates)), "pairs_per_s_all": rates, "live_objects": live}


def bench_heap(cfg: Config) -> dict[str, Any]:
    heap = Heap(64 * GiB)
    result = time_churn(heap.allocate, heap.free, cfg.heap_live, cfg.heap_pairs, cfg.alloc_repeats, cfg.seed)
    heap.check()
    result.pop("live_objects")
    return {"what": "Heap.allocate/free (bookkeeping, capacity 64 GiB)", **result,
            "used_bytes": heap.used_bytes, "nblocks": heap.nblocks}


def manager_capacity(nlive: int) -> int:
    """Three times the expected live bytes (log-uniform mean), at least 256 MiB."""
    mean = (OBJ_MAX - OBJ_MIN) / math.log(OBJ_MAX / OBJ_MIN)
    return max(256 * MiB, -(-int(3 * nlive * mean) // MiB) * MiB)


def bench_manager_alloc(cfg: Config) -> dict[str, Any]:
    capacity = manager_capacity(cfg.manager_live)
    with Manager(fast=DRAM(capacity, bandwidth="ddr4"), slow=DRAM(64 * MiB, name="DRAM2", bandwidth="ddr4")) as m:
        result = time_churn(functools.partial(m.allocate, m.fast), m.free, cfg.manager_live, cfg.manager_pairs,
                            cfg.alloc_repeats, cfg.seed)
        m.check()
        for region in result.pop("live_objects"):
            m.free(region)
    return {"what": f"Manager.allocate/free on DRAM ({format_size(capacity)} real memory)", **result}


# ---------------------------------------------------------------------- overlap
def bench_overlap(cfg: Config, pm_path: str | None) -> dict[str, Any]:
    import statistics
    from cachedarrays import CachedArray, LRUPolicy, evict, prefetch, readable, writable
    n = cfg.overlap_bytes
    with Manager(DRAM(n + 16 * MiB), PM(pm_path, n + 16 * MiB), policy=LRUPolicy()) as m:
        x = CachedArray((n // 8,), m, np.float64, place="slow")
        with writable(x) as a:
            a[:] = 1.0
        work = np.random.default_rng(cfg.seed).random(1 << 15)

        def compute(rounds: int) -> None:
            acc = work
            for _ in range(rounds):
                acc = np.sqrt(acc + 1.0)

        def copy_then(rounds: int, overlap: bool) -> float:
            evict(x)  # clean: frees the DRAM copy, keeps the PM one (no bytes move)
            t0 = time.perf_counter()
            prefetch(x)
            if not overlap:
                with readable(x):
                    pass
            compute(rounds)
            with readable(x) as a:
                assert a[-1] == 1.0
            return time.perf_counter() - t0

        prefetch(x)
        copy_s = statistics.median(copy_then(0, False) for _ in range(3))
        t0 = time.perf_counter()
        compute(100)
        rounds = max(1, int(100 * copy_s / (time.perf_counter() - t0)))
        compute_s = statistics.median(_time(lambda: compute(rounds)) for _ in range(3))
        sync, over, hidden = [], [], []
        for r in range(cfg.repeats):
            for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                m.reset_telemetry()
                t = copy_then(rounds, overlap)
                (over if overlap else sync).append(t)
                if overlap:
                    c = m.telemetry()["copies"]["PM->DRAM"]
                    hidden.append(c["hidden_seconds"] / c["measured_seconds"])
        return {"bytes": n, "copy_ms": copy_s * 1e3, "compute_ms": compute_s * 1e3,
                "sync_ms": statistics.median(sync) * 1e3, "overlapped_ms": statistics.median(over) * 1e3,
                "speedup": statistics.median(sync) / statistics.median(over),
                "hidden_fraction": statistics.median(hidden)}


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- report
def print_copies(rows: list[dict[str, Any]]) -> None:
    table = [(r["pair"], format_size(r["size"]), r["ours_gbps"], r["numpy_gbps"], r["ratio"],
              f">= {TARGET_RATIO}" if r["target"] else "-", verdict(r["pass"]) if r["target"] else "-")
             for r in rows]
    print_table("1. Copy bandwidth: Manager.copyto (ours) vs np.copyto on the same buffers\n"
                "   GB/s = bytes copied / seconds (each byte counted once, not read + write; 1 GB = 1e9 B);"
                " median of interleaved repeats",
                ("pair", "size", "ours GB/s", "numpy GB/s", "ours/numpy", "target", "status"), table)


def print_alignment(rows: list[dict[str, Any]]) -> None:
    table = [(r["diff_mod_4096"], r["ours_gbps"], r["numpy_gbps"], r["ratio"], r["vs_ours_at_0"],
              verdict(r["pass"])) for r in rows]
    print_table(f"2. Alignment: {format_size(ALIGN_SIZE)} DRAM->DRAM, (dst - src) mod 4096 set by taking views at byte\n"
                "   offsets inside two page-aligned DRAM regions; ours = cachedarrays.copy.copy_bytes (the kernel of\n"
                f"   Manager.copyto), numpy = np.copyto.  Target: ours/numpy and ours/ours@0 both >= {TARGET_RATIO}",
                ("dst-src mod 4096", "ours GB/s", "numpy GB/s", "ours/numpy", "ours/ours@0", "status"), table)


def print_alloc(heap: dict[str, Any], mgr: dict[str, Any]) -> None:
    table = [
        ("Heap", heap["live"], heap["pairs_per_batch"], f"{heap['pairs_per_s']:,.0f}",
         f">= {TARGET_PAIRS_PER_S:,}", verdict(heap["pairs_per_s"] >= TARGET_PAIRS_PER_S)),
        ("Manager (DRAM)", mgr["live"], mgr["pairs_per_batch"], f"{mgr['pairs_per_s']:,.0f}",
         f"({TARGET_PAIRS_PER_S:,})", verdict(mgr["pairs_per_s"] >= TARGET_PAIRS_PER_S) + "*"),
    ]
    print_table(f"3. Allocator: random free+allocate pairs, sizes log-uniform {OBJ_MIN} B .. {format_size(OBJ_MAX)};"
                f" median of {heap['batches']} batches",
                ("allocator", "live objects", "pairs/batch", "pairs/s", "target", "status"), table)
    print("   * the issue's target is for the Heap; the Manager row is compared against it for information")


def summarize(copies: list[dict], align: list[dict], heap: dict) -> dict[str, bool]:
    return {
        f"copy ratio >= {TARGET_RATIO} at >= 64 MiB": all(r["pass"] for r in copies if r["target"]),
        "no drop at bad alignments": all(r["pass"] for r in align),
        f"heap >= {TARGET_PAIRS_PER_S:,} pairs/s": heap["pairs_per_s"] >= TARGET_PAIRS_PER_S,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.split("\n\n")[0], "results/core.json")
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--pm-path", default=None,
                   help="PM pool location (a directory or new file); default: a temporary file under $TMPDIR")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats per copy measurement (default {FULL.repeats}, quick {QUICK.repeats})")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.repeats is not None:
        cfg = replace(cfg, repeats=max(1, args.repeats))
    t_start = time.perf_counter()
    warmup()

    manager = make_copy_manager(max(cfg.sizes), args.pm_path)
    print(f"cachedarrays core benchmark ({'quick' if args.quick else 'full'}); PM file: {manager.slow.path} "
          f"(libpmem: {manager.slow.uses_libpmem}, is_pmem: {manager.slow.is_pmem}); "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if os.getloadavg()[0] >= 1:
        print("warning: other processes are competing for the CPUs; timings will be noisy")
    try:
        copies = [row for size in cfg.sizes for row in bench_copies_at(manager, size, cfg.repeats)]
        print_copies(copies)
        align = bench_alignment(manager, cfg.repeats)
        print_alignment(align)
        telemetry = manager.telemetry()["copies"]
    finally:
        manager.close()

    heap = bench_heap(cfg)
    mgr = bench_manager_alloc(cfg)
    print_alloc(heap, mgr)

    overlap = bench_overlap(cfg, args.pm_path)
    print_table(f"4. Overlap on the CPU: prefetch {format_size(overlap['bytes'])} PM->DRAM on the copy engine's thread "
                f"while numpy computes (~{overlap['compute_ms']:.0f} ms), vs the same loop after a synchronous copy "
                f"({overlap['copy_ms']:.0f} ms); medians",
                ("copy then compute ms", "overlapped ms", "speedup", "hidden fraction of copy time"),
                [(overlap["sync_ms"], overlap["overlapped_ms"], overlap["speedup"], overlap["hidden_fraction"])])

    summary = summarize(copies, align, heap)
    print_targets(summary)
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal time {elapsed:.1f} s")
    write_json(args.out, {
        "benchmark": "core", "quick": args.quick, "config": asdict(cfg), "environment": environment(),
        "units": {"gbps": "bytes copied / seconds / 1e9 (each byte counted once)", "pairs_per_s": "free+allocate pairs per second"},
        "copies": copies, "alignment": align,
        "alignment_method": "views at byte offsets inside two DRAM regions, copied with cachedarrays.copy.copy_bytes",
        "allocator": {"heap": heap, "manager": mgr}, "manager_copy_telemetry": telemetry, "overlap": overlap,
        "targets": summary, "seconds": elapsed,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
