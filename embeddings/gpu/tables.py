"""Table-level entry points of the GPU path: a table's data as a CuPy array for one call.

A CachedArray is pinned (``readable`` for lookups, ``writable`` for updates) while its kernels
are queued; releasing the view records the work on CuPy's stream, so the region is not moved
or reused under it. If the policy moved the array to a host level when it was pinned, the call
returns ``NotImplemented`` and the caller runs the CPU kernels instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from cachedarrays import CachedArray, readable, writable

from ..batch import make_bags
from ..optim import RowwiseAdagrad
from . import cached, ops, update_graph
from .backend import cuda_backend
from .handoff import to_jax


@contextmanager
def device_rows(data: Any, write: bool) -> Iterator[Any]:
    """A CuPy array of the table's rows for one call, or None if they are on the host now."""
    if isinstance(data, CachedArray):
        view = (writable if write else readable)(data)
        try:
            arr = view.array
            yield None if isinstance(arr, np.ndarray) else arr
        finally:
            view.release()
        return
    yield cuda_backend().asarray(data)


def _cached(table: Any) -> bool:
    """A GPU cached table (:mod:`.cached` or :mod:`.lru`): batches resolve to its slots."""
    return getattr(table, "gpu_cache", False)


def lookup(table: Any, indices: Any, offsets: Any, mode: str | None, weights: Any, out: Any = None) -> Any:
    """``lookup`` / ``lookup_into`` of a SimpleEmbedding on a GPU (``NotImplemented``: on the host
    now) or of a GPU CachedEmbeddings."""
    if _cached(table):
        result = cached.lookup(table, indices, offsets, mode, weights, out)
        return result if out is not None or isinstance(result, np.ndarray) else to_jax(result)
    be = cuda_backend()
    if type(table.data) is be.xp.ndarray:  # nothing to pin: the common case without a context manager
        return ops.lookup(be, table.name, table.data, indices, offsets, mode=mode, weights=weights, out=out,
                          wrap=to_jax)
    with device_rows(table.data, write=False) as W:
        if W is None:
            return NotImplemented
        return ops.lookup(be, table.name, W, indices, offsets, mode=mode, weights=weights, out=out, wrap=to_jax)


def state_for(optimizer: Any, table: Any) -> Any:
    """The row-wise Adagrad accumulator of ``table`` on the device (None for SGD)."""
    if not isinstance(optimizer, RowwiseAdagrad):
        return None
    return optimizer.device_state(table, lambda n, v: cuda_backend().xp.full(n, v, np.float32))


def prepare(table: Any, grad: Any, indices: Any, offsets: Any, mode: str | None, weights: Any,
            optimizer: Any, flags: Any = None, slot: int = 0) -> ops.PreparedUpdate:
    """Validate a table's update (nothing written yet; device checks in flight in ``flags``)."""
    if table.eltype() != np.float32:
        raise TypeError(f"{table.name}: GPU tables must be float32, not {table.eltype()}")
    return ops.prepare_pullback(cuda_backend(), table.name, table.nvectors(), table.featuresize(), grad, indices,
                                offsets, mode=mode, weights=weights, optimizer=optimizer, flags=flags, slot=slot)


def apply(table: Any, prep: ops.PreparedUpdate, optimizer: Any, plan: Any = None) -> Any:
    """Run a prepared update in place, by ``plan`` when given (``NotImplemented``: the rows are
    on the host now)."""
    be = cuda_backend()
    if type(table.data) is be.xp.ndarray:  # nothing to pin
        ops.apply_pullback(be, table.data, state_for(optimizer, table), prep, optimizer, plan)
        return None
    with device_rows(table.data, write=True) as W:
        if W is None:
            return NotImplemented
        ops.apply_pullback(be, W, state_for(optimizer, table), prep, optimizer, plan)
    return None


def pullback(table: Any, grad: Any, indices: Any, offsets: Any, mode: str | None, weights: Any,
             optimizer: Any) -> Any:
    """``pullback`` of a SimpleEmbedding on a GPU (``NotImplemented``: on the host now) or of a
    GPU CachedEmbeddings."""
    if _cached(table):
        return cached.pullback(table, grad, indices, offsets, mode, weights, optimizer)
    return apply(table, prepare(table, grad, indices, offsets, mode, weights, optimizer), optimizer)


def _per_table(T: int, indices, offsets, weights) -> tuple[list, list]:
    """Offsets and weights as one entry per table (None where not given), checked against ``indices``."""
    offsets = [None] * T if offsets is None else list(offsets)
    weights = [None] * T if weights is None else list(weights)
    if not (len(indices) == len(offsets) == len(weights) == T):
        raise ValueError(f"need one index array (and offsets, weights) per table: {T} tables")
    return offsets, weights


