"""Small helpers shared by the benchmarks: timing, tables, JSON output, command line.

Timing reports medians (the machines we run on are noisy); `time_interleaved`
alternates the contenders inside each repeat so that drift hits them equally.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence


def parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small, fast run (a smoke test, not a measurement)")
    p.add_argument("--out", default=default_out, help=f"where to write the JSON results (default: {default_out})")
    return p


def sample(fn: Callable[[], object], number: int = 1) -> float:
    """Seconds per call of ``fn``, timed over ``number`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def median_time(fn: Callable[[], object], repeats: int = 5, number: int = 1, warmup: int = 1) -> float:
    """Median over ``repeats`` samples of the seconds per call of ``fn`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    return statistics.median(sample(fn, number) for _ in range(repeats))


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeats: int = 5, number: int = 1,
                     warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function; each repeat samples all of them, in alternating order."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(sample(fns[name], number))
    return {name: statistics.median(s) for name, s in samples.items()}


def event_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of the GPU work ``fn`` queues on CuPy's current stream, between two CUDA
    events (after one untimed call)."""
    import cupy as cp
    fn()
    ts = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return statistics.median(ts)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_targets(summary: Mapping[str, bool]) -> None:
    """One PASS/MISS line per named target."""
    print("\nTargets:")
    for name, ok in summary.items():
        print(f"  {verdict(ok)}  {name}")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print ``rows`` under ``columns`` as an aligned plain-text table (floats with 2 decimals)."""
    def cell(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, float) else str(x)
    text = [[cell(x) for x in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(columns)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print(line)
    for r in text:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))


def environment() -> dict[str, Any]:
    """Where the numbers came from: host, CPU model, count and load, Python and numpy versions (the
    host's CPU sets how fast a step's kernels are dispatched: GPU machines of one kind differ in it)."""
    import numpy as np
    return {"host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "python": platform.python_version(), "numpy": np.__version__,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating parent directories."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    print(f"\nwrote {path}")
