"""Backward pass: turn the output gradient into a table update, fused with the optimizer.

``pullback(table, grad, indices, offsets, optimizer=...)`` validates everything before it writes
(indices, offsets, gradient shape/dtype, finiteness), then reindexes the batch into a CSR of unique rows
by radix sort (:mod:`embeddings.kernels.reindex`) and runs the fused accumulate-and-apply kernel
(:mod:`embeddings.kernels.update`) in the ``Update`` context. Batches build one plan on the
calling thread (~6 ns per index) and update in parallel: one parallel region per call, which on
a shared machine (where every region may wait for a core) beat reindexing per thread. Only from
``config.PARALLEL_REINDEX_MIN`` indices do the threads reindex and update in one region, each
owning a range of rows.

Plain SGD on float32/float64 tables needs no unique rows: batches of up to ``config.OWNER_MAX``
indices are applied owner-computes (:mod:`embeddings.kernels.owner`), each thread adding the
contributions to the rows it owns in batch order. At 16384 single-index bags that halved the
update (the plan cost more than the update itself); at 655,360 indices it was 1.4-2x faster.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads

from .batch import Bags, make_bags
from .kernels import owner as O
from .kernels import update as U
from .kernels.checks import nonfinite_row
from .kernels.reindex import reindex_into, reindex_sort_serial, row_bits, sort_params, sortable
from .kernels.rowaccess import row_major, spec_for
from . import config
from .aligned import aligned_copy, rows_aligned
from .gpu import table_on_gpu
from .lookup import gpu_tables, prefetch_distance
from .optim import SGD, Optimizer, RowwiseAdagrad
from .protocol import UPDATE, EmbeddingTable

_scratch: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scratch_for(table: EmbeddingTable) -> np.ndarray:
    """The table's dense reindexing map (int32 per row, all -1 between calls), created on first
    use; only for tables too large for the radix sort's packed keys, and the ensemble."""
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


class Workspace:
    """Reusable reindexing buffers, one set per Python thread (:func:`workspace`).

    Fresh arrays of several MB would cost a page fault per 4 KiB on every call; these grow to the
    largest batch seen and are reused. Each call takes views of the sizes it needs.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type, fill: int | None = None) -> np.ndarray:
        """An array of ``shape`` (a view of a reused buffer). ``fill``: the value a new buffer is
        created with; callers that need it keep that invariant between calls (``head`` is -1)."""
        n = math.prod(shape)
        a = self._arrays.get(name)
        if a is None or a.size < n:
            a = np.empty(max(n, 1), dtype) if fill is None else np.full(max(n, 1), fill, dtype)
            self._arrays[name] = a
        return a[:n] if len(shape) == 1 else a[:n].reshape(shape)


_local = threading.local()


def workspace() -> Workspace:
    """The calling thread's :class:`Workspace`."""
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = Workspace()
    return ws


def sort_buffers(ws: Workspace, tag: str, nvec: int, bags: Bags) -> tuple:
    """The arguments of :func:`~.kernels.reindex.reindex_sort_serial` after the batch (``npass``,
    ``dbits``, ``first_use``, workspace and plan arrays), views of ``ws``'s buffers named ``tag``+...;
    the last four are the plan (``uniq``, ``starts``, ``bag``, ``coef``)."""
    L = bags.indices.size
    need_coef = bags.weights.size > 0 or bags.mean
    npass, dbits = sort_params(nvec)
    first_use = L <= config.FIRST_USE_MAX
    by_pos = first_use or bags.weights.size > 0

    def get(name: str, shape: tuple[int, ...], dtype: type, fill: int | None = None) -> np.ndarray:
        return ws.get(tag + name, shape, dtype, fill)

    return (npass, dbits, first_use, get("keys", (L,), np.int64), get("tmp", (L,), np.int64),
            get("hists", (npass, 1 << dbits), np.int64), get("bagpos", (L if by_pos else 0,), np.int32),
            get("coefpos", (L if by_pos and need_coef else 0,), np.float32),
            get("head", (L if first_use else 0,), np.int64, -1),
            get("uniq", (L,), np.int64), get("starts", (L + 1,), np.int64), get("bag", (L,), np.int32),
            get("coef", (L if need_coef else 0,), np.float32))


