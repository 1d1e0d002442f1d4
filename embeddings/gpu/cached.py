"""The GPU ``CachedEmbeddings``: hot rows cached in HBM over a table in host memory (issue #19).

Layout. The base table is a CachedArray in a host level of the manager (page-locked DRAM under
a GPU); the cache is a ring of rows in the manager's fast level (HBM), followed by a staging
area for the rows a batch uses that are not cached. The bookkeeping is the CPU cache's
(:mod:`embeddings.kernels.cache`, on the host): pointer table, back-edges, reference counters,
the ring's head and tail, over a page-locked host mirror of the ring that admitted rows are
gathered into and copied up from asynchronously. The host resolves each batch's indices to
device slots where the batch is anyway, so the pointer table needs no HBM and adds no traffic
(the slots go up in place of the indices), and the GPU kernels of :mod:`.ops` run on the device
ring as on any table. A row's updates keep batch order, so results equal the uncached table's
bit for bit.

Policies. ``dynamic`` admits every row a batch touches (as FBGEMM's UVM cache does), so a
batch's kernels read only HBM; when full it flushes its oldest pages (a second chance for rows
hit since they were cached), moving rows on the device and writing evicted rows back when the
table holds updates. ``static`` holds a fixed hot set; ``simple`` caches nothing. A batch's rows
that are not cached go through the staging area: gathered on the host, copied up, and after an
update copied back before the next batch is resolved.

Prefetch. :func:`prefetch` admits the next batch's rows while the current batch computes, but
never flushes (a flush could move rows the current batch still uses) and admits nothing while
the current batch has staged rows (their updates have not reached the base table yet): new rows
go into free slots, their upload queued on the device stream behind the current lookup.

On a manager without a GPU the same code runs with numpy arrays as the "device" (the reference
backend of :mod:`.backend`), which is what CI tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachedarrays import Manager

from .. import cached as C
from ..batch import Bags, make_bags
from ..kernels import cache as K
from ..kernels.rowaccess import entries
from ..optim import RowwiseAdagrad
from ..protocol import Context, RowSource
from . import ops
from .backend import ReferenceBackend, cuda_backend
from .hbm import DeviceArrays

STAGING_ROWS = 4096  # the staging area's initial rows
STATE_BYTES = 4  # per cache or staging row of a table trained with row-wise Adagrad: its accumulator
_EMPTY = np.empty(0, np.int64)


class DeviceCache(C.BaseRows):
    """What the GPU cached tables share (:class:`CachedEmbeddings`, :class:`.lru.LRUCachedEmbeddings`):
    batches are validated on the host as the CPU validates them, then resolved to the slots of
    device rows by the table's ``resolve``; the last resolution is kept in ``_memo`` as
    ``(indices, offsets, weights, mode, generation, device bags)`` for the update of the same
    batch. Row-wise Adagrad's accumulator follows the rows: ``_dstate`` by slot on the device,
    the optimizer's host array for the rest (``_load_state``). The table needs ``name``,
    ``backend``, the base of :class:`~embeddings.cached.BaseRows`, ``_check_open``, ``_generation``
    and ``_load_state``."""

    on_device = True  # lookups and updates take embeddings.gpu.tables, not the CPU kernels
    gpu_cache = True  # a cached GPU table: its batches are resolved to slots, and it prefetches
    _memo: tuple | None = None
    _opt: Any = None  # the optimizer whose accumulator _dstate holds
    _dstate: Any = None

    def device_state(self, optimizer: Any) -> Any:
        """The device accumulator of row-wise Adagrad, by slot (None for SGD); with a new
        optimizer, first filled from its host accumulator, which holds the rows that are not on
        the device (the previous optimizer's written back to its own)."""
        if not isinstance(optimizer, RowwiseAdagrad):
            return None
        if self._opt is not optimizer:
            self._load_state(optimizer)
            self._opt = optimizer
        return self._dstate

    def _staging_refused(self, n: int, cache: str) -> MemoryError:
        """The error for a batch whose ``n`` staging rows do not fit beside ``cache`` (the
        staging area then keeps its old size, so the table stays usable)."""
        return MemoryError(f"{self.name}: a batch needs {n} staging rows beside the {cache}, more than "
                           f"{self.manager.fast.name} has room for; raise its capacity (--fast-budget) or lower "
                           f"the cache fraction")

    def rows(self, context: Context | None, indices: np.ndarray | None = None,
             writable: bool = False) -> RowSource:
        raise TypeError(f"{self.name}: a GPU cached table has no host row source; use embeddings.lookup / pullback")

    def validate(self, indices: Any, offsets: Any, weights: Any, mode: str | None, known_valid: bool = False) -> Bags:
        """The batch checked as the CPU checks it (device arrays are read back first); the
        indices' range is not checked again when ``known_valid``."""
        self._check_open()
        be = self.backend
        host = [None if x is None else (be.to_host(x) if be.is_device(x) else x) for x in (indices, offsets, weights)]
        return make_bags(self.name, self.nvectors(), host[0], host[1], host[2], mode, known_valid=known_valid)

    def _reused(self, indices: Any, offsets: Any, weights: Any, mode: str | None) -> ops.DeviceBags | None:
        """The last resolution if it was of these very arguments and its slots still hold their rows."""
        memo = self._memo
        if memo is not None and memo[0] is indices and memo[1] is offsets and memo[2] is weights \
                and memo[3] == mode and memo[4] == self._generation:
            return memo[5]
        return None


class CachedEmbeddings(DeviceCache, C.CachedEmbeddings):
    """An embedding table in host memory whose hot rows are cached in the manager's fast level
    (HBM on a GPU manager); the arguments are those of :class:`embeddings.CachedEmbeddings`
    (the dynamic policy admits every accessed row, so ``admit`` and ``age_window`` are not taken).
    Tables are float32. ``staging_rows``: the staging area's initial size (it grows on demand)."""

    def __init__(self, base: Any, manager: Manager | None = None, *, policy: str = "dynamic",
                 cache_rows: int | None = None, cache_fraction: float = 0.1, cacheslack: int | None = None,
                 page_rows: int | None = None, hot: Any = None, seed: int = 0, second_chance: bool = True,
                 staging_rows: int = STAGING_ROWS, name: str = "table") -> None:
        view = self._open_base(base, manager, policy, second_chance, name)
        manager = self.manager
        self._hbm = DeviceArrays(manager, name)
        try:
            host_base(view, manager, name)
        except (ValueError, TypeError):
            self.close()
            raise
        self._dtype, self._base = view.dtype, view
        nvectors, F = view.shape
        self._rowbytes = F * 4
        self.counts = np.zeros(3, np.int64)
        self._scratch = np.zeros(3, np.int64)  # counts of a batch already counted by its prefetch
        self.rows_written_back = self.flushes = 0
        self._dirty = False
        self._freq = np.empty(0, np.uint8)  # no access counts: the admission kernel admits every miss (ADMIT 0)
        self.state = np.zeros(5, np.int64)
        self.cachelower = self.cacheslack = 0
        self._generation = 0  # changes whenever a resolved slot may stop holding its row
        self._memo: tuple | None = None
        self._counted = False  # the next resolution was counted by a prefetch
        self._staged, self._staged_dirty = _EMPTY, False
        self._inflight = None  # fence after the last upload from a host buffer
        self._hstate = None
        rows = 0
        if policy != "simple":
            try:
                rows = C.cache_size(cache_rows, cache_fraction, nvectors, name)
            except ValueError:
                self.close()
                raise
        self.page_rows = int(page_rows or max(1, min(-(-max(rows, 1) // C.PAGES_PER_CACHE),
                                                     C.PAGE_BYTES // max(1, self._rowbytes))))
        ring = -(-rows // self.page_rows) * self.page_rows
        self._ring = ring
        self._W = self._hbm.new((ring + max(1, int(staging_rows)), F))
        self.backend = ReferenceBackend() if isinstance(self._W, np.ndarray) else cuda_backend()
        self._hstage = self.backend.pinned((self._W.shape[0] - ring, F), np.float32)
        self._cache = self.backend.pinned((ring, F), np.float32)  # the host mirror of the ring
        self._ptr = self._backedge = self._ref = None
        if policy == "simple":
            return
        self._ptr = entries(self._base, np.arange(nvectors))
        self._backedge = np.full(ring, -1, np.int64)
        self._ref = np.zeros(ring, np.uint8)
        self.state[:] = (0, 0, rows, ring, 0)
        slack = min(rows, int(cacheslack if cacheslack is not None else max(self.page_rows, rows // 10)))
        self._set_bounds(rows - slack, slack)
        if policy == "static":
            self._fill_static(hot, seed)

    # ------------------------------------------------------------------ resolution
    def resolve(self, indices: Any, offsets: Any, weights: Any, mode: str | None,
                bags: Bags | None = None, reuse: bool = False) -> ops.DeviceBags:
        """The batch on the device with each index replaced by the slot holding its row (admitting
        rows under the dynamic policy, staging the rest). ``reuse`` (a lookup's update): the last
        resolution of the same arguments while its slots still hold their rows."""
        if reuse and (same := self._reused(indices, offsets, weights, mode)) is not None:
            return same
        bags = self.validate(indices, offsets, weights, mode) if bags is None else bags
        flat = bags.indices.astype(np.int64, copy=False)
        self._finish_staging()
        if self.policy == "dynamic":
            counts = self._scratch if self._counted else self.counts
            self._admit(flat, flush=True, counts=counts)
        elif self.policy == "static":
            self.access(flat)
        else:
            self.counts[1] += flat.size
        self._counted = False
        slots = np.empty(flat.size, np.int64)
        if self.policy == "simple":
            slots.fill(-1)
        elif flat.size:
            K.cache_slots(self._cache, self._ptr, flat, slots)
        miss = slots < 0
        if miss.any():
            slots[miss] = self._stage(flat[miss])
        dtype = np.int32 if self._W.shape[0] < 2 ** 31 else np.int64
        dbags = ops.upload_bags(self.backend, bags, offsets is not None, slots.astype(dtype))
        self._memo = (indices, offsets, weights, mode, self._generation, dbags)
        return dbags

    def _admit(self, flat: np.ndarray, flush: bool, counts: np.ndarray) -> None:
        """Cache the uncached rows of ``flat`` while room lasts (flushing first when full and
        ``flush``) and queue their upload."""
        self.backend.wait(self._inflight)  # the ring's host mirror is the source of queued uploads
        if flat.size == 0:
            return
        if flush:
            self._make_room(flat)
        elif self.isfull():
            return
        t0 = time.perf_counter()
        h0 = int(self.state[K.HEAD])
        self._admission(flat, counts)
        self._admitted(h0, time.perf_counter() - t0)

    def _make_room(self, flat: np.ndarray) -> None:
        """Flush until the batch's misses fit (at most ``cachelower`` rows stay when full), so a
        batch that misses more than the slack is admitted rather than staged."""
        hits = np.zeros(3, np.int64)
        self._count(flat, hits)
        limit = int(self.state[K.LIMIT])
        target = max(0, limit - (flat.size - int(hits[0])))
        if self.isfull():
            target = min(target, self.cachelower)
        if self.cached_rows > target:
            self._flush(target, self._dirty)

    def _admitted(self, h0: int, seconds: float) -> None:
        """Queue the upload of the newly cached ring positions ``[h0, HEAD)`` from the host mirror
        (rows, and Adagrad's accumulator)."""
        h1 = int(self.state[K.HEAD])
        if h1 <= h0:
            return
        t0 = time.perf_counter()
        be, ring = self.backend, self._ring
        for a, b in _ranges(h0, h1, ring):
            be.upload(self._W[a:b], self._cache[a:b])
            if self._dstate is not None:
                buf = self._sstage[a:b]
                np.take(self._hstate, self._backedge[a:b], out=buf)
                be.upload(self._dstate[a:b], buf)
        self._inflight = be.fence()
        self._account_cached(h1 - h0, seconds + time.perf_counter() - t0)

    def _stage(self, rows: np.ndarray) -> np.ndarray:
        """Copy the distinct ``rows`` into the staging area; their slots, aligned with ``rows``."""
        uniq, inv = np.unique(rows, return_inverse=True)
        S, ring, be = uniq.size, self._ring, self.backend
        self._grow_staging(S)
        be.wait(self._inflight)
        t0 = time.perf_counter()
        np.take(self._base, uniq, axis=0, out=self._hstage[:S])
        be.upload(self._W[ring:ring + S], self._hstage[:S])
        if self._dstate is not None:
            np.take(self._hstate, uniq, out=self._sstage_tail[:S])
            be.upload(self._dstate[ring:ring + S], self._sstage_tail[:S])
        self._inflight = be.fence()
        self._staged = uniq
        self._generation += 1
        self.manager.account(self.manager.slow, self.manager.fast, S * self._rowbytes, time.perf_counter() - t0)
        return ring + inv.reshape(-1)

    def _grow_staging(self, S: int) -> None:
        """Room for ``S`` staged rows (the staging area is empty when this is called). The ring
        goes through its host mirror, so the old and the new array are never both allocated."""
        have = self._W.shape[0] - self._ring
        if S <= have:
            return
        new = S + S // 4
        ring, F, be = self._ring, self.featuresize(), self.backend
        be.wait(self._inflight)
        self._cache[...] = be.to_host(self._W[:ring])
        held = be.to_host(self._dstate[:ring]) if self._dstate is not None else None
        self._hbm.drop(self._W)
        self._W = None
        if held is not None:
            self._hbm.drop(self._dstate)
            self._dstate = None
        try:
            self._W = self._hbm.new((ring + new, F))
            refused = False
        except MemoryError:
            self._W = self._hbm.new((ring + have, F))  # as before, so the table stays usable
            new, refused = have, True
        be.upload(self._W[:ring], self._cache)
        if held is not None:
            self._sstage[...] = held
            self._dstate = self._hbm.new((ring + new,), np.float32)
            be.upload(self._dstate[:ring], self._sstage)
            self._sstage_tail = be.pinned((new,), np.float32)
        self._inflight = be.fence()
        self._hstage = be.pinned((new, F), np.float32)
        self._generation += 1
        if refused:
            raise self._staging_refused(S, f"{ring}-row cache")

    def _finish_staging(self) -> None:
        """Write updated staged rows back to the base table (waits for their update) and empty
        the staging area."""
        if self._staged.size == 0:
            return
        if self._staged_dirty:
            t0 = time.perf_counter()
            S, ring, be = self._staged.size, self._ring, self.backend
            self._base[self._staged] = be.to_host(self._W[ring:ring + S])
            if self._dstate is not None:
                self._hstate[self._staged] = be.to_host(self._dstate[ring:ring + S])
            self.manager.account(self.manager.fast, self.manager.slow, S * self._rowbytes, time.perf_counter() - t0)
        self._staged, self._staged_dirty = _EMPTY, False
        self._generation += 1

    def updated(self) -> None:
        """Note that the last resolved batch was updated (its staged rows must go back)."""
        self._dirty = True
        self._staged_dirty = self._staged.size > 0

    def _load_state(self, optimizer: RowwiseAdagrad) -> None:
        """``_dstate`` from ``optimizer``'s host accumulator (:meth:`DeviceCache.device_state`)."""
        if self._opt is not None:
            self._state_down()
            self._hbm.drop(self._dstate)
        self._hstate = optimizer.state(self)
        ring = self._ring
        self._dstate = self._hbm.new((self._W.shape[0],), np.float32)
        self._sstage = self.backend.pinned((ring,), np.float32)
        self._sstage_tail = self.backend.pinned((self._W.shape[0] - ring,), np.float32)
        live = self._live_slots()
        if live.size:
            self._dstate[self.backend.asarray(live)] = self.backend.asarray(self._hstate[self._backedge[live]])
        S = self._staged.size
        if S:
            self._dstate[ring:ring + S] = self.backend.asarray(self._hstate[self._staged])

    def _state_down(self) -> None:
        """Copy the device accumulator of every cached and staged row into the host one."""
        if self._dstate is None:
            return
        live = self._live_slots()
        if live.size:
            self._hstate[self._backedge[live]] = self.backend.to_host(self._dstate[self.backend.asarray(live)])
        S = self._staged.size
        if S and self._staged_dirty:
            self._hstate[self._staged] = self.backend.to_host(self._dstate[self._ring:self._ring + S])

    def _live_slots(self) -> np.ndarray:
        if self.policy == "simple":
            return _EMPTY
        tail, head = int(self.state[K.TAIL]), int(self.state[K.HEAD])
        return np.arange(tail, head, dtype=np.int64) % max(self._ring, 1)

    # ------------------------------------------------------------------ the CPU cache's operations
    def access_and_cache(self, indices: np.ndarray) -> None:
        """Cache the rows of ``indices`` that are not cached, while room lasts (flushing first if full)."""
        self._check_open()
        if self.policy == "dynamic":
            self._admit(np.ascontiguousarray(indices, np.int64).ravel(), flush=True, counts=self.counts)

    def prefetch(self, indices: Any) -> bool:
        """Admit the rows of ``indices`` (the next batch) while the current batch computes;
        whether anything was admitted. Counts this batch's hits and misses (its lookup then
        does not)."""
        self._check_open()
        if self.policy != "dynamic" or self._staged.size or self.isfull():
            return False
        idx = self.validate(indices, None, None, None).indices.astype(np.int64, copy=False)
        self._admit(idx, flush=False, counts=self.counts)
        self._counted = True
        return True

    def _flush(self, target: int | None, writeback: bool) -> None:
        """Drop the oldest pages until at most ``target`` rows stay: the host bookkeeping moves
        spared rows to the head and uncaches the rest; the device copies follow round by round
        (a round ends where the pages reach rows this flush moved), evicted rows going back to
        the base table when ``writeback``."""
        if self.policy == "simple":
            return
        target = self.cachelower if target is None else int(target)
        if self.cached_rows <= target:
            return
        self.backend.wait(self._inflight)
        spare = self.second_chance and target > 0
        ring, page = self._ring, self.page_rows
        t0 = time.perf_counter()
        written = 0
        moves: list = []
        round_head = int(self.state[K.HEAD])
        while self.cached_rows > target:
            tail, head = int(self.state[K.TAIL]), int(self.state[K.HEAD])
            if tail >= round_head:
                written += self._apply_moves(moves, writeback)
                moves, round_head = [], head
            stop = min((tail // page + 1) * page, head, round_head)  # a page may reach into this round's moves
            slots = np.arange(tail, stop, dtype=np.int64) % ring
            rows, refs = self._backedge[slots], self._ref[slots]
            K.flush_page(self._base, self._cache, self._ptr, self._backedge, self._ref, self.state, stop, False,
                         spare)
            live = rows >= 0
            moved = live & (refs > 0) if spare else np.zeros_like(live)
            dst = (head + np.arange(int(moved.sum()), dtype=np.int64)) % ring
            moves.append((slots[moved], dst, slots[live & ~moved], rows[live & ~moved]))
        written += self._apply_moves(moves, writeback)
        self._generation += 1
        self._flushed(written, time.perf_counter() - t0)

    def _apply_moves(self, moves: list, writeback: bool) -> int:
        """The device side of flushed pages: evicted rows read back (when ``writeback``), spared
        rows moved to their new slots; every source is read before any destination is written."""
        if not moves:
            return 0
        be = self.backend
        src, dst, ev, evrows = (np.concatenate(parts) for parts in zip(*moves))
        arrays = [(self._W, self._base)] + ([(self._dstate, self._hstate)] if self._dstate is not None else [])
        written = 0
        if writeback and ev.size:
            at = be.asarray(ev)
            for dev, home in arrays:
                home[evrows] = be.to_host(dev[at])
            written = int(ev.size)
        if src.size:
            s, d = be.asarray(src), be.asarray(dst)
            for dev, _ in arrays:
                dev[d] = dev[s]
        return written

    def writeback(self) -> None:
        """Copy every cached and staged row back to the base table and keep it cached (e.g. before
        a checkpoint); Adagrad's accumulator too."""
        self._check_open()
        self._finish_staging()
        if self._dirty and self.policy != "simple":
            t0 = time.perf_counter()
            live = self._live_slots()
            if live.size:
                self._base[self._backedge[live]] = self.backend.to_host(self._W[self.backend.asarray(live)])
                self.rows_written_back += int(live.size)
                self.manager.account(self.manager.fast, self.manager.slow, live.size * self._rowbytes,
                                     time.perf_counter() - t0)
        self._state_down()
        self._dirty = False

    def invalidate(self) -> None:
        """Drop every cached and staged row without writing it back, after the base table (and the
        optimizer's host state) were replaced, e.g. by loading a checkpoint."""
        self._check_open()
        self._staged, self._staged_dirty = _EMPTY, False
        self._dirty = False
        if self._dstate is not None:
            self._hbm.drop(self._dstate)
        self._opt = self._hstate = self._dstate = None
        self._flush(0, writeback=False)
        self._generation += 1
        if self.policy == "static":
            self._refill()

    def close(self) -> None:
        """Write everything back (if the table holds updates), then free the device arrays."""
        if not self._pins:
            return
        if self._hbm:  # not when construction failed before the device arrays
            self.writeback()
            self._hbm.close()
        views, self._pins = self._pins, []
        for v in views:
            v.release()
        self._W = self._dstate = None
        self._memo = None

    def check(self) -> None:
        """The CPU cache's invariants over the host bookkeeping, plus: nothing staged is pending
        unless something is staged."""
        super().check()
        if self._staged_dirty and self._staged.size == 0:
            raise C.InvariantError(f"{self.name}: staged rows marked updated but none staged")

    def __repr__(self) -> str:
        return (f"gpu.CachedEmbeddings({self.name!r}, {self.policy}, nvectors={self.nvectors()}, "
                f"featuresize={self.featuresize()}, cached={self.cached_rows})")


def host_base(view: Any, manager: Manager, name: str) -> np.ndarray:
    """A GPU cached table's base as opened (:func:`embeddings.cached.open_base`): a row-major
    2-d float32 array in host memory, else the error that says so."""
    if not isinstance(view, np.ndarray):
        raise ValueError(f"{name}: the base table must be in host memory; {manager.fast.name} holds the cache")
    if view.dtype != np.float32 or view.ndim != 2 or not view.flags.c_contiguous:
        raise TypeError(f"{name}: the base table must be a row-major 2-d float32 array, got {view.dtype} {view.shape}")
    return view


def _ranges(h0: int, h1: int, ring: int) -> list[tuple[int, int]]:
    """Ring positions ``[h0, h1)`` as at most two slot ranges."""
    a, b = h0 % ring, h0 % ring + (h1 - h0)
    return [(a, b)] if b <= ring else [(a, ring), (0, b - ring)]


def prefetch(table: Any, next_indices: Any) -> bool:
    """Start bringing the rows of ``next_indices`` (the next batch of ``table``) into HBM while the
    current batch computes; whether anything was admitted (a GPU CachedEmbeddings under the
    dynamic policy with room left; other tables ignore it)."""
    if getattr(table, "gpu_cache", False):
        return table.prefetch(next_indices)
    return False


def lookup(table: CachedEmbeddings, indices: Any, offsets: Any, mode: str | None, weights: Any,
           out: Any = None, bags: Bags | None = None) -> Any:
    """``lookup`` / ``lookup_into`` of a GPU cached table (``bags``: the batch, validated already)."""
    be = table.backend
    dbags = table.resolve(indices, offsets, weights, mode, bags)
    shape = (dbags.nout, table.featuresize())
    if out is None:
        res = be.xp.empty(shape, np.float32)
    else:
        ops.check_out(be, out, shape, table.name)
        res = out
    ops.run_pooled(be, res, table._W, dbags)
    return res


@dataclass
class CachedUpdate:
    """A cached table's update whose checks are done or in flight (:func:`prepare`): its
    arguments, the validated batch (None: it is the batch the table resolved last, whose
    resolution the update reuses), the gradient on the device and its checks in flight."""

    args: tuple
    bags: Bags | None
    grad: Any
    pending: ops.Pending | None


def prepare(table: CachedEmbeddings, grad: Any, indices: Any, offsets: Any, mode: str | None, weights: Any,
            flags: Any = None, slot: int = 0) -> CachedUpdate:
    """Every check of ``pullback`` in the CPU's order, nothing written: the batch (not again if
    the table just resolved these very arguments), the gradient's shape, and its finiteness in
    flight into ``flags[slot:slot + 3]`` (new flags when None)."""
    be = table.backend
    same = table._reused(indices, offsets, weights, mode)
    bags = table.validate(indices, offsets, weights, mode) if same is None else None
    nout = same.nout if bags is None else bags.nout
    g = ops.check_grad(be, table.name, grad, nout, table.featuresize())
    pending = ops.check_finite(be, table.name, g, be.flags(3) if flags is None else flags, slot) if g.size else None
    return CachedUpdate((indices, offsets, weights, mode), bags, g, pending)


def resolved(table: CachedEmbeddings, prep: CachedUpdate) -> ops.PreparedUpdate:
    """A prepared update with its batch resolved to the table's slots (the lookup's slots when
    the table just resolved these very arguments)."""
    dbags = table.resolve(*prep.args, bags=prep.bags, reuse=True)
    return ops.PreparedUpdate(dbags, prep.grad, prep.pending)


def run(table: CachedEmbeddings, prep: ops.PreparedUpdate, optimizer: Any, plan: Any = None) -> None:
    """Confirm a resolved update's checks and run it on the table's slots (by ``plan`` when given)."""
    ops.apply_pullback(table.backend, table._W, table.device_state(optimizer), prep, optimizer, plan)
    table.updated()


def apply(table: CachedEmbeddings, prep: CachedUpdate, optimizer: Any) -> None:
    """Resolve a prepared update's batch (reusing the lookup's slots), confirm its checks and run it."""
    run(table, resolved(table, prep), optimizer)


def pullback(table: CachedEmbeddings, grad: Any, indices: Any, offsets: Any, mode: str | None, weights: Any,
             optimizer: Any) -> None:
    """``pullback`` of a GPU cached table: checked in the CPU's order before anything is written."""
    ops.check_optimizer(optimizer)
    apply(table, prepare(table, grad, indices, offsets, mode, weights), optimizer)
