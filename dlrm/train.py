"""``python -m dlrm.train``: train DLRM on synthetic or Criteo data with tables placed by a policy.

Flags follow the public reference DLRM (``dlrm_s_pytorch.py``) where they exist; ours are
``--policy``, ``--cache-fraction``, ``--fast-capacity``, ``--pm-path``, ``--threads``,
``--report``, ``--plot``, ``--save``, ``--load``, ``--checkpoint-every``, ``--checkpoint-minutes``,
``--resume-from-pool``, ``--device`` and ``--fast-budget``. The defaults train a small model on
synthetic data with a hidden teacher in about a minute.

``--device gpu`` trains on a GPU: dense part and interaction in JAX there, tables in HBM
(``--policy dram``) or in host DRAM with their hot rows cached in HBM (``simple``/``static``/
``dynamic``: bookkeeping on the host; ``lru``: a set-associative cache the GPU runs itself, the
fastest), the next batch's rows prefetched while the current one computes; ``--fast-budget``
caps the HBM the tables may use (see :mod:`dlrm.gpu`).

Two ways to survive a restart or a kill -9: ``--save FILE`` with a checkpoint interval writes
checkpoint files (atomically: a crash mid-write keeps the previous one) and ``--load FILE``
resumes; or ``--pm-path POOL --resume-from-pool`` keeps the tables themselves in a persistent
pool, makes a durable point at each interval, and the same command line continues from the last
durable point without reading any file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from embeddings.gpu.lru import READS

from . import checkpoint
from . import gpu
from .dense import PRECISIONS, DLRMConfig
from .metrics import accuracy
from .model import DEVICES, OPTIMIZERS
from .placement import GPU_POLICIES, POLICIES, cache_rows, flush, hitrate, hot_rows, make_tables, table_devices

DEFAULTS = dict(sizes="100000-50000-20000-10000-5000-2000-1000-500", bot="13-512-256-64-16", top="512-256-1")


def parse_dashes(s: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in str(s).split("-") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be dash-separated integers like 1000-2000, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be positive integers, got {s!r}")
    return out


def str2bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "y", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dlrm.train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument_group("model (reference DLRM names)")
    a.add_argument("--arch-sparse-feature-size", type=int, default=16, help="embedding dimension")
    a.add_argument("--arch-embedding-size", default=DEFAULTS["sizes"], help="rows per table, dash-separated")
    a.add_argument("--arch-mlp-bot", default=DEFAULTS["bot"], help="dense input size, then bottom layers (last = feature size)")
    a.add_argument("--arch-mlp-top", default=DEFAULTS["top"], help="top layers after the interaction (last = 1)")
    a.add_argument("--arch-interaction-op", choices=("dot", "cat"), default="dot")
    t = p.add_argument_group("training")
    t.add_argument("--mini-batch-size", type=int, default=512)
    t.add_argument("--num-batches", type=int, default=600, help="batches per epoch (0: the whole data set)")
    t.add_argument("--nepochs", type=int, default=1)
    t.add_argument("--learning-rate", type=float, default=0.1)
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="embedding tables: fused SGD, SGD whose GPU updates add a row's entries in any order "
                        "(sgd-any: faster, not reproducible bit for bit; on CPU tables the same as sgd) or "
                        "row-wise Adagrad; dense weights always use SGD")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dense-precision", choices=PRECISIONS, default="f32",
                   help="matmul precision of the MLPs: bf16 = bfloat16 operands, float32 accumulation and weights")
    d = p.add_argument_group("data")
    d.add_argument("--data-generation", choices=("random", "dataset"), default="random",
                   help="random: synthetic data with a hidden teacher; dataset: Criteo Kaggle format")
    d.add_argument("--raw-data-file", default=None, help="Criteo text file(s), plain or gzip, comma-separated")
    d.add_argument("--processed-data-file", default=None, help="preprocessed binary file (written from the raw file if given)")
    d.add_argument("--max-ind-range", type=int, default=-1, help="hash categoricals modulo this (<=0: dictionary ids)")
    d.add_argument("--strict-data", action="store_true", help="a malformed input line is fatal instead of skipped")
    d.add_argument("--test-fraction", type=float, default=0.1, help="held-out fraction of a data set")
    d.add_argument("--num-indices-per-lookup", type=int, default=1)
    d.add_argument("--num-indices-per-lookup-fixed", type=str2bool, nargs="?", const=True, default=True,
                   help="exactly k indices per bag (else 1..k)")
    d.add_argument("--index-distribution", choices=("uniform", "zipf"), default="zipf")
    d.add_argument("--zipf-alpha", type=float, default=1.0)
    d.add_argument("--test-num-batches", type=int, default=8, help="held-out batches per evaluation")
    o = p.add_argument_group("output")
    o.add_argument("--print-freq", type=int, default=100)
    o.add_argument("--test-freq", type=int, default=200, help="evaluate every N batches (0: only at the end)")
    o.add_argument("--report", default=None, help="write a JSON report here")
    o.add_argument("--plot", default=None, help="draw PREFIX_loss.png and PREFIX_phases.png")
    o.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    o.add_argument("--save", default=None, help="write a checkpoint here at the end (and at each checkpoint interval)")
    o.add_argument("--load", default=None, help="resume from this checkpoint (continues at its step)")
    o.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="also checkpoint (--save) or make a durable point (--resume-from-pool) every STEPS batches (0: off)")
    o.add_argument("--checkpoint-minutes", type=float, default=0.0, metavar="MINUTES",
                   help="... and/or every MINUTES minutes of training (0: off)")
    m = p.add_argument_group("memory (ours)")
    m.add_argument("--policy", choices=POLICIES + GPU_POLICIES, default="dram",
                   help="dram: tables in DRAM; simple: tables in PM; static/dynamic: CachedEmbeddings; "
                        "lru, lfu (--device gpu): a set-associative cache in HBM run by the GPU itself, a missed "
                        "row taking the least recently used way of its set (lru) or the way used in the fewest "
                        "batches (lfu: keeps the hot rows of skewed traffic)")
    m.add_argument("--cache-fraction", type=float, default=0.1, help="static/dynamic/lru/lfu: cached rows per table")
    m.add_argument("--lru-reads", choices=READS, default="split",
                   help="lru/lfu: how missed rows come up: split (the GPU reads a share from host memory while CPU "
                        "threads gather the rest, the share adapting until both take as long), mapped (the GPU "
                        "reads them all) or staged (CPU threads gather them all into one block copied up at once)")
    m.add_argument("--static-sample-batches", type=int, default=16,
                   help="static: fill the cache with the rows most used in this many training batches "
                        "(0: random rows)")
    m.add_argument("--fast-capacity", default="auto", help="DRAM heap size (auto: what the policy needs)")
    m.add_argument("--slow-capacity", default="auto", help="PM heap size (auto: the tables plus slack)")
    m.add_argument("--pm-path", default=None, help="directory or file for the PM heap (default: a temp dir)")
    m.add_argument("--resume-from-pool", action="store_true",
                   help="keep the tables, dense weights and optimizer state in the persistent pool file --pm-path "
                        "(created if missing) and continue from its last durable point")
    m.add_argument("--threads", type=int, default=0, help="numba threads (0: all cores)")
    m.add_argument("--device", choices=DEVICES, default="cpu",
                   help="gpu: dense part and tables on the GPU (dram: tables in HBM; simple/static/dynamic/lru/lfu: "
                        "host tables with hot rows cached in HBM)")
    m.add_argument("--fast-budget", type=gpu.parse_budget, default="auto", metavar="SIZE|PCT",
                   help="--device gpu: HBM the tables may use, a size (8GiB) or a percentage of the tables' bytes "
                        "(10%%); auto: what the policy needs")
    return p


def make_manager(args, table_bytes: int, featuresize: int, state_bytes: int = 0):
    """The DRAM and PM devices for ``args``; ``state_bytes`` (dense weights and optimizer state) sizes a new pool."""
    from cachedarrays import DRAM, PM, LRUPolicy, Manager, parse_size

    slack = 64 << 20
    if args.fast_capacity == "auto":
        if args.policy == "dram":
            fast = table_bytes + slack
        elif args.policy in ("static", "dynamic"):
            fast = int(2 * args.cache_fraction * table_bytes) + slack
        else:
            fast = slack
    else:
        fast = parse_size(args.fast_capacity)
    slow = table_bytes + slack if args.slow_capacity == "auto" else parse_size(args.slow_capacity)
    if args.slow_capacity == "auto" and args.pm_path is not None and os.path.isfile(args.pm_path):
        slow = None  # an existing pool file keeps its size
    elif args.resume_from_pool and args.slow_capacity == "auto":
        # a changed object keeps its durable copy until the next durable point: room for two of each
        slow = 2 * (table_bytes + state_bytes) + slack
    manager = Manager(DRAM(fast), PM(args.pm_path, slow), policy=LRUPolicy())
    if not args.resume_from_pool and getattr(manager.slow, "unclaimed", None):
        n = len(manager.slow.unclaimed)
        manager.close()
        raise SystemExit(f"error: {args.pm_path} is a persistent pool holding {n} objects of an earlier "
                         f"--resume-from-pool run; pass --resume-from-pool to continue it, or use another --pm-path")
    return manager


def open_data(args, cfg_bottom: list[int]):
    """(data source, table sizes, dense dim)."""
    if args.data_generation == "dataset":
        from .data.criteo import CriteoDataset, preprocess

        path = args.processed_data_file
        if args.raw_data_file:
            raws = args.raw_data_file.split(",")
            path = path or raws[0] + ".dlrm.bin"
            rep = preprocess(raws, path, max_ind_range=max(0, args.max_ind_range), strict=args.strict_data)
            print(f"preprocessed -> {path}: {rep.summary()}", file=sys.stderr)
        if not path:
            raise SystemExit("error: --data-generation dataset needs --raw-data-file or --processed-data-file")
        ds = CriteoDataset(path, args.mini_batch_size, args.test_fraction)
        return ds, ds.table_sizes, ds.dense_dim
    from .data.synthetic import SyntheticData

    sizes = parse_dashes(args.arch_embedding_size, "--arch-embedding-size")
    ds = SyntheticData(sizes, cfg_bottom[0], args.mini_batch_size, num_indices=args.num_indices_per_lookup,
                       fixed=args.num_indices_per_lookup_fixed, distribution=args.index_distribution,
                       alpha=args.zipf_alpha, seed=args.seed)
    return ds, sizes, cfg_bottom[0]


def check_args(args) -> None:
    """Refuse contradictory or unusable persistence flags before any work."""
    from cachedarrays.checkpoint import check_writable

    if args.resume_from_pool:
        if args.load:
            raise SystemExit("error: --load and --resume-from-pool both say where to resume from; pass one")
        if args.pm_path is None or os.path.isdir(args.pm_path):
            raise SystemExit("error: --resume-from-pool needs --pm-path to name a pool file (created if missing), "
                             f"got {'nothing' if args.pm_path is None else 'the directory ' + args.pm_path}")
    if args.device == "gpu":
        if args.resume_from_pool or args.pm_path is not None:
            raise SystemExit("error: --device gpu keeps the tables in host DRAM and HBM; --pm-path and "
                             "--resume-from-pool are CPU-only (use --save/--load to checkpoint)")
    elif args.policy in GPU_POLICIES:
        raise SystemExit(f"error: --policy {args.policy} is the GPU cache (tags in HBM, run by the GPU); "
                         "it needs --device gpu")
    elif args.fast_budget != "auto":
        raise SystemExit("error: --fast-budget caps the HBM of --device gpu; the CPU run's DRAM heap is --fast-capacity")
    if args.save:
        check_writable(args.save)
    if args.checkpoint_every < 0 or args.checkpoint_minutes < 0:
        raise SystemExit("error: --checkpoint-every and --checkpoint-minutes must not be negative")
    if (args.checkpoint_every or args.checkpoint_minutes) and not (args.save or args.resume_from_pool):
        raise SystemExit("error: a checkpoint interval needs --save FILE or --pm-path POOL --resume-from-pool")


def make_gpu_manager(args, sizes: list[int], featuresize: int):
    """The GPU and host-DRAM levels of a ``--device gpu`` run: the GPU level holds ``--fast-budget``
    (refused before any memory is touched when it cannot hold what must be in HBM)."""
    from cachedarrays import parse_size

    table_bytes = sum(sizes) * featuresize * 4
    rows = [cache_rows(n, args.cache_fraction) for n in sizes]
    capacity = gpu.resolve_budget(args.fast_budget, table_bytes, gpu.hbm_need(args.policy, sizes, featuresize, rows),
                                   args.policy)
    gpu.require_gpu()
    host = table_bytes + gpu.SLACK if args.fast_capacity == "auto" else parse_size(args.fast_capacity)
    return gpu.make_manager(capacity, host)


def with_next(items):
    """``(i, batch, next batch or None)`` for each ``(i, batch)``: the next batch is known one step ahead."""
    prev = None
    for item in items:
        if prev is not None:
            yield prev[0], prev[1], item[1]
        prev = item
    if prev is not None:
        yield prev[0], prev[1], None


def state_bytes(cfg: DLRMConfig, optimizer: str) -> int:
    """Bytes of the dense weights and the tables' optimizer state (kept beside the tables in a pool)."""
    layers = list(zip(cfg.bottom[:-1], cfg.bottom[1:])) + list(zip(cfg.top_sizes[:-1], cfg.top_sizes[1:]))
    dense = 4 * sum((a + 1) * b for a, b in layers)
    return dense + (4 * sum(cfg.table_sizes) if optimizer == "adagrad" else 0)


