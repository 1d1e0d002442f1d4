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
from numba import njit, prange

from .codecs import load, store
from .lookup import nchunks_for
from .rowaccess import featuresize, prefetch_row, row_of

SGD = 0
ADAGRAD = 1
GRADIENT = 2


@njit(cache=True, fastmath=True)
def update_chunk(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                 opt, lr, eps, state, gout, u0, u1, dist, acc):
    """Apply the optimizer to unique rows ``uniq[u0:u1]``."""
    F = featuresize(spec, base)
    nbytes = F * base.itemsize
    has_coef = ent_coef.size > 0
    lr32 = np.float32(lr)
    for u in range(u0, u1):
        if u + dist < u1:
            prefetch_row(base, cache, slots, uniq[u + dist], nbytes)
        for k in range(F):
            acc[k] = 0.0
        for q in range(starts[u], starts[u + 1]):
            g = grad[ent_bag[q]]
            if has_coef:
                c = ent_coef[q]
                for k in range(F):
                    acc[k] += c * g[k]
            else:
                for k in range(F):
                    acc[k] += g[k]
        r = uniq[u]
        if opt == GRADIENT:
            o = gout[u]
            for k in range(F):
                o[k] = acc[k]
            continue
        row = row_of(base, cache, slots, r)
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


@njit(parallel=True, cache=True, fastmath=True)
def apply_update(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef, U,
                 opt, lr, eps, state, gout, dist, nthreads):
    """Parallel fused update over the first ``U`` unique rows of a plan."""
    F = base.shape[1]
    nc = nchunks_for(U, nthreads, 4)
    for c in prange(nc):
        acc = np.empty(F, np.float32)
        update_chunk(spec, base, cache, slots, codec, grad, uniq, starts, ent_bag, ent_coef,
                     opt, lr, eps, state, gout, c * U // nc, (c + 1) * U // nc, dist, acc)
