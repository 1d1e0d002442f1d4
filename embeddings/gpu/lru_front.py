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

Everything after the probe runs over the batch's misses compacted (:func:`.lru_group.front`'s
``cap``), not over the whole batch: each group and batch size bounds its misses by those of its
last placements (:class:`MissBound`; a new entry, captured anew, each time the bound moves). The
first placement of a group runs uncompacted; a batch with more misses than the bound has its
front run again uncompacted (:func:`.lru_group.ran`), and raises the bound. On the H100 at 84%
hits (8 tables, 2.6M entries), the sorts and the kernels after the probe then handle about 530,000
entries instead of 2.6M, and the front took 2.14 ms from its launch to the counts on the host
instead of 2.59 (medians, one process, the DLRM step beside it).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

from . import graphs, lru_group as LG

GRAPHS = os.environ.get("CACHEDARRAYS_PLACEMENT_GRAPHS", "1") != "0"
COMPACT = os.environ.get("CACHEDARRAYS_PLACEMENT_COMPACT", "1") != "0"
MAX_FRONTS = 4
CAP_MARGIN = 1.2  # room in a compacted front for this many times the most entries that missed lately
WINDOW = 16  # placements whose misses set a group's bound
SHRINK = 0.85  # a bound comes down once the misses call for less than this share of it


class FrontGraph(graphs.Entry):
    """One group's captured front: its fixed buffers, the graph once captured, and its outputs."""

    def __init__(self, tables: list, xp: Any, n: int, dtype: Any, counted: bool, cap: int | None) -> None:
        super().__init__(tables)
        self.counted, self.cap = counted, cap
        self.raw = xp.empty(n, dtype)  # the batch, as uploaded
        self.table = xp.empty(LG.Group.words(len(tables)), np.int64)
        self.out: LG.Front | None = None
        self.holds: list = []
        self.hosts: LG.HostSide | None = None  # page-locked, where each replay leaves the counts and the read's rows


#: Fronts run since the process began (or ``COUNTS.clear()``): ``replayed``, ``captured``,
#: ``capture failed`` and ``step by step`` (graphs off, host tables, an entry's first placement),
#: and ``run again`` (compacted misses that overflowed their bound).
COUNTS: collections.Counter = collections.Counter()

_fronts = graphs.Entries()
_warned = [False]
_misses: dict[tuple, "MissBound"] = {}  # a group's (tables, sizes) -> its bound on misses


def _entry(tables: list, sizes: list[int], dtype: Any, counted: bool, cap: int | None = None) -> FrontGraph:
    key = (tuple(id(t) for t in tables), tuple(int(s) for s in sizes), np.dtype(dtype).str, counted, tables[0].reads,
           cap)
    return _fronts.get(key, tables, lambda: FrontGraph(tables, tables[0].backend.xp, sum(sizes), dtype, counted, cap),
                       MAX_FRONTS)


class MissBound:
    """A group's bound on the entries of its batches that miss (:func:`.lru_group.front`'s
    ``cap``): ``CAP_MARGIN`` times the most of its last :data:`WINDOW` placements, in steps of a
    64th of the batch, raised as soon as that grows and lowered only once it falls below
    :data:`SHRINK` of it (each new bound is a new graph to capture). A cache that warms up
    misses most of its first batches: a bound that never came down would keep their size."""

    def __init__(self, n: int) -> None:
        self.n, self.cap = n, None
        self.seen: collections.deque = collections.deque(maxlen=WINDOW)
        self.host: LG.HostSide | None = None  # the last placement's, whose misses are read at the next

    def update(self) -> int | None:
        """The bound for the next front, from the misses of the last one (run since)."""
        if self.host is not None:
            self.seen.append(int(self.host.cnt[2]))
            self.host = None
        if not self.seen or not COMPACT:
            return None
        unit = max(64, self.n // 64)
        want = -(-int(max(self.seen) * CAP_MARGIN + 1) // unit) * unit
        have = self.n if self.cap is None else self.cap
        if want > have or want < SHRINK * have or self.cap is None:
            self.cap = want
        return None if self.cap >= self.n else self.cap


def _cap(tables: list, sizes: list[int]) -> tuple[MissBound, int | None]:
    """The group's :class:`MissBound` and the bound of its next front (None: the whole batch)."""
    key = (tuple(id(t) for t in tables), tuple(int(s) for s in sizes))
    rec = _misses.get(key)
    if rec is None:
        rec = _misses[key] = MissBound(sum(sizes))
    return rec, rec.update()


def forget(table: Any) -> None:
    """Drop the entries of groups with ``table`` (it is closing: their memory goes back)."""
    _fronts.forget(table)
    for key in [k for k in _misses if id(table) in k[0]]:
        del _misses[key]


def place(tables: list, sizes: list[int], now: list[int], lock: list[int], blocks: list[np.ndarray],
          counted: bool = True) -> tuple[LG.Group, LG.Front]:
    """The group of ``tables`` placing the batches in page-locked ``blocks`` (one after the other,
    ``sizes`` entries each) at stamps ``now`` with locks ``lock``, and its :func:`.lru_group.front`,
    run (:func:`.lru_group.ran`): uploaded and replayed where a graph serves the group, else run as
    it is. The front's arrays stay valid until the next placement of the same group."""
    g, f = _place(tables, sizes, now, lock, blocks, counted)
    done = LG.ran(g, f)
    if done is not f:
        COUNTS["run again"] += 1
    return g, done


def _place(tables: list, sizes: list[int], now: list[int], lock: list[int], blocks: list[np.ndarray],
           counted: bool) -> tuple[LG.Group, LG.Front]:
    """:func:`place` up to the front's launch (the host has not waited for it)."""
    be = tables[0].backend
    xp = be.xp
    rec, cap = _cap(tables, sizes)
    if not GRAPHS or isinstance(tables[0]._tags, np.ndarray) or sum(sizes) == 0:
        COUNTS["step by step"] += 1
        g = LG.Group(tables, sizes, now, lock)
        f = LG.front(g, be.upload_blocks(blocks).astype(np.int64, copy=False), xp, counted, cap=cap)
        rec.host = f.host
        return g, f
    entry = _entry(tables, sizes, blocks[0].dtype, counted, cap)
    g = LG.Group(tables, sizes, now, lock, into=entry.table)
    be.upload_blocks(blocks, out=entry.raw)
    for ev in entry.holds:  # the last placement's copy home reads the outputs a replay overwrites
        be.follow(ev)
    entry.holds = g.holds
    if entry.hosts is None:
        entry.hosts = LG.host_side(g, entry.raw.size if cap is None else cap, be.pinned)
    rec.host = entry.hosts
    if not entry.ready(lambda: _capture(entry, g, xp)):
        COUNTS["step by step"] += 1
        return g, _front(entry, g, xp)
    entry.graph.launch(xp.cuda.get_current_stream())
    COUNTS["replayed"] += 1
    return g, entry.out


def _front(entry: FrontGraph, g: LG.Group, xp: Any) -> LG.Front:
    """``g``'s front over ``entry``'s buffers (the batch as uploaded, widened; its page-locked host side)."""
    return LG.front(g, entry.raw.astype(np.int64), xp, entry.counted, entry.hosts, entry.cap)


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
