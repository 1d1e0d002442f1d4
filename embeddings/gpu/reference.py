"""Host references of the CUDA kernels, with the same arithmetic in the same order.

* :func:`pooled_into`: a JAX Pallas kernel (one program; a loop over bags, each summing its rows
  one by one in index order, ``acc += r`` or ``acc += w * r``; mean as a multiply by ``1 / n``:
  the numba kernels' order as compiled), run with ``interpret=True`` so it
  runs on a CPU. It is the form of the lookup that CI checks against the numba kernels bit for
  bit (unweighted) and that the CUDA kernel transcribes.
* :func:`update`: a numpy transcription of the CUDA update kernels, rounding for rounding (per
  unique row: its entries in batch order, long rows in chunks of :func:`chunk_len` whose sums
  are added in chunk order; then SGD or row-wise Adagrad); :func:`sgd_any`, the any-order SGD
  update with its entries applied one by one in batch order.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=32)
def _pooled_call(B: int, F: int, weighted: bool, mean: bool):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    def kernel(W_ref, idx_ref, off_ref, w_ref, o_ref):
        def row(j):
            return W_ref[pl.ds(idx_ref[j], 1), :]

        def bag(b, carry):
            s = off_ref[b]
            e = off_ref[b + 1]
            acc = jnp.zeros((1, F), jnp.float32)
            if weighted:
                acc = lax.fori_loop(s, e, lambda j, a: a + w_ref[j] * row(j), acc)
            else:
                acc = lax.fori_loop(s, e, lambda j, a: a + row(j), acc)
            if mean:
                n = (e - s).astype(jnp.float32)
                acc = acc * jnp.where(e > s, jnp.float32(1.0) / jnp.maximum(n, jnp.float32(1.0)), jnp.float32(1.0))
            o_ref[pl.ds(b, 1), :] = acc
            return carry

        lax.fori_loop(0, B, bag, 0)

    return jax.jit(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((B, F), jnp.float32), interpret=True))


def pooled(W: np.ndarray, idx: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None,
           mean: bool) -> np.ndarray:
    """Pooled lookup of CSR bags (``offsets``: nbags + 1 entries) by the Pallas kernel; validated input."""
    B = offsets.size - 1
    F = W.shape[1]
    if B == 0 or F == 0:
        return np.zeros((B, F), np.float32)
    idx = np.asarray(idx).reshape(-1)
    weighted = weights is not None and weights.size > 0
    nb = bucket(B)
    f = _pooled_call(nb, F, weighted, bool(mean))
    out = f(padded(np.asarray(W, np.float32), bucket(W.shape[0]), 0),
            padded(idx.astype(np.int64, copy=False), bucket(idx.size), 0),
            padded(np.asarray(offsets, np.int64), nb + 1, offsets[-1]),
            padded(np.asarray(weights, np.float32) if weighted else np.ones(1, np.float32), bucket(idx.size), 0))
    return np.asarray(out)[:B]


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 8), or past 65536 to a multiple of an eighth
    of one. The jitted kernel is compiled for each shape of its arguments (about 0.3 s a
    compile); rounded shapes leave few to compile, for at most an eighth more memory."""
    if n <= 65536:
        return max(8, 1 << (n - 1).bit_length())
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def padded(a: np.ndarray, n: int, fill) -> np.ndarray:
    """``a`` with its first dimension extended to ``n`` with ``fill``: the kernel reads only the
    entries the offsets name, and the extra bags are empty."""
    if n == a.shape[0]:
        return a
    out = np.empty((n,) + a.shape[1:], a.dtype)
    out[:a.shape[0]] = a
    out[a.shape[0]:] = fill
    return out


def pooled_into(out, W, idx, off, k, w, mean) -> None:
    """The :class:`~.backend.ReferenceBackend` lookup: bags from ``off`` or of fixed width ``k``."""
    B = out.shape[0]
    offsets = off if off is not None else np.arange(B + 1, dtype=np.int64) * k
    out[...] = pooled(W, idx, offsets, w, mean)


CHUNK = 32  # a row with more entries than this is summed in chunks (see chunk_len)


def chunk_len(n: int, C: int = CHUNK) -> int:
    """Entries per chunk of a row of ``n > C`` entries: ``max(C, ceil(sqrt(n)))``, so both the
    chunk sums and their combination take O(sqrt(n)) sequential adds."""
    return max(C, math.isqrt(n - 1) + 1)