def ensemble_lookup(tables: list, indices, offsets, mode, weights, out: Any = None) -> Any:
    """Every table into ``(batch, tables, featuresize)``. Host batches are validated before any
    kernel runs; device batches are checked by the kernels (a new output) or before them (``out``),
    and every table's error is raised in table order before the result is returned."""
    if any(_cached(t) for t in tables):
        return _ensemble_lookup_per_table(tables, indices, offsets, mode, weights, out)
    be = cuda_backend()
    T = len(tables)
    offsets, weights = _per_table(T, indices, offsets, weights)
    flags = be.flags(3 * T)
    fresh = out is None
    checked = [ops.device_bags(be, t.name, t.nvectors(), i, o, w, mode, flags=flags, slot=3 * n, fused=fresh)
               for n, (t, i, o, w) in enumerate(zip(tables, indices, offsets, weights))]
    bags = [b for b, _, _ in checked]
    pending = [p for _, _, p in checked]
    _same_batch([b.nout for b in bags])
    F = tables[0].featuresize()
    shape = (bags[0].nout, T, F)
    if fresh:
        res = be.xp.empty(shape, np.float32)
    else:
        ops.check_out(be, out, shape, "ensemble")
        ops.confirm(be, pending)
        res = out
    for i, (t, b, p) in enumerate(zip(tables, bags, pending)):
        with device_rows(t.data, write=False) as W:
            if W is None:
                raise RuntimeError(f"{t.name}: moved off the GPU during an ensemble lookup")
            ops.check_table(t.name, W)
            ops.run_pooled(be, res[:, i, :], W, b, flags if fresh and p is not None else None, 3 * i)
    return ops.handed(be, res, pending, to_jax) if fresh else res


def _ensemble_lookup_per_table(tables: list, indices, offsets, mode, weights, out: Any) -> Any:
    """An ensemble with GPU cached tables: every batch validated, then one lookup per table,
    each into its column of the one output."""
    T = len(tables)
    offsets, weights = _per_table(T, indices, offsets, weights)
    bags = [t.validate(i, o, w, mode) if _cached(t) else make_bags(t.name, t.nvectors(), i, o, w, mode)
            for t, i, o, w in zip(tables, indices, offsets, weights)]
    _same_batch([b.nout for b in bags])
    be = next(t.backend for t in tables if _cached(t))
    shape = (bags[0].nout, T, tables[0].featuresize())
    if out is None:
        res = be.xp.empty(shape, np.float32)
    else:
        ops.check_out(be, out, shape, "ensemble")
        res = out
    for n, (t, i, o, w, b) in enumerate(zip(tables, indices, offsets, weights, bags)):
        if _cached(t):
            cached.lookup(t, i, o, mode, w, out=res[:, n, :], bags=b)
        else:
            res[:, n, :] = _raw_lookup(t, i, o, mode, w)
    return res if out is not None or isinstance(res, np.ndarray) else to_jax(res)


def _raw_lookup(table: Any, indices, offsets, mode, weights) -> Any:
    """A SimpleEmbedding on the GPU's lookup as a CuPy array."""
    with device_rows(table.data, write=False) as W:
        if W is None:
            raise RuntimeError(f"{table.name}: moved off the GPU during an ensemble lookup")
        return ops.lookup(cuda_backend(), table.name, W, indices, offsets, mode=mode, weights=weights)


def ensemble_pullback(tables: list, grad: Any, indices, offsets, mode, weights, optimizer) -> None:
    """Every table's update; all validated (indices, the gradient's shape, its finiteness on the
    device with one wait for all tables) before any table changes. A GPU cached table resolves
    its batch to its slots (its lookup's resolution, when it was of these very arguments)."""
    T = len(tables)
    offsets, weights = _per_table(T, indices, offsets, weights)
    ops.check_optimizer(optimizer)
    be = next((t.backend for t in tables if _cached(t)), None) or cuda_backend()
    g3 = be.asarray(grad)
    F = tables[0].featuresize()
    if g3.ndim != 3 or tuple(g3.shape[1:]) != (T, F):
        raise ValueError(f"ensemble gradient shape {tuple(g3.shape)}, expected (batch, {T}, {F})")
    flags = be.flags(3 * T)
    preps = [(cached.prepare(t, g3[:, n, :], i, o, mode, w, flags, 3 * n) if _cached(t)
              else prepare(t, g3[:, n, :], i, o, mode, w, optimizer, flags, 3 * n))
             for n, (t, i, o, w) in enumerate(zip(tables, indices, offsets, weights))]
    ops.confirm(be, [p.pending for p in preps])
    preps = [replace(p, pending=None) for p in preps]  # confirmed
    # Every table planned at once (one sort). A cached table resolves its batch first (its
    # lookup's resolution); one given twice resolves and plans each batch just before its update,
    # since resolving the second may move the first's rows.
    once = [not _cached(t) or sum(u is t for u in tables) == 1 for t in tables]
    preps = [cached.resolved(t, p) if _cached(t) and o else p for t, p, o in zip(tables, preps, once)]
    if update_graph.eligible(tables, g3, preps, F):  # lru tables: the rest as one CUDA graph
        update_graph.run(be, tables, g3, preps, optimizer, F)
        return
    ready = [n for n, (p, o) in enumerate(zip(preps, once)) if o and ops.needs_plan(p, F, optimizer)]
    plans = dict(zip(ready, ops.plans(be, [preps[n].bags.idx for n in ready], F)))
    for n, (t, p, o) in enumerate(zip(tables, preps, once)):
        if _cached(t):
            cached.run(t, p if o else cached.resolved(t, p), optimizer, plans.get(n))
        elif apply(t, p, optimizer, plans.get(n)) is NotImplemented:
            raise RuntimeError(f"{t.name}: moved off the GPU during an ensemble update")


def _same_batch(n: list[int]) -> None:
    if len(set(n)) != 1:
        raise ValueError(f"all tables must produce the same batch size, got {sorted(set(n))}")