def make_plan(table: EmbeddingTable, bags: Bags) -> UpdatePlan:
    """Reindex a validated batch into an :class:`UpdatePlan` on the calling thread.

    Radix sort of the batch's (row, position) keys (:func:`~.kernels.reindex.reindex_sort_serial`):
    its cost depends on the batch only, never on the table size. Unique rows are in order of first
    use for batches of up to ``config.FIRST_USE_MAX`` indices, ascending otherwise. Tables too
    large for the packed key fall back to the dense per-table map of
    :func:`~.kernels.reindex.reindex_into`. The plan lives in this thread's :func:`workspace`:
    it is valid until the next ``make_plan`` on the same thread (copy what must outlive that).
    """
    L = bags.indices.size
    ws = workspace()
    nvec = table.nvectors()
    if not sortable(nvec, L):
        need_coef = bags.weights.size > 0 or bags.mean
        uniq, starts = ws.get("uniq", (L,), np.int64), ws.get("starts", (L + 1,), np.int64)
        ent_bag, ent_coef = ws.get("bag", (L,), np.int32), ws.get("coef", (L if need_coef else 0,), np.float32)
        n = reindex_into(bags.indices, bag_offsets(bags), bags.weights, bags.mean, scratch_for(table),
                         uniq, np.empty(L, np.int64), starts, ent_bag, ent_coef)
        return UpdatePlan(uniq[:n], starts[: n + 1], ent_bag, ent_coef)
    args = sort_buffers(ws, "", nvec, bags)
    n = reindex_sort_serial(bags.indices, bag_offsets(bags), bags.weights, bags.mean, *args)
    uniq, starts, ent_bag, ent_coef = args[-4:]
    return UpdatePlan(uniq[:n], starts[: n + 1], ent_bag, ent_coef)


def run_parts(table: EmbeddingTable, g: np.ndarray, bags: Bags, opt: int, lr: float, eps: float,
              state: np.ndarray, P: int) -> None:
    """Reindex and update in one parallel region, each of ``P`` threads owning a row range
    (:func:`~.kernels.update.pullback_parts`). The ``Update`` context gets the batch's indices."""
    L = bags.indices.size
    nvec = table.nvectors()
    npass, dbits = sort_params(nvec)
    weighted = bags.weights.size > 0
    need_coef = weighted or bags.mean
    ws = workspace()
    with table.rows(UPDATE, bags.indices, writable=True) as src:
        dist = prefetch_distance(src.base.shape[1] * src.base.itemsize)
        U.pullback_parts(spec_for(table.featuresize()), src.base, src.cache, src.slots, src.codec, row_major(g),
                         bags.indices, bag_offsets(bags), bags.weights, bags.mean, row_bits(nvec), dbits,
                         ws.get("pkeys", (P, L), np.int64), ws.get("ptmp", (P, L), np.int64),
                         ws.get("phists", (P, npass, 1 << dbits), np.int64),
                         ws.get("bagpos", (L if weighted else 0,), np.int32),
                         ws.get("coefpos", (L if weighted else 0,), np.float32),
                         ws.get("puniq", (P, L), np.int64), ws.get("pstarts", (P, L + 1), np.int64),
                         ws.get("pbag", (P, L), np.int32), ws.get("pcoef", (P, L if need_coef else 0), np.float32),
                         opt, lr, eps, state, dist, P)


def owner_segments(offsets: np.ndarray, most: int) -> list[tuple[int, int]]:
    """Split the bags into consecutive ranges ``(b0, b1)`` of at most ``most`` indices each (a
    bag larger than that is a range of its own), so owner-computes scratch stays bounded."""
    B = offsets.size - 1
    ranges, b0 = [], 0
    while b0 < B:
        b1 = int(np.searchsorted(offsets, offsets[b0] + most, side="right")) - 1
        b1 = min(max(b1, b0 + 1), B)
        ranges.append((b0, b1))
        b0 = b1
    return ranges


def run_owner(table: EmbeddingTable, g: np.ndarray, bags: Bags, lr: float, P: int) -> None:
    """SGD without an update plan (:mod:`~.kernels.owner`): each of ``P`` threads applies the
    batch positions of the rows it owns, in batch order, a segment of at most
    ``config.OWNER_SEGMENT`` indices at a time.

    ``g`` has not been checked for NaN/inf yet: the first segment's :func:`~.kernels.owner.prepare`
    checks all of it, and a bad gradient raises before the ``Update`` context (which a caching
    table uses to count accesses and mark rows dirty) is entered and before anything is written.
    """
    L = bags.indices.size
    F = table.featuresize()
    if config.serial(L * F):
        P = 1
    offsets = bag_offsets(bags)
    segments = owner_segments(offsets, config.OWNER_SEGMENT)
    width = max(int(offsets[b1] - offsets[b0]) for b0, b1 in segments)
    ws = workspace()
    pos, bag = ws.get("opos", (P, width), np.int32), ws.get("obag", (P, width), np.int32)
    counts, bad = ws.get("ocount", (P,), np.int64), ws.get("obad", (P,), np.int64)
    prepare, apply = (O.prepare_serial, O.apply_owned_serial) if P == 1 else (O.prepare, O.apply_owned)

    def prepare_segment(b0: int, b1: int, g1: int) -> None:
        prepare(bags.indices, offsets, b0, b1, g, 0, g1, table.nvectors(), pos, bag, counts, bad)

    prepare_segment(*segments[0], g.shape[0])
    rows = bad[bad >= 0]
    if rows.size:
        raise nonfinite_error(table, int(rows.min()))
    with table.rows(UPDATE, bags.indices, writable=True) as src:
        dist = prefetch_distance(src.base.shape[1] * src.base.itemsize)
        head = (spec_for(F), src.base, src.cache, src.slots, src.codec, row_major(g), bags.indices, offsets,
                bags.weights, bags.mean, lr)
        for i, (b0, b1) in enumerate(segments):
            if i > 0:
                prepare_segment(b0, b1, 0)
            apply(*head, b0, pos, bag, counts, dist)


