"""Embedding lookups and fused updates on tables in GPU memory, against PyTorch on CUDA.

Same run, same data: one CuPy table per feature size (torch and JAX see it through DLPack,
without a copy), indices on the device as CuPy int32 arrays (torch and JAX read the same
buffer), ``batch`` bags of 1 and 40 lookups, uniform and Zipf(1) indices
(``embeddings.distributions``). Rows, per case:

* lookup: ``embeddings.lookup`` (device batch checked inside the kernel, one sync, JAX output),
  the same through the driver without the JAX handoff (CuPy output), the kernel alone
  (pre-validated batch; CUDA-event time), ``torch.nn.functional.embedding_bag(mode="sum")``,
  plain JAX ``jnp.take(W, I, axis=0).sum(1)``, and ours from a host (numpy) batch;
* update: ``embeddings.pullback`` with SGD, SGD in any order (``deterministic=False``: atomic
  adds, no plan; its largest difference from SGD after one update) and row-wise Adagrad, and
  the deterministic update's phases (the stable argsort of the indices, the whole plan),
  against ``nn.EmbeddingBag(sparse=True)`` forward +
  backward + ``optim.SGD.step`` (and that minus its forward: the target compares with backward +
  step), and the rows' read-modify-write alone: every unique row of the batch read and written
  back in place by one thread group a row, as the update's kernel has them (a measured floor for
  random rows, which the streaming copy bandwidth overstates).

Times are medians of CUDA-synchronised wall-clock runs (lookups ten times as many as updates).
GB/s counts bytes moved once (rows and indices read, outputs written; an update reads and writes
each unique row once and reads the gradient and the indices) against the device-to-device copy
bandwidth measured here (read + write). Targets: lookup at least as fast as torch in every case;
pooled lookups (40 per bag) at >= 60% of the copy bandwidth; the SGD update >= 5x faster than
torch's backward + step and within 1.5x of its memory-traffic floor (judged for both SGDs). A
table of host-side costs (microseconds per call of each step of a lookup) shows where the time
outside the kernel goes.
10M rows (``--quick``: 1M rows, batch 8192). Writes ``results/gpu_embeddings.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

import numpy as np

try:
    from benchmarks import _paths  # noqa: F401
    from benchmarks._common import environment, event_time, parser, print_table, print_targets, verdict, write_json
except ImportError:
    import _paths  # noqa: F401
    from _common import environment, event_time, parser, print_table, print_targets, verdict, write_json


LOOKUP_REPEATS = 10  # lookups run this many times as often: they take 0.1-3 ms, and at 1 a bag host noise moves them


def timed(fn, sync, repeats: int) -> float:
    """Median seconds of ``fn`` (after one warm-up call), synchronising the device around each run."""
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def host_split(cp, be, table, W, I, reps: int = 200) -> dict[str, float]:
    """Microseconds of host time per call of each step of ``embeddings.lookup`` on a device batch
    (launches are asynchronous; the sync row waits for the kernel). The lookup makes its JAX
    array unordered while the kernel runs, since it waits for the kernel anyway."""
    import jax

    import embeddings as E
    from embeddings.gpu import handoff, ops

    def per_call(fn) -> float:
        fn()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t = (time.perf_counter() - t0) / reps
        cp.cuda.Device().synchronize()
        return t * 1e6

    flags = be.flags(3)
    bags, _, _ = ops.device_bags(be, table.name, W.shape[0], I, flags=flags, fused=True)
    out = cp.empty((bags.nout, W.shape[1]), cp.float32)
    return {
        "flags": per_call(lambda: be.flags(3)),
        "device_bags": per_call(lambda: ops.device_bags(be, table.name, W.shape[0], I, flags=flags, fused=True)),
        "empty output": per_call(lambda: cp.empty((bags.nout, W.shape[1]), cp.float32)),
        "kernel launch": per_call(lambda: ops.run_pooled(be, out, W, bags)),
        "launch + sync": per_call(lambda: (ops.run_pooled(be, out, W, bags), be.sync())),
        "JAX handoff (ours)": per_call(lambda: handoff.to_jax(out)),
        "JAX handoff (ours, unordered)": per_call(lambda: handoff.to_jax(out, ordered=False)),
        "JAX handoff (jax.dlpack)": per_call(lambda: jax.dlpack.from_dlpack(out)),
        "ops.lookup (CuPy out)": per_call(lambda: ops.lookup(be, table.name, W, I)),
        "embeddings.lookup": per_call(lambda: E.lookup(table, I)),
    }


def copy_bandwidth(cp, nbytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in GB/s, read + write counted."""
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    t = timed(lambda: b.__setitem__(Ellipsis, a), cp.cuda.Device().synchronize, repeats)
    del a, b
    return 2 * nbytes / t / 1e9


