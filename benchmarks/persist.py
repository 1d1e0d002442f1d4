"""Persistent pools: resuming from a pool versus loading a checkpoint file, and the cost of a durable point.

What it measures, and how:

1. Resume.  A table set of ``--size`` bytes (``--tables`` float32 tables of 64 columns) is built
   in a PM pool file (``persistent`` objects, one durable point) and also saved as a checkpoint
   file the way ``dlrm.train --save`` writes one (``cachedarrays.checkpoint.save_npz``).  Then,
   alternately ``--repeats`` times (median reported):
   - *pool*: open the pool file (``PM(path)``: lock, map, read and verify the metadata, pre-fault),
     the manager and the pool, and every table by name (``persistent``): the tables are ready,
     in place, nothing is copied;
   - *checkpoint*: create the PM device a run needs for the tables (a new pool file of the same
     size), allocate the tables in it, and read the checkpoint into them (``open_npz``, as
     ``dlrm.train --load`` does: numpy's zip reader with its CRC check, then a copy).
   Both end with one row of every table read.  Both files are in the page cache (just written),
   as they are on a restart; the table says how much of each path is device setup.
   Target: the pool path at least 20x faster than the checkpoint path.
2. Durable point.  The tables are cached in DRAM (``prefetch``); a fraction of them (whole tables:
   dirty tracking is per object) is written, and ``m.persist()`` is timed: it writes the dirty
   tables back to PM regions that are not their durable copies, persists those bytes, then commits
   the metadata.  The baseline is a plain ``msync`` of the same bytes: the same tables copied into
   PM regions in place and persisted, with no commit.  Reported: bytes written to PM (data +
   metadata), ms per GiB of dirty data, and the ratio to the baseline.  A third row times the
   first in-place write of a PM-resident table after a durable point (the pool copies the table's
   durable copy out of the way first: the cost of keeping the durable point when tables are
   updated in place in PM, once per table per interval).

``--dir`` picks the file system (default: a temporary directory under the system's temp dir,
on disk here; ``/dev/shm`` makes msync free).  The machine needs about 4.5x ``--size`` of disk
(the pool file holds two copies, plus the checkpoint and the baseline's file) and 2x of memory.  ``--quick`` uses 256 MiB.
Run ``python benchmarks/persist.py --size 4GiB`` for the issue's case (default 1 GiB, laptop-sized).
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import _common as C  # noqa: E402
from cachedarrays import DRAM, PM, CachedArray, LRUPolicy, Manager, parse_size, prefetch, readable, writable  # noqa: E402
from cachedarrays.checkpoint import open_npz, save_npz  # noqa: E402
from cachedarrays.copy import copy_bytes, warmup  # noqa: E402
from cachedarrays.devices.pmmeta import encode_slot  # noqa: E402
from cachedarrays.pool import Pool, persistent  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)
COLUMNS = 64
TARGET = 20.0
FULL_PASS = "pool, then one read of every byte"
RESUME_DRAM = "8MiB"  # neither resume path uses DRAM; the same small device for both
BW = (10.0, 10.0)     # a fixed performance model: no bandwidth probe inside the timings


def table_shapes(size: int, tables: int) -> list[tuple[int, int]]:
    rows = max(1, size // (tables * COLUMNS * 4))
    return [(rows, COLUMNS)] * tables


def pool_capacity(size: int) -> int:
    return 2 * size + (64 << 20)  # a changed table keeps its durable copy until the next durable point


def build(directory: str, shapes, size: int) -> tuple[str, str]:
    """The pool file (one durable point) and the checkpoint file of the same tables."""
    pool_path, ck_path = os.path.join(directory, "tables.pool"), os.path.join(directory, "tables.npz")
    m = Manager(DRAM("64MiB"), PM(pool_path, pool_capacity(size)), policy=LRUPolicy())
    xs = [persistent(m, f"tables/{i}", shape=s, dtype=np.float32) for i, s in enumerate(shapes)]
    for i, x in enumerate(xs):
        with writable(x) as a:
            for lo in range(0, a.shape[0], 1 << 18):
                a[lo:lo + (1 << 18)] = np.float32(i) + np.arange(min(1 << 18, a.shape[0] - lo), dtype=np.float32)[:, None]
    m.persist()
    views = [readable(x) for x in xs]
    save_npz(ck_path, {f"table{i}": v.array for i, v in enumerate(views)}, {"step": 0})
    for v in views:
        v.release()
    del views, xs
    m.close()
    return pool_path, ck_path


def touch(xs) -> None:
    for x in xs:
        with readable(x) as a:
            float(a[-1, 0])


def read_all(xs) -> float:
    """Read every byte of every table once (a full pass, as training makes eventually)."""
    total = 0.0
    for x in xs:
        with readable(x) as a:
            for lo in range(0, a.shape[0], 1 << 18):
                total += float(a[lo:lo + (1 << 18)].max())
    return total


def resume_from_pool(pool_path: str, shapes) -> dict:
    t0 = time.perf_counter()
    m = Manager(DRAM(RESUME_DRAM, bandwidth=BW), PM(pool_path), policy=LRUPolicy())
    t1 = time.perf_counter()
    Pool.open(m)
    xs = [persistent(m, f"tables/{i}", shape=s, dtype=np.float32) for i, s in enumerate(shapes)]
    touch(xs)
    t2 = time.perf_counter()
    read_all(xs)
    t3 = time.perf_counter()
    copied = sum(m.telemetry()["bytes_moved"].values())
    del xs
    m.close()
    return {"setup": t1 - t0, "tables": t2 - t1, "total": t2 - t0, "read_all": t3 - t2, "bytes_copied": copied}


def load_checkpoint(ck_path: str, directory: str, shapes, size: int) -> dict:
    t0 = time.perf_counter()
    m = Manager(DRAM(RESUME_DRAM, bandwidth=BW), PM(directory, size + (64 << 20)), policy=LRUPolicy())  # one copy
    xs = [CachedArray(s, m, np.float32, place="slow") for s in shapes]
    t1 = time.perf_counter()
    with open_npz(ck_path) as ck:
        for i, x in enumerate(xs):
            with writable(x) as a:
                a[...] = ck[f"table{i}"]
    touch(xs)
    t2 = time.perf_counter()
    del xs
    m.close()
    return {"setup": t1 - t0, "tables": t2 - t1, "total": t2 - t0}


def metadata_bytes(pm: PM) -> int:
    """Bytes of the last commit's metadata slot (header, extents, name table)."""
    return len(encode_slot(pm.committed))