def nonfinite_error(table: EmbeddingTable, row: int) -> FloatingPointError:
    """The error for a NaN or inf in output-gradient row ``row``."""
    return FloatingPointError(f"{table.name}: non-finite gradient in output row {row}; update refused, table unchanged")


def check_grad(grad: object, bags: Bags, table: EmbeddingTable, finite: bool = True) -> np.ndarray:
    """Validate the output gradient: float, shape (nout, featuresize), and finite unless
    ``finite`` is false (the caller then checks that itself, as :func:`run_owner` does)."""
    g = np.asarray(grad)
    if g.dtype.kind != "f":
        raise TypeError(f"{table.name}: gradient must be floating point, got {g.dtype}")
    if g.shape != (bags.nout, table.featuresize()):
        raise ValueError(f"{table.name}: gradient shape {g.shape}, expected {(bags.nout, table.featuresize())}")
    if g.dtype != np.float32:
        g = g.astype(np.float32)
    if g.ndim == 2 and g.strides[1] != g.itemsize:  # kernels read contiguous gradient rows
        g = np.ascontiguousarray(g)
    if finite and g.size:
        bad = nonfinite_row(g)
        if bad >= 0:
            raise nonfinite_error(table, bad)
    return g


def gathered_grad(g: np.ndarray, entries: int) -> np.ndarray:
    """The output gradient ((batch, featuresize), or an ensemble's (batch, tables, featuresize))
    as a plan-driven update reads it: ``g`` itself, or a copy on cache lines
    (:func:`~.aligned.aligned_copy`) when its rows are off their lines and the ``entries`` batch
    positions read each row more than once on average.

    The fused update gathers gradient rows in the order of the table rows they update, so a row
    16 bytes off a line touches one line more on every read (numpy puts a large ``np.ones_like``
    there; JAX and torch gradients start on a line). Row-wise Adagrad, 16384 bags of 8 or 40
    from 1M rows, F=16/64/256: 3-22% slower from such a gradient than from one on a line, 1-7%
    with the copy (medians of two noisy runs). Owner-computes SGD reads the gradient in batch
    order and ran the same either way; with one read per row a copy cannot pay."""
    nrows = math.prod(g.shape[:-1])
    if entries <= nrows:
        return g
    views = [g] if g.ndim == 2 else [g[:, i, :] for i in range(g.shape[1])]
    if all(rows_aligned(v) for v in views):
        return g
    return aligned_copy(g)


def run_update(table: EmbeddingTable, g: np.ndarray, plan: UpdatePlan, opt: int, lr: float,
               eps: float, state: np.ndarray, gout: np.ndarray) -> None:
    """Run the fused kernel for a plan in the Update context."""
    n = plan.uniq.size
    if n == 0 or table.featuresize() == 0:
        return
    with table.rows(UPDATE, plan.uniq, writable=(opt != U.GRADIENT)) as src:
        dist = prefetch_distance(src.base.shape[1] * src.base.itemsize)
        spec = spec_for(table.featuresize())
        g = row_major(g)
        if config.serial(plan.bag.size * table.featuresize()):
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
    if table_on_gpu(table) and gpu_tables.pullback(table, grad, indices, offsets, mode, weights,
                                                   optimizer) is not NotImplemented:
        return
    bags = make_bags(table.name, table.nvectors(), indices, offsets, weights, mode)
    L = bags.indices.size
    owner = (isinstance(optimizer, SGD) and 0 < L <= config.OWNER_MAX and table.featuresize() > 0
             and table.eltype() in (np.float32, np.float64))
    g = check_grad(grad, bags, table, finite=not owner)  # run_owner checks in its first region
    if L == 0 or table.featuresize() == 0:
        return
    P = get_num_threads()
    opt, lr, eps, state = optimizer.code, float(optimizer.lr), float(optimizer.eps), optimizer.state(table)
    if owner:
        run_owner(table, g, bags, lr, P)
    elif P > 1 and L >= config.PARALLEL_REINDEX_MIN and sortable(table.nvectors(), L):
        run_parts(table, gathered_grad(g, L), bags, opt, lr, eps, state, P)
    else:
        run_update(table, gathered_grad(g, L), make_plan(table, bags), opt, lr, eps, state, _NO_GOUT)


def sparse_gradient(table: EmbeddingTable, grad: object, indices: object, offsets: object | None = None,
                    *, mode: str | None = None, weights: object | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The table gradient in sparse form ``(rows, values)``: unique rows, in order of first use
    for batches of up to ``config.FIRST_USE_MAX`` indices and ascending otherwise.

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
