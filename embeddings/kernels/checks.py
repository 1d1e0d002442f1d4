"""Input validation kernels (run before anything is written).

Each check is a branch-free reduction over blocks of ``BLOCK`` elements (min/max of the indices,
an OR of "is not finite" over gradient rows) that LLVM vectorises; only a block that fails is
searched again element by element for the exact first bad position, so the early exit happens
between blocks. Large inputs are split into ordered chunks checked in parallel, and the first
failing chunk holds the answer.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from .. import config
from .intrinsics import address_as_pointer
from .rowaccess import out_row

BLOCK = 4096  # elements per vectorised block (16-32 KiB: the block is re-read from L1/L2 on failure)


@njit(cache=True, inline="always")
def _block_in_range(idx, lo, hi, n):
    """Whether every idx[lo:hi] is in [0, n): a max reduction over the values as unsigned
    (negatives become huge), which vectorises. The loop runs over a contiguous view from 0, so
    numba's negative-index wraparound folds away and the loads stay plain vector loads."""
    a = carray(address_as_pointer(idx.ctypes.data + lo * idx.itemsize, idx), hi - lo)
    m = np.uint64(0)
    for p in range(hi - lo):
        m = max(m, np.uint64(np.int64(a[p])))
    return m < np.uint64(n)


@njit(cache=True, nogil=True)
def _first_out_of_range_in(idx, lo, hi, n):
    """Smallest p in [lo, hi) with idx[p] outside [0, n), or -1."""
    for b in range(lo, hi, BLOCK):
        e = min(b + BLOCK, hi)
        if not _block_in_range(idx, b, e, n):
            for p in range(b, e):
                v = idx[p]
                if v < 0 or v >= n:
                    return p
    return -1


@njit(cache=True, inline="always")
def _first_found(firsts):
    """The first entry of ``firsts`` (each ordered chunk's first bad position, or -1) that is one."""
    for c in range(firsts.size):
        if firsts[c] >= 0:
            return firsts[c]
    return -1


@njit(cache=True, nogil=True)
def first_out_of_range_serial(idx, n):
    """Smallest position p with idx[p] < 0 or idx[p] >= n, or -1 (on the calling thread)."""
    return _first_out_of_range_in(idx, 0, idx.size, n)