def update(W, state, grad, perm, srow, off, B, k, w, mean, opt, lr, eps, vec: int) -> None:
    """The CUDA update kernels, row by row (small inputs only: a Python loop).

    Each run ``q0:q1`` of equal ``srow`` (row ``r``) gets the gradient rows of its entries
    ``perm[q0:q1]`` summed in order (``acc + g``, or ``acc + coef * g`` with two roundings), a row
    of more than :data:`CHUNK` entries chunk by chunk with the chunk sums added in order; then
    ``row - mult * acc``. Row-wise Adagrad sums squares as the kernel's thread group does: ``vec``
    floats per thread chunk (4 or 1), thread ``t`` of ``G`` takes chunks ``t, t + G, ...``, then a
    butterfly."""
    F = W.shape[1]
    perm = np.asarray(perm, np.int64)
    L = perm.size
    bag, coef = _entries(perm, off, B, k, w, mean)
    scaled = coef is not None
    lr32, eps32 = np.float32(lr), np.float32(eps)

    def run(q0: int, q1: int) -> np.ndarray:
        acc = np.zeros(F, np.float32)
        for q in range(q0, q1):
            acc = acc + coef[q] * grad[bag[q]] if scaled else acc + grad[bag[q]]
        return acc

    heads = np.flatnonzero(np.concatenate(([True], srow[1:] != srow[:-1]))) if L else np.zeros(0, np.int64)
    for q0, q1 in zip(heads, np.append(heads[1:], L)):
        q0, q1 = int(q0), int(q1)
        r = int(srow[q0])
        if q1 - q0 <= CHUNK:
            acc = run(q0, q1)
        else:
            cl = chunk_len(q1 - q0)
            acc = np.zeros(F, np.float32)
            for a in range(q0, q1, cl):
                acc = acc + run(a, min(a + cl, q1))
        mult = lr32
        if opt == 1:
            st = np.float32(state[r] + _sumsq(acc, vec) / np.float32(F))
            state[r] = st
            mult = lr32 / (np.sqrt(st) + eps32)
        W[r] = W[r] - np.float32(mult) * acc


def sgd_any(W, grad, idx, off, B, k, w, mean, lr) -> None:
    """The any-order SGD update in one of its orders: entry ``q`` of bag ``b`` subtracts
    ``lr * (coef_q * grad[b])`` (``coef``: the weight, times ``1 / n`` for mean; two roundings)
    from its row, one entry after another in batch order. The kernel first sums a row's entries
    within a tile of the batch; a row with one entry rounds the same either way."""
    idx = np.asarray(idx).reshape(-1)
    bag, coef = _entries(np.arange(idx.size), off, B, k, w, mean)
    g = np.asarray(grad, np.float32)[bag]
    if coef is not None:
        g = coef[:, None] * g
    np.subtract.at(W, idx, np.float32(lr) * g)


def _entries(positions, off, B, k, w, mean) -> tuple[np.ndarray, np.ndarray | None]:
    """The bag of each batch position in ``positions`` (bags from ``off`` or of width ``k``) and
    the coefficient of its gradient row, as the kernels round it (``w``; ``1 / n`` for mean;
    ``w * (1 / n)``), or None where every coefficient is 1."""
    offsets = off if off is not None else np.arange(B + 1, dtype=np.int64) * k
    bag = np.searchsorted(offsets, positions, side="right") - 1
    if w is None and not mean:
        return bag, None
    coef = np.ones(len(positions), np.float32)
    if mean:
        coef = np.float32(1.0) / (offsets[bag + 1] - offsets[bag]).astype(np.float32)
    if w is not None:
        wp = np.asarray(w, np.float32).reshape(-1)[positions]
        coef = wp * coef if mean else wp
    return bag, coef


def lanes(F: int, vec: int) -> int:
    """Threads per row of the update kernels (a power of two of at most 32): :func:`.cuda.group`."""
    from .cuda import group
    return group(F // vec, pow2=True)[0]


def _sumsq(acc: np.ndarray, vec: int) -> np.float32:
    """Sum of squares of ``acc`` in the kernel's order (per-thread sums, then an xor butterfly)."""
    FT = acc.size // vec
    sq = acc.reshape(FT, vec) * acc.reshape(FT, vec)
    chunk = sq[:, 0]
    for i in range(1, vec):
        chunk = chunk + sq[:, i]
    G = lanes(acc.size, vec)
    part = np.zeros(G, np.float32)
    for c in range(FT):
        part[c % G] = part[c % G] + chunk[c]
    o = G // 2
    while o:
        part = part + part[np.arange(G) ^ o]
        o //= 2
    return part[0]