class PlainFile:
    """The baseline: an ordinary file mapping, written in place and msync'ed, with no commit."""

    def __init__(self, path: str, nbytes: int):
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 0)
        self.bytes = np.frombuffer(self.mm, np.uint8)
        self.bytes[::4096] = 0  # first touch, outside the timings (as the pool's file was)
        self.mm.flush()

    def write(self, offset: int, data: np.ndarray) -> None:
        copy_bytes(self.bytes[offset:offset + data.size], data)
        self.mm.flush(offset - offset % mmap.ALLOCATIONGRANULARITY, data.size + offset % mmap.ALLOCATIONGRANULARITY)

    def close(self) -> None:
        del self.bytes
        self.mm.close()


def durable_points(pool_path: str, plain_path: str, shapes, size: int, fractions, repeats: int) -> list[dict]:
    """ms per GiB of dirty data for m.persist() and for a plain msync of the same bytes."""
    m = Manager(DRAM(size + (64 << 20)), PM(pool_path), policy=LRUPolicy())
    pool = Pool.open(m)
    xs = [persistent(m, f"tables/{i}", shape=s, dtype=np.float32) for i, s in enumerate(shapes)]
    for x in xs:
        prefetch(x, force=True)
    m.persist()
    pm = m.slow
    plain = PlainFile(plain_path, size)
    rows = []
    for frac in fractions:
        k = max(1, round(frac * len(xs)))
        dirty = k * xs[0].nbytes
        ours, base, written, meta_bytes = [], [], [], []
        for r in range(repeats):
            for x in xs[:k]:
                with writable(x) as a:
                    a[0, 0] += 1                      # one store makes the whole table dirty
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):  # alternate, so drift hits both
                if which == 0:
                    before = m.telemetry()["bytes_moved"].get(f"{m.fast.name}->{pm.name}", 0)
                    seq = pm.committed.seq
                    t0 = time.perf_counter()
                    m.persist()
                    ours.append(time.perf_counter() - t0)
                    meta = metadata_bytes(pm) + 8 * (pm.committed.seq - seq)
                    meta_bytes.append(meta)
                    written.append(m.telemetry()["bytes_moved"].get(f"{m.fast.name}->{pm.name}", 0) - before + meta)
                else:
                    t0 = time.perf_counter()
                    for i, x in enumerate(xs[:k]):
                        plain.write(i * x.nbytes, m.bytes(m.primary(x.object)))
                    base.append(time.perf_counter() - t0)
        o, b = statistics.median(ours), statistics.median(base)
        rows.append({"case": f"{k}/{len(xs)} tables dirty", "dirty_bytes": dirty, "written_bytes": statistics.median(written),
                     "metadata_bytes": statistics.median(meta_bytes),
                     "ours_seconds": o, "msync_seconds": b, "ours_ms_per_gib": 1e3 * o / (dirty / GiB),
                     "msync_ms_per_gib": 1e3 * b / (dirty / GiB), "ratio": o / b})
    # tables resident in PM and updated in place: the first write after a durable point copies the durable copy away
    for x in xs:
        m.policy.evict(x.object)
    m.persist()
    times, base = [], []
    for r in range(repeats):
        x = xs[r % len(xs)]
        t0 = time.perf_counter()
        with writable(x) as a:
            a[0, 0] += 1
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain.write((r % len(xs)) * x.nbytes, m.bytes(m.primary(x.object)))
        base.append(time.perf_counter() - t0)
        m.persist()
    o, b = statistics.median(times), statistics.median(base)
    rows.append({"case": "first in-place write in PM (copy of 1 table)", "dirty_bytes": xs[0].nbytes,
                 "written_bytes": xs[0].nbytes + metadata_bytes(pm) + 8, "metadata_bytes": metadata_bytes(pm) + 8, "ours_seconds": o, "msync_seconds": b,
                 "ours_ms_per_gib": 1e3 * o / (xs[0].nbytes / GiB), "msync_ms_per_gib": 1e3 * b / (xs[0].nbytes / GiB),
                 "ratio": o / b})
    plain.close()
    m.check()
    del xs, pool
    m.close()
    return rows


