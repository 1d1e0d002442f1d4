"""Input validation kernels (run before anything is written)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import config


@njit(parallel=True, cache=True)
def first_out_of_range(idx, n):
    """Smallest position p with idx[p] < 0 or idx[p] >= n, or -1."""
    L = idx.size
    nc = 16 if L >= 1 << 16 else 1
    firsts = np.full(nc, -1, np.int64)
    for c in prange(nc):
        for p in range(c * L // nc, (c + 1) * L // nc):
            v = idx[p]
            if v < 0 or v >= n:
                firsts[c] = p
                break
    for c in range(nc):
        if firsts[c] >= 0:
            return firsts[c]
    return -1


@njit(cache=True)
def first_bad_offset(offsets):
    """Smallest b with offsets[b+1] < offsets[b], or -1."""
    for b in range(offsets.size - 1):
        if offsets[b + 1] < offsets[b]:
            return b
    return -1


@njit(parallel=True, cache=True)
def first_nonfinite_row(x):
    """Smallest row of 2-d ``x`` holding a NaN or inf, or -1 (no fastmath: it must see NaN)."""
    n = x.shape[0]
    nc = 16 if n >= 1024 else 1
    firsts = np.full(nc, -1, np.int64)
    for c in prange(nc):
        for i in range(c * n // nc, (c + 1) * n // nc):
            bad = False
            for k in range(x.shape[1]):
                if not np.isfinite(x[i, k]):
                    bad = True
            if bad:
                firsts[c] = i
                break
    for c in range(nc):
        if firsts[c] >= 0:
            return firsts[c]
    return -1


@njit(cache=True)
def first_out_of_range_serial(idx, n):
    """:func:`first_out_of_range` on the calling thread."""
    for p in range(idx.size):
        v = idx[p]
        if v < 0 or v >= n:
            return p
    return -1


@njit(cache=True)
def first_nonfinite_row_serial(x):
    """:func:`first_nonfinite_row` on the calling thread."""
    for i in range(x.shape[0]):
        for k in range(x.shape[1]):
            if not np.isfinite(x[i, k]):
                return i
    return -1


def out_of_range(idx: np.ndarray, n: int) -> int:
    """First bad position (or -1), in parallel only for large inputs."""
    if idx.size < config.SERIAL_CHECK:
        return int(first_out_of_range_serial(idx, n))
    return int(first_out_of_range(idx, n))


def nonfinite_row(x: np.ndarray) -> int:
    """First row with a NaN or inf (or -1), in parallel only for large inputs."""
    if x.size < config.SERIAL_CHECK:
        return int(first_nonfinite_row_serial(x))
    return int(first_nonfinite_row(x))
