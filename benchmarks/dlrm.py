"""DLRM training throughput against a straightforward PyTorch CPU DLRM, loss curves, and policies.

What it measures, and how:

1. Training samples/s of ``dlrm`` (tables in DRAM: ``--policy dram``) and of the PyTorch
   baseline in ``benchmarks/torch_dlrm.py`` (``nn.EmbeddingBag(mode="sum", sparse=True)`` +
   ``torch.optim.SGD``, 2 threads) with identical architecture, initial weights, data and
   hyper-parameters (SGD, lr 0.01, BCE), on two shapes:

   (a) Kaggle-shaped: 26 tables with the Criteo Kaggle sizes (36.4M rows), feature size 16,
       bottom 13-512-256-64-16, top 512-256-1, one index per table, batch 2048;
   (b) 8 tables of 1,000,000 rows, feature size 64, exactly 100 indices per bag, bottom
       512-512-64, top 1024-1024-1024-1, batch 2048.

   Indices are uniform. Batches are generated before timing (data generation excluded for
   both); each step is timed alone (lookup, forward, backward, all updates); ours and torch
   alternate in blocks inside every round and the median step time gives samples/s. Ours runs
   twice over the same tables: dense matmuls in float32 (as torch) and in bfloat16 with float32
   accumulation and weights (``--dense-precision bf16``; the dissertation's comparison in section
   5.5.2 used bf16 MLPs too). Targets: ours/torch >= 1.5 on (a) and >= 2 on (b), against the f32
   torch baseline. For a like-for-like view of bf16, torch also runs under bf16 autocast (its own
   mixed precision) in the same rounds; that table is information, not a target. The torch step
   is also timed without its embedding work (pooled embeddings precomputed, in the same rounds),
   which splits both implementations into embedding work and dense work.
2. Loss curves: both models from the same initial weights on the same planted data (synthetic,
   labels drawn from a hidden teacher, Zipf indices), 200 steps of the Kaggle architecture with
   tables capped at 100k rows, batch 1024, lr 0.1, ours in f32 and in bf16. Target: the 20-step
   moving averages differ by less than 0.01 everywhere (for f32, summation order is the only
   difference; bf16 rounds the matmul operands).
3. Policies on (b) with Zipf(1) indices, all built side by side and run in alternating rounds:
   samples/s and the time per phase (lookup, dense forward+backward, embedding update, dense
   update, cache flush) for ``dram``, ``simple``
   (tables in PM) and, when ``embeddings.cached.CachedEmbeddings`` exists, ``static`` and
   ``dynamic`` with 10% of each table cacheable (static: the hot set of 4 other batches; dynamic:
   after 6 untimed steps), as in the dissertation's Figure 5.12. The PM
   device here is a file mapping on an ordinary file system, so "PM" runs at page-cache (DRAM)
   speed on this machine: the policy differences are overheads, not device bandwidth.

``--quick`` shrinks tables (rows / 100, at least 3), batches (512 and 256) and step counts: a
smoke test (< 2 minutes), not a measurement. JSON goes to ``results/dlrm.json``.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time

import _paths  # noqa: F401  (this file is dlrm.py: make `import dlrm` find the package)
import cachedarrays  # noqa: E402,F401  (sets OMP_WAIT_POLICY before numba starts its threads)
import numpy as np  # noqa: E402

from _common import environment, parser, print_table, verdict, write_json  # noqa: E402

KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
          5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def shapes(quick: bool) -> dict:
    scale = (lambda n: max(3, n // 100)) if quick else (lambda n: n)
    return {
        "a": dict(label="(a) Kaggle 26 tables, F16, 1 idx", sizes=[scale(n) for n in KAGGLE], F=16,
                  bot=(13, 512, 256, 64, 16), top=(512, 256, 1), k=1, B=512 if quick else 2048, target=1.5),
        "b": dict(label="(b) 8 x 1M, F64, 100 idx/bag", sizes=[scale(1_000_000)] * 8, F=64,
                  bot=(512, 512, 64), top=(1024, 1024, 1024, 1), k=100, B=256 if quick else 2048, target=2.0),
    }


def build(shape: dict, policy: str, tmp: str, lr: float, seed: int = 0, cache_fraction: float = 0.1,
          precision: str = "f32", sample: list | None = None):
    from cachedarrays import DRAM, PM, LRUPolicy, Manager
    from dlrm import DLRM, DLRMConfig, make_tables
    from dlrm.placement import cache_rows, hot_rows

    cfg = DLRMConfig(shape["sizes"], shape["F"], shape["bot"], shape["top"])
    hot = None
    if policy == "static" and sample is not None:  # the hot set of sample batches, as dlrm.train does
        hot = hot_rows(sample, cfg.ntables, [cache_rows(n, cache_fraction) for n in cfg.table_sizes])
    nbytes = sum(shape["sizes"]) * shape["F"] * 4
    fast = {"dram": nbytes, "simple": 0}.get(policy, int(2 * cache_fraction * nbytes)) + (64 << 20)
    slow = (nbytes if policy != "dram" else 0) + (64 << 20)
    m = Manager(DRAM(fast), PM(tmp, slow), policy=LRUPolicy())
    tables = make_tables(cfg.table_sizes, cfg.featuresize, policy, m, cache_fraction, seed, hot=hot)
    return m, DLRM(cfg, tables, lr=lr, seed=seed, precision=precision)


def data_for(shape: dict, dist: str, n: int, seed: int = 0):
    from dlrm.data import SyntheticData

    d = SyntheticData(shape["sizes"], shape["bot"][0], shape["B"], num_indices=shape["k"], fixed=True,
                      distribution=dist, seed=seed)
    return [d.batch(i) for i in range(n)]


def torch_twin(model, lr: float, bf16: bool = False):
    import torch
    from dlrm.placement import read_table
    from torch_dlrm import TorchDLRM, TorchTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    tm = TorchDLRM([read_table(t) for t in model.tables], model.dense_numpy(), model.config.interaction)
    return TorchTrainer(tm, lr, bf16=bf16)


def compare(shape: dict, steps: int, rounds: int, lr: float = 0.01) -> dict:
    """Median step time of ours (dense matmuls in f32 and in bf16, two models over the same
    tables) and of torch, alternating blocks of ``steps`` over ``rounds``."""
    from dlrm import DLRM
    from torch_dlrm import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m, model = build(shape, "dram", tmp, lr)
        ours = {"f32": model, "bf16": DLRM(model.config, model.tables, lr=lr, seed=0, precision="bf16")}
        batches = data_for(shape, "uniform", 3)
        tbs = [TorchTrainer.convert(b) for b in batches]
        tt = torch_twin(model, lr)
        tt16 = torch_twin(model, lr, bf16=True)
        for mod in ours.values():
            mod.warmup(batches[0])
            mod.timer.reset()
        tt.step(tbs[0])
        tt16.step(tbs[0])
        setup = time.perf_counter() - t0
        # torch without its embedding work (precomputed pooled embeddings) splits its step in two
        lys = [tt.pooled(tb) for tb in tbs]
        tt.dense_only_step(tbs[0], lys[0])
        times: dict = {"f32": [], "bf16": [], "torch": [], "torch_bf16": [], "torch_dense": []}
        torches = {"torch": lambda j: tt.step(tbs[j]), "torch_bf16": lambda j: tt16.step(tbs[j]),
                   "torch_dense": lambda j: tt.dense_only_step(tbs[j], lys[j])}
        for r in range(rounds):
            order = ("f32", "bf16", "torch", "torch_bf16", "torch_dense")
            for who in (order if r % 2 == 0 else order[::-1]):
                for s in range(steps):
                    j = (r * steps + s) % len(batches)
                    t = time.perf_counter()
                    if who in torches:
                        torches[who](j)
                    else:
                        ours[who].train_step(batches[j])
                    times[who].append(time.perf_counter() - t)
        phases = {p: {k: 1e3 * v / len(times[p]) for k, v in ours[p].timer.table().items()} for p in ours}
        del lys
        B = shape["B"]
        med = {k: statistics.median(v) for k, v in times.items()}
        res = {"label": shape["label"], "batch": B, "ours_step_s": med["f32"], "ours_bf16_step_s": med["bf16"],
               "torch_step_s": med["torch"], "ours_samples_s": B / med["f32"], "ours_bf16_samples_s": B / med["bf16"],
               "torch_samples_s": B / med["torch"], "torch_bf16_step_s": med["torch_bf16"],
               "torch_bf16_samples_s": B / med["torch_bf16"], "ours_steps": times["f32"],
               "ours_bf16_steps": times["bf16"], "torch_steps": times["torch"], "torch_bf16_steps": times["torch_bf16"],
               "ours_phase_ms": phases["f32"], "ours_bf16_phase_ms": phases["bf16"],
               "setup_s": setup, "target": shape["target"], "torch_dense_only_step_s": med["torch_dense"]}
        res["ratio"] = res["ours_samples_s"] / res["torch_samples_s"]
        res["ratio_bf16"] = res["ours_bf16_samples_s"] / res["torch_samples_s"]
        res["ratio_bf16_vs_torch_bf16"] = res["ours_bf16_samples_s"] / res["torch_bf16_samples_s"]
        del tt, tt16, torches, model, ours, tbs
        m.close()
    gc.collect()
    return res


def _curve_summary(ours: list, theirs: list) -> dict:
    w = min(20, len(ours))
    ma = lambda x: np.convolve(x, np.ones(w) / w, mode="valid")  # noqa: E731
    diff = float(np.max(np.abs(ma(ours) - ma(theirs))))
    return {"ours": ours, "max_abs_diff_moving_avg": diff, "window": w,
            "max_abs_diff_per_step": float(np.max(np.abs(np.subtract(ours, theirs)))),
            "ours_first": float(np.mean(ours[:w])), "ours_last": float(np.mean(ours[-w:])),
            "torch_last": float(np.mean(theirs[-w:])), "ok": bool(diff < 0.01 and np.mean(ours[-w:]) < np.mean(ours[:w]))}


def loss_curves(quick: bool, steps: int) -> dict:
    """Ours (f32 and bf16 dense matmuls, each from fresh tables) and torch from the same initial
    weights on the same planted batches."""
    from torch_dlrm import TorchTrainer

    shape = dict(label="planted", sizes=[min(n, 10_000 if quick else 100_000) for n in KAGGLE], F=16,
                 bot=(13, 512, 256, 64, 16), top=(512, 256, 1), k=1, B=256 if quick else 1024)
    lr = 0.1
    batches = data_for(shape, "zipf", steps, seed=1)
    curves = {}
    theirs: list = []
    for precision in ("f32", "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            m, model = build(shape, "dram", tmp, lr, seed=1, precision=precision)
            if not theirs:
                tt = torch_twin(model, lr)
                theirs = [tt.step(TorchTrainer.convert(b)) for b in batches]
                del tt
            curves[precision] = _curve_summary([model.train_step(b).loss for b in batches], theirs)
            del model
            m.close()
    return {"steps": steps, "torch": theirs, **curves}


def policies(shape: dict, steps: int, rounds: int, warm: int) -> list[dict]:
    """Every placement policy built side by side and trained ``warm`` untimed steps, then
    ``rounds`` rounds in which each policy runs ``steps`` steps (order alternating), so that the
    machine's load drifts over all of them."""
    from contextlib import ExitStack

    from dlrm.placement import POLICIES, flush, hitrate, reset_counters

    # every step sees a batch of its own (a cache must not learn a repeating pool); the static hot
    # set comes from other batches of the same distribution, as `dlrm.train` samples it
    batches = data_for(shape, "zipf", warm + steps * rounds + 4)
    batches, sample = batches[:-4], batches[-4:]  # same hot rows (same data seed), other batches
    runs = {}
    with ExitStack() as stack:
        for policy in POLICIES:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            m, model = build(shape, policy, tmp, 0.01, sample=sample)
            stack.callback(m.close)
            model.warmup(batches[0])
            for b in batches[:warm]:  # dynamic caches reach their steady state
                model.train_step(b)
            for t in model.tables:
                reset_counters(t)
            m.reset_telemetry()
            model.timer.reset()
            runs[policy] = (m, model, [])
        names = list(runs)
        for r in range(rounds):
            for policy in (names if r % 2 == 0 else names[::-1]):
                _, model, times = runs[policy]
                for s in range(steps):
                    t = time.perf_counter()
                    model.train_step(batches[warm + r * steps + s])
                    times.append(time.perf_counter() - t)
        out = []
        for policy, (m, model, times) in runs.items():
            with model.timer("cache flush"):
                for t in model.tables:
                    flush(t)
            tele = m.telemetry()
            rates = [hitrate(t) for t in model.tables]
            rates = [x for x in rates if x is not None]
            n = len(times)
            out.append({"policy": policy, "samples_s": shape["B"] / statistics.median(times), "steps": times,
                        "phase_ms": {k: 1e3 * v / n for k, v in model.timer.table().items()},
                        "hitrate": float(np.mean(rates)) if rates else None,
                        "bytes_moved": tele["bytes_moved"],
                        "peak": {k: v["high_water"] for k, v in tele["occupancy"].items()}})
        runs.clear()
    gc.collect()
    return out


