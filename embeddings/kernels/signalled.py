"""A gather whose pieces a device can take as each is ready, with no host thread in between.

CPU threads gather rows of several host tables into one contiguous block, ``block[j] =
tables[tabs[j]][rows[j]]``, in pieces (consecutive runs of ``j``). Each thread gathers its share
of every piece in turn and, once its share of piece ``p`` is in the block, publishes that with a
store into a flag in page-locked memory. A device stream that waits on the flags (a backend's
``wait_flags``) copies each piece up as soon as every thread has published it.

Without it, a thread of the caller had to learn that a piece was gathered and then queue its
copy, and that thread needed the GIL each time, which a training step beside it holds most of the
time (in the GPU ``lru`` placement on the H100, about 0.9 ms passed between the last piece gathered
and its put being queued). Here the caller queues every copy as soon as the threads run without
the GIL (:meth:`Gathering.running`) and needs no GIL until they have finished.

Flags are int64, one per piece and thread (``flags[p * threads + t]``): 0 until thread ``t``
has written its share of piece ``p``, then :data:`DONE`, or :data:`FAILED` if it could not
(a table or row out of range, checked row by row as it goes; every later flag of that thread is
:data:`FAILED` too). A waiter sees every flag of a piece nonzero in any case, so nothing waits for
ever, and treats :data:`FAILED` as an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from ..aligned import rows_on_lines
from .atomics import exchange
from .intrinsics import address_as_pointer, store_fence
from .rowaccess import out_ptr, spec_for
from .scatter import THREADS, thread_pool
from .simd import vcopy, vcopy_stream

DONE, FAILED = 1, 2


def _copy_row(spec, dst, src, F, stream):  # pragma: no cover - numba only
    pass


@overload(_copy_row)
def _copy_row_impl(spec, dst, src, F, stream):
    if isinstance(spec, types.BaseTuple) and len(spec) > 0:
        def simd(spec, dst, src, F, stream):
            if stream:
                vcopy_stream(spec, dst, src)
            else:
                vcopy(spec, dst, src)
        return simd

    def plain(spec, dst, src, F, stream):
        d, s = carray(dst, F), carray(src, F)
        for c in range(F):
            d[c] = s[c]
    return plain


@njit(cache=True, nogil=True)
def _share(spec, addrs, strides, nrows, tabs, rows, block, cuts, th, nth, flags, started, stream):  # pragma: no cover
    """Thread ``th`` of ``nth``: marks itself started (without the GIL from here on), then its
    share of each piece and its flag; the first bad position, or -1."""
    exchange(started, th, 1)
    F = block.shape[1]
    bad = -1
    for p in range(cuts.size - 1):
        lo, hi = cuts[p], cuts[p + 1]
        if bad < 0:
            for j in range(lo + (hi - lo) * th // nth, lo + (hi - lo) * (th + 1) // nth):
                t, r = tabs[j], rows[j]
                if t < 0 or t >= addrs.size or r < 0 or r >= nrows[t]:
                    bad = j
                    break
                _copy_row(spec, out_ptr(block, j), address_as_pointer(addrs[t] + r * strides[t], block), F, stream)
            store_fence()  # the streaming stores land before the flag says so
        exchange(flags, p * nth + th, DONE if bad < 0 else FAILED)
    return bad


class Gathering:
    """A :func:`gather_signalled` under way: :meth:`result` waits for its threads."""

    def __init__(self, futures: list[Future], start: float, started: np.ndarray, tables: Sequence[np.ndarray],
                 tabs: np.ndarray, rows: np.ndarray) -> None:
        self._futures, self._start, self._started = futures, start, started
        self._held = tables  # the threads read them through raw addresses
        self._tabs, self._rows = tabs, rows

    def running(self, timeout_s: float = 10.0) -> bool:
        """Wait until every thread runs its share without the GIL (or has ended), so that it
        finishes and sets its flags whatever other threads do. Until then a thread still needs
        the GIL, and a thread that holds it while it waits for the device (a synchronous CUDA
        call, or the first launch of a kernel, which loads it and waits for the device's running
        kernels) would wait for a device that waits for the flags: queue a device wait on the
        flags only once this returned True (False: ``timeout_s`` passed first; :meth:`join`
        then waits for the threads to end)."""
        deadline = time.monotonic() + timeout_s
        while not all(s or f.done() for s, f in zip(self._started, self._futures)):
            if time.monotonic() > deadline:
                return False
            time.sleep(2e-5)
        return True

    def join(self) -> None:
        """Wait until every thread has ended, raising nothing (:meth:`result` raises)."""
        wait(self._futures)

    def result(self) -> float:
        """Seconds from the start to the last thread's end, once every thread has ended (raising
        what went wrong: an ``IndexError`` naming the first position out of range)."""
        ends, bad = [], []
        for f in self._futures:
            end, b = f.result()
            ends.append(end)
            if b >= 0:
                bad.append(b)
        if bad:
            j = min(bad)
            raise IndexError(f"gather: position {j} names row {int(self._rows[j])} of table {int(self._tabs[j])}, "
                             "outside it")
        return max(ends, default=self._start) - self._start


def gather_signalled(tables: Sequence[np.ndarray], tabs: np.ndarray, rows: np.ndarray, block: np.ndarray,
                     cuts: np.ndarray, flags: np.ndarray, done: Callable[[], None] | None = None) -> Gathering:
    """Start ``block[j] = tables[tabs[j]][rows[j]]`` on the gather pool's threads and return at
    once. ``cuts`` (``P + 1`` increasing positions from 0 to ``len(block)``) cuts the rows into
    ``P`` pieces; ``flags`` (int64, ``P * threads`` entries) receives each thread's flag per piece
    (zeroed here, before any thread starts). The ``threads`` shares run on the gather pool of
    :data:`~.scatter.THREADS` threads (more shares than that queue behind the first ones).
    ``done`` is called once every thread has ended, from the last one. The arguments are checked
    before any thread starts; the rows, as they are gathered."""
    tabs, rows, cuts = (np.ascontiguousarray(a, np.int64) for a in (tabs, rows, cuts))
    m = block.shape[0] if block.ndim == 2 else -1
    if block.ndim != 2 or (block.size and block.strides[1] != block.itemsize):
        raise ValueError(f"gather: the block must be 2-d with contiguous rows, got {block.ndim}-d")
    if tabs.shape != (m,) or rows.shape != (m,):
        raise ValueError(f"gather: {m} rows in the block, but {tabs.shape} tables and {rows.shape} rows")
    for i, t in enumerate(tables):
        rows_fit = t.ndim == 2 and t.shape[1] == block.shape[1] and t.dtype == block.dtype
        if not rows_fit or (t.size and t.strides[1] != t.itemsize):
            raise ValueError(f"gather: table {i} is {t.shape} {t.dtype}, "
                             f"the block's rows {block.shape[1:]} {block.dtype}")
    if cuts.ndim != 1 or cuts.size < 2 or cuts[0] != 0 or cuts[-1] != m or np.any(np.diff(cuts) < 0):
        raise ValueError(f"gather: pieces must cut 0..{m} in increasing positions, got {cuts}")
    P = cuts.size - 1
    if flags.dtype != np.int64 or flags.ndim != 1 or flags.size % P or flags.size == 0:
        raise ValueError(f"gather: flags must be int64, one per piece ({P}) and thread, got {flags.size} {flags.dtype}")
    nth = flags.size // P
    flags[:] = 0
    spec = spec_for(block.shape[1]) if block.dtype == np.float32 else ()
    stream = bool(spec) and rows_on_lines(block)
    addrs = np.array([t.ctypes.data for t in tables], np.int64)
    strides = np.array([t.strides[0] for t in tables], np.int64)
    nrows = np.array([t.shape[0] for t in tables], np.int64)
    started = np.zeros(nth, np.int64)
    pending, lock = [nth], threading.Lock()

    def share(th: int) -> tuple[float, int]:
        try:
            bad = _share(spec, addrs, strides, nrows, tabs, rows, block, cuts, th, nth, flags, started, stream)
            return time.perf_counter(), int(bad)
        except BaseException:
            mine = flags[th::nth]
            mine[mine == 0] = FAILED
            raise
        finally:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last and done is not None:
                done()

    pool = thread_pool("gather", THREADS)
    start = time.perf_counter()
    return Gathering([pool.submit(share, th) for th in range(nth)], start, started, list(tables), tabs, rows)
