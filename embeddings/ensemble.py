"""``Ensemble``: lookup and update of many tables at once into one (batch, tables, featuresize) array.

All tables must share the feature size and storage type (that is what lets one compiled kernel
serve them all); the output is written in place, so ``out`` can be a reshaped slice of the
DLRM interaction input. Per-table validation happens before any kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import numpy as np
from numba import get_num_threads

from . import config
from .aligned import aligned_empty
from .batch import Bags, make_bags
from .kernels import ensemble as K
from .kernels.reindex import plan_arrays, reindex_many, reindex_sort_many, sortable
from .kernels.rowaccess import entries, spec_for
from .gpu import table_on_gpu
from .lookup import gpu_tables, prefetch_distance, run_lookup
from .optim import SGD, Optimizer, RowwiseAdagrad
from .protocol import FORWARD, UPDATE, EmbeddingTable, RowSource
from .pullback import (bag_offsets, check_grad, gathered_grad, make_plan, run_update, scratch_for, sort_buffers,
                       workspace)

_MAX_TABLES = 64  # numba unpacks tuples into parallel regions only up to ~100 entries


class Ensemble:
    """A group of tables looked up and updated together."""

    def __init__(self, tables: Sequence[EmbeddingTable]) -> None:
        self.tables = list(tables)
        if not self.tables:
            raise ValueError("an ensemble needs at least one table")
        fs = {t.featuresize() for t in self.tables}
        if len(fs) != 1:
            raise ValueError(f"ensemble tables must share the feature size, got {sorted(fs)}")
        dts = {np.dtype(t.eltype()) for t in self.tables}
        if len(dts) != 1:
            raise TypeError(f"ensemble tables must share the element type, got {sorted(map(str, dts))}")
        self._F = fs.pop()

    def __len__(self) -> int:
        return len(self.tables)

    def featuresize(self) -> int:
        return self._F

    def _on_gpu(self) -> bool:
        """Whether the tables' rows are on a GPU (all of them: a mix is refused)."""
        where = [table_on_gpu(t) for t in self.tables]
        if any(where) and not all(where):
            raise TypeError("an ensemble's tables must all be on a GPU or all on the host, got "
                            + ", ".join(f"{t.name}: {'GPU' if g else 'host'}" for t, g in zip(self.tables, where)))
        return where[0]

    def _bags(self, indices, offsets, weights, mode) -> list[Bags]:
        T = len(self.tables)
        if len(indices) != T:
            raise ValueError(f"expected index arrays for {T} tables, got {len(indices)}")
        for what, xs in (("offsets", offsets), ("weights", weights)):
            if xs is not None and len(xs) != T:
                raise ValueError(f"expected {what} for {T} tables, got {len(xs)}")
        bags = [make_bags(t.name, t.nvectors(), indices[i], None if offsets is None else offsets[i],
                          None if weights is None else weights[i], mode)
                for i, t in enumerate(self.tables)]
        n = {b.nout for b in bags}
        if len(n) != 1:
            raise ValueError(f"all tables must produce the same batch size, got {sorted(n)}")
        if len({b.offsets is None for b in bags}) != 1:
            raise ValueError("mixing pooled and non-reducing lookups in one ensemble call")
        return bags

    def lookup(self, indices: Sequence[object], offsets: Sequence[object] | None = None, *,
               mode: str | None = None, weights: Sequence[object] | None = None) -> np.ndarray:
        """Look up every table; returns a new float32 array (batch, tables, featuresize): a JAX
        array on the GPU for tables on a GPU."""
        if self._on_gpu():
            return gpu_tables.ensemble_lookup(self.tables, indices, offsets, mode, weights)
        bags = self._bags(indices, offsets, weights, mode)
        out = aligned_empty((bags[0].nout, len(self.tables), self._F))
        self._lookup(out, bags)
        return out

    def lookup_into(self, out: np.ndarray, indices: Sequence[object], offsets: Sequence[object] | None = None,
                    *, mode: str | None = None, weights: Sequence[object] | None = None) -> np.ndarray:
        """Look up every table into ``out`` (batch, tables, featuresize), any float32 view (a
        CuPy array for tables on a GPU)."""
        if self._on_gpu():
            return gpu_tables.ensemble_lookup(self.tables, indices, offsets, mode, weights, out=out)
        bags = self._bags(indices, offsets, weights, mode)
        shape = (bags[0].nout, len(self.tables), self._F)
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError("ensemble output must be a float32 numpy array")
        if out.shape != shape:
            raise ValueError(f"ensemble output shape {out.shape}, expected {shape}")
        if not out.flags.writeable:
            raise ValueError("ensemble output is read-only")
        self._lookup(out, bags)
        return out

    def _lookup(self, out: np.ndarray, bags: list[Bags]) -> None:
        if out.shape[0] == 0 or self._F == 0:
            return
        if out.strides[2] != out.itemsize:  # kernels need contiguous output rows
            tmp = aligned_empty(out.shape)
            self._lookup(tmp, bags)
            out[...] = tmp
            return
        with ExitStack() as stack:
            srcs = [stack.enter_context(t.rows(FORWARD, b.indices)) for t, b in zip(self.tables, bags)]
            if len(srcs) > _MAX_TABLES or config.serial(sum(b.indices.size for b in bags) * self._F):
                for i, (s, b) in enumerate(zip(srcs, bags)):
                    run_lookup(out[:, i, :], s, b)
                return
            bases, caches, slotss = _tuples(srcs)
            spec = spec_for(self._F)
            dist = prefetch_distance(srcs[0].base.shape[1] * srcs[0].base.itemsize)
            idxs = _same_dtype([b.indices for b in bags])
            if all(b.offsets is None or b.singles() for b in bags):
                K.ensemble_gather(spec, out, bases, caches, slotss, srcs[0].codec, idxs, dist,
                                  get_num_threads())
            else:
                offs = tuple(b.offsets for b in bags)
                ws = tuple(b.weights for b in bags)
                if len({w.size > 0 for w in ws}) != 1:  # weights for some tables only: ones for the rest
                    ws = tuple(w if w.size else np.ones(b.indices.size, np.float32) for w, b in zip(ws, bags))
                K.ensemble_pooled(spec, out, bases, caches, slotss, srcs[0].codec, idxs, offs, ws,
                                  bags[0].mean, dist, get_num_threads())

    def pullback(self, grad: np.ndarray, indices: Sequence[object], offsets: Sequence[object] | None = None,
                 *, mode: str | None = None, weights: Sequence[object] | None = None,
                 optimizer: Optimizer) -> None:
        """Fused optimizer step for every table; ``grad`` is (batch, tables, featuresize).

        Reindexing runs in parallel across tables, the updates over (table, chunk) work items.
        Everything is validated (including finiteness of ``grad``) before any table changes.
        """
        if not isinstance(optimizer, (SGD, RowwiseAdagrad)):
            raise TypeError(f"unsupported optimizer {optimizer!r}")
        if not np.isfinite(optimizer.lr):
            raise ValueError(f"learning rate must be finite, got {optimizer.lr}")
        if self._on_gpu():
            gpu_tables.ensemble_pullback(self.tables, grad, indices, offsets, mode, weights, optimizer)
            return
        bags = self._bags(indices, offsets, weights, mode)
        g3 = np.asarray(grad)
        shape = (bags[0].nout, len(self.tables), self._F)
        if g3.shape != shape:
            raise ValueError(f"ensemble gradient shape {g3.shape}, expected {shape}")
        if g3.dtype != np.float32:
            if g3.dtype.kind != "f":
                raise TypeError(f"gradient must be floating point, got {g3.dtype}")
            g3 = g3.astype(np.float32)
        if g3.strides[2] != g3.itemsize:
            g3 = np.ascontiguousarray(g3)
        for i, (t, b) in enumerate(zip(self.tables, bags)):
            check_grad(g3[:, i, :], b, t)
        if shape[0] == 0 or self._F == 0:
            return
        T = len(self.tables)
        g3 = gathered_grad(g3, sum(b.indices.size for b in bags))
        if T > _MAX_TABLES or config.serial(sum(b.indices.size for b in bags) * self._F):  # table by table
            for i, (t, b) in enumerate(zip(self.tables, bags)):
                run_update(t, g3[:, i, :], make_plan(t, b), optimizer.code, float(optimizer.lr),
                           float(optimizer.eps), optimizer.state(t), _NO_GOUT)
            return
        uniqs, startss, ent_bags, ent_coefs, Us = self._plans(bags)
        states = tuple(optimizer.state(t) for t in self.tables)
        with ExitStack() as stack:
            srcs = [stack.enter_context(t.rows(UPDATE, u[:n], writable=True))
                    for t, u, n in zip(self.tables, uniqs, Us)]
            bases, caches, slotss = _tuples(srcs)
            dist = prefetch_distance(srcs[0].base.shape[1] * srcs[0].base.itemsize)
            K.ensemble_update(spec_for(self._F), bases, caches, slotss, srcs[0].codec, g3, uniqs,
                              startss, ent_bags, ent_coefs, Us, optimizer.code, float(optimizer.lr),
                              float(optimizer.eps), states, _NO_GOUT, dist, get_num_threads())

    def _plans(self, bags: list[Bags]) -> tuple:
        """Every table's update plan, reindexed in parallel across tables: ``(uniqs, startss,
        ent_bags, ent_coefs, Us)``, tuples of per-table arrays and the unique-row counts.

        The radix sort over each table's batch (as ``pullback.make_plan``), in this thread's
        workspace; the dense per-table maps only when a table is too large for the packed keys.
        """
        T = len(self.tables)
        Us = np.zeros(T, np.int64)
        idxs = _same_dtype([b.indices for b in bags])
        offs = tuple(bag_offsets(b) for b in bags)
        if all(sortable(t.nvectors(), b.indices.size) for t, b in zip(self.tables, bags)):
            ws = workspace()
            cols = list(zip(*(sort_buffers(ws, f"ensemble{i}.", t.nvectors(), b)
                              for i, (t, b) in enumerate(zip(self.tables, bags)))))
            small = [np.array(c, np.int64) for c in cols[:3]]
            arrays = [tuple(c) for c in cols[3:]]
            reindex_sort_many(idxs, offs, tuple(b.weights for b in bags), bags[0].mean, *small, *arrays, Us)
            return (*arrays[-4:], Us)
        need_coef = any(b.weights.size > 0 for b in bags) or bags[0].mean
        plans = [plan_arrays(b.indices.size, need_coef) for b in bags]
        uniqs, countss, startss, ent_bags, ent_coefs = (tuple(p[j] for p in plans) for j in range(5))
        ws = tuple(b.weights if b.weights.size or not need_coef else np.ones(b.indices.size, np.float32)
                   for b in bags)
        reindex_many(idxs, offs, ws, bags[0].mean, tuple(scratch_for(t) for t in self.tables), uniqs, countss,
                     startss, ent_bags, ent_coefs, Us)
        return uniqs, startss, ent_bags, ent_coefs, Us