def split_row(r: dict) -> list:
    ph = r["ours_phase_ms"]
    ours_emb = ph.get("lookup", 0) + ph.get("embedding update", 0)
    ours_dense = ph.get("dense fwd+bwd", 0) + ph.get("dense update", 0)
    torch_dense = 1e3 * r["torch_dense_only_step_s"]
    torch_emb = max(0.0, 1e3 * r["torch_step_s"] - torch_dense)
    r["split_ms"] = {"ours_embeddings": ours_emb, "torch_embeddings": torch_emb, "ours_dense": ours_dense,
                     "torch_dense": torch_dense}
    return [r["label"][:3], f"{ours_emb:.1f}", f"{torch_emb:.1f}", f"{torch_emb / max(ours_emb, 1e-9):.2f}x",
            f"{ours_dense:.1f}", f"{torch_dense:.1f}", f"{torch_dense / max(ours_dense, 1e-9):.2f}x"]


def main(argv=None) -> dict:
    p = parser(__doc__, "results/dlrm.json")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,loss,policies")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    q = args.quick
    sh = shapes(q)
    env = environment()
    import torch

    env["torch"] = torch.__version__
    print(f"DLRM benchmark{' (--quick: smoke test, not a measurement)' if q else ''}; "
          f"load average {env['loadavg'][0]:.1f} on {env['cpus']} CPUs", flush=True)
    results: dict = {"environment": env, "quick": q}
    rows = []
    for key in ("a", "b"):
        if key in skip:
            continue
        r = compare(sh[key], steps=2, rounds=2 if q else 8)
        results[key] = r
        for prec, suffix in (("f32", ""), ("bf16", "_bf16")):
            ratio = r["ratio" + suffix]
            rows.append([r["label"], prec, r["batch"], f"{r['ours' + suffix + '_samples_s']:.0f}",
                         f"{r['torch_samples_s']:.0f}", f"{ratio:.2f}x", f">= {r['target']}x",
                         verdict(ratio >= r["target"])])
        print(f"  {r['label']}: ours {r['ours_samples_s']:.0f}/s (bf16 dense {r['ours_bf16_samples_s']:.0f}/s), "
              f"torch {r['torch_samples_s']:.0f}/s (bf16 autocast {r['torch_bf16_samples_s']:.0f}/s)", flush=True)
    if rows:
        print_table("training throughput, tables in DRAM, uniform indices (median step; data generation excluded; "
                    "ours with f32 and with bf16 dense matmuls, torch f32)",
                    ["shape", "ours dense", "batch", "ours samples/s", "torch samples/s", "ratio", "target", ""], rows)
        print_table("like for like in bf16: ours with bf16 dense matmuls against torch under bf16 autocast "
                    "(information; the targets above are against the f32 torch baseline the issue specifies)",
                    ["shape", "ours bf16 samples/s", "torch bf16 samples/s", "ratio"],
                    [[results[k]["label"], f"{results[k]['ours_bf16_samples_s']:.0f}",
                      f"{results[k]['torch_bf16_samples_s']:.0f}", f"{results[k]['ratio_bf16_vs_torch_bf16']:.2f}x"]
                     for k in ("a", "b") if k in results])
        print_table("where the time goes (ms per step; torch split by timing its step without embeddings)",
                    ["shape", "ours embeddings", "torch embeddings", "ratio", "ours dense", "torch dense", "ratio"],
                    [split_row(results[k]) for k in ("a", "b") if k in results])
        for key in ("a", "b"):
            if key in results:
                for prec, name in (("f32", "ours_phase_ms"), ("bf16", "ours_bf16_phase_ms")):
                    ph = results[key][name]
                    print(f"  ours {key} ({prec}) ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items() if v > 0))
    if "loss" not in skip:
        lc = loss_curves(q, 40 if q else 200)
        results["loss_curves"] = lc
        print_table(f"loss curves on planted data, same initial weights ({lc['steps']} steps; target: 20-step "
                    "moving averages within 0.01 of torch's)",
                    ["ours dense", "first 20 (ours)", "last 20 ours", "last 20 torch", "max |diff| per step",
                     "max |diff| 20-step avg", ""],
                    [[prec, f"{c['ours_first']:.4f}", f"{c['ours_last']:.4f}", f"{c['torch_last']:.4f}",
                      f"{c['max_abs_diff_per_step']:.1e}", f"{c['max_abs_diff_moving_avg']:.1e}", verdict(c["ok"])]
                     for prec, c in ((p_, lc[p_]) for p_ in ("f32", "bf16"))])
    if "policies" not in skip:
        shp = dict(sh["b"])
        pol = policies(shp, 1 if q else 2, 2 if q else 4, 2 if q else 6)
        results["policies"] = pol
        names = ["lookup", "dense fwd+bwd", "embedding update", "dense update", "cache flush"]
        prow = []
        for r in pol:
            moved = sum(r["bytes_moved"].values())
            prow.append([r["policy"], f"{r['samples_s']:.0f}"] + [f"{r['phase_ms'].get(n, 0):.1f}" for n in names]
                        + ["-" if r["hitrate"] is None else f"{100 * r['hitrate']:.1f}%", f"{moved / 2**20:.1f}"])
        print_table(f"{sh['b']['label']}, Zipf(1) indices, per policy (ms per step; cache 10% for static/dynamic)",
                    ["policy", "samples/s"] + names + ["hit rate", "MiB moved"], prow)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
