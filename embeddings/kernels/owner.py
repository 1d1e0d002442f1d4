"""Owner-computes SGD: the fused update without reindexing.

Plain SGD changes a row by the sum of its occurrences' contributions, ``-lr * coef * grad[bag]``,
and adding them one at a time in batch order gives the same row up to rounding.  So instead of
sorting the batch into unique rows (:mod:`.reindex`), each of ``P`` threads owns a contiguous
range of rows, collects the batch positions that fall in its range (in batch order, one
branch-free pass over the indices) and applies them, prefetching rows ahead along its own list.
No two threads write one row, so no locks; a row touched twice is usually still in L1.

It runs as two parallel regions, back to back: :func:`prepare` collects each thread's positions
and checks the gradient for NaN/inf on both cores (it reads nothing of the table), and only if
the gradient is finite does :func:`apply_owned` write; the caller raises in between.  Checked
serially before the kernel, the gradient cost 0.12 ms of a 0.6 ms update at F=64 (16384 cold
rows) and ~0.45 of 2.4 ms at F=256.

For a batch of 16384 single-index bags the radix plan cost more than the update itself (F=16:
0.29 ms plan, 0.14 ms update), and at 655,360 indices (F=64) owner-computes ran 1.4-2x faster
than plan plus update, so single-table SGD batches of up to ``config.OWNER_MAX`` indices on
float32/float64 tables take this path.  Row-wise Adagrad needs each row's summed gradient and
keeps the plan; 16-bit storage too (rounding after every occurrence would lose more than rounding
once); and so do ensembles, whose plans are built in parallel across tables (DLRM shape (b),
8 tables x 204,800 indices: owner-computes table by table 43 ms against 47 ms uniform, 28 against
27 ms Zipf: not worth a second ensemble path).

The per-position step (:func:`_scaled`) takes scalars and runs under ``error_model="numpy"``: a
helper taking the arrays, with Python's division-by-zero check, kept an ``NRT_incref``/``decref``
pair per position in the loop and ran 4.5x slower (L2-resident F=16 rows).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .checks import first_nonfinite_row_in
from .lookup import _simd
from .rowaccess import featuresize, out_ptr, out_row, prefetch_row, prefetch_span, row_of, row_ptr, uidx
from .simd import vfma8


@njit(cache=True)
def owner_scale(nvectors, P):
    """The multiplier ``m`` with ``(r * m) >> 32`` the owner (0 .. P-1) of row ``r < nvectors``:
    contiguous, nearly equal row ranges without a division per index."""
    return (np.int64(P) << 32) // max(nvectors, 1)


@njit(cache=True)
def collect(idx, offsets, b0, b1, t, m, pos, bag):
    """Positions of thread ``t``'s rows in bags ``b0:b1``, in batch order, as offsets from the
    segment's first position and bag (``int32``); returns the count."""
    n = 0
    q0 = offsets[uidx(b0)]
    for b in range(b0, b1):
        for q in range(offsets[uidx(b)], offsets[uidx(b + 1)]):
            pos[uidx(n)] = q - q0
            bag[uidx(n)] = b - b0
            n += ((idx[uidx(q)] * m) >> 32) == t
    return n


@njit(cache=True, inline="always", error_model="numpy")
def _scaled(lr, w, mean, size):
    """Step of one position: ``lr`` times its weight, over its bag's size for mean pooling (scalars
    only: see the module docstring)."""
    c = lr * w
    if mean:
        c /= np.float32(size)
    return c


def sub_row(spec, base, cache, slots, codec, grad, r, b, c):  # pragma: no cover - numba only
    """``row(r) -= c * grad[b]``: 8-wide vector FMAs for float32 rows of a specialised size, a
    plain loop otherwise (chosen at compile time)."""
    raise NotImplementedError


