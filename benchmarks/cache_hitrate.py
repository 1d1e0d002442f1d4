"""Hit rates of the GPU set-associative cache's replacements, ``lru`` against ``lfu``, on the
index stream of ``gpu_dlrm.py`` (Zipf(1), a row's rank scattered over the table), without a GPU.

One table of ``--rows`` rows and a cache of ``--cache-fraction`` of them in ``--ways``-way sets,
placed batch after batch by the numpy forms of the placement (:mod:`embeddings.gpu.lru_kernels`:
probe, distinct misses, victims, settle; the CUDA kernels are tested to make their decisions),
with the ways of the previous batch locked as a prefetch of the next batch locks those of the
batch in flight. No row moves: only the decisions run. ``--shift EVERY`` moves the whole hot set
to other rows every EVERY batches (a drifting stream). Reported after ``--warm`` batches: hit
rate (lookups that found their row), misses a batch, the bytes a batch would move (each miss up,
an evicted updated row down) at 256-byte rows, and the ideal static top-k bound of a Zipf(1)
stream at this cache size (a cache that always held the most frequent rows). Defaults run in
about a minute on a laptop (4.5M rows); ``--rows 45000000 --batches 1000`` is the benchmark's
table over a long run. JSON to ``results/cache_hitrate.json``.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
from tqdm import tqdm

try:
    from benchmarks import _paths  # noqa: F401
    from benchmarks._common import environment, parser, print_table, write_json
    from benchmarks.gpu_dlrm import scatter, zipf_ranks
except ImportError:  # run as a script from benchmarks/
    import _paths  # noqa: F401
    from _common import environment, parser, print_table, write_json
    from gpu_dlrm import scatter, zipf_ranks

from embeddings.gpu import lru_kernels as LK
from embeddings.gpu.lru import REPLACEMENTS

def stream(n: int, shape: tuple[int, int], batches: int, shift: int, seed: int):
    """``batches`` batches of Zipf(1) rows of an ``n``-row table (``gpu_dlrm.py``'s stream), the
    hot set moved by a large odd offset every ``shift`` batches (0: never)."""
    rng = np.random.default_rng(seed)
    for b in range(batches):
        off = (b // shift) * 1_000_003 if shift else 0
        yield (scatter(zipf_ranks(n, shape, rng), n, 0) + off) % n


def simulate(replacement: str, n: int, cache_fraction: float, ways: int, batch: tuple[int, int], batches: int,
             warm: int, shift: int, seed: int) -> dict:
    """Place ``batches`` batches under ``replacement``; hit rate and moves over those after ``warm``."""
    sets = -(-max(1, round(cache_fraction * n)) // ways)
    S = sets * ways
    tags, stamp = np.full(S, -1, np.int64), np.zeros(S, np.int32)
    dirty = np.zeros(S, np.bool_)
    uses = np.zeros(S, np.int32) if replacement == "lfu" else None
    counts, left = np.zeros(2, np.int64), np.zeros(1, np.int64)
    none = sets * n
    hits = misses = back = 0
    for b, rows in enumerate(tqdm(stream(n, batch, batches, shift, seed), total=batches, desc=replacement,
                                  leave=False, disable=None)):
        now = b + 2
        _, key = LK.probe(rows.ravel(), tags, stamp, sets, ways, now, n, uses)
        sk = np.sort(key)
        first, row = LK.distinct(sk, n, none)
        victim = LK.victims(sk, first, np.cumsum(first), n, stamp, ways, now - 1, left, uses)
        before = int(counts[1])
        LK.settle(row, victim, tags, stamp, dirty, now, counts, uses)
        dirty[stamp == now] = True  # the batch's update writes every row it used
        if b >= warm:
            m = int(np.count_nonzero(sk != none))
            hits += sk.size - m
            misses += m
            back += int(counts[1]) - before
    timed = max(1, batches - warm)
    return {"hit_rate": hits / max(1, hits + misses), "misses_per_batch": misses / timed,
            "written_back_per_batch": back / timed, "slots": S}


def main(argv=None) -> int:
    p = parser(__doc__, "results/cache_hitrate.json")
    p.add_argument("--rows", type=int, default=4_500_000, help="rows of the table")
    p.add_argument("--cache-fraction", type=float, default=0.093, help="cached rows / rows (gpu_dlrm's 10%% budget)")
    p.add_argument("--ways", type=int, default=16, help="ways a set")
    p.add_argument("--batch", type=int, default=16384, help="bags a batch")
    p.add_argument("--lookups", type=int, default=20, help="lookups a bag")
    p.add_argument("--batches", type=int, default=300, help="batches placed")
    p.add_argument("--warm", type=int, default=0, help="batches before counting (default: the last 40 count)")
    p.add_argument("--shift", type=int, default=0, metavar="EVERY", help="move the hot set every EVERY batches")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.batches = 200_000, 1024, 40
    if args.rows < 1 or args.batches < 1 or args.ways < 1 or not 0 < args.cache_fraction <= 1:
        p.error("--rows, --batches and --ways must be positive and --cache-fraction in (0, 1]")
    warm = args.warm or max(0, args.batches - 40)
    if warm >= args.batches:
        p.error(f"--warm {warm} leaves no batch to count of --batches {args.batches}")
    shape = (args.batch, args.lookups)
    print(f"Cache hit rates: {args.rows} rows, {args.cache_fraction:.3f} cached in {args.ways}-way sets, batches of "
          f"{args.batch} x {args.lookups} Zipf(1), {args.batches} batches (the last {args.batches - warm} counted)"
          + (f", hot set moved every {args.shift}" if args.shift else ""), flush=True)
    out = {"environment": environment(), "args": vars(args), "results": {}}
    rows_out = []
    for rep in REPLACEMENTS:
        t0 = time.perf_counter()
        r = simulate(rep, args.rows, args.cache_fraction, args.ways, shape, args.batches, warm, args.shift, args.seed)
        r["seconds"] = time.perf_counter() - t0
        out["results"][rep] = r
        moved = (r["misses_per_batch"] + r["written_back_per_batch"]) * 256 / 1e6
        rows_out.append([rep, f"{100 * r['hit_rate']:.2f}%", r["misses_per_batch"], moved, r["seconds"]])
    k = out["results"]["lru"]["slots"]
    ideal = math.log(k + 1) / math.log(args.rows + 1)
    out["ideal_static_top_k"] = ideal
    rows_out.append(["ideal static top-k", f"{100 * ideal:.2f}%", "", "", ""])
    print_table("Hit rate by replacement", ["replacement", "hit rate", "misses/batch", "MB moved/batch (F=64)",
                                            "seconds"], rows_out)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
