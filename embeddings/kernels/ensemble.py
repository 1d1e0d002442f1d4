"""Ensemble kernels: many tables in one parallel region (dissertation section 5.2.3).

Work items are (table, chunk of the batch) pairs, so the threads balance across tables and
within a table. Per-table arrays travel as homogeneous tuples (numba indexes them with a run-time
table number); ``caches``/``slotss`` are tuples or ``None`` for tables without indirection. The
chunk functions are the single-table ones, so row access specialises the same way (and a
caching table's hits are counted the same way, see ``rowaccess.record_hits``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .lookup import gather_chunk_any, pooled_chunk_any
from .update import update_chunk_any


def pick(xs, t):  # pragma: no cover - numba only
    """``xs[t]``, or ``None`` when ``xs`` is ``None``."""
    raise NotImplementedError


@overload(pick, inline="always")
def _pick(xs, t):
    if isinstance(xs, types.NoneType):
        return lambda xs, t: None
    return lambda xs, t: xs[t]


@njit(cache=True)
def _chunks(T, B, nthreads):
    c = (nthreads * 4 + T - 1) // T
    return max(1, min(c, B))


@njit(parallel=True, cache=True, fastmath=True)
def ensemble_gather(spec, out3, bases, caches, slotss, codec, idxs, dist, nthreads):
    """out3[i, t] = row_t(idxs[t][i]) for every table t."""
    T = len(bases)
    B = out3.shape[0]
    C = _chunks(T, B, nthreads)
    for it in prange(T * C):
        t = it // C
        c = it % C
        gather_chunk_any(spec, out3[:, t, :], bases[t], pick(caches, t), pick(slotss, t), codec,
                     idxs[t], c * B // C, (c + 1) * B // C, dist, False)


@njit(parallel=True, cache=True, fastmath=True)
def ensemble_pooled(spec, out3, bases, caches, slotss, codec, idxs, offss, ws, mean, dist, nthreads):
    """out3[b, t] = pooled bag b of table t for every table t."""
    T = len(bases)
    B = out3.shape[0]
    F = out3.shape[2]
    C = _chunks(T, B, nthreads)
    for it in prange(T * C):
        t = it // C
        c = it % C
        acc = np.empty(F, np.float32)
        pooled_chunk_any(spec, out3[:, t, :], bases[t], pick(caches, t), pick(slotss, t), codec,
                     idxs[t], offss[t], ws[t], mean, c * B // C, (c + 1) * B // C, dist, acc)


@njit(parallel=True, cache=True, fastmath=True)
def ensemble_update(spec, bases, caches, slotss, codec, grad3, uniqs, startss, ent_bags, ent_coefs,
                    Us, opt, lr, eps, states, gout, dist, nthreads):
    """Fused optimizer step for every table's update plan (``Us[t]`` unique rows each)."""
    T = len(bases)
    F = grad3.shape[2]
    C = _chunks(T, 1 << 30, nthreads)
    for it in prange(T * C):
        t = it // C
        c = it % C
        U = Us[t]
        heap = np.empty(F, np.float32)
        update_chunk_any(spec, bases[t], pick(caches, t), pick(slotss, t), codec, grad3[:, t, :],
                     uniqs[t], startss[t], ent_bags[t], ent_coefs[t], opt, lr, eps, states[t], gout,
                     c * U // C, (c + 1) * U // C, dist, heap)
