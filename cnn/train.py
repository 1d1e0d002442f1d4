"""Command line: train a CNN under a fast-memory budget in one or more operating modes and report traffic.

Example::

    python -m cnn.train --model resnet --depth 50 --batch 32 --image 64 --iterations 5 \\
        --mode caLM --fast-budget 25% --report out.json --plot figs/resnet

The footprint is measured first by one unconstrained (``dram``) iteration; the
budget is a fraction of it (``25%``) or a size (``64MiB``, bytes).  Each mode
then prints, per iteration: the loss, the time, the bytes copied DRAM->PM and
PM->DRAM, the peak fast-device use against its capacity (the budget), and the
modeled movement time; mode ``cap`` adds its coverage (uses that found their
object in fast memory) and prefetch accuracy, per iteration and over the run.

``--device gpu`` runs the layers as jitted JAX on the GPU: the budget is GPU memory (HBM) and the
level below it host DRAM, so the traffic columns read GPU->DRAM and DRAM->GPU; mode ``dram`` keeps
everything in HBM.  ``--recompute`` runs every batch norm, ReLU, convolution sequence as one layer
that recomputes the normalised activations in backward instead of keeping them for it (MemFerry's
trade: less memory and traffic for a little compute); its footprint and traffic are its own run's.

With one mode, ``--save FILE`` writes a checkpoint (weights, momentum, iteration) at the end and
every ``--checkpoint-every`` iterations / ``--checkpoint-minutes`` minutes, atomically (a crash
mid-write keeps the previous one); ``--load FILE`` continues from one up to ``--iterations``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from cachedarrays import DeviceUnavailableError, OutOfMemoryError, format_size
from cachedarrays.checkpoint import CheckpointError, Interval

from .modes import DEVICES, MODES, BudgetTooSmallError, ModelTooLargeError
from .trainer import Config, IterationRecord, RunResult, measure_footprint, run_mode


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cnn.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("vgg", "resnet", "densenet"), default="resnet", help="model family")
    p.add_argument("--depth", type=int, default=50,
                   help="weighted layers: VGG convs+3, ResNet 3*blocks+2 (50, 101, 152, 200 standard), "
                        "DenseNet 2*layers+5 (121, 169, 201, 264 standard)")
    p.add_argument("--width", type=int, default=16, help="base channels (DenseNet: growth rate)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image", type=int, default=64, help="image height and width (digits: 8)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--mode", default="caLM",
                   help=f"one or more of {', '.join(MODES)} separated by commas, or 'all' (default caLM)")
    p.add_argument("--fast-budget", default="25%",
                   help="fast memory budget (DRAM; GPU memory with --device gpu): a fraction of the measured "
                        "footprint ('25%%') or a size ('64MiB', bytes); ignored by mode dram (default 25%%)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu: DRAM over PM; gpu: GPU memory over host DRAM, layers run on the GPU (default cpu)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute batch-norm+ReLU outputs in backward instead of keeping them")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.01, digits 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0 for plain SGD)")
    p.add_argument("--granularity", choices=("layer", "block"), default="layer",
                   help="cleanup after each layer's backward, or after each residual/dense block's")
    p.add_argument("--data", choices=("synthetic", "digits"), default="synthetic",
                   help="synthetic normal inputs (default) or the 8x8 digits (needs scikit-learn); "
                        "digits prints the test accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pm-dir", default=None, help="directory for the PM file (default: a temporary directory)")
    p.add_argument("--report", default=None, help="write per-iteration records of every mode as JSON here")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="draw PREFIX-occupancy-MODE.png (device use over the last iteration) and "
                        "PREFIX-bytes.png (bytes moved per mode); needs matplotlib")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="write a checkpoint here at the end and at each checkpoint interval (one mode only)")
    p.add_argument("--load", default=None, metavar="FILE",
                   help="resume from this checkpoint; --iterations is the total (one mode only)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N iterations (0: off)")
    p.add_argument("--checkpoint-minutes", type=float, default=0.0, metavar="M",
                   help="checkpoint every M minutes (0: off)")
    args = p.parse_args(argv)
    modes = list(MODES) if args.mode == "all" else [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)} or 'all'")
    args.modes = modes
    if (args.save or args.load) and len(modes) != 1:
        p.error("--save and --load take exactly one --mode")
    if args.checkpoint_every < 0 or args.checkpoint_minutes < 0:
        p.error("--checkpoint-every and --checkpoint-minutes must not be negative")
    if (args.checkpoint_every or args.checkpoint_minutes) and not args.save:
        p.error("a checkpoint interval needs --save FILE")
    if args.save:
        from cachedarrays.checkpoint import CheckpointError, check_writable
        try:
            check_writable(args.save)
        except CheckpointError as e:
            p.error(str(e))
    return args


def describe(rec: IterationRecord) -> str:
    """One line per iteration, as the script prints it (with coverage and prefetch accuracy where the
    policy counts them, as ``cap`` does)."""
    f, s = rec.fast_device, rec.slow_device
    line = (f"  iter {rec.iteration:3d}  loss {rec.loss:8.5f}  time {rec.seconds:7.3f} s  "
            f"{f}->{s} {format_size(rec.dram_to_pm_bytes):>10}  {s}->{f} {format_size(rec.pm_to_dram_bytes):>10}  "
            f"peak fast {format_size(rec.peak_fast_bytes):>10} / {format_size(rec.fast_capacity):<10}  "
            f"modeled movement {1e3 * rec.modeled_movement_seconds:8.2f} ms")
    if rec.coverage is not None:
        line += f"  coverage {100 * rec.coverage:5.1f}%"
    if rec.prefetch_accuracy is not None:
        line += f"  accuracy {100 * rec.prefetch_accuracy:5.1f}%"
    return line


def summarise_policy(report: dict) -> str:
    """One line for a learned-prefetch policy's report over the whole run."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"
    return (f"learned prefetch over the run: coverage {pct(report['coverage'])} of {report['uses']} uses, "
            f"accuracy {pct(report['accuracy'])} ({report['prefetches_useful']} of {report['prefetches_issued']} "
            f"prefetches used, {report['prefetches_evicted_unused']} evicted unused), "
            f"{report['demand_fetches']} fetched on use")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    digits = None
    if args.data == "digits":
        from .data import load_digits
        digits = load_digits(seed=args.seed)
        cfg = Config(args.model, args.depth, args.width, args.batch, 8, digits.classes, 1,
                     args.lr if args.lr is not None else 0.05, args.momentum, args.seed, args.granularity,
                     args.device, args.recompute)
        data = lambda i: digits.batch(i, args.batch, args.seed)  # noqa: E731
    else:
        cfg = Config(args.model, args.depth, args.width, args.batch, args.image, args.classes, 3,
                     args.lr if args.lr is not None else 0.01, args.momentum, args.seed, args.granularity,
                     args.device, args.recompute)
        data = None
    print(f"model {cfg.label} on the {args.device.upper()}; measuring the footprint with one unconstrained "
          f"iteration ...", flush=True)
    try:
        fp = measure_footprint(cfg, data, args.pm_dir)
    except DeviceUnavailableError as e:
        print(f"error: --device gpu needs a usable CUDA GPU: {e}", file=sys.stderr)
        return 2
    except ModelTooLargeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"footprint {format_size(fp.footprint)} (weights and optimiser state {format_size(fp.persistent)}, "
          f"{format_size(fp.allocated)} allocated per iteration); smallest budget for its kernels "
          f"{format_size(fp.min_budget)} ({fp.min_budget_kernel}; a smaller budget runs narrower kernels where "
          f"those fit)", flush=True)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm
        progress = lambda it: tqdm(it, desc="iterations", leave=False, file=sys.stderr)  # noqa: E731
        write = tqdm.write
    else:
        write = print
    results: dict[str, RunResult] = {}
    accuracy: dict[str, float] = {}
    for mode in args.modes:
        budget = "no budget" if mode == "dram" else f"fast budget {args.fast_budget}"
        print(f"\nmode {mode} ({budget})", flush=True)

        def evaluate(tr, mode=mode):
            if digits is not None:
                accuracy[mode] = float((tr.predict(digits.x_test) == digits.y_test).mean())

        try:
            results[mode] = run_mode(cfg, mode, args.fast_budget, args.iterations, fp, data, args.pm_dir,
                                     on_iteration=lambda r: write(describe(r)), progress=progress, after=evaluate,
                                     save=args.save, load=args.load,
                                     interval=Interval(args.checkpoint_every, args.checkpoint_minutes),
                                     on_save=lambda path, i: write(f"  checkpoint written to {path} (iteration {i})"))
        except (BudgetTooSmallError, CheckpointError, ModelTooLargeError, OutOfMemoryError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if mode in accuracy:
            print(f"  test accuracy {100 * accuracy[mode]:.1f}% on {len(digits.x_test)} digits")
        if results[mode].policy_report is not None:
            print("  " + summarise_policy(results[mode].policy_report))
    if args.report:
        payload = {"config": vars(cfg), "fast_budget": args.fast_budget,
                   "modes": {k: r.as_dict() for k, r in results.items()}}
        if accuracy:
            payload["test_accuracy"] = accuracy
        directory = os.path.dirname(args.report)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(args.report, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.report}")
    if args.plot:
        from cachedarrays.plot import plot_bytes_moved, plot_occupancy
        directory = os.path.dirname(args.plot)
        if directory:
            os.makedirs(directory, exist_ok=True)
        for mode, r in results.items():
            print("wrote", plot_occupancy(r.telemetry, f"{args.plot}-occupancy-{mode}.png",
                                          f"{cfg.label}: {mode}, one iteration"))
        print("wrote", plot_bytes_moved({m: r.telemetry for m, r in results.items()}, f"{args.plot}-bytes.png",
                                        f"{cfg.label}: bytes moved in the last iteration"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
