"""Where the GPU DLRM step's time goes: every kernel and copy of a few steps, on a timeline.

Builds the part-1 model of ``gpu_dlrm.py`` (``lru`` cached tables in page-locked host memory and
a 10% HBM budget; default 8 x 20M rows, smaller than the benchmark so that it starts in a
minute) and its in-HBM twin, times ``--steps`` steps of each by phase, then records
``--traced`` steps of ours with ``torch.profiler``. Its CUPTI tracing sees the whole process:
CuPy's kernels, JAX's, the prefetch thread's, each with its stream, and the host's CUDA calls
with their thread. Written: the Chrome trace (open it in Perfetto or chrome://tracing) and a
summary, printed and as JSON: each stream's busy time and the kernels that fill it, how much of
it other streams overlap, the GPU's idle time, the longest host calls, and a timeline of the
first traced step.

``--analyse TRACE`` prints the summary of a saved trace (``.json`` or ``.json.gz``) and needs no
GPU. This is a profiling tool, not a benchmark: it has no baseline and no targets.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import sys
import time
from typing import Any

try:
    from benchmarks import _paths  # noqa: F401
    from benchmarks._common import parser, write_json
except ImportError:
    import _paths  # noqa: F401
    from _common import parser, write_json
from embeddings.gpu.lru import READS

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")


def union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The sorted, disjoint union of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Total length where two disjoint sorted interval lists (:func:`union`) intersect."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise(events: list[dict], timeline_ms: float = 60.0, shortest_us: float = 15.0) -> dict[str, Any]:
    """The summary of a Chrome trace's events (times in microseconds, as torch writes them)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    if not gpu:
        return {"gpu_events": 0}
    t0 = gpu[0]["ts"]
    streams: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream")].append(e)
    busy = {s: union([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in streams.items()}
    whole = union([tuple(x) for iv in busy.values() for x in iv])
    span = whole[-1][1] - whole[0][0]
    per_stream = {}
    for s, es in streams.items():
        others = union([tuple(x) for s2, iv in busy.items() if s2 != s for x in iv])
        names: collections.Counter = collections.Counter()
        for e in es:
            names[e["name"][:80]] += e["dur"]
        per_stream[str(s)] = {
            "events": len(es),
            "busy_ms": sum(b - a for a, b in busy[s]) / 1e3,
            "overlapped_by_others_ms": overlap(busy[s], others) / 1e3,
            "top": [(n, d / 1e3) for n, d in names.most_common(10)],
        }
    threads: dict[Any, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in host:
        threads[e.get("tid")][e["name"]] += e["dur"]
    return {
        "gpu_events": len(gpu),
        "span_ms": span / 1e3,
        "gpu_busy_ms": sum(b - a for a, b in whole) / 1e3,
        "streams": per_stream,
        "host_calls_ms": {str(t): [(n, d / 1e3) for n, d in c.most_common(6)] for t, c in threads.items()},
        "long_host_calls": [((e["ts"] - t0) / 1e3, e["dur"] / 1e3, str(e.get("tid")), e["name"])
                            for e in sorted(host, key=lambda e: e["ts"])
                            if e["dur"] >= 200 and e["ts"] - t0 <= timeline_ms * 1e3],
        "timeline": [((e["ts"] - t0) / 1e3, e["dur"] / 1e3, str(e.get("args", {}).get("stream")), e["name"][:70])
                     for e in gpu if e["dur"] >= shortest_us and e["ts"] - t0 <= timeline_ms * 1e3],
    }


def print_summary(s: dict[str, Any]) -> None:
    if not s.get("gpu_events"):
        print("no GPU events in the trace")
        return
    print(f"{s['gpu_events']} GPU events over {s['span_ms']:.1f} ms; the GPU busy (any stream) "
          f"{s['gpu_busy_ms']:.1f} ms, idle {s['span_ms'] - s['gpu_busy_ms']:.1f} ms")
    for name, st in s["streams"].items():
        print(f"stream {name}: {st['events']} events, busy {st['busy_ms']:.2f} ms, other streams beside it "
              f"{st['overlapped_by_others_ms']:.2f} ms")
        for n, d in st["top"]:
            print(f"    {d:8.2f} ms  {n}")
    for t, calls in s["host_calls_ms"].items():
        print(f"host thread {t}: " + ", ".join(f"{n} {d:.1f} ms" for n, d in calls))
    print("host CUDA calls of 0.2 ms or more (ms from the first GPU event, ms, thread, call):")
    for at, d, t, n in s["long_host_calls"]:
        print(f"  {at:8.2f} {d:7.2f}  {t}  {n}")
    print("timeline (ms from the first GPU event, ms, stream, name):")
    for at, d, st, n in s["timeline"]:
        print(f"  {at:8.2f} {d:7.2f}  s{st}  {n}")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def record(args) -> tuple[str, dict[str, Any]]:
    """Build both models, time them by phase, trace ours; (trace path, phase timings)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from dlrm import gpu as G
    try:
        from benchmarks.gpu_dlrm import host_model, in_hbm_model, make_batches
    except ImportError:
        from gpu_dlrm import host_model, in_hbm_model, make_batches

    T, n, F, B, k = args.tables, args.rows, 64, args.batch, args.lookups
    small = max(1, n // 10)
    budget = int(T * n * F * 4 * args.budget / 100)
    cf = G.cache_fraction_for(budget, "lru", [n] * T, F)
    need = args.warm_steps + 2 * args.steps + args.traced + 2
    big, small_b = make_batches(need, T, n, small, B, k, seed=1)
    sync = cp.cuda.get_current_stream().synchronize
    hbm = in_hbm_model(cp, T, small, F, 0.01, small_b[0])
    ours, m, views, _ = host_model(T, n, F, budget, "lru", cf, 0.01, big[0])
    for t in ours.tables:
        t.reads = args.lru_reads
    print(f"{T} x {n} rows, HBM budget {args.budget}% -> cache fraction {cf:.4f}, {args.lru_reads} reads; "
          f"{args.warm_steps} warm-up steps", flush=True)
    for j in range(args.warm_steps):
        ours.train_step(big[j], big[j + 1])
    at = {"ours": args.warm_steps, "in HBM": 0}  # the next batch of each model (ours: the one prefetched)
    phases = {}

    def steps(model, batches, count, label, who):
        model.timer.reset()
        sync()
        t = time.perf_counter()
        for _ in range(count):
            j = at[who]
            at[who] += 1
            model.train_step(batches[j], batches[j + 1])
        sync()
        ms = 1e3 * (time.perf_counter() - t) / count
        split = {p: 1e3 * v / count for p, v in model.timer.table().items() if v}
        phases[label] = {"ms_per_step": ms, "phases_ms": split}
        print(f"{label:8s} {ms:7.2f} ms/step; " + ", ".join(f"{p} {v:.1f}" for p, v in split.items()), flush=True)

    # both timed before the profiler starts: after it, untraced steps ran slower (the in-HBM
    # model's 14-20 ms step took 118 ms after a trace, its phases still adding up to 22 ms)
    steps(hbm, small_b, args.steps, "in HBM", "in HBM")
    steps(ours, big, args.steps, "ours", "ours")  # each batch the one the step before prefetched
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps(ours, big, args.traced, "traced", "ours")
    os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    raw = args.trace[:-3] if args.trace.endswith(".gz") else args.trace
    prof.export_chrome_trace(raw)
    if raw != args.trace:
        with open(raw, "rb") as f, gzip.open(args.trace, "wb") as g:
            g.write(f.read())
        os.remove(raw)
    return args.trace, phases


def main(argv=None) -> int:
    p = parser(__doc__, "results/gpu_trace.json")
    p.add_argument("--analyse", metavar="TRACE", help="summarise this saved trace (no GPU needed) and stop")
    p.add_argument("--trace", default="results/gpu_trace.trace.json.gz", help="where to write the Chrome trace")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=20_000_000, help="rows per table")
    p.add_argument("--budget", type=float, default=10.0, help="HBM budget, percent of the tables' bytes")
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--lru-reads", choices=READS, default="split",
                   help="how ours brings missed rows up (LRUCachedEmbeddings(reads=))")
    p.add_argument("--lookups", type=int, default=20, help="lookups per bag")
    p.add_argument("--warm-steps", type=int, default=50)
    p.add_argument("--steps", type=int, default=8, help="timed steps of each model")
    p.add_argument("--traced", type=int, default=3, help="steps of ours in the trace")
    p.add_argument("--timeline-ms", type=float, default=60.0, help="how much of the trace the timeline prints")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.warm_steps, args.steps, args.traced = 1_000_000, 4096, 8, 3, 2
    out: dict[str, Any] = {}
    if args.analyse is None:
        from cachedarrays.devices import gpu
        if not gpu.available():
            print("gpu_trace skipped: no usable CUDA GPU here (or CuPy is missing); --analyse needs none",
                  file=sys.stderr)
            return 0
        args.analyse, out["phases"] = record(args)
    summary = summarise(load(args.analyse), args.timeline_ms)
    print_summary(summary)
    out["trace"], out["summary"] = args.analyse, summary
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