def _tuples(srcs: list[RowSource]):
    """Homogeneous tuples for the kernels; tables without indirection get an all-uncached pointer table."""
    bases = tuple(s.base for s in srcs)
    if all(s.slots is None for s in srcs):
        return bases, None, None
    caches = tuple(s.cache if s.slots is not None else s.base[:1] for s in srcs)
    slotss = tuple(s.slots if s.slots is not None else _home_entries(s.base) for s in srcs)
    return bases, caches, slotss


_homes: dict[tuple[int, int, int], np.ndarray] = {}
_MAX_HOMES = 64


def _home_entries(base: np.ndarray) -> np.ndarray:
    """A pointer table with every row of ``base`` uncached (its own address), for a plain table in
    an ensemble with caching ones; kept for the next call while ``base`` stays where it is (at most
    ``_MAX_HOMES`` of them: 8 bytes per row each)."""
    key = (base.ctypes.data, base.shape[0], base.strides[0])
    table = _homes.get(key)
    if table is None:
        if len(_homes) >= _MAX_HOMES:
            _homes.clear()
        table = _homes[key] = entries(base, np.arange(base.shape[0]))
    return table


def _same_dtype(idxs: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Index arrays as one tuple type (int64 unless all are int32)."""
    if all(i.dtype == np.int32 for i in idxs):
        return tuple(idxs)
    return tuple(i.astype(np.int64, copy=False) for i in idxs)


_NO_GOUT = np.empty((0, 0), np.float32)
