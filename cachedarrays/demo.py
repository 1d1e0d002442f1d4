"""``python -m cachedarrays.demo``: the dissertation's Listing 4.4 with CachedArrays.

C = A @ B runs with all three matrices prefetched into the fast device (DRAM),
then with all three evicted to the slow device (PM), then under the LRU policy
moving them in before the multiply and out after it.  Prints median times, the
bytes moved per direction, and measured next to modeled copy times.

``--device gpu`` runs the tour on three levels, GPU over DRAM over PM: the multiply runs
as JAX on the GPU when the matrices are there (zero-copy views), with numpy on the host
otherwise, and the placements are: in the GPU, in DRAM, in PM, and moved into the GPU,
multiplied and moved out.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import (DRAM, GPU, PM, CachedArray, LRUPolicy, Manager, assign, evict, format_size, prefetch, readable,
               similar, writable)
from .copy import warmup


def multiply(A: CachedArray, B: CachedArray, C: CachedArray) -> None:
    """C = A @ B: JAX on the GPU when all three are there, numpy on the host otherwise."""
    on_gpu = all(x.device == x.manager.fast.name and x.manager.fast.kind == "gpu" for x in (A, B, C))
    with readable(A) as a, readable(B) as b:
        c = writable(C)
        try:
            if on_gpu:
                import jax.numpy as jnp
                assign(c, jnp.matmul(a, b))
            elif isinstance(c.array, np.ndarray):
                np.matmul(np.asarray(a), np.asarray(b), out=c.array)
            else:
                assign(c, np.matmul(np.asarray(a), np.asarray(b)))
        finally:
            c.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="./run demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="matrix side (float32), default 2048")
    parser.add_argument("--fast-capacity", default="256MiB", help="DRAM heap size, default 256MiB")
    parser.add_argument("--slow-capacity", default="512MiB", help="PM heap size, default 512MiB")
    parser.add_argument("--pm-path", default=None, help="directory or file for the PM pool (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="multiplies per placement; the median is shown")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: DRAM over PM (default); gpu: a GPU over DRAM over PM (needs CUDA and CuPy)")
    parser.add_argument("--gpu-capacity", default="256MiB", help="GPU heap size with --device gpu, default 256MiB")
    args = parser.parse_args(argv)

    warmup()
    n = args.size
    rng = np.random.default_rng(0)
    levels = [DRAM(args.fast_capacity), PM(args.pm_path, args.slow_capacity)]
    if args.device == "gpu":
        levels.insert(0, GPU(args.gpu_capacity))
    with Manager(*levels, policy=LRUPolicy()) as m:
        pm = m.slow
        for dev in m.levels:
            print(f"{dev.name}: {dev}")
        print(f"{pm.name} via {'libpmem' if pm.uses_libpmem else 'mmap'} at {pm.path}")
        A = CachedArray(rng.standard_normal((n, n), dtype=np.float32), m)
        B = CachedArray(rng.standard_normal((n, n), dtype=np.float32), m)
        C = similar(A)
        print(f"\nC = A @ B, {n}x{n} float32 ({format_size(A.nbytes)} per matrix)\n")
        pairs = [f"{a.name}->{b.name}" for a, b in zip(m.levels, m.levels[1:])]
        pairs += [f"{b.name}->{a.name}" for a, b in zip(m.levels, m.levels[1:])]
        print(f"{'placement':<34}{'median':>10}{'GFLOP/s':>10}" + "".join(f"{p:>12}" for p in pairs))
        fast = m.fast.name
        plans = [(f"prefetched into fast ({fast})", lambda: prefetch(A, B, C, force=True), lambda: None)]
        if args.device == "gpu":
            plans.append(("in DRAM", lambda: (evict(A, B, C), prefetch(A, B, C, force=True, to="DRAM")),
                          lambda: None))
        plans += [(f"evicted to slow ({pm.name})", lambda: evict(A, B, C, to=pm), lambda: None),
                  ("moved in, multiplied, moved out", lambda: prefetch(A, B, C, force=True), lambda: evict(A, B, C))]
        results = []
        for label, before, after in plans:
            moved0 = dict(m.telemetry()["bytes_moved"])
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                before()
                multiply(A, B, C)
                after()
                times.append(time.perf_counter() - t0)
            moved = {k: v - moved0.get(k, 0) for k, v in m.telemetry()["bytes_moved"].items()}
            t = float(np.median(times))
            results.append(np.asarray(C))
            print(f"{label:<34}{t * 1e3:>8.1f}ms{2 * n**3 / t / 1e9:>10.1f}"
                  + "".join(f"{format_size(moved.get(p, 0)):>12}" for p in pairs))
        if args.device == "gpu":  # the GPU multiplies with TF32 tensor cores: equal within their precision
            errors = [float(np.max(np.abs(r - results[0]))) for r in results]
            assert all(np.allclose(results[0], r, rtol=1e-2, atol=0.5) for r in results), \
                f"placements disagree: largest differences from the first {errors}"
            print("\nall placements agree (GPU and host matmuls within TF32 precision); copies over the whole run:")
        else:
            assert all(np.array_equal(results[0], r) for r in results), "placements disagree"
            print("\nall placements give identical results; copies over the whole run:")
        tele = m.telemetry()
        for pair, v in tele["copies"].items():
            print(f"  {pair}: {format_size(v['bytes'])} in {v['count']} copies, "
                  f"measured {v['measured_seconds'] * 1e3:.1f} ms (hidden {v['hidden_seconds'] * 1e3:.1f} ms), "
                  f"modeled {v['modeled_seconds'] * 1e3:.1f} ms")
        c = tele["counters"]
        print(f"  evictions: {c.get('evictions_written_back', 0)} written back, "
              f"{c.get('evictions_clean_elided', 0)} clean (copy elided); prefetches: {c.get('prefetches', 0)}")
        print(f"  fast-device high-water mark: {format_size(tele['occupancy'][m.fast.name]['high_water'])}")
        print("measured = wall clock of the copies here (the PM file sits in the page cache, so it runs at DRAM "
              "speed);\nmodeled = bytes / device-model bandwidth (PM: optane profile 39/13 GB/s; DRAM: measured probe).")
        del A, B, C
        m.check()


if __name__ == "__main__":
    main()
