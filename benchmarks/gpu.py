"""GPU benchmark: the manager's copies against bare CUDA copies, and prefetch overlapped with compute.

Runs on a machine with a CUDA GPU and CuPy (``pip install 'cachedarrays[gpu]'``).

1. Copies of 256 MiB and 4 GiB objects (``--quick``: 256 MiB only).  ``manager`` is
   ``Manager.copyto_async(...)`` + wait between a GPU region and a region of the page-locked
   DRAM heap (wall clock as a user sees it, thread hand-off and all); ``bare`` is one
   ``cudaMemcpyAsync`` between pinned memory from ``cudaHostAlloc`` and a CuPy buffer, timed
   the same way; ``pageable`` is ``cupy.ndarray.set`` / ``.get`` from plain numpy memory.  The
   three alternate inside every repeat; medians of 7.  GB/s counts each byte once.
   GPU->GPU: the manager between two GPU regions against ``cupy.copyto``.
   Target: manager/bare >= 0.9 for host->GPU and GPU->host.
2. Overlap: a chain of 16 jitted matmul layers ``h = tanh(h @ W_i)`` on 1 GiB weights
   (16384 x 16384 float32; ``--quick``: 8 layers of 64 MiB) held in DRAM, with a GPU level of
   3 GiB (room for two weights and change).  The batch is calibrated so a layer computes at
   least as long as its weight takes to copy.  ``resident``: every weight a JAX array in HBM;
   ``prefetch``: ``prefetch(W[i+1])`` while ``readable(W[i])`` is held for layer i (the pin
   keeps W[i] in; the eviction of W[i-1] is clean and moves nothing, and the copy into its
   bytes waits on the GPU for layer i-1 to finish reading them); ``copy at use``: after layer
   i-1 has finished, ``prefetch(W[i])`` and wait for it, then layer i: every copy is exposed.  Median of 5 chains each.  Target: prefetch >= 0.9x resident speed.

Writes ``results/gpu.json``; ``--help`` for options.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

try:
    from benchmarks._common import environment, parser, print_table, print_targets, verdict, write_json
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from _common import environment, parser, print_table, print_targets, verdict, write_json

MiB, GiB = 1 << 20, 1 << 30
TARGET_COPY = 0.9
TARGET_OVERLAP = 0.9


def _median(fn, repeats: int) -> float:
    fn()
    return statistics.median(_timed(fn) for _ in range(repeats))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_copies(sizes: list[int], repeats: int) -> list[dict]:
    import cupy as cp
    from cachedarrays import DRAM, GPU, Manager
    rows = []
    for n in sizes:
        with Manager(GPU(2 * n + 64 * MiB), DRAM(n + 64 * MiB)) as m:
            g = m.allocate_or_raise(m.fast, n)
            g2 = m.allocate_or_raise(m.fast, n)
            d = m.allocate_or_raise(m.slow, n)
            m.bytes(d)[:] = 1
            pinned = cp.cuda.alloc_pinned_memory(n)
            dev = cp.empty(n, dtype=cp.uint8)
            dev2 = cp.empty(n, dtype=cp.uint8)
            pageable = np.ones(n, dtype=np.uint8)
            stream = cp.cuda.Stream(non_blocking=True)

            def bare(dst, src):
                def f():
                    cp.cuda.runtime.memcpyAsync(dst, src, n, 4, stream.ptr)
                    stream.synchronize()
                return f

            def manager(dst, src):
                return lambda: m.copyto_async(dst, src).wait()

            cases = {
                "host->GPU": {"manager": manager(g, d), "bare": bare(dev.data.ptr, pinned.ptr),
                              "pageable": lambda: (dev.set(pageable), cp.cuda.Device().synchronize())},
                "GPU->host": {"manager": manager(d, g), "bare": bare(pinned.ptr, dev.data.ptr),
                              "pageable": lambda: dev.get(out=pageable)},
                "GPU->GPU": {"manager": manager(g2, g), "bare": lambda: (cp.copyto(dev2, dev),
                                                                         cp.cuda.Device().synchronize())},
            }
            for pair, fns in cases.items():
                samples = {k: [] for k in fns}
                for name, fn in fns.items():
                    fn()
                for r in range(repeats):
                    for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                        samples[name].append(_timed(fns[name]))
                t = {k: statistics.median(v) for k, v in samples.items()}
                row = {"pair": pair, "bytes": n, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
                       **{f"{k}_GBps": n / v / 1e9 for k, v in t.items()},
                       "manager_over_bare": t["bare"] / t["manager"]}
                if "pageable" in t:
                    row["manager_over_pageable"] = t["pageable"] / t["manager"]
                rows.append(row)
            m.wait_all()
    return rows


def bench_overlap(layers: int, side: int, budget: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import cachedarrays as ca
    from cachedarrays import DRAM, GPU, CachedArray, LRUPolicy, Manager, readable
    wbytes = side * side * 4
    layer = jax.jit(lambda h, w: jnp.tanh(h @ w))
    with Manager(GPU(budget), DRAM(layers * wbytes + 256 * MiB), policy=LRUPolicy()) as m:
        weights = []
        for i in range(layers):
            w = CachedArray((side, side), m, np.float32, place="slow")
            with ca.writable(w) as a:
                a[...] = np.float32(1.0 / side) * (1 + (i % 3))
            weights.append(w)
        # the copy time of one weight, measured through the manager
        ca.prefetch(weights[0], force=True)
        with readable(weights[0]) as a:
            a.block_until_ready()
        ca.evict(weights[0])
        copy_s = m.telemetry()["copies"]["DRAM->GPU"]["measured_seconds"]
        resident = [jax.device_put(np.full((side, side), 1.0 / side, np.float32)) for _ in range(layers)]
        batch = 1024
        while True:  # calibrate: one layer at least as long as one weight copy
            h0 = jnp.ones((batch, side), jnp.float32)
            t = _median(lambda: layer(h0, resident[0]).block_until_ready(), 5)
            if t >= 1.1 * copy_s or batch >= 65536:
                break
            batch *= 2
        h0 = jnp.ones((batch, side), jnp.float32)

        def run_resident():
            h = h0
            for w in resident:
                h = layer(h, w)
            h.block_until_ready()

        def run_ours(lookahead: bool):
            def run():
                h = h0
                if lookahead:
                    ca.prefetch(weights[0], force=True)
                for i, w in enumerate(weights):
                    if not lookahead:  # serial: the previous layer, then the copy, then this layer
                        h.block_until_ready()
                        ca.prefetch(w, force=True)
                        m.ready(m.primary(w.object))
                    with readable(w) as a:  # pinned: the prefetch below cannot evict it
                        if lookahead and i + 1 < len(weights):
                            ca.prefetch(weights[i + 1], force=True)
                        h = layer(h, a)
                h.block_until_ready()
            return run

        m.reset_telemetry()
        fns = {"resident": run_resident, "prefetch": run_ours(True), "copy at use": run_ours(False)}
        for fn in fns.values():
            fn()
        samples = {k: [] for k in fns}
        moved = {k: {"DRAM->GPU": 0, "GPU->DRAM": 0, "hidden_s": 0.0, "exposed_s": 0.0} for k in fns}
        for r in range(repeats):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                m.reset_telemetry()
                samples[name].append(_timed(fns[name]))
                tele = m.telemetry()
                up = tele["copies"].get("DRAM->GPU", {})
                moved[name]["DRAM->GPU"] += up.get("bytes", 0) / repeats
                moved[name]["GPU->DRAM"] += tele["bytes_moved"].get("GPU->DRAM", 0) / repeats
                moved[name]["hidden_s"] += up.get("hidden_seconds", 0.0) / repeats
                moved[name]["exposed_s"] += up.get("exposed_seconds", 0.0) / repeats
        t = {k: statistics.median(v) for k, v in samples.items()}
        return {"layers": layers, "weight_bytes": wbytes, "batch": batch, "gpu_budget": budget,
                "layer_ms": _median(lambda: layer(h0, resident[0]).block_until_ready(), 5) * 1e3,
                "weight_copy_ms": copy_s * 1e3, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
                "prefetch_speed_vs_resident": t["resident"] / t["prefetch"],
                "copy_at_use_speed_vs_resident": t["resident"] / t["copy at use"], "per_chain": moved}


def main(argv=None) -> int:
    p = parser(__doc__, "results/gpu.json")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median reported)")
    p.add_argument("--parts", default="copies,overlap", help="comma-separated parts to run (default: both)")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    from cachedarrays.devices import gpu
    if not gpu.available():
        print("gpu benchmark skipped: no usable CUDA GPU here (or CuPy is missing)", file=sys.stderr)
        return 0
    sizes = [256 * MiB] if args.quick else [256 * MiB, 4 * GiB]
    print(f"cachedarrays GPU benchmark ({'quick' if args.quick else 'full'})")
    copies = bench_copies(sizes, args.repeats) if "copies" in parts else []
    rows = []
    for r in copies:
        rows.append([r["pair"], f"{r['bytes'] // MiB} MiB", r["manager_GBps"], r["bare_GBps"],
                     r.get("pageable_GBps", float("nan")), r["manager_over_bare"],
                     r.get("manager_over_pageable", float("nan"))])
    if copies:
        print_table("Copies (GB/s, each byte once; medians)", ["pair", "size", "manager", "bare cudaMemcpyAsync",
                                                              "pageable", "manager/bare", "manager/pageable"], rows)
    if "overlap" not in parts:
        overlap = None
    elif args.quick:
        overlap = bench_overlap(8, 4096, 160 * MiB, 3)
    else:
        overlap = bench_overlap(16, 16384, 3 * GiB, 5)
    targets = {f"{r['pair']} {r['bytes'] // MiB} MiB: manager >= {TARGET_COPY}x bare ({r['manager_over_bare']:.2f})":
               r["manager_over_bare"] >= TARGET_COPY for r in copies if r["pair"] != "GPU->GPU"}
    if overlap is not None:
        print_overlap(overlap)
        targets[f"prefetch chain >= {TARGET_OVERLAP}x resident ({overlap['prefetch_speed_vs_resident']:.2f})"] = \
            overlap["prefetch_speed_vs_resident"] >= TARGET_OVERLAP
    print_targets(targets)
    write_json(args.out, {"environment": environment(), "quick": args.quick, "copies": copies, "overlap": overlap,
                          "targets": {k: verdict(v) for k, v in targets.items()}})
    return 0


def print_overlap(overlap: dict) -> None:
    print_table(f"Overlap: {overlap['layers']} layers, {overlap['weight_bytes'] // MiB} MiB weights in DRAM, "
                f"GPU budget {overlap['gpu_budget'] // MiB} MiB, batch {overlap['batch']} "
                f"(layer {overlap['layer_ms']:.1f} ms, weight copy {overlap['weight_copy_ms']:.1f} ms)",
                ["chain", "ms", "speed vs resident", "GiB DRAM->GPU", "GiB GPU->DRAM", "copy ms hidden",
                 "copy ms exposed"],
                [[label, overlap[f"{key}_ms"], overlap["resident_ms"] / overlap[f"{key}_ms"],
                  overlap["per_chain"][key]["DRAM->GPU"] / GiB, overlap["per_chain"][key]["GPU->DRAM"] / GiB,
                  overlap["per_chain"][key]["hidden_s"] * 1e3, overlap["per_chain"][key]["exposed_s"] * 1e3]
                 for label, key in (("all weights resident in HBM", "resident"),
                                    ("prefetch W[i+1] during layer i", "prefetch"),
                                    ("copy each weight at its use", "copy at use"))])
    print("  (per chain, means; hidden/exposed: copy time a GPU consumer did not / did wait for)")


if __name__ == "__main__":
    sys.exit(main())
