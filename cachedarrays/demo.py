"""``./run demo``: the dissertation's Listing 4.4 — one matrix multiply with all data in the fast
device, one with all data in the slow device, and one that prefetches the operands into the fast device first.

Prints times and the bytes the manager moved between devices.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import DRAM, PM, Manager, format_size
from .copy import warmup


def _matrix(manager: Manager, device, n: int, fill: np.ndarray | None = None):
    region = manager.allocate_or_raise(device, n * n * 4)
    obj = manager.new_object(region)
    view = manager.bytes(region).view(np.float32).reshape(n, n)
    if fill is not None:
        view[...] = fill
    return obj, view


def _view(manager: Manager, obj) -> np.ndarray:
    region = manager.primary(obj)
    n = int(round((region.nbytes // 4) ** 0.5))
    return manager.bytes(region).view(np.float32).reshape(n, n)


def _move(manager: Manager, obj, device) -> None:
    """Move ``obj``'s primary to ``device`` with the data management API (Listings 4.1 / 4.2)."""
    src = manager.primary(obj)
    if src.device is device:
        return
    dst = manager.getlinked(src, device) or manager.allocate_or_raise(device, src.nbytes)
    manager.copyto(dst, src)
    manager.set_primary(obj, dst)
    manager.free(src)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="./run demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="matrix side (float32), default 2048")
    parser.add_argument("--fast-capacity", default="256MiB", help="DRAM heap size, default 256MiB")
    parser.add_argument("--slow-capacity", default="512MiB", help="PM heap size, default 512MiB")
    parser.add_argument("--pm-path", default=None, help="directory or file for the PM pool (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="multiplies per placement; the median is shown")
    args = parser.parse_args(argv)

    n = args.size
    rng = np.random.default_rng(0)
    a0 = rng.standard_normal((n, n), dtype=np.float32)
    b0 = rng.standard_normal((n, n), dtype=np.float32)
    warmup()
    with Manager(DRAM(args.fast_capacity), PM(args.pm_path, args.slow_capacity)) as m:
        print(f"devices: {m.fast} and {m.slow} ({'libpmem' if m.slow.uses_libpmem else 'mmap'}, "
              f"file {m.slow.path})")
        print(f"C = A @ B with {n}x{n} float32 matrices ({format_size(n * n * 4)} each)\n")
        print(f"{'placement':<28}{'median time':>12}{'GFLOP/s':>10}{'bytes moved':>14}")
        results = {}
        for label, device, prefetch in (("all in fast (DRAM)", m.fast, False),
                                        ("all in slow (PM)", m.slow, False),
                                        ("slow, prefetched to fast", m.slow, True)):
            before = sum(m.telemetry()["bytes_moved"].values())
            a, av = _matrix(m, device, n, a0)
            b, bv = _matrix(m, device, n, b0)
            c, cv = _matrix(m, device, n)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                if prefetch:
                    for obj in (a, b, c):
                        _move(m, obj, m.fast)
                np.matmul(_view(m, a), _view(m, b), out=_view(m, c))
                if prefetch:
                    for obj in (a, b, c):
                        _move(m, obj, m.slow)
                times.append(time.perf_counter() - t0)
            results[label] = _view(m, c).copy()
            moved = sum(m.telemetry()["bytes_moved"].values()) - before
            t = float(np.median(times))
            print(f"{label:<28}{t * 1e3:>10.1f}ms{2 * n**3 / t / 1e9:>10.1f}{format_size(moved):>14}")
            for obj in (a, b, c):
                m.free(obj)
            m.check()
        ref = results["all in fast (DRAM)"]
        assert all(np.array_equal(ref, r) for r in results.values()), "placements disagree"
        tele = m.telemetry()
        print("\nall placements give identical results")
        for pair, v in tele["copies"].items():
            print(f"  {pair}: {format_size(v['bytes'])} in {v['count']} copies, "
                  f"measured {v['measured_seconds'] * 1e3:.1f} ms, modeled {v['modeled_seconds'] * 1e3:.1f} ms")
        print("note: on this machine the PM device is a file in the page cache, so 'slow' runs at DRAM speed;\n"
              "the modeled times use the device model (PM: optane profile, DRAM: measured probe).")
        m.check()


if __name__ == "__main__":
    main()
