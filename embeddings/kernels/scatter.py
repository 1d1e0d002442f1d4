"""Moving rows between host tables and a contiguous block with CPU threads: ``dst[rows[i]] =
src[i]`` (scatter), ``block[i] = table[rows[i]]`` (gather), now or in the background.

The GPU ``lru`` cache sends the rows it evicts home as one contiguous block (one DMA into
page-locked memory) and this scatters them into the host tables, in the background so that
the training step does not wait for it (:func:`scatter_later`); the rows a placement brings in
are gathered on the same kind of pool by :mod:`.signalled`, which lets the device take each piece
as it is ready (:func:`gather_rows` gathers and waits, as the benchmarks' floors do). Each piece
is a numba kernel that runs without the GIL, on a pool of Python threads rather than numba's
parallel layer, so that it can run beside numba kernels of the main thread whatever threading
layer numba picked.
float32 rows of a specialised feature size are copied with vector loads and stores
(:func:`~.simd.vcopy`), streaming ones where every destination row starts a cache line
(:func:`~.simd.vcopy_stream`: no read of the line it overwrites): 405,000 rows of 64 into an
8 GB table took 110 ns a row as numba's row assignment, 22 with vector copies and 18 streamed
on one core of the CI machine; on the H100 machine 494,000 random rows gathered out of two
page-locked 11.5 GB tables took 15 ms with numba's row assignment on 16 threads, 6.0 ms with
vector copies on 8 and 4.6 ms on 16.
``CACHEDARRAYS_SCATTER_THREADS`` sets each pool's size (default: a quarter of the cores, at least
one, so that both pools together leave half the cores to the training step beside them). On the
H100 machine's 16 cores, in one process each: the DLRM step with split reads took 19.6-20.0 ms
with 4 threads a pool and 20.3-21.9 with 8, staged reads 21.4-21.9 and 21.4-23.0, mapped reads
(the scatter only) 22.3-26.0 and 23.0-25.3. Beside the training step a gather does not speed up
with threads: 260,000 rows took 5.4, 5.7 and 6.2 ms on 4, 8 and 12 (alone, 489,000 rows took 7.3
ms on 4 and 4.8 on 16); a move may name its own count (``threads``), as the benchmarks' floors do.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numba import njit

from .checks import first_out_of_range_serial
from .intrinsics import store_fence
from ..aligned import rows_on_lines
from .rowaccess import out_ptr, spec_for, uidx
from .simd import vcopy, vcopy_stream

PIECE = 8192  # rows per task at least: a task's fixed cost stays small against its copies


def _threads() -> int:
    text = os.environ.get("CACHEDARRAYS_SCATTER_THREADS", "")
    if not text:
        return max(1, (os.cpu_count() or 1) // 4)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"CACHEDARRAYS_SCATTER_THREADS must be a positive integer, got {text!r}")
    return n


THREADS = _threads()
Job = tuple[np.ndarray, np.ndarray, np.ndarray]

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}  # per kind and size: a scatter never queues behind a gather
_later: ThreadPoolExecutor | None = None
_start = threading.Lock()  # the pools are made on first use, from whichever thread comes first


@njit(cache=True, nogil=True)
def _scatter(dst, rows, src):  # pragma: no cover - numba only
    for i in range(rows.size):
        dst[rows[i]] = src[i]


@njit(cache=True, nogil=True)
def _gather(dst, rows, src):  # pragma: no cover - numba only
    for i in range(rows.size):
        dst[i] = src[rows[i]]


@njit(cache=True, nogil=True)
def _gather_simd(spec, dst, rows, src, stream):  # pragma: no cover - numba only
    for i in range(rows.size):
        if stream:
            vcopy_stream(spec, out_ptr(dst, i), out_ptr(src, rows[uidx(i)]))
        else:
            vcopy(spec, out_ptr(dst, i), out_ptr(src, rows[uidx(i)]))
    if stream:
        store_fence()


@njit(cache=True, nogil=True)
def _scatter_simd(spec, dst, rows, src, stream):  # pragma: no cover - numba only
    for i in range(rows.size):
        if stream:
            vcopy_stream(spec, out_ptr(dst, rows[uidx(i)]), out_ptr(src, i))
        else:
            vcopy(spec, out_ptr(dst, rows[uidx(i)]), out_ptr(src, i))
    if stream:
        store_fence()


def _simd(table: np.ndarray, block: np.ndarray) -> tuple:
    """The vector-copy spec for rows between ``table`` and ``block`` (empty: numba's row copies)."""
    spec = spec_for(table.shape[1]) if table.ndim == 2 else ()
    if spec and table.dtype == np.float32 and table.strides[1] == 4 and block.strides[1] == 4:
        return spec
    return ()


def _piece(kind: str, table: np.ndarray, rows: np.ndarray, block: np.ndarray) -> None:
    """One piece of a scatter (``table[rows[i]] = block[i]``) or a gather (``block[i] =
    table[rows[i]]``), by the fastest kernel its arrays allow: vector copies of specialised
    rows, streamed when every row of the destination starts a cache line."""
    simd, plain = (_scatter_simd, _scatter) if kind == "scatter" else (_gather_simd, _gather)
    dst, src = (table, block) if kind == "scatter" else (block, table)
    spec = _simd(table, block)
    if spec:
        simd(spec, dst, rows.astype(np.int64, copy=False), src, rows_on_lines(dst))
    else:
        plain(dst, rows, src)


def _check(jobs: Sequence[Job], into: str) -> None:
    """Refuse jobs whose block, rows and table do not agree (before any row moves)."""
    for table, rows, block in jobs:
        n = int(rows.size)
        if block.shape[0] != n or table.shape[1:] != block.shape[1:] or table.dtype != block.dtype:
            raise ValueError(f"{into} of {block.shape} {block.dtype} rows at {n} positions of {table.shape} "
                             f"{table.dtype}")
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise TypeError(f"{into} rows must be a 1-d integer array, got {rows.ndim}-d {rows.dtype}")
        if n and first_out_of_range_serial(np.ascontiguousarray(rows), table.shape[0]) >= 0:  # without the GIL
            raise IndexError(f"{into} rows outside 0..{table.shape[0] - 1}")


def _shares(jobs: Sequence[Job], parts: int) -> list[list[Job]]:
    """The jobs' rows, one after the other, cut into ``parts`` runs of nearly equal length, each
    the list of job slices it covers (plain integer arithmetic: numpy's fixed costs on arrays of
    a few entries were most of a move's GIL time)."""
    total = sum(int(rows.size) for _, rows, _ in jobs)
    shares, job, start = [], 0, 0  # start: where job ``job`` begins in the run of all rows
    for p in range(parts):
        a, b = total * p // parts, total * (p + 1) // parts
        share = []
        while job < len(jobs) and a < b:
            table, rows, block = jobs[job]
            lo, hi = a - start, min(b - start, int(rows.size))
            if hi > lo:
                share.append((table, rows[lo:hi], block[lo:hi]))
            a = start + hi
            if hi == int(rows.size):
                start += int(rows.size)
                job += 1
        if share:
            shares.append(share)
    return shares


def _pieces(kind: str, share: Sequence[Job]) -> None:
    for table, rows, block in share:
        _piece(kind, table, rows, block)


def _split_run(kind: str, jobs: Sequence[Job], threads: int | None = None) -> None:
    """The ``kind`` (scatter or gather) of every job, the rows of all of them cut into one
    share per thread of a ``kind`` pool of ``threads`` threads (default :data:`THREADS`; fewer
    where a share would be below :data:`PIECE` rows); returns when all are done. One task per
    thread, not per job and thread: each task costs its thread and the caller some GIL, which
    a training step's thread beside the move waits for."""
    threads = THREADS if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"{kind}: threads must be at least 1, got {threads}")
    total = sum(int(rows.size) for _, rows, _ in jobs)
    shares = _shares(jobs, max(1, min(threads, total // PIECE)))
    if len(shares) <= 1:
        for share in shares:
            _pieces(kind, share)
        return
    pool = thread_pool(kind, threads)
    for f in [pool.submit(_pieces, kind, share) for share in shares]:
        f.result()


def thread_pool(kind: str, threads: int) -> ThreadPoolExecutor:
    """The pool of ``threads`` threads that runs moves of ``kind`` (made on first use)."""
    with _start:
        if (kind, threads) not in _pools:
            _pools[kind, threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"cachedarrays-{kind}")
        return _pools[kind, threads]


def scatter_rows(jobs: Sequence[Job], threads: int | None = None) -> None:
    """For each ``(dst, rows, src)``: ``dst[rows[i]] = src[i]`` (as many rows as positions, the
    same row shape and dtype, every position in range: checked for every job before any is
    written), split across ``threads`` threads (default :data:`THREADS`); returns when all are done."""
    _check(jobs, "scatter")
    _split_run("scatter", jobs, threads)


def gather_rows(jobs: Sequence[Job], threads: int | None = None) -> None:
    """For each ``(table, rows, block)``: ``block[i] = table[rows[i]]`` (checked as for
    :func:`scatter_rows` before any row moves), split across ``threads`` threads (default
    :data:`THREADS`); returns when all are done."""
    _check(jobs, "gather")
    _split_run("gather", jobs, threads)


def scatter_later(ready: Callable[[], None], jobs: Callable[[], Sequence[Job]]) -> Future:
    """:func:`scatter_rows` of ``jobs()`` once ``ready()`` has returned (a wait for the rows to
    land in host memory), on a background thread; the future is done when the rows are home.
    Scatters started this way run one after the other, in the order they were started."""
    global _later
    with _start:
        if _later is None:
            _later = ThreadPoolExecutor(1, thread_name_prefix="cachedarrays-home")

    def run() -> None:
        ready()
        scatter_rows(jobs())
    return _later.submit(run)