@overload(sub_row, inline="always")
def _sub_row(spec, base, cache, slots, codec, grad, r, b, c):
    if _simd(spec, base, codec):
        def impl(spec, base, cache, slots, codec, grad, r, b, c):
            vfma8(spec, row_ptr(base, cache, slots, r), out_ptr(grad, b), -c)
    else:
        def impl(spec, base, cache, slots, codec, grad, r, b, c):
            F = featuresize(spec, base)
            row = row_of(base, cache, slots, r, F)
            g = out_row(grad, b, F)
            for k in range(F):
                row[k] -= c * g[k]
    return impl


@njit(cache=True, fastmath=True, error_model="numpy")
def apply(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, lr, b0, pos, bag, n, dist):
    """``row[idx[q]] -= lr * coef * grad[bag]`` for the ``n`` collected positions, prefetching
    the table row and the gradient row ``dist`` positions ahead."""
    nbytes = featuresize(spec, base) * base.itemsize
    gbytes = featuresize(spec, base) * grad.itemsize
    lr32 = np.float32(lr)
    one = np.float32(1.0)
    has_w = weights.size > 0
    q0 = offsets[uidx(b0)]
    for j in range(n):
        if j + dist < n:
            jp = j + dist
            prefetch_row(base, cache, slots, idx[uidx(q0 + pos[uidx(jp)])], nbytes)
            prefetch_span(grad.ctypes.data + (b0 + bag[uidx(jp)]) * grad.strides[0], gbytes)
        q = q0 + pos[uidx(j)]
        b = b0 + bag[uidx(j)]
        c = _scaled(lr32, weights[uidx(q)] if has_w else one, mean,
                    offsets[uidx(b + 1)] - offsets[uidx(b)] if mean else 1)
        sub_row(spec, base, cache, slots, codec, grad, idx[uidx(q)], b, c)


@njit(cache=True, inline="always")
def _prepare_part(idx, offsets, b0, b1, grad, g0, g1, m, pos, bag, counts, bad, t, P):
    """Thread ``t``'s share of :func:`prepare`."""
    counts[t] = collect(idx, offsets, b0, b1, t, m, pos[t], bag[t])
    bad[t] = first_nonfinite_row_in(grad, g0 + t * (g1 - g0) // P, g0 + (t + 1) * (g1 - g0) // P)


@njit(parallel=True, cache=True)
def prepare(idx, offsets, b0, b1, grad, g0, g1, nvectors, pos, bag, counts, bad):
    """First region of owner-computes SGD, reading nothing of the table: thread ``t`` of
    ``P = counts.size`` collects the positions of its rows in bags ``b0:b1`` (``counts[t]`` of them
    into ``pos[t]``/``bag[t]``) and checks its share of gradient rows ``g0:g1`` for NaN/inf
    (``bad[t]``: the first such row, or -1).  The check runs here, on both cores, so that a bad
    gradient is refused before :func:`apply_owned` writes anything."""
    P = counts.size
    m = owner_scale(nvectors, P)
    for t in prange(P):
        _prepare_part(idx, offsets, b0, b1, grad, g0, g1, m, pos, bag, counts, bad, t, P)


@njit(cache=True)
def prepare_serial(idx, offsets, b0, b1, grad, g0, g1, nvectors, pos, bag, counts, bad):
    """:func:`prepare` for one thread (``counts.size == 1``), without a parallel region."""
    _prepare_part(idx, offsets, b0, b1, grad, g0, g1, owner_scale(nvectors, 1), pos, bag, counts, bad, 0, 1)


@njit(parallel=True, cache=True)
def apply_owned(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, lr, b0, pos, bag, counts, dist):
    """Second region: thread ``t`` applies the ``counts[t]`` positions :func:`prepare` collected
    for it; no two threads write one row."""
    for t in prange(counts.size):
        apply(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, lr, b0, pos[t], bag[t],
              counts[t], dist)


@njit(cache=True)
def apply_owned_serial(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, lr, b0, pos, bag, counts,
                       dist):
    """:func:`apply_owned` for one thread, without a parallel region."""
    apply(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, lr, b0, pos[0], bag[0], counts[0], dist)
