"""The update of an ensemble of ``lru`` tables replayed as one CUDA graph.

After its checks, the update of a DLRM step's eight cached tables is some seventy launches: one
sort of every table's slots, the sorted rows, the long rows, three update kernels and the dirty
marks of each table. Each launch costs the training thread CuPy's launch overhead while it holds
the GIL that the prefetch thread beside it needs. None of them waits for the GPU (the plan's
counts stay on the device, :class:`.backend.Plan`), and the batch fixes their shapes, so the
launches are captured once as a CUDA graph and replayed as one: on the H100 the update phase
of the DLRM step fell from 4.95 to 1.83 ms (1.56 with the prefetch joined before the next
lookup, :meth:`dlrm.DLRM.train_step`).

A graph reads and writes the addresses it was captured with. Each entry keeps a buffer for the
gradient and one per table for its slots, both copied in before a replay, and its arrays (the
plans, the chunk sums) in a memory pool of its own. It is keyed by everything else its kernels
take: the tables' rows, accumulators and dirty bits (a table whose arrays move gets a new
entry), the sizes, the pooling, the optimizer's kind, learning rate and epsilon. The first
update of a key runs eagerly; the second captures, on a side stream, with the tables' prefetches
finished; later ones replay. A learning rate that changes every step never captures.
``CACHEDARRAYS_UPDATE_GRAPHS=0`` turns graphs off.

An update takes a graph only when every table is an ``lru`` table given once, has no staged
rows, and its batch is of fixed-size bags (no offsets, no weights) whose plan waits for
nothing (:func:`.backend.counts_stay`); anything else updates as before. An entry holds about 12 words per
batch entry and the gradient (about 0.3 GB at the DLRM benchmark's size) outside the manager's
levels; :data:`MAX_UPDATES` entries are kept, and a closed table's are dropped.
"""

from __future__ import annotations

import collections
import os
from dataclasses import replace
from typing import Any

import numpy as np

from . import backend as B
from . import graphs, lru_kernels as LK, ops, reference

GRAPHS = os.environ.get("CACHEDARRAYS_UPDATE_GRAPHS", "1") != "0"
MAX_UPDATES = 4

#: Updates since the process began (or ``COUNTS.clear()``): ``replayed``, ``captured``,
#: ``capture failed`` and ``eager`` (an entry's first update).
COUNTS: collections.Counter = collections.Counter()

_entries = graphs.Entries()
_warned = [False]


class UpdateGraph(graphs.Entry):
    """One ensemble's captured update: the buffers it reads, the graph once captured, its pool."""

    def __init__(self, tables: list, xp: Any, shape: tuple, idxs: list) -> None:
        super().__init__(tables)
        self.grad = xp.empty(shape, np.float32)
        self.idx = [xp.empty_like(i) for i in idxs]


def eligible(tables: list, grad: Any, preps: list, F: int) -> bool:
    """Whether the resolved updates ``preps`` of ``tables`` (gradient ``grad``, rows of ``F``)
    may run as a graph (see the module's docstring)."""
    if not GRAPHS or F == 0 or isinstance(grad, np.ndarray) or not grad.flags.c_contiguous:
        return False
    if not all(getattr(t, "update_graphs", False) and not t._staged.size for t in tables):
        return False
    if len({id(t) for t in tables}) != len(tables):
        return False
    return all(p.bags.off is None and p.bags.w is None and p.bags.idx.size
               and B.counts_stay(int(p.bags.idx.size), reference.CHUNK, F) for p in preps)


def _entry(tables: list, xp: Any, grad: Any, preps: list, states: list, optimizer: Any) -> UpdateGraph:
    idxs = [p.bags.idx for p in preps]
    key = (tuple(id(t) for t in tables), tuple(t._W.data.ptr for t in tables),
           tuple(0 if s is None else s.data.ptr for s in states), tuple(t._dirty.data.ptr for t in tables),
           tuple(int(t._nslots) for t in tables),
           tuple(grad.shape), tuple(int(i.size) for i in idxs), idxs[0].dtype.str,
           tuple((p.bags.k, p.bags.mean, p.bags.nout) for p in preps),
           int(optimizer.code), float(optimizer.lr), float(optimizer.eps))
    return _entries.get(key, tables, lambda: UpdateGraph(tables, xp, tuple(grad.shape), idxs), MAX_UPDATES)


def forget(table: Any) -> None:
    """Drop the entries with ``table`` (it is closing: their memory goes back)."""
    _entries.forget(table)


def run(be: Any, tables: list, grad: Any, preps: list, optimizer: Any, F: int) -> None:
    """Every table's update (``preps``, resolved and confirmed; ``grad`` the ``(batch, tables,
    F)`` gradient): its plan, its fused update and its dirty marks, replayed as a graph where
    the entry has one."""
    xp = be.xp
    states = [t.device_state(optimizer) for t in tables]
    entry = _entry(tables, xp, grad, preps, states, optimizer)
    entry.grad[...] = grad
    for buf, p in zip(entry.idx, preps):
        buf[...] = p.bags.idx
    if entry.ready(lambda: _capture(be, entry, tables, states, preps, optimizer, F)):
        entry.graph.launch(xp.cuda.get_current_stream())
        COUNTS["replayed"] += 1
    else:
        COUNTS["eager"] += 1
        _body(be, entry, tables, states, preps, optimizer, F)


def _body(be: Any, entry: UpdateGraph, tables: list, states: list, preps: list, optimizer: Any, F: int) -> None:
    """The launches a graph replays: the plans of the slots in ``entry.idx`` (none for SGD in any
    order), the update of each table from ``entry.grad``, the slots' dirty marks."""
    plans = ops.plans(be, entry.idx, F) if ops.planned(optimizer) else [None] * len(tables)
    for n, (t, state, p, plan) in enumerate(zip(tables, states, preps, plans)):
        mine = ops.PreparedUpdate(replace(p.bags, idx=entry.idx[n]), entry.grad[:, n, :], None)
        ops.apply_pullback(be, t._W, state, mine, optimizer, plan)
        LK.mark_dirty(entry.idx[n], t._dirty, t._nslots)  # what the table's updated() marks, from the entry's slots


def _capture(be: Any, entry: UpdateGraph, tables: list, states: list, preps: list, optimizer: Any, F: int) -> None:
    """Capture ``entry``'s update on a side stream after the current one (:func:`.graphs.capture`),
    once the tables' prefetches are done (nothing else runs beside the capture)."""
    xp = be.xp
    for t in tables:
        if t._inflight is not None:
            t._inflight.wait()
    side = xp.cuda.Stream(non_blocking=True)
    side.wait_event(xp.cuda.get_current_stream().record())

    def work() -> None:
        with side:
            _body(be, entry, tables, states, preps, optimizer, F)

    got = graphs.capture(xp, side, work, COUNTS, _warned, "an ensemble's update")
    if got is None:
        entry.failed = True
    else:
        entry.graph, _, entry.pool = got
