"""Host references of the CUDA kernels, with the same arithmetic in the same order.

* :func:`pooled_into`: a JAX Pallas kernel (one program; a loop over bags, each summing its rows
  one by one in index order, ``acc += r`` or ``acc += w * r``; mean as a multiply by ``1 / n``:
  the numba kernels' order as compiled), run with ``interpret=True`` so it
  runs on a CPU. It is the form of the lookup that CI checks against the numba kernels bit for
  bit (unweighted) and that the CUDA kernel transcribes.
* :func:`update`: a numpy transcription of the CUDA update kernel (per unique row: accumulate
  its entries in batch order, then SGD or row-wise Adagrad).
"""

from __future__ import annotations

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
    idx = idx if idx.size else np.zeros(1, idx.dtype)
    w = np.ones(1, np.float32) if weights is None or weights.size == 0 else np.asarray(weights, np.float32)
    f = _pooled_call(B, F, weights is not None and weights.size > 0, bool(mean))
    return np.asarray(f(np.asarray(W, np.float32), idx, np.asarray(offsets, np.int64), w))


def pooled_into(out, W, idx, off, k, w, mean) -> None:
    """The :class:`~.backend.ReferenceBackend` lookup: bags from ``off`` or of fixed width ``k``."""
    B = out.shape[0]
    offsets = off if off is not None else np.arange(B + 1, dtype=np.int64) * k
    out[...] = pooled(W, idx, offsets, w, mean)


def update(W, state, grad, keys, pbits, starts, U, off, B, k, w, mean, opt, lr, eps) -> None:
    """The CUDA update kernel, unique row by unique row (small inputs only: a Python loop)."""
    F = W.shape[1]
    mask = (1 << pbits) - 1
    lr32, eps32 = np.float32(lr), np.float32(eps)
    offsets = off if off is not None else np.arange(B + 1, dtype=np.int64) * k
    for u in range(U):
        q0, q1 = int(starts[u]), int(starts[u + 1])
        r = int(keys[q0]) >> pbits
        acc = np.zeros(F, np.float32)
        for q in range(q0, q1):
            p = int(keys[q]) & mask
            b = int(np.searchsorted(offsets, p, side="right")) - 1
            if w is not None or mean:
                coef = np.float32(1.0)
                if mean:
                    coef = np.float32(1.0) / np.float32(offsets[b + 1] - offsets[b])
                if w is not None:
                    coef = np.float32(w[p]) * coef if mean else np.float32(w[p])
                acc += coef * grad[b]
            else:
                acc += grad[b]
        mult = lr32
        if opt == 1:
            st = np.float32(state[r] + np.float32(np.dot(acc, acc)) / np.float32(F))
            state[r] = st
            mult = lr32 / (np.sqrt(st) + eps32)
        W[r] = W[r] - np.float32(mult) * acc
