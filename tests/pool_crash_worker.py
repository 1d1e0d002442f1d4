"""A process that works on a persistent pool until it is killed: the subject of the kill -9 test.

``python pool_crash_worker.py serve`` imports everything once, prints ``ready``, then for each
line ``run PATH SEED DELAY`` on stdin forks a child that runs `work` on the pool at ``PATH``,
sends it SIGKILL after ``DELAY`` seconds and prints ``killed SIGNAL`` (or ``exited CODE``).
Forking skips the interpreter start and imports, so the test can kill tens of workers quickly.

The contents at durable point ``k`` are a pure function, `expected(k)`, so the test can check a
reopened pool without knowing when the worker died.  Between durable points the worker scribbles
garbage into the named objects (in place in PM, in DRAM copies that the policy evicts, through
long-held writable views), moves them, deletes and recreates them, and only then writes the
contents of ``k + 1`` and makes the durable point: a crash anywhere must still show ``k``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from cachedarrays import DRAM, PM, LRUPolicy, Manager, OutOfMemoryError, evict, prefetch, writable
from cachedarrays.pool import Pool, persistent

SIZES = {"w0": 3_000, "w1": 70_000, "w2": 20_000, "w3": 150_000, "w4": 9_000, "w5": 40_000}


def expected(k: int) -> dict[str, np.ndarray]:
    """The named objects and their contents at durable point ``k`` (none at 0)."""
    if k == 0:
        return {}
    present = np.random.default_rng([k, 99]).random(len(SIZES)) < 0.6
    return {name: np.random.default_rng([k, i]).integers(0, 256, n, dtype=np.uint8)
            for i, (name, n) in enumerate(SIZES.items()) if present[i]}


def work(path: str, seed: int) -> None:
    """Open (or create) the pool and advance it durable point by durable point, forever."""
    m = Manager(DRAM("192KiB", bandwidth=(10, 10)), PM(path, None if os.path.exists(path) else "2MiB"),
                policy=LRUPolicy())
    pool = Pool.open(m)
    rng = np.random.default_rng(seed)
    k = pool.attrs.get("k", 0)
    held = []
    while True:
        for _ in range(int(rng.integers(2, 8))):   # garbage that must never reach a durable point
            names = pool.names()
            if not names:
                break
            x = pool.get(names[int(rng.integers(len(names)))])
            op = int(rng.integers(5))
            try:
                if op == 0:
                    x[int(rng.integers(x.shape[0])):] = rng.integers(0, 256, dtype=np.uint8)
                elif op == 1:
                    prefetch(x, force=True)
                    x[:] = 0xEE
                elif op == 2 and not m.pinned(x.object):
                    evict(x)
                elif op == 3:
                    view = writable(x)              # a long-held view, as a cached table keeps
                    view.array[:7] = 0x77
                    held.append((view, x))
                elif op == 4 and names:
                    pool.delete(x_name := names[0])
                    persistent(m, x_name, shape=SIZES[x_name], dtype=np.uint8)[:] = 0x55
            except OutOfMemoryError:
                pass
        for view, x in held[:-1]:
            view.array[-5:] = 0x33
            view.release()
        held = held[-1:]
        target = expected(k + 1)
        for name in pool.names():
            if name not in target:
                pool.delete(name)
        for name, data in target.items():
            persistent(m, name, shape=data.shape, dtype=np.uint8)[...] = data
        pool.persist({"k": k + 1})
        k += 1


def serve() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        _, path, seed, delay = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                work(path, int(seed))
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            print("killed", os.WTERMSIG(status), flush=True)
        else:
            print("exited", os.WEXITSTATUS(status), flush=True)


if __name__ == "__main__":
    serve()