@njit(parallel=True, cache=True, nogil=True)
def first_out_of_range(idx, n):
    """:func:`first_out_of_range_serial` over 16 ordered chunks in parallel."""
    L = idx.size
    nc = 16 if L >= 1 << 16 else 1
    firsts = np.full(nc, -1, np.int64)
    for c in prange(nc):
        firsts[c] = _first_out_of_range_in(idx, c * L // nc, (c + 1) * L // nc, n)
    return _first_found(firsts)


@njit(cache=True, inline="always")
def _copy_checked_in(idx, out, lo, hi, n):
    """``out[lo:hi] = idx[lo:hi]`` and the smallest position there outside [0, n) (or -1)."""
    first = -1
    for b in range(lo, hi, BLOCK):
        e = min(b + BLOCK, hi)
        if first < 0 and not _block_in_range(idx, b, e, n):
            first = _first_out_of_range_in(idx, b, e, n)
        src = carray(address_as_pointer(idx.ctypes.data + b * idx.itemsize, idx), e - b)
        dst = carray(address_as_pointer(out.ctypes.data + b * out.itemsize, out), e - b)
        for p in range(e - b):  # raw views from 0: plain vector loads and stores
            dst[p] = src[p]
    return first


@njit(parallel=True, cache=True, nogil=True)
def _copy_checked_each(src_at, sizes, bounds, dst_at, like_src, like_dst):  # pragma: no cover - numba only
    T = sizes.size
    firsts = np.full((T, 16), -1, np.int64)
    for p in prange(T * 16):
        t, c = p // 16, p % 16
        L = sizes[t]
        nc = 16 if L >= 1 << 16 else 1
        if c < nc:
            idx = carray(address_as_pointer(src_at[t], like_src), L)
            out = carray(address_as_pointer(dst_at[t], like_dst), L)
            firsts[t, c] = _copy_checked_in(idx, out, c * L // nc, (c + 1) * L // nc, bounds[t])
    result = np.full(T, -1, np.int64)
    for t in range(T):
        result[t] = _first_found(firsts[t])
    return result


def copy_checked_each(srcs: list[np.ndarray], bounds: list[int], outs: list[np.ndarray]) -> np.ndarray:
    """``outs[t][:] = srcs[t]`` (converted to ``outs[t]``'s type) for every ``t``, and the smallest
    position of each ``srcs[t]`` whose index is outside ``[0, bounds[t])`` (or -1): the range check
    and the copy in one pass over the indices, each array in 16 ordered chunks (one below 65536
    entries) checked block by block as :func:`first_out_of_range` checks them (an out-of-range
    value may not survive the conversion), all arrays in one parallel region (one wake-up of the
    threads, not one per array: a DLRM step checks eight tables' batches this way). The arrays
    are 1-d and contiguous, each ``outs[t]`` as long as ``srcs[t]``; those of one pair of types
    go to one kernel."""
    result = np.full(len(srcs), -1, np.int64)
    kinds: dict = {}
    for t, (src, out) in enumerate(zip(srcs, outs)):
        if src.ndim != 1 or out.shape != src.shape or not (src.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError(f"copy_checked_each: array {t} must be 1-d and contiguous, into one of its length")
        kinds.setdefault((src.dtype, out.dtype), []).append(t)
    for ts in kinds.values():
        at = np.array(ts)
        result[at] = _copy_checked_each(np.array([srcs[t].ctypes.data for t in ts], np.int64),
                                        np.array([srcs[t].size for t in ts], np.int64),
                                        np.array([bounds[t] for t in ts], np.int64),
                                        np.array([outs[t].ctypes.data for t in ts], np.int64),
                                        srcs[ts[0]], outs[ts[0]])
    return result


@njit(cache=True, nogil=True)
def first_bad_offset(offsets):
    """Smallest b with offsets[b+1] < offsets[b] (1-d, contiguous), or -1: a branch-free OR over
    blocks of raw views (it vectorises; the early-exit loop took 6.8 us for 16385 offsets),
    searched only on failure."""
    n = offsets.size - 1
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        lo = carray(address_as_pointer(offsets.ctypes.data + b0 * offsets.itemsize, offsets), m)
        hi = carray(address_as_pointer(offsets.ctypes.data + (b0 + 1) * offsets.itemsize, offsets), m)
        bad = 0
        for b in range(m):
            bad |= np.int32(hi[b] < lo[b])
        if bad:
            for b in range(m):
                if hi[b] < lo[b]:
                    return b0 + b
    return -1


@njit(cache=True, nogil=True)
def is_range(offsets):
    """Whether offsets[b] == b for every b (1-d, contiguous): a branch-free OR that vectorises
    (validated CSR offsets of n indices in n bags are this exactly when no bag is empty)."""
    v = carray(address_as_pointer(offsets.ctypes.data, offsets), offsets.size)
    bad = 0
    for b in range(offsets.size):
        bad |= np.int32(v[b] != b)
    return bad == 0


@njit(cache=True, inline="always")
def _all_finite(a, n):
    """Whether a[:n] (a contiguous float vector) is all finite: ``v - v`` is 0 for a finite v and
    NaN for NaN or inf, and an integer OR of the comparisons vectorises (no fastmath here: it must
    see NaN)."""
    bad = 0
    for k in range(n):
        v = a[k]
        bad |= np.int32((v - v) != 0)
    return bad == 0


@njit(cache=True, inline="always")
def _rows_finite(x, lo, hi):
    """Whether rows lo:hi of 2-d ``x`` (contiguous rows) are all finite; one flat vector when the
    rows are adjacent in memory, else row by row."""
    F = x.shape[1]
    if x.strides[0] == F * x.itemsize:
        n = (hi - lo) * F
        return _all_finite(carray(address_as_pointer(x.ctypes.data + lo * x.strides[0], x), n), n)
    for i in range(lo, hi):
        if not _all_finite(out_row(x, i, F), F):
            return False
    return True


@njit(cache=True, nogil=True)
def first_nonfinite_row_in(x, lo, hi):
    """Smallest row in [lo, hi) holding a NaN or inf, or -1."""
    step = max(1, BLOCK // max(x.shape[1], 1))
    for b in range(lo, hi, step):
        e = min(b + step, hi)
        if not _rows_finite(x, b, e):
            for i in range(b, e):
                for k in range(x.shape[1]):
                    if not np.isfinite(x[i, k]):
                        return i
    return -1


@njit(cache=True, nogil=True)
def first_nonfinite_row_serial(x):
    """Smallest row of 2-d ``x`` holding a NaN or inf, or -1 (on the calling thread)."""
    return first_nonfinite_row_in(x, 0, x.shape[0])


@njit(parallel=True, cache=True, nogil=True)
def first_nonfinite_row(x):
    """:func:`first_nonfinite_row_serial` over 16 ordered chunks of rows in parallel."""
    n = x.shape[0]
    nc = 16 if n >= 1024 else 1
    firsts = np.full(nc, -1, np.int64)
    for c in prange(nc):
        firsts[c] = first_nonfinite_row_in(x, c * n // nc, (c + 1) * n // nc)
    return _first_found(firsts)


def out_of_range(idx: np.ndarray, n: int) -> int:
    """First bad position (or -1), in parallel only for large inputs."""
    if idx.size < config.SERIAL_CHECK:
        return int(first_out_of_range_serial(idx, n))
    return int(first_out_of_range(idx, n))


def nonfinite_row(x: np.ndarray) -> int:
    """First row of 2-d ``x`` (contiguous rows, any row stride) with a NaN or inf (or -1), in
    parallel only for large inputs."""
    if x.size < config.SERIAL_CHECK:
        return int(first_nonfinite_row_serial(x))
    return int(first_nonfinite_row(x))