def run(args) -> dict:
    """Train as ``args`` say; returns the report dict (also written to ``--report``)."""
    from tqdm import tqdm

    from cachedarrays.checkpoint import Interval

    check_args(args)
    if args.threads > 0:
        import numba
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    from .data.loader import Prefetcher
    from .model import DLRM
    from .report import format_summary, plot_run, summarize

    bottom = parse_dashes(args.arch_mlp_bot, "--arch-mlp-bot")
    top = parse_dashes(args.arch_mlp_top, "--arch-mlp-top")
    data, sizes, dense_dim = open_data(args, bottom)
    if bottom[0] != dense_dim:
        raise SystemExit(f"error: --arch-mlp-bot starts with {bottom[0]} but the data has {dense_dim} dense features")
    F = args.arch_sparse_feature_size
    try:
        cfg = DLRMConfig(sizes, F, bottom, top, args.arch_interaction_op)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    table_bytes = sum(sizes) * F * 4
    per_epoch = args.num_batches if args.num_batches > 0 else getattr(data, "nbatches", lambda s: 0)("train")
    if per_epoch <= 0:
        raise SystemExit("error: --num-batches must be positive for synthetic data (or the data set is too small)")
    total = per_epoch * args.nepochs

    if args.device == "gpu":
        manager = make_gpu_manager(args, sizes, F)
    else:
        manager = make_manager(args, table_bytes, F, state_bytes(cfg, args.optimizer))
    with manager:
        t0 = time.perf_counter()
        hot = None
        if args.policy == "static" and args.static_sample_batches > 0:
            n = min(args.static_sample_batches, per_epoch)
            hot = hot_rows((data.batch(i) for i in range(n)), len(sizes),
                           [cache_rows(r, args.cache_fraction) for r in sizes])
        arrays, meta = checkpoint.pool_tables(manager, sizes, F) if args.resume_from_pool else (None, None)
        tables = make_tables(sizes, F, args.policy, manager, args.cache_fraction, args.seed, hot=hot,
                             arrays=arrays, init=meta is None, lru_reads=args.lru_reads)
        del arrays
        model = DLRM(cfg, tables, optimizer=args.optimizer, lr=args.learning_rate, seed=args.seed,
                     precision=args.dense_precision, device=args.device)
        start = 0
        if args.load:
            start = int(checkpoint.load(args.load, model)["step"])
        if args.resume_from_pool:
            from cachedarrays.pool import Pool

            print(f"pool {Pool.open(manager).recovery}", file=sys.stderr)
            if meta is not None:
                start = checkpoint.pool_load(manager, model, meta)
                print(f"resuming from the pool at step {start}", file=sys.stderr)
        model.warmup(data.batch(start % per_epoch if args.data_generation == "dataset" else start))
        setup = time.perf_counter() - t0
        print(f"DLRM: {len(sizes)} tables ({sum(sizes)} rows x {F}, {table_bytes / 2**20:.1f} MiB) policy={args.policy} "
              f"on {', '.join(sorted(set(table_devices(tables))))}, dense on {args.device}; bottom {'-'.join(map(str, bottom))}, "
              f"top {'-'.join(map(str, cfg.top_sizes))}, {args.arch_interaction_op} interaction; "
              f"batches {start}..{total} of {args.mini_batch_size}; setup and compilation {setup:.1f} s", file=sys.stderr)
        manager.reset_telemetry()
        losses: list[tuple[int, float]] = []
        evals: list[dict] = []
        B = args.mini_batch_size

        ntest = args.test_num_batches
        if hasattr(data, "nbatches"):  # a data set: never evaluate a held-out batch twice
            ntest = min(ntest, data.nbatches("test"))

        def evaluate(step: int) -> None:
            if ntest <= 0:
                tqdm.write(f"test at step {step}: no held-out batch (need {B} held-out samples)")
                return
            e = model.evaluate(data.batch(j, "test") for j in range(ntest))
            e["step"] = step
            evals.append(e)
            tqdm.write(f"test at step {step}: loss {e['loss']:.5f}  accuracy {e['accuracy']:.4f}  "
                       f"AUC {e['auc']:.4f}  ({e['samples']} samples)")

        wall0 = time.perf_counter()
        eval_seconds = 0.0
        win_t, win_loss, win_acc, win_n = time.perf_counter(), 0.0, 0.0, 0
        loader = Prefetcher(lambda i: data.batch(i % per_epoch if args.data_generation == "dataset" else i),
                            start, total)
        bar = tqdm(total=total, initial=start, disable=args.no_progress, unit="batch", dynamic_ncols=True,
                   file=sys.stderr)
        interval = Interval(args.checkpoint_every, args.checkpoint_minutes)

        def keep(step: int) -> None:
            """A checkpoint file and/or a durable point of the pool at ``step``."""
            model.finish()  # the next batch's prefetch lands first (and raises what went wrong in it)
            with model.timer("checkpoint"):
                if args.save:
                    checkpoint.save(args.save, model, step, extra={"policy": args.policy})
                    tqdm.write(f"checkpoint written to {args.save} (step {step})", file=sys.stderr)
                if args.resume_from_pool:
                    point = checkpoint.pool_save(manager, model, step, extra={"policy": args.policy})
                    tqdm.write(f"durable point {point} of {args.pm_path} (step {step})", file=sys.stderr)
            interval.done()

        def account(i: int, batch, r) -> None:
            """Step ``i``'s loss and accuracy into the curve, the window and the progress bar."""
            nonlocal win_t, win_loss, win_acc, win_n
            losses.append((i + 1, r.loss))
            win_loss += r.loss
            win_acc += accuracy(r.logits, batch.labels)
            win_n += 1
            bar.update(1)
            if win_n and (i + 1) % max(1, args.print_freq) == 0:
                dt = time.perf_counter() - win_t
                tqdm.write(f"step {i + 1}/{total}: loss {win_loss / win_n:.5f}  accuracy {win_acc / win_n:.4f}  "
                           f"{win_n * B / dt:.0f} samples/s")
                win_t, win_loss, win_acc, win_n = time.perf_counter(), 0.0, 0.0, 0
            if not args.no_progress and (i + 1) % 10 == 0:
                el = time.perf_counter() - wall0 - eval_seconds
                bar.set_postfix(loss=f"{r.loss:.4f}", samples_s=f"{(i + 1 - start) * B / max(el, 1e-9):.0f}")

        last = None  # the last step's (i, batch, result), read once the next step has started: no wait for it
        try:
            for i, batch, nxt in with_next(loader):
                r = model.train_step(batch, nxt if args.device == "gpu" else None)
                if last is not None:
                    account(*last)
                last = (i, batch, r)
                if interval.enabled and i + 1 < total and interval.due(i + 1):
                    keep(i + 1)
                if args.test_freq > 0 and (i + 1) % args.test_freq == 0 and i + 1 < total:
                    te = time.perf_counter()
                    evaluate(i + 1)
                    eval_seconds += time.perf_counter() - te
            if last is not None:
                account(*last)
        finally:
            bar.close()
            loader.close()
        model.timer.add("data loading", loader.wait_seconds)
        with model.timer("cache flush"):
            for t in tables:
                flush(t)
        wall = time.perf_counter() - wall0 - eval_seconds
        evaluate(total)
        steps = total - start
        tinfo = [{"name": t.name, "rows": t.nvectors(), "device": dev, "hitrate": hitrate(t)}
                 for t, dev in zip(tables, table_devices(tables))]
        summary = summarize(model.timer.table(), steps, steps * B, wall, manager.telemetry(), tinfo)
        print(format_summary(summary))
        if args.save or args.resume_from_pool:
            keep(total)
        report = {"args": {k: v for k, v in vars(args).items()}, "config": {
            "table_sizes": list(cfg.table_sizes), "featuresize": F, "bottom": list(cfg.bottom),
            "top": list(cfg.top_sizes), "interaction": cfg.interaction},
            "start_step": start, "losses": losses, "evals": evals, "summary": summary}
        if args.report:
            os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
            with open(args.report, "w") as f:
                json.dump(report, f, indent=1, default=float)
        if args.plot:
            paths = plot_run(args.plot, losses, evals, summary["phases_seconds"], steps,
                             title=f"DLRM ({args.policy})")
            print("plots: " + ", ".join(paths), file=sys.stderr)
        del model, tables
        return report


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    from cachedarrays import CachedArraysError

    try:
        main()
    except CachedArraysError as e:  # a bad checkpoint or pool: one line naming the file and the problem
        raise SystemExit(f"error: {e}") from None