def main(argv=None) -> int:
    p = C.parser(__doc__, "results/persist.json")
    p.add_argument("--size", default="1GiB", help="bytes of the table set (default 1GiB; the issue's case is 4GiB)")
    p.add_argument("--tables", type=int, default=4, help="number of tables (default 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 5, quick 3)")
    p.add_argument("--dir", default=None, help="directory for the pool and checkpoint files (default: a temp dir)")
    args = p.parse_args(argv)
    size = parse_size("256MiB" if args.quick else args.size)
    repeats = args.repeats or (3 if args.quick else 5)
    if args.tables < 1 or repeats < 1:
        p.error("--tables and --repeats must be positive")
    shapes = table_shapes(size, args.tables)
    size = sum(r * c * 4 for r, c in shapes)
    directory = tempfile.mkdtemp(prefix="persist-bench-", dir=args.dir)
    need = int(4.5 * size) + (256 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        shutil.rmtree(directory)
        p.error(f"{directory} has {free / GiB:.1f} GiB free, the benchmark needs about {need / GiB:.1f} GiB: "
                f"pass a smaller --size or another --dir")
    results = {"environment": C.environment(), "quick": args.quick, "size_bytes": size, "tables": args.tables,
               "repeats": repeats, "dir": directory}
    try:
        warmup()
        print(f"building {args.tables} tables of {shapes[0][0]} x {COLUMNS} float32 ({size / GiB:.2f} GiB) in {directory} ...",
              flush=True)
        t0 = time.perf_counter()
        pool_path, ck_path = build(directory, shapes, size)
        print(f"  built in {time.perf_counter() - t0:.1f} s (pool file {os.path.getsize(pool_path) / GiB:.2f} GiB, "
              f"checkpoint {os.path.getsize(ck_path) / GiB:.2f} GiB)", flush=True)

        pool_runs, ck_runs = [], []
        for r in range(repeats):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for which in order:
                gc.collect()
                if which == 0:
                    pool_runs.append(resume_from_pool(pool_path, shapes))
                else:
                    ck_runs.append(load_checkpoint(ck_path, directory, shapes, size))
        med = {name: {k: statistics.median(run[k] for run in runs) for k in ("setup", "tables", "total")}
               for name, runs in (("pool", pool_runs), ("checkpoint", ck_runs))}
        full = statistics.median(run["read_all"] for run in pool_runs)
        med[FULL_PASS] = {"setup": med["pool"]["setup"], "tables": med["pool"]["tables"] + full,
                          "total": med["pool"]["total"] + full}
        ratio = med["checkpoint"]["total"] / med["pool"]["total"]
        results["resume"] = {"pool": med["pool"], "checkpoint": med["checkpoint"], "ratio": ratio,
                             "pool_bytes_copied": max(run["bytes_copied"] for run in pool_runs),
                             "runs": {"pool": pool_runs, "checkpoint": ck_runs}}
        C.print_table(f"Resume {args.tables} tables, {size / GiB:.2f} GiB (seconds, median of {repeats} per column; "
                      f"the checkpoint's devices include a new PM file for the tables)",
                      ["path", "devices", "tables ready", "total", "checkpoint / this", "GB/s of tables"],
                      [[name, med[name]["setup"], med[name]["tables"], med[name]["total"],
                        f"{med['checkpoint']['total'] / med[name]['total']:.1f}", f"{size / 1e9 / med[name]['total']:.1f}"]
                       for name in ("pool", FULL_PASS, "checkpoint")])
        print(f"bytes copied to resume from the pool: {results['resume']['pool_bytes_copied']}")

        rows = durable_points(pool_path, os.path.join(directory, "plain.bin"), shapes, size, (0.25, 0.5, 1.0), repeats)
        results["durable_point"] = rows
        C.print_table(f"Durable point cost (median of {repeats}): m.persist() vs a plain msync of the same bytes",
                      ["case", "dirty MiB", "written MiB", "metadata B", "persist ms", "msync ms",
                       "persist ms/GiB", "msync ms/GiB", "x msync"],
                      [[r["case"], r["dirty_bytes"] / MiB, r["written_bytes"] / MiB, int(r["metadata_bytes"]), 1e3 * r["ours_seconds"],
                        1e3 * r["msync_seconds"], r["ours_ms_per_gib"], r["msync_ms_per_gib"], f"{r['ratio']:.2f}"]
                       for r in rows])
        results["targets"] = {f"reopen >= {TARGET:.0f}x faster than loading the checkpoint": ratio >= TARGET}
        C.print_targets(results["targets"])
        C.write_json(args.out, results)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
