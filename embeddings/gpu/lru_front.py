"""A prefetched placement's front (:func:`.lru_group.front`) replayed as one CUDA graph.

The front of a table-batched placement is some twenty device steps (the probe, three sorts, the
victims, the moves and six gathers by permutation) whose shapes the batch's size fixes. Issued one
by one from Python they cost the prefetch thread about 1 ms of CPU a placement, all of it holding
the GIL that the training step beside it needs (the DLRM step is bound by the two threads' Python
together). Captured once as a CUDA graph, the same work is one launch.

A graph reads and writes the addresses it was captured with, so each group of tables placing
batches of one size keeps a :class:`FrontGraph`: the buffer its batch is uploaded into, the
buffer of its pointer table (:attr:`.lru_group.Group.dev`, whose values, the stamps and pointers,
are uploaded afresh each time), the page-locked arrays where the front leaves what the host
reads of it (:class:`.lru_group.HostSide`), and the front's outputs with the private memory pool that holds
them and the temporaries of its sorts (nothing else allocates from that pool, so no other work
reuses their memory between replays). Each replay overwrites the previous placement's outputs:
it waits on the device for the copy home that reads them (:attr:`.lru_group.Group.holds`), and
what outlives the placement (its slots) is copied out by the caller. The first placement of an
entry runs eagerly (kernels compiled, sorts warmed), the second captures. A capture that fails
leaves that entry eager for good, with one warning. ``CACHEDARRAYS_PLACEMENT_GRAPHS=0`` turns
graphs off. The host form (:class:`~.backend.ReferenceBackend` tables) is always eager.

An entry holds the front's arrays (about 16 words per batch entry) in device memory outside the
manager's levels, as CuPy's pool held them before between placements; :data:`MAX_FRONTS` entries
are kept, and a closed table's are dropped.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

from . import graphs, lru_group as LG

GRAPHS = os.environ.get("CACHEDARRAYS_PLACEMENT_GRAPHS", "1") != "0"
MAX_FRONTS = 4


class FrontGraph(graphs.Entry):
    """One group's captured front: its fixed buffers, the graph once captured, and its outputs."""

    def __init__(self, tables: list, xp: Any, n: int, dtype: Any, counted: bool) -> None:
        super().__init__(tables)
        self.counted = counted
        self.raw = xp.empty(n, dtype)  # the batch, as uploaded
        self.table = xp.empty(LG.Group.words(len(tables)), np.int64)
        self.out: LG.Front | None = None
        self.holds: list = []
        self.hosts: LG.HostSide | None = None  # page-locked, where each replay leaves the counts and the read's rows


#: Fronts run since the process began (or ``COUNTS.clear()``): ``replayed``, ``captured``,
#: ``capture failed`` and ``step by step`` (graphs off, host tables, an entry's first placement).
COUNTS: collections.Counter = collections.Counter()

_fronts = graphs.Entries()
_warned = [False]


def _entry(tables: list, sizes: list[int], dtype: Any, counted: bool) -> FrontGraph:
    key = (tuple(id(t) for t in tables), tuple(int(s) for s in sizes), np.dtype(dtype).str, counted, tables[0].reads)
    return _fronts.get(key, tables, lambda: FrontGraph(tables, tables[0].backend.xp, sum(sizes), dtype, counted),
                       MAX_FRONTS)


def forget(table: Any) -> None:
    """Drop the entries of groups with ``table`` (it is closing: their memory goes back)."""
    _fronts.forget(table)


def place(tables: list, sizes: list[int], now: list[int], lock: list[int], blocks: list[np.ndarray],
          counted: bool = True) -> tuple[LG.Group, LG.Front]:
    """The group of ``tables`` placing the batches in page-locked ``blocks`` (one after the other,
    ``sizes`` entries each) at stamps ``now`` with locks ``lock``, and its :func:`.lru_group.front`:
    uploaded and replayed where a graph serves the group, else run as it is. The front's arrays
    stay valid until the next placement of the same group."""
    be = tables[0].backend
    xp = be.xp
    if not GRAPHS or isinstance(tables[0]._tags, np.ndarray) or sum(sizes) == 0:
        COUNTS["step by step"] += 1
        g = LG.Group(tables, sizes, now, lock)
        return g, LG.front(g, be.upload_blocks(blocks).astype(np.int64, copy=False), xp, counted)
    entry = _entry(tables, sizes, blocks[0].dtype, counted)
    g = LG.Group(tables, sizes, now, lock, into=entry.table)
    be.upload_blocks(blocks, out=entry.raw)
    for ev in entry.holds:  # the last placement's copy home reads the outputs a replay overwrites
        be.follow(ev)
    entry.holds = g.holds
    if entry.hosts is None:
        entry.hosts = LG.host_side(g, entry.raw.size, be.pinned)
    if not entry.ready(lambda: _capture(entry, g, xp)):
        COUNTS["step by step"] += 1
        return g, _front(entry, g, xp)
    entry.graph.launch(xp.cuda.get_current_stream())
    COUNTS["replayed"] += 1
    return g, entry.out


def _front(entry: FrontGraph, g: LG.Group, xp: Any) -> LG.Front:
    """``g``'s front over ``entry``'s buffers (the batch as uploaded, widened; its page-locked host side)."""
    return LG.front(g, entry.raw.astype(np.int64), xp, entry.counted, entry.hosts)


def _capture(entry: FrontGraph, g: LG.Group, xp: Any) -> None:
    """Capture ``entry``'s front on this thread's stream (:func:`.graphs.capture`)."""
    stream = xp.cuda.get_current_stream()
    if stream.ptr == 0:  # the legacy default stream cannot be captured
        entry.failed = True
        COUNTS["capture failed"] += 1
        return
    got = graphs.capture(xp, stream, lambda: _front(entry, g, xp), COUNTS, _warned, "a placement's front")
    if got is None:
        entry.failed = True
    else:
        entry.graph, entry.out, entry.pool = got
