"""Fused backward + optimizer kernels.

For every unique row of an update plan (see :mod:`.reindex`) the gradient is accumulated from
the rows of the output gradient that used it (``acc = sum coef * grad[bag]``, in an L1-resident
float32 vector) and the optimizer is applied to the table row at once, so no dense (or even
sparse) table gradient is ever materialised. Unique rows are independent, so chunks of them are
updated in parallel without locks (dissertation section 5.2.3).

Optimizers (``opt``): ``SGD`` (0): ``row -= lr * g``; row-wise Adagrad (1):
``state[r] += mean(g**2); row -= lr * g / (sqrt(state[r]) + eps)``; and ``GRADIENT`` (2), which
only writes ``g`` to ``gout[u]`` (used to inspect gradients and in tests).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from numba.extending import overload

from .codecs import load, store
from .intrinsics import prefetch, stack_f32
from .lookup import _simd, nchunks_for
from .reindex import reindex_part
from .rowaccess import accumulator, featuresize, out_ptr, out_row, prefetch_row, prefetch_slot, row_of, row_ptr, uidx
from .simd import vcopy, vfma8, vzero

SGD = 0
ADAGRAD = 1
GRADIENT = 2


@njit(cache=True, inline="always")
def _prefetch_grad(grad, ent_bag, starts, u, gbytes):
    """Prefetch the gradient rows of unique row ``u`` (at most two: the common cases)."""
    q0 = starts[uidx(u)]
    q1 = min(starts[uidx(u + 1)], q0 + 2)
    for q in range(q0, q1):
        a = grad.ctypes.data + ent_bag[uidx(q)] * grad.strides[0]
        off = 0
        while off < gbytes:
            prefetch(a + off)
            off += 64


@njit(cache=True, fastmath=True)
def update_chunk(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                 opt, lr, eps, state, gout, u0, u1, dist, heap):
    """Apply the optimizer to unique rows ``uniq[u0:u1]`` (``heap``: scratch, as in lookups)."""
    F = featuresize(spec, base)
    acc = accumulator(spec, heap)
    nbytes = F * base.itemsize
    gbytes = F * 4
    has_coef = ent_coef.size > 0
    lr32 = np.float32(lr)
    for u in range(u0, u1):
        if u + dist < u1:
            prefetch_row(base, cache, slots, uniq[u + dist], nbytes)
            prefetch_slot(slots, uniq, u + 2 * dist, u1)
            _prefetch_grad(grad, ent_bag, starts, u + dist, gbytes)
        for k in range(F):
            acc[k] = 0.0
        for q in range(starts[u], starts[u + 1]):
            g = out_row(grad, ent_bag[q], F)
            if has_coef:
                c = ent_coef[q]
                for k in range(F):
                    acc[k] += c * g[k]
            else:
                for k in range(F):
                    acc[k] += g[k]
        r = uniq[u]
        if opt == GRADIENT:
            o = out_row(gout, u, F)
            for k in range(F):
                o[k] = acc[k]
            continue
        row = row_of(base, cache, slots, r, F)
        mult = lr32
        if opt == ADAGRAD:
            g2 = np.float32(0.0)
            for k in range(F):
                g2 += acc[k] * acc[k]
            st = state[r] + g2 / np.float32(F)
            state[r] = st
            mult = lr32 / (np.sqrt(st) + np.float32(eps))
        for k in range(F):
            row[k] = store(codec, load(codec, row[k]) - mult * acc[k])


@njit(cache=True, fastmath=True)
def update_chunk_simd(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                      opt, lr, eps, state, gout, u0, u1, dist, heap):
    """:func:`update_chunk` for float32 rows of a specialised size (register accumulator)."""
    F = 8 * len(spec)
    nbytes = F * 4
    gbytes = nbytes
    has_coef = ent_coef.size > 0
    lr32 = np.float32(lr)
    one = np.float32(1.0)
    acc = stack_f32(spec)
    accv = carray(acc, F)
    for u in range(u0, u1):
        if u + dist < u1:
            prefetch_row(base, cache, slots, uniq[uidx(u + dist)], nbytes)
            prefetch_slot(slots, uniq, u + 2 * dist, u1)
            _prefetch_grad(grad, ent_bag, starts, u + dist, gbytes)
        vzero(spec, acc)
        for q in range(starts[uidx(u)], starts[uidx(u + 1)]):
            vfma8(spec, acc, out_ptr(grad, ent_bag[uidx(q)]), ent_coef[uidx(q)] if has_coef else one)
        r = uniq[uidx(u)]
        if opt == GRADIENT:
            vcopy(spec, out_ptr(gout, u), acc)
            continue
        mult = lr32
        if opt == ADAGRAD:
            g2 = np.float32(0.0)
            for k in range(F):
                g2 += accv[k] * accv[k]
            st = state[uidx(r)] + g2 / np.float32(F)
            state[uidx(r)] = st
            mult = lr32 / (np.sqrt(st) + np.float32(eps))
        vfma8(spec, row_ptr(base, cache, slots, r), acc, -mult)


def update_chunk_any(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                     opt, lr, eps, state, gout, u0, u1, dist, heap):  # pragma: no cover
    """Compile-time choice between the SIMD and the generic update chunk."""
    raise NotImplementedError


@overload(update_chunk_any)
def _update_chunk_any(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                      opt, lr, eps, state, gout, u0, u1, dist, heap):
    f = update_chunk_simd if _simd(spec, base, codec) else update_chunk

    def impl(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
             opt, lr, eps, state, gout, u0, u1, dist, heap):
        f(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
          opt, lr, eps, state, gout, u0, u1, dist, heap)

    return impl


@njit(parallel=True, cache=True, fastmath=True)
def apply_update(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef, U,
                 opt, lr, eps, state, gout, dist, nthreads):
    """Parallel fused update over the first ``U`` unique rows of a plan."""
    F = base.shape[1]
    nc = nchunks_for(U, nthreads, 4)
    for c in prange(nc):
        heap = np.empty(F, np.float32)
        update_chunk_any(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                     opt, lr, eps, state, gout, c * U // nc, (c + 1) * U // nc, dist, heap)


@njit(cache=True, fastmath=True)
def apply_update_serial(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef, U,
                        opt, lr, eps, state, gout, dist):
    """:func:`apply_update` on the calling thread (small updates)."""
    heap = np.empty(base.shape[1], np.float32)
    update_chunk_any(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                     opt, lr, eps, state, gout, 0, U, dist, heap)


@njit(parallel=True, cache=True, fastmath=True)
def pullback_parts(spec, base, cache, slots, codec, grad, idx, offsets, weights, mean, rbits, dbits,
                   keys, tmp, hists, bagpos, coefpos, uniq, starts, ent_bag, ent_coef, opt, lr, eps, state,
                   dist, P):
    """Reindex and update in one parallel region, split by row range over ``P`` threads.

    Thread ``t`` builds the CSR of the rows it owns (:func:`~.reindex.reindex_part`, in row
    ``t`` of the buffers ``keys``/``tmp``/``hists``/``uniq``/``starts``/``ent_bag``/``ent_coef``)
    and at once applies the optimizer to those rows; no other thread touches them, so there is
    no lock and no barrier between the two phases. Returns nothing; ``opt`` is SGD or ADAGRAD.
    """
    F = base.shape[1]
    nogout = np.empty((0, 0), np.float32)
    for t in prange(P):
        U = reindex_part(idx, offsets, weights, mean, t, P, rbits, dbits, keys[t], tmp[t], hists[t],
                         bagpos, coefpos, uniq[t], starts[t], ent_bag[t], ent_coef[t])
        heap = np.empty(F, np.float32)
        update_chunk_any(spec, base, cache, slots, codec, grad, uniq[t], starts[t], ent_bag[t], ent_coef[t],
                         opt, lr, eps, state, nogout, 0, U, dist, heap)
