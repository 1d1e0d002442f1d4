"""Learned prefetch on the CPU: mode ``cap`` (CorrelationPrefetchPolicy) against ``caLMP`` and ``ca0`` on one CNN.

One ResNet trains a few iterations under each mode at several fast-memory budgets (fractions of
the footprint measured by an unconstrained iteration), the modes of one budget side by side with a
``dram`` run, their iterations interleaved (order reversed every other iteration) so that machine
noise hits them alike.  ``cap`` needs no annotations: it learns the first iteration's order of
uses and prefetches ahead from the second; ``caLMP`` follows the program's prefetch hints (LRU);
``ca0`` starts everything in PM and moves it in on use.

Reported per budget and mode: seconds per iteration (median of the iterations after the first,
and the fastest), the ratio to ``dram``; PM bytes read and written per iteration (manager copies
plus kernel operands read or written in place on PM: ``caLMP`` computes on PM-resident operands
where ``cap`` and ``ca0`` fetch them) and the ratio of the total to ``caLMP``'s; measured copy
time a use waited for (exposed, median); and, for ``cap``, coverage (uses that found their
object in DRAM) and prefetch accuracy (learned prefetches used before being evicted) in the last
iteration.  Losses of every mode must equal ``dram``'s bit for bit (checked).

DRAM is this machine's (probed bandwidth); PM is a file (default in /dev/shm) modeled at the
Optane profile.  Tests never assert on timings; this script reports them.
Run ``python benchmarks/prefetch.py`` (``--quick``: a smaller model, about a minute).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C  # noqa: E402
from benchmarks.cnn import interleaved, ratio  # noqa: E402
from cnn.trainer import Config, measure_footprint  # noqa: E402

MODES = ("dram", "ca0", "caLMP", "cap")
FULL = Config("resnet", 26, 8, 16, 32)
QUICK = Config("resnet", 14, 4, 8, 16)
BUDGETS = (50, 25)
MiB = 2.0 ** 20


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> int:
    p = C.parser(__doc__, "results/prefetch.json")
    p.add_argument("--iterations", type=int, default=None, help="iterations per run (default 6, quick 4)")
    p.add_argument("--pm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="directory for the PM files (default /dev/shm)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    iterations = args.iterations or (4 if args.quick else 6)
    t0 = time.perf_counter()
    fp = measure_footprint(cfg, pm_dir=args.pm_dir)
    print(f"{cfg.label}: footprint {fp.footprint / MiB:.2f} MiB, smallest budget {fp.min_budget / MiB:.2f} MiB; "
          f"{iterations} iterations per mode", flush=True)
    results: dict = {"environment": C.environment(), "quick": args.quick, "iterations": iterations,
                     "config": vars(cfg), "footprint": fp.__dict__, "budgets": {}}
    rows, same = [], True
    for budget in BUDGETS:
        per = interleaved(cfg, fp, budget, iterations, args.pm_dir, MODES)
        results["budgets"][f"{budget}%"] = per
        ref, lmp = per["dram"], per.get("caLMP", {})
        lmp_bytes = lmp.get("pm_read", 0) + lmp.get("pm_written", 0)
        for mode in MODES:
            s = per[mode]
            if "error" in s:
                rows.append([f"{budget}%", mode, "below smallest budget"] + [""] * 9)
                continue
            same &= s["losses"] == ref["losses"]
            moved = s["pm_read"] + s["pm_written"]
            rows.append([f"{budget}%", mode, s["seconds"], s["best_seconds"], s["seconds"] / ref["seconds"],
                         s["pm_read"] / MiB, s["pm_written"] / MiB,
                         "-" if mode == "dram" else ratio(moved, lmp_bytes),
                         1e3 * s["exposed_movement_seconds"], pct(s["coverage"]), pct(s["prefetch_accuracy"]),
                         f"{s['peak_fast'] / MiB:.2f}/{s['fast_capacity'] / MiB:.2f}"])
        print(f"  {budget}% done ({time.perf_counter() - t0:.0f} s)", flush=True)
    C.print_table(f"{cfg.label}, per iteration (time: median after the first, best: fastest; bytes, coverage and "
                  f"accuracy: last iteration; PM bytes = manager copies + kernel operands on PM)",
                  ["budget", "mode", "time s", "best s", "x dram", "PM rd MiB", "PM wr MiB", "bytes x caLMP",
                   "exposed ms", "coverage", "accuracy", "peak/cap MiB"], rows)
    print(f"\nevery mode's losses equal dram's bit for bit: {'yes' if same else 'NO'}")
    results["losses_equal"] = same
    results["seconds"] = time.perf_counter() - t0
    C.write_json(args.out, results)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