RMW_SOURCE = r"""
extern "C" __global__ void rmw_rows(float4* W, int FT, const int* rows, long long n, float z) {
    long long q = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (q >= n) return;
    long long r = rows[q];
    for (int c = threadIdx.x; c < FT; c += blockDim.x) {
        float4 v = W[r * FT + c];
        v.x -= z * v.x; v.y -= z * v.y; v.z -= z * v.z; v.w -= z * v.w;
        W[r * FT + c] = v;
    }
}
"""


def rmw_time(cp, W, rows, repeats: int) -> float:
    """Seconds (median, CUDA events) to read and write back every row of ``rows`` (sorted, unique)
    of ``W`` in place, one thread group a row as the update's kernel has them, values unchanged
    (``z`` = 0 at run time): what random rows' read-modify-write costs here, the part of the
    update's traffic that the copy bandwidth, a streaming measure, does not show."""
    from embeddings.gpu import cuda
    kern = cuda.compiled(RMW_SOURCE).get_function("rmw_rows")
    FT = W.shape[1] // 4
    g, per = cuda.group(FT, pow2=True)
    n = int(rows.size)
    return event_time(lambda: kern((-(-n // per),), (g, per), (W, np.int32(FT), rows, np.int64(n), np.float32(0))),
                      repeats)


def any_order_diff(cp, E, table, W, g, I, rows) -> float:
    """Largest difference between one deterministic and one any-order SGD update of the same rows
    (``rows``: the batch's), each from the rows as they were (restored after)."""
    before = W[rows]
    E.pullback(table, g, I, optimizer=E.SGD(1e-4))
    sorted_ = W[rows]
    W[rows] = before
    E.pullback(table, g, I, optimizer=E.SGD(1e-4, deterministic=False))
    diff = float(cp.abs(W[rows] - sorted_).max())
    W[rows] = before
    return diff


def indices_for(dist: str, nrows: int, shape: tuple[int, int], seed: int) -> np.ndarray:
    from embeddings import distributions as D
    f = D.uniform if dist == "uniform" else D.zipf
    return f(nrows, shape, seed=seed).astype(np.int32)


def main(argv=None) -> int:
    p = parser(__doc__, "results/gpu_embeddings.json")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per case (median reported)")
    args = p.parse_args(argv)
    from cachedarrays.devices import gpu
    if not gpu.available():
        print("gpu_embeddings benchmark skipped: no usable CUDA GPU here (or CuPy is missing)", file=sys.stderr)
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take 75% of the GPU from CuPy
    import cupy as cp
    import jax
    import jax.numpy as jnp
    import torch

    import embeddings as E
    from embeddings.gpu import ops
    from embeddings.gpu.backend import cuda_backend

    nrows, batch = (1_000_000, 8192) if args.quick else (10_000_000, 65536)
    reps = 3 if args.quick else args.repeats

    def sync() -> None:
        cp.cuda.Device().synchronize()
        torch.cuda.synchronize()

    bw = copy_bandwidth(cp, (256 << 20) if args.quick else (2 << 30), reps)
    print(f"GPU embeddings benchmark ({'quick' if args.quick else 'full'}): {nrows} rows, batch {batch}; "
          f"device copy bandwidth {bw:.0f} GB/s (read + write)")
    be = cuda_backend()
    results, targets, splits = [], {}, {}
    for F in (64, 256):
        W = cp.random.default_rng(F).standard_normal((nrows, F), dtype=cp.float32) * 0.01
        table = E.SimpleEmbedding(W, f"t{F}")
        Wt = torch.from_dlpack(W)
        Wj = jax.dlpack.from_dlpack(W)
        jtake = jax.jit(lambda w, i: jnp.take(w, i, axis=0).sum(1))
        emb = torch.nn.EmbeddingBag.from_pretrained(Wt, freeze=False, sparse=True, mode="sum")
        assert emb.weight.data_ptr() == W.data.ptr, "torch copied the table"
        topt = torch.optim.SGD(emb.parameters(), lr=1e-4)
        for k in (1, 40):
            for dist in ("uniform", "zipf"):
                case = f"F={F} k={k} {dist}"
                try:  # one failing case must not lose the others' measurements
                    I = cp.asarray(indices_for(dist, nrows, (batch, k), seed=k))
                    It = torch.from_dlpack(I)
                    Ij = jax.dlpack.from_dlpack(I)
                    L = batch * k
                    bags, _, _ = ops.device_bags(be, table.name, nrows, I, flags=be.flags(3))
                    out = cp.empty((batch, F), cp.float32)
                    I_host = I.get()
                    # correctness in the same run: ours against torch on this data
                    ours = np.asarray(E.lookup(table, I))
                    ref = torch.nn.functional.embedding_bag(It, Wt, mode="sum").cpu().numpy()
                    err = float(np.abs(ours - ref).max())
                    lreps = LOOKUP_REPEATS * reps
                    t_api = timed(lambda: E.lookup(table, I), sync, lreps)
                    t_ops = timed(lambda: ops.lookup(be, table.name, W, I), sync, lreps)
                    t_host_idx = timed(lambda: E.lookup(table, I_host), sync, lreps)
                    t_kernel = event_time(lambda: ops.run_pooled(be, out, W, bags), lreps)
                    t_torch = timed(lambda: torch.nn.functional.embedding_bag(It, Wt, mode="sum"), sync, lreps)
                    t_jax = timed(lambda: jtake(Wj, Ij).block_until_ready(), sync, lreps)
                    if k == 1 and dist == "uniform":
                        splits[f"F={F}"] = host_split(cp, be, table, W, I)
                    lbytes = L * F * 4 + L * 4 + batch * F * 4
                    g = cp.random.default_rng(1).standard_normal((batch, F), dtype=cp.float32)
                    gt = torch.from_dlpack(g)
                    uniq = cp.unique(I)
                    U = int(uniq.size)
                    t_rmw = rmw_time(cp, W, uniq, reps)
                    any_diff = any_order_diff(cp, E, table, W, g, I, uniq)
                    del uniq
                    ubytes = batch * F * 4 + L * 4 + 2 * U * F * 4
                    t_floor = ubytes / (bw * 1e9)  # the update's bytes at the copy bandwidth
                    flat = I.reshape(-1)
                    t_sort = timed(lambda: be.argsort(flat), sync, reps)
                    pbits = max(1, (L - 1).bit_length())  # the alternative: one sort of (row << pbits | position)
                    packed = (flat.astype(cp.int64) << pbits) | cp.arange(L, dtype=cp.int64)
                    t_sort64 = timed(lambda: cp.sort(packed), sync, reps)
                    del packed
                    t_plan = timed(lambda: ops.plan(be, flat), sync, reps)
                    plan = ops.plan(be, flat)
                    long_rows, chunks = plan.sizes()
                    t_sgd = timed(lambda: E.pullback(table, g, I, optimizer=E.SGD(1e-4)), sync, reps)
                    anyway = E.SGD(1e-4, deterministic=False)
                    t_any = timed(lambda: E.pullback(table, g, I, optimizer=anyway), sync, reps)
                    ada = E.RowwiseAdagrad(1e-4)
                    t_ada = timed(lambda: E.pullback(table, g, I, optimizer=ada), sync, reps)
                    del ada

                    def torch_step():
                        topt.zero_grad(set_to_none=True)
                        emb(It).backward(gt)
                        topt.step()

                    t_tstep = timed(torch_step, sync, reps)
                    t_tfwd = timed(lambda: emb(It), sync, reps)
                    t_tbwd = max(t_tstep - t_tfwd, 1e-9)
                    r = {"case": case, "F": F, "k": k, "dist": dist, "rows": nrows, "batch": batch, "unique_rows": U,
                         "long_rows": long_rows, "chunks": chunks, "max_abs_diff_vs_torch": err,
                         "lookup_ms": t_api * 1e3, "lookup_cupy_ms": t_ops * 1e3,
                         "lookup_host_indices_ms": t_host_idx * 1e3,
                         "lookup_kernel_ms": t_kernel * 1e3, "torch_lookup_ms": t_torch * 1e3,
                         "jax_take_sum_ms": t_jax * 1e3, "lookup_GBps": lbytes / t_api / 1e9,
                         "lookup_kernel_GBps": lbytes / t_kernel / 1e9, "lookup_bw_fraction": lbytes / t_api / 1e9 / bw,
                         "lookup_kernel_bw_fraction": lbytes / t_kernel / 1e9 / bw,
                         "torch_over_ours_lookup": t_torch / t_api,
                         "sort_ms": t_sort * 1e3, "sort_int64_keys_ms": t_sort64 * 1e3, "plan_ms": t_plan * 1e3,
                         "sgd_ms": t_sgd * 1e3, "adagrad_ms": t_ada * 1e3, "torch_step_ms": t_tstep * 1e3,
                         "torch_bwd_step_ms": t_tbwd * 1e3, "update_floor_ms": t_floor * 1e3,
                         "torch_bwd_step_over_ours_sgd": t_tbwd / t_sgd,
                         "sgd_over_floor": t_sgd / t_floor, "sgd_any_ms": t_any * 1e3,
                         "torch_bwd_step_over_ours_sgd_any": t_tbwd / t_any,
                         "sgd_any_over_floor": t_any / t_floor, "sgd_any_max_abs_diff": any_diff,
                         "rmw_ms": t_rmw * 1e3,
                         "rmw_GBps": 2 * U * F * 4 / t_rmw / 1e9, "sgd_over_rmw": t_sgd / t_rmw}
                    results.append(r)
                    print(f"  {case}: lookup {r['lookup_ms']:.3f} ms (kernel {r['lookup_kernel_ms']:.3f}) torch "
                          f"{r['torch_lookup_ms']:.3f} jax {r['jax_take_sum_ms']:.3f}; sgd {r['sgd_ms']:.3f} (sort "
                          f"{r['sort_ms']:.3f} plan {r['plan_ms']:.3f}) any order {r['sgd_any_ms']:.3f} adagrad "
                          f"{r['adagrad_ms']:.3f} torch step {r['torch_step_ms']:.3f}; max |ours - torch| {err:.2e}",
                          flush=True)
                    targets[f"{case}: lookup <= torch ({r['lookup_ms']:.3f} vs {r['torch_lookup_ms']:.3f} ms)"] = \
                        t_api <= t_torch
                    if k > 1:
                        targets[f"{case}: lookup >= 60% of copy bandwidth ({100 * r['lookup_bw_fraction']:.0f}%)"] = \
                            r["lookup_bw_fraction"] >= 0.6
                    for tag, key in (("SGD", "sgd"), ("SGD any order", "sgd_any")):
                        speedup, over = r[f"torch_bwd_step_over_ours_{key}"], r[f"{key}_over_floor"]
                        targets[f"{case}: {tag} >= 5x torch backward+step ({speedup:.1f}x)"] = speedup >= 5
                        targets[f"{case}: {tag} within 1.5x of its traffic floor ({over:.2f}x)"] = over <= 1.5
                    del plan, flat, I, It, Ij, bags, out, g, gt
                except Exception:
                    traceback.print_exc()
                    print(f"  {case}: FAILED (traceback above)", flush=True)
                    targets[f"{case}: ran"] = False
        del table, Wt, Wj, emb, topt, W
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print_table("Lookups (ms, medians; GB/s of rows read + output written; % of the copy bandwidth)",
                ["case", "ours", "ours CuPy out", "kernel", "torch", "jax take+sum", "ours host idx", "GB/s",
                 "% copy bw", "kernel %", "torch/ours"],
                [[r["case"], r["lookup_ms"], r["lookup_cupy_ms"], r["lookup_kernel_ms"], r["torch_lookup_ms"],
                  r["jax_take_sum_ms"], r["lookup_host_indices_ms"], r["lookup_GBps"], 100 * r["lookup_bw_fraction"],
                  100 * r["lookup_kernel_bw_fraction"], r["torch_over_ours_lookup"]] for r in results])
    steps = list(next(iter(splits.values()))) if splits else []
    print_table("Host time of a lookup's steps (microseconds per call, device batch, k=1 uniform)",
                ["step"] + list(splits), [[st] + [splits[c][st] for c in splits] for st in steps])
    print_table("Updates (ms, medians)",
                ["case", "unique", "long rows", "argsort", "sort i64 keys", "plan", "ours SGD", "ours Adagrad",
                 "torch fwd+bwd+step", "torch bwd+step", "floor", "torch/ours", "ours/floor", "rows' RMW",
                 "RMW GB/s", "ours/RMW"],
                [[r["case"], r["unique_rows"], r["long_rows"], r["sort_ms"], r["sort_int64_keys_ms"], r["plan_ms"],
                  r["sgd_ms"], r["adagrad_ms"], r["torch_step_ms"], r["torch_bwd_step_ms"], r["update_floor_ms"],
                  r["torch_bwd_step_over_ours_sgd"], r["sgd_over_floor"], r["rmw_ms"], r["rmw_GBps"],
                  r["sgd_over_rmw"]] for r in results])
    print_table("SGD in any order (SGD(deterministic=False): atomic adds, no plan; ms, medians)",
                ["case", "ours SGD", "ours any order", "torch bwd+step", "floor", "torch/any", "any/floor",
                 "any/RMW", "max |any - SGD|"],
                [[r["case"], r["sgd_ms"], r["sgd_any_ms"], r["torch_bwd_step_ms"], r["update_floor_ms"],
                  r["torch_bwd_step_over_ours_sgd_any"], r["sgd_any_over_floor"], r["sgd_any_ms"] / r["rmw_ms"],
                  f"{r['sgd_any_max_abs_diff']:.1e}"] for r in results])
    print_targets(targets)
    write_json(args.out, {"environment": environment(), "quick": args.quick, "copy_GBps": bw, "results": results,
                          "host_split_us": splits,
                          "targets": {k: verdict(v) for k, v in targets.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
