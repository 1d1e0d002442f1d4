"""Backward pass: turn the output gradient into a table update, fused with the optimizer.

``pullback(table, grad, indices, offsets, optimizer=...)`` validates everything first (indices,
offsets, gradient shape/dtype, finiteness), then builds the CSR update plan by reindexing
(:mod:`embeddings.kernels.reindex`) and runs the fused accumulate-and-apply kernel
(:mod:`embeddings.kernels.update`) in the ``Update`` context.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads

from .batch import Bags, make_bags
from .kernels import update as U
from .kernels.checks import nonfinite_row
from .kernels.reindex import plan_arrays, reindex_into, reindex_parallel
from .kernels.rowaccess import spec_for
from . import config
from .lookup import prefetch_distance
from .optim import SGD, Optimizer, RowwiseAdagrad
from .protocol import UPDATE, EmbeddingTable

_scratch: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scratch_for(table: EmbeddingTable) -> np.ndarray:
    """The table's reindexing map (int32 per row, all -1 between calls), created on first use."""
    s = _scratch.get(table)
    if s is None or s.size != table.nvectors():
        s = np.full(table.nvectors(), -1, np.int32)
        _scratch[table] = s
    return s


@dataclass(frozen=True)
class UpdatePlan:
    """CSR of unique rows: row ``uniq[u]`` gets ``sum(coef[q] * grad[bag[q]])`` over
    ``q in starts[u]:starts[u+1]`` (``coef`` empty means all ones)."""

    uniq: np.ndarray
    starts: np.ndarray
    bag: np.ndarray
    coef: np.ndarray


def bag_offsets(bags: Bags) -> np.ndarray:
    """CSR offsets of a batch; a non-reducing batch is one bag per index."""
    if bags.offsets is not None:
        return bags.offsets
    return np.arange(bags.indices.size + 1, dtype=np.int64)


def make_plan(table: EmbeddingTable, bags: Bags) -> UpdatePlan:
    """Reindex a validated batch into an :class:`UpdatePlan`."""
    L = bags.indices.size
    uniq, counts, starts, ent_bag, ent_coef = plan_arrays(L, bags.weights.size > 0 or bags.mean)
    P = get_num_threads()
    if P > 1 and L >= config.PARALLEL_REINDEX_MIN:
        n = reindex_parallel(bags.indices, bag_offsets(bags), bags.weights, bags.mean, scratch_for(table),
                             P, uniq, counts, starts, ent_bag, ent_coef, np.empty(L, np.int64))
    else:
        n = reindex_into(bags.indices, bag_offsets(bags), bags.weights, bags.mean, scratch_for(table),
                         uniq, counts, starts, ent_bag, ent_coef)
    return UpdatePlan(uniq[:n], starts[: n + 1], ent_bag, ent_coef)


def check_grad(grad: object, bags: Bags, table: EmbeddingTable) -> np.ndarray:
    """Validate the output gradient: float, shape (nout, featuresize), finite."""
    g = np.asarray(grad)
    if g.dtype.kind != "f":
        raise TypeError(f"{table.name}: gradient must be floating point, got {g.dtype}")
    if g.shape != (bags.nout, table.featuresize()):
        raise ValueError(f"{table.name}: gradient shape {g.shape}, expected {(bags.nout, table.featuresize())}")
    if g.dtype != np.float32:
        g = g.astype(np.float32)
    if g.ndim == 2 and g.strides[1] != g.itemsize:  # kernels read contiguous gradient rows
        g = np.ascontiguousarray(g)
    if g.size:
        bad = nonfinite_row(g)
        if bad >= 0:
            raise FloatingPointError(f"{table.name}: non-finite gradient in output row {bad}; "
                                     "update refused, table unchanged")
    return g


def run_update(table: EmbeddingTable, g: np.ndarray, plan: UpdatePlan, opt: int, lr: float,
               eps: float, state: np.ndarray, gout: np.ndarray) -> None:
    """Run the fused kernel for a plan in the Update context."""
    n = plan.uniq.size
    if n == 0 or table.featuresize() == 0:
        return
    with table.rows(UPDATE, plan.uniq, writable=(opt != U.GRADIENT)) as src:
        dist = prefetch_distance(src.base.shape[1] * src.base.itemsize)
        spec = spec_for(table.featuresize())
        if plan.bag.size * table.featuresize() < config.SERIAL_WORK or get_num_threads() == 1:
            U.apply_update_serial(spec, src.base, src.cache, src.slots, src.codec, g, plan.uniq,
                                  plan.starts, plan.bag, plan.coef, n, opt, lr, eps, state, gout, dist)
        else:
            U.apply_update(spec, src.base, src.cache, src.slots, src.codec, g, plan.uniq, plan.starts,
                           plan.bag, plan.coef, n, opt, lr, eps, state, gout, dist, get_num_threads())


def pullback(table: EmbeddingTable, grad: object, indices: object, offsets: object | None = None,
             *, mode: str | None = None, weights: object | None = None,
             optimizer: Optimizer) -> None:
    """Apply ``optimizer`` to ``table`` given ``grad``, the gradient of the lookup's output.

    ``indices``/``offsets``/``mode``/``weights`` are those of the forward :func:`lookup`.
    Raises before anything is written: ``IndexError``/``ValueError``/``TypeError`` as lookup, and
    ``FloatingPointError`` for a NaN or inf in ``grad``.
    """
    if not isinstance(optimizer, (SGD, RowwiseAdagrad)):
        raise TypeError(f"unsupported optimizer {optimizer!r}")
    if not np.isfinite(optimizer.lr):
        raise ValueError(f"learning rate must be finite, got {optimizer.lr}")
    bags = make_bags(table.name, table.nvectors(), indices, offsets, weights, mode)
    g = check_grad(grad, bags, table)
    plan = make_plan(table, bags)
    run_update(table, g, plan, optimizer.code, float(optimizer.lr), float(optimizer.eps),
               optimizer.state(table), _NO_GOUT)


def sparse_gradient(table: EmbeddingTable, grad: object, indices: object, offsets: object | None = None,
                    *, mode: str | None = None, weights: object | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The table gradient in sparse form ``(rows, values)``, unique rows in order of first use.

    Same reindexing and accumulation as :func:`pullback`, without applying an optimizer; for
    inspection and tests (training uses the fused path).
    """
    bags = make_bags(table.name, table.nvectors(), indices, offsets, weights, mode)
    g = check_grad(grad, bags, table)
    plan = make_plan(table, bags)
    gout = np.zeros((plan.uniq.size, table.featuresize()), np.float32)
    run_update(table, g, plan, U.GRADIENT, 0.0, 0.0, _NO_STATE, gout)
    return plan.uniq.copy(), gout


_NO_GOUT = np.empty((0, 0), np.float32)
_NO_STATE = np.empty(0, np.float32)
