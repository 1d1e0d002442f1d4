"""``LRUCachedEmbeddings``: hot rows cached in HBM, found and moved by the device itself.

Layout (FBGEMM's "UVM cache" design). The cache is ``sets x ways`` slots of rows in the
manager's fast level (HBM); a row may live only in the ways of its set (a hash of the row
number). Beside the rows, in HBM: the tags (the row each slot holds, -1 when free), the stamps
(the last batch that used the slot), the dirty bits and, under the ``lfu`` replacement, each
slot's count of batches of use. The base table stays in page-locked host memory, which the GPU
reads in place through its mapped address.

Resolving a batch is array work on the device, with no per-index work on the host: probe the
ways of each index's set, stamp the hits, find the distinct misses, give the k-th miss of a set
the k-th way in the order of eviction (least recently used first; under ``lfu``, used in the
fewest batches first) among those whose stamps are older than the batches in flight, write the
evicted dirty rows back (gathered into one block, copied home in one DMA and scattered into the
host table by CPU threads in the background, which anything reading host rows waits for) and
read the admitted rows in (part over PCIe by the GPU, in host address order, beside that copy,
part gathered by CPU threads and copied up in one DMA), and replace each index by its slot.
Arrays keep the batch's length and the GPU's reads run over a count the device holds; the host
waits only for the numbers of rows going home and coming in (:mod:`.lru_group`, which places
the batches of several tables with one set of kernels). A miss whose set has no
way left (every way used by a batch in flight) goes to a staging area after the ways: read in
the same way, written back by the GPU through the mapped address right after its update. A row's updates
keep batch order on whatever slot holds it, so results equal the uncached table's bit for bit.

Against the host-bookkept :class:`.cached.CachedEmbeddings` (pointer table on the host, CLOCK
pages): nothing scales with the batch on the host, at the price of set conflicts (a set's rows
compete for its ways) instead of one global order of eviction.

Prefetch. ``prefetch(next_indices)`` (or :meth:`LRUCachedEmbeddings.prefetch_works` for
several tables, run on a worker thread by :mod:`.prefetcher`) places a later batch while the
current one computes. It locks the ways of the batches still in use by their stamps (the
oldest prefetched batch not yet looked up, else the batch looked up last), so nothing they read
or update moves, and it admits nothing while rows are staged (their updates have not reached
the base table). A prefetched placement waits in a queue until the lookup of the same indices
takes its slots; that lookup and its update run beside a prefetch of the next batch, so the
DLRM trainer starts the next batch's prefetch before the current batch's lookup.

On a manager without a GPU the same code runs with numpy as the device (the reference backend:
the base table is its own mapped view), which is what CI tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import collections
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from cachedarrays import Manager
from cachedarrays.errors import InvariantError

from .. import cached as C
from ..batch import Bags
from ..optim import RowwiseAdagrad
from ..protocol import EmbeddingTable
from . import ops
from .backend import ReferenceBackend, checked_index_blocks, cuda_backend
from .cached import STAGING_ROWS, DeviceCache, host_base
from . import lru_front as LF, lru_group as LG
from . import update_graph as UG
from . import lru_kernels as LK
from .hbm import DeviceArrays

WAYS = 16
SLOT_BYTES = 8 + 4 + 1  # per slot beside its row: tag (int64), stamp (int32), dirty bit (bool)
USES_BYTES = 4  # and under ``lfu`` its count of batches of use (int32)
READS = ("mapped", "staged", "split")  # how a placement's rows come in (:func:`.lru_group.read`)
REPLACEMENTS = ("lru", "lfu")  # which way of a set a missed row takes (:func:`.lru_kernels.eviction_keys`)


def slot_bytes(replacement: str = "lru") -> int:
    """HBM a cache slot needs beside its row under ``replacement``."""
    return SLOT_BYTES + (USES_BYTES if replacement == "lfu" else 0)


class LRUCachedEmbeddings(DeviceCache, EmbeddingTable):
    """An embedding table in host memory whose hot rows are cached in the manager's fast level
    (HBM on a GPU manager) in ``ways``-way sets, least recently used way evicted first. ``base``,
    ``manager``, ``cache_rows`` / ``cache_fraction`` as for :class:`embeddings.CachedEmbeddings`
    (the cache holds ``cache_rows`` rounded up to whole sets). Tables are float32.
    ``staging_rows``: the staging area's initial size (it grows on demand). ``reads``: how the
    rows a placement brings in come up, ``"split"`` (the default: the GPU reads the share
    :attr:`read_share` of them through their mapped host addresses while CPU threads gather the
    rest, the share adapting each placement until both parts take as long), ``"mapped"`` (the
    GPU reads them all) or ``"staged"`` (CPU threads gather them all into one block that goes up
    piece by piece as they finish each; :func:`.lru_group.read`); it may be changed between
    steps. ``replacement``: which way of its set a missed row takes, ``"lru"`` (the default: the
    least recently used) or ``"lfu"`` (the way whose row was used in the fewest batches since it
    came in, the least recently used among equals; 4 more bytes of HBM a slot). Under skewed (Zipf) traffic
    ``lfu`` keeps the hot rows that a burst of rows seen once would push out of an LRU set;
    it does not age its counts, so rows hot long ago stay until their set runs out of colder
    ways."""

    _inflight: threading.Event | None = None  # set when a background prefetch has finished
    update_graphs = True  # an ensemble's update of these tables may be one CUDA graph (:mod:`.update_graph`)
    _home: Future | None = None  # the rows the last placement sent home, landing (:func:`.lru_group.drain`)
    _validated: tuple | None = None  # (validated indices, the prefetched placement they equal), for _take_ahead

    def __init__(self, base: Any, manager: Manager | None = None, *, cache_rows: int | None = None,
                 cache_fraction: float = 0.1, ways: int = WAYS, staging_rows: int = STAGING_ROWS,
                 reads: str = "split", replacement: str = "lru", name: str = "table") -> None:
        self.name = name
        self.reads = reads  # checked before anything is allocated
        if replacement not in REPLACEMENTS:
            raise ValueError(f"{name}: replacement must be one of {REPLACEMENTS}, got {replacement!r}")
        self.replacement = replacement
        self.read_share = 0.5
        self.base_array, self.manager, pin = C.open_base(base, manager, name)
        self._pins = [pin]
        self._hbm = DeviceArrays(self.manager, name)
        view = pin.array
        try:
            self._base = host_base(view, self.manager, name)
            self._dtype = self._base.dtype
            nvectors, F = view.shape
            rows = C.cache_size(cache_rows, cache_fraction, nvectors, name)
            if int(ways) < 1:
                raise ValueError(f"{name}: ways must be at least 1, got {ways}")
            self.ways = min(int(ways), rows)
            self.sets = -(-rows // self.ways)
            self._nslots = S = self.sets * self.ways
            self._W = self._hbm.new((S + max(1, int(staging_rows)), F))
            self.backend = ReferenceBackend() if isinstance(self._W, np.ndarray) else cuda_backend()
            self._tags = self._hbm.new((S,), np.int64)
            self._stamp = self._hbm.new((S,), np.int32)
            self._dirty = self._hbm.new((S + 1,), np.bool_)  # [S]: where staging slots' bits go
            self._uses = self._hbm.new((S,), np.int32) if replacement == "lfu" else None
            self._state_map: weakref.finalize | None = None
            self._hbase, _ = self.backend.mapped(self._base, False, self.name)
        except BaseException:
            self.close()
            raise
        self._drop_rows()
        self._rowbytes = F * 4
        xp = self.backend.xp
        # on the device: hits, misses, rows admitted, evictions written back, the last placement left a row out
        self._counts = xp.zeros(5, np.int64)
        self._seen = np.zeros(2, np.int64)  # admitted, written back as last accounted
        self._clock = 0  # stamps given out so far
        self._inflight_stamp = 0  # the stamp of the batch resolved last (its ways are locked for a prefetch)
        # an event after this table's device work up to the resolution of the batch resolved last,
        # when nothing but that batch's update has touched the table since (None: not known)
        self._before_update: Any = None
        self._staged = xp.empty(0, np.int64)  # rows in the staging area, by staging slot
        self._last = None  # the slots of the batch resolved last (an update marks them dirty)
        self._memo: tuple | None = None  # (indices, offsets, weights, mode, generation, bags)
        self._ahead: collections.deque[Ahead] = collections.deque()  # prefetched batches, oldest first
        self._ahead_lock = threading.Lock()  # a prefetch's thread appends, the caller's lookups take
        self._lookups = 0  # batches resolved so far that could have taken a prefetched placement
        self._generation = 0  # changes whenever a resolved slot may stop holding its row
        self.rows_written_back = 0
        self.prefetch_fallbacks = 0  # prefetched batches whose lookup had to place them itself
        # CPU seconds of this table's share of its placements on the prefetch thread: on a GPU, mostly
        # Python holding the GIL, which the training step's thread then waits for
        self.prefetch_cpu_s = 0.0
        self._fallbacks_in_a_row = 0
        self._hstate_dev = None  # the optimizer's host accumulator as the device sees it

    @property
    def policy(self) -> str:
        """The name reports and telemetry give this table's policy: its replacement."""
        return self.replacement

    @property
    def read_share(self) -> float:
        """Under split reads, the share of a placement's rows that the GPU reads (the rest CPU
        threads gather); each placement moves it toward where both parts take as long
        (:func:`.lru_group.balance`). A value set here is where that starts."""
        return self._read_share

    @read_share.setter
    def read_share(self, value: float) -> None:
        share = float(value)
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{self.name}: read_share must be between 0 and 1, got {value!r}")
        self._read_share = share

    @property
    def reads(self) -> str:
        return self._reads

    @reads.setter
    def reads(self, value: str) -> None:
        if value not in READS:
            raise ValueError(f"{self.name}: reads must be one of {READS}, got {value!r}")
        self._reads = value

    def _map_state(self, host: np.ndarray) -> Any:
        """The optimizer's host accumulator as the device reads and writes it in place,
        page-locked first if it is not. The page-locking lasts exactly as long as this table uses
        the array: undone (:meth:`_unmap_state`) when the accumulator is replaced or dropped, the
        table closed, or the table collected unclosed; the array is kept alive until then, since
        freed memory that stays registered breaks later copies from whatever reuses it."""
        self._unmap_state()
        view, handle = self.backend.mapped(host, True, self.name)
        if handle is not None:
            self._state_map = weakref.finalize(self, _unmap, self.backend, handle, host)
            self._state_map.atexit = False
        return view

    def _unmap_state(self) -> None:
        if self._state_map is not None:
            self._state_map()
            self._state_map = None

    # ------------------------------------------------------------------ resolution
    def resolve(self, indices: Any, offsets: Any, weights: Any, mode: str | None,
                bags: Bags | None = None, reuse: bool = False) -> ops.DeviceBags:
        """The batch on the device with each index replaced by the slot holding its row
        (admitting misses, staging what finds no way). ``reuse`` (a lookup's update): the last
        resolution of the same arguments while its slots still hold their rows. A batch that a
        finished prefetch placed takes its slots and runs beside a background prefetch of the
        next batch, as an update on the reuse path does; anything else waits for it."""
        if reuse and (same := self._reused(indices, offsets, weights, mode)) is not None:
            return same
        bags = self.validate(indices, offsets, weights, mode) if bags is None else bags
        flat = bags.indices
        ahead = self._take_ahead(flat)
        if ahead is not None:
            self._prefetch_outcome(ahead.placed)
        if ahead is not None and ahead.placed:
            if self._staged.size:
                self._join()
                self._finish_staging()
            slots = ahead.slots  # runs beside a prefetch of the next batch, which never moves these rows
            self._inflight_stamp = ahead.stamp
        else:
            self._join()
            self._finish_staging()
            with self._ahead_lock:  # batches prefetched after this one keep their rows
                later = [a.stamp for a in self._ahead]
            slots = self._place(self.backend.asarray(flat).astype(np.int64, copy=False), count=ahead is None,
                                lock=min(later) if later else None)
            self._inflight_stamp = self._clock
        dtype = _slot_type([self])
        dbags = ops.upload_bags(self.backend, bags, offsets is not None, slots.astype(dtype, copy=False))
        self._last = dbags.idx
        self._before_update = self.backend.fence()
        self._memo = (indices, offsets, weights, mode, self._generation, dbags)
        return dbags

    def prefetch(self, indices: Any) -> bool:
        """Resolve ``indices`` (the next batch) now, while the current batch computes; whether
        every row found a slot (then the lookup of the same indices reuses them). Counts the
        batch's hits and misses (its lookup then does not)."""
        return self.prefetch_works([self], [indices])[0]()

    @classmethod
    def prefetch_works(cls, tables: Sequence["LRUCachedEmbeddings"], indices: Sequence[Any]) -> list[Callable[[], bool]]:
        """:meth:`prefetch` in two parts, for several tables: every batch validated now (the first
        error raises before any table is touched), then the device work, which may run on
        another thread with its own stream beside the lookup and update of the batches in use
        (whose slots it never touches): one function per group of tables that can be placed
        together (:mod:`.lru_group`: same device, row size and optimizer state), and for a
        table with rows staged one that places nothing. Each returns whether every row of its
        tables found a slot. Each batch is checked as it is copied into a page-locked block of
        the type its table's rows fit (int32 below 2**31 rows), which the device work uploads
        as it is: joining the batches there took that thread 3 ms of a DLRM step. Every
        table's batch is checked and copied in one parallel pass, one wake-up of the threads."""
        flats = [t.validate(idx, None, None, None, known_valid=True).indices  # the range is checked below
                 for t, idx in zip(tables, indices)]
        blocks, bad = checked_index_blocks([t.backend for t in tables], flats, [t.nvectors() for t in tables])
        for t, idx, first in zip(tables, indices, bad):
            if first >= 0:
                t.validate(idx, None, None, None)  # raises a lookup's error, naming the position
        works: list[Callable[[], bool]] = []
        kinds: dict = {}
        for t, flat, block in zip(tables, flats, blocks):
            before = t._before_update  # _join forgets it
            t._join(home=False)
            if t._staged.size:
                t._prefetch_outcome(False)
                works.append(lambda: False)
            else:
                kinds.setdefault((t.backend.xp, t._W.shape[1], t._dstate is None, t.reads, block.dtype),
                                 []).append((t, flat, block, before))
        for group in kinds.values():
            ts, fs, bs, afters = (list(part) for part in zip(*group))
            works.append(_place_work(ts, fs, bs, afters))
        return works

    def validate(self, indices: Any, offsets: Any, weights: Any, mode: str | None,
                 known_valid: bool = False) -> Bags:
        """:meth:`.cached.DeviceCache.validate`, without checking the range of host indices equal to
        a prefetched batch's again (the prefetch checked them; comparing reads them once, as the
        check would). The batch's lookup then finds its placement without comparing again."""
        ahead = None
        if not known_valid and isinstance(indices, np.ndarray) and indices.dtype.kind in "iu":
            flat = indices.reshape(-1)
            with self._ahead_lock:
                ahead = next((a for a in self._ahead if _same(a.flat, flat)), None)
        bags = super().validate(indices, offsets, weights, mode, known_valid or ahead is not None)
        self._validated = None if ahead is None else (bags.indices, ahead)
        return bags

    def _take_ahead(self, flat: np.ndarray) -> Ahead | None:
        """The prefetched placement of ``flat``, dropping those prefetched before it. When there is
        none, the placements started since the previous lookup stay (they are the next batches':
        a trainer starts the next batch's prefetch before the current lookup, and it may have
        landed already) and older ones are dropped: they were skipped, and while queued they
        lock their ways. A prefetched placement stays valid until it is taken or dropped: later
        placements lock its ways, and whatever drops cached rows (flushes, invalidation) drops
        it too."""
        known, self._validated = self._validated, None
        with self._ahead_lock:
            found = None
            if known is not None and known[0] is flat:  # validate found it (if it is still queued)
                found = next((i for i, a in enumerate(self._ahead) if a is known[1]), None)
            if found is None:
                found = next((i for i, a in enumerate(self._ahead) if _same(a.flat, flat)), None)
            if found is None:
                self._ahead = collections.deque(a for a in self._ahead if a.since == self._lookups)
            else:
                for _ in range(found):
                    self._ahead.popleft()
            self._lookups += 1
            return None if found is None else self._ahead.popleft()

    def _prefetch_outcome(self, placed: bool) -> None:
        """Count a prefetched batch whose lookup must place it itself (some row found no way,
        or rows were still staged when it was prefetched) and warn, once, when three in a row
        did: then the cache cannot hold the rows of the batches in flight, and every lookup
        places its batch on the caller's thread, staging what does not fit."""
        if placed:
            self._fallbacks_in_a_row = 0
            return
        self.prefetch_fallbacks += 1
        self._fallbacks_in_a_row += 1
        if self._fallbacks_in_a_row == 3:
            warnings.warn(f"{self.name}: three prefetched batches in a row did not fit the cache ({self.sets} sets "
                          f"of {self.ways} ways must hold the rows of the batch in use and of the next one): their "
                          "lookups place them again and stage what does not fit, which is slow; give the cache "
                          "more rows (--cache-fraction, --fast-budget) or use smaller batches", RuntimeWarning,
                          stacklevel=4)

    def _join(self, home: bool = True) -> None:
        """Wait for a prefetch of this table running on another thread and, when ``home``, for
        the rows its last placement sent home to land in the host table. Every operation but
        the update of the batch in flight (whose slots a prefetch never touches) does, so a
        caller who skips the prefetcher's ``finish`` cannot race it; starting a prefetch waits
        for the prefetch only (its placement drains the rows before it reads any)."""
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None
        self._before_update = None  # an operation other than the update follows
        if home:
            LG.drain([self])

    def _place(self, idx: Any, count: bool = True, lock: int | None = None) -> Any:
        """Slots for the flat device indices ``idx`` under a new stamp (:func:`.lru_group.place`
        for this table alone, the ways of this batch locked, and those of stamps from ``lock``
        on when given): hits stamped, misses admitted into the least recently used ways of
        their sets, the rest staged; hits and misses counted when ``count``. The host waits for
        the front's counts (:func:`.lru_group.place`) and for the placement's counts."""
        xp = self.backend.xp
        self._clock += 1
        n = int(idx.size)
        if n == 0:
            return xp.empty(0, np.int64)
        g = LG.Group([self], [n], [self._clock], [self._clock if lock is None else min(lock, self._clock)])
        p = LG.place(g, idx, xp, count)
        self._generation += 1
        if _sync_counts(g)[0]:
            rest = xp.flatnonzero(p.first & (p.victim < 0))
            p.victim[rest] = self._nslots + self._stage(p.row[rest])
        return LG.slots(g, p)

    def _account_counts(self, counts: np.ndarray) -> bool:
        """Account the moves of the last placement to the manager from the table's ``counts``
        as read on the host (:func:`_sync_counts`); whether it left a row out (found no way)."""
        seen = np.array(counts[2:4])
        admitted, back = (int(d) for d in seen - self._seen)
        self._seen = seen
        self.rows_written_back += back
        m = self.manager
        if back:
            m.account(m.fast, m.slow, back * self._rowbytes, 0.0)
        if admitted:
            m.account(m.slow, m.fast, admitted * self._rowbytes, 0.0)
        return bool(counts[4])

    def _homes(self, rows: bool = True, state: bool = True) -> list[tuple[Any, Any]]:
        """(device array, its home as the device sees it) for the rows (when ``rows``) and
        Adagrad's accumulator (when ``state`` and there is one): what moves with a row."""
        pairs = [(self._W, self._hbase)] if rows else []
        if state and self._dstate is not None:
            pairs.append((self._dstate, self._hstate_dev))
        return pairs

    def _copy(self, drow: Any, srow: Any, n: int, down: bool, base: int = 0, state: bool = True) -> None:
        """Rows (and Adagrad's accumulator when ``state``) between the device arrays and the
        host: ``down`` copies device rows ``srow`` to host rows ``drow``, else host rows ``srow``
        to device rows ``drow``; a None index array stands for ``base + arange(n)``."""
        for dev, home in self._homes(state=state):
            if down:
                LK.copy_rows(home, drow, dev, srow, n, sbase=base)
            else:
                LK.copy_rows(dev, drow, home, srow, n, dbase=base)

    def _stage(self, rows: Any) -> Any:
        """Read the distinct ``rows`` into the staging area; their staging positions."""
        n = int(rows.size)
        self._grow_staging(n)
        self._copy(None, rows, n, down=False, base=self._nslots)
        self._staged = rows
        self._generation += 1
        self.manager.account(self.manager.slow, self.manager.fast, n * self._rowbytes, 0.0)
        return self.backend.xp.arange(n, dtype=np.int64)

    def _grow_staging(self, n: int) -> None:
        """Room for ``n`` staged rows (the staging area is empty when this is called): a new
        array, the cached rows going through the host so that two never hold HBM together."""
        S = self._nslots
        have = self._W.shape[0] - S
        if n <= have:
            return
        be = self.backend
        new = n + n // 4
        held = be.to_host(self._W[:S])
        st = be.to_host(self._dstate[:S]) if self._dstate is not None else None
        self._hbm.drop(self._W)
        if st is not None:
            self._hbm.drop(self._dstate)
            self._dstate = None
        try:
            self._W = self._hbm.new((S + new, held.shape[1]))
            refused = False
        except MemoryError:
            self._W = self._hbm.new((S + have, held.shape[1]))  # as before, so the table stays usable
            refused = True
        self._W[:S] = be.asarray(held)
        if st is not None:
            self._dstate = self._hbm.new((self._W.shape[0],), np.float32)
            self._dstate[:S] = be.asarray(st)
        self._generation += 1
        if refused:
            raise self._staging_refused(n, f"{S}-slot cache")

    def _finish_staging(self, updated: bool = False) -> None:
        """Empty the staging area, writing its rows (and their accumulators) back to the base
        table when they were ``updated``. Staged rows never wait updated: :meth:`updated`
        writes them back at once."""
        n = int(self._staged.size)
        if n == 0:
            return
        self._before_update = None  # host rows change: the next placement may read them
        if updated:
            self._copy(self._staged, None, n, down=True, base=self._nslots)
            self.manager.account(self.manager.fast, self.manager.slow, n * self._rowbytes, 0.0)
        self._staged = self._staged[:0]
        self._generation += 1

    def updated(self) -> None:
        """Note that the batch resolved last was updated: its slots are dirty, and its staged rows
        go home now (a prefetch of the next batch, which may read them from the host, is not
        started while rows are staged)."""
        if self._last is not None and self._last.size:
            LK.mark_dirty(self._last, self._dirty, self._nslots)
        self._finish_staging(updated=True)

    # ------------------------------------------------------------------ optimizer state
    def _load_state(self, optimizer: RowwiseAdagrad) -> None:
        """``_dstate`` from ``optimizer``'s host accumulator (:meth:`DeviceCache.device_state`),
        mapped for the device (page-locked first: it is the optimizer's plain array)."""
        self._join()
        self._state_down()
        if self._dstate is not None:
            self._hbm.drop(self._dstate)
        self._hstate_dev = self._map_state(optimizer.state(self))
        self._dstate = self._hbm.new((self._W.shape[0],), np.float32)
        live = self.backend.xp.flatnonzero(self._tags >= 0)
        LK.copy_rows(self._dstate, live, self._hstate_dev, self._tags[live], int(live.size))
        LK.copy_rows(self._dstate, None, self._hstate_dev, self._staged, int(self._staged.size), dbase=self._nslots)

    def _state_down(self) -> None:
        """Copy the device accumulator of every cached row to the host one (staged rows' went home
        with their update)."""
        if self._dstate is None:
            return
        xp = self.backend.xp
        live = xp.flatnonzero(self._tags >= 0)
        LK.copy_rows(self._hstate_dev, self._tags[live], self._dstate, live, int(live.size))
        self.backend.sync()

    # ------------------------------------------------------------------ whole-cache operations
    @property
    def counts(self) -> np.ndarray:
        """Hits, misses, rows admitted (read from the device)."""
        self._join()
        return np.array(self.backend.to_host(self._counts[:3]))

    @property
    def cached_rows(self) -> int:
        return int((self._tags >= 0).sum())

    def isfull(self) -> bool:
        return self.cached_rows == self._nslots

    def writeback(self) -> None:
        """Write every updated cached row back to the base table and keep it cached
        (e.g. before a checkpoint); Adagrad's accumulator too. The base table is current when
        this returns."""
        self._check_open()
        self._join()
        self._finish_staging()
        xp = self.backend.xp
        d = xp.flatnonzero((self._tags >= 0) & self._dirty[:self._nslots])
        if d.size:
            self._copy(self._tags[d], d, int(d.size), down=True, state=False)
            self.rows_written_back += int(d.size)
            self.manager.account(self.manager.fast, self.manager.slow, int(d.size) * self._rowbytes, 0.0)
        self._dirty.fill(False)
        self._state_down()
        self.backend.sync()

    def flush_dirty(self, target: int | None = None) -> None:
        """Write every updated row back and empty the cache (``target``: accepted for the
        cached-table API; this cache empties fully)."""
        self.writeback()
        self._drop_all()

    def flush_clean(self, target: int | None = None) -> None:
        """Empty the cache without writing anything back (the base table is current)."""
        self._check_open()
        self._join()
        self._finish_staging()
        self._drop_all()

    def _drop_rows(self) -> None:
        """Every slot free: no tag, stamp 0, clean, no use."""
        self._tags.fill(-1)
        self._stamp.fill(0)
        self._dirty.fill(False)
        if self._uses is not None:
            self._uses.fill(0)

    def _drop_all(self) -> None:
        self._drop_rows()
        self._ahead.clear()
        self._memo = None
        self._generation += 1

    def invalidate(self) -> None:
        """Drop every cached and staged row without writing it back, after the base table (and
        the optimizer's host state) were replaced, e.g. by loading a checkpoint."""
        self._check_open()
        self._join()
        self._staged = self._staged[:0]
        if self._dstate is not None:
            self._hbm.drop(self._dstate)
        self._unmap_state()
        self._opt = self._hstate_dev = self._dstate = None
        self._drop_all()

    def close(self) -> None:
        """Write everything back, then free the device arrays and undo host mappings."""
        self._join()
        LF.forget(self)
        UG.forget(self)
        if not self._pins:
            return
        if getattr(self, "_hbase", None) is not None:
            self.writeback()
        self._hbm.close()
        if getattr(self, "_state_map", None) is not None:
            self._unmap_state()
        views, self._pins = self._pins, []
        for v in views:
            v.release()
        self._W = self._dstate = self._hbase = None
        self._memo = None
        if hasattr(self, "_ahead"):
            self._ahead.clear()

    def _check_open(self) -> None:
        if not self._pins:
            raise RuntimeError(f"{self.name}: table is closed")

    # ------------------------------------------------------------------ reporting and checking
    def telemetry(self) -> dict:
        hits, misses, admitted = (int(c) for c in self.counts)
        return self._traffic(hits, misses, admitted, sets=self.sets, ways=self.ways,
                             prefetch_fallbacks=self.prefetch_fallbacks, prefetch_cpu_s=self.prefetch_cpu_s)

    def reset_counters(self) -> None:
        self._join()
        self._counts.fill(0)
        self._seen[:] = 0
        self.prefetch_fallbacks = 0
        self.prefetch_cpu_s = 0.0

    def check(self) -> None:
        """Every tag a row of the table, in its own set, at most once; dirty bits and stamps
        only where they can be; staged rows not cached."""
        self._join()
        be, name = self.backend, self.name
        tags = be.to_host(self._tags)
        stamp = be.to_host(self._stamp)[:self._nslots]
        dirty = be.to_host(self._dirty)[:self._nslots]
        live = tags >= 0
        rows = tags[live]
        if np.any(tags < -1) or np.any(rows >= self.nvectors()):
            raise InvariantError(f"{name}: tags outside the table: {tags[(tags < -1) | (tags >= self.nvectors())][:5]}")
        uniq, n = np.unique(rows, return_counts=True)
        if np.any(n > 1):
            raise InvariantError(f"{name}: rows {uniq[n > 1][:5]} are cached in more than one slot")
        home = LK.set_of(rows, self.sets)
        if np.any(home != np.flatnonzero(live) // self.ways):
            raise InvariantError(f"{name}: rows {rows[home != np.flatnonzero(live) // self.ways][:5]} sit outside "
                                 f"their set")
        if np.any(dirty & ~live):
            raise InvariantError(f"{name}: free slots {np.flatnonzero(dirty & ~live)[:5]} are marked dirty")
        if np.any(stamp > self._clock) or np.any(stamp < 0):
            raise InvariantError(f"{name}: stamps beyond the clock ({self._clock})")
        if self._uses is not None:
            uses = be.to_host(self._uses)
            if np.any(uses[live] < 1) or np.any(uses[live] > np.maximum(stamp[live], 1)) or np.any(uses[~live] != 0):
                raise InvariantError(f"{name}: counts of use outside [1, stamp] for cached rows or not 0 for free slots")
        staged = be.to_host(self._staged)
        if np.intersect1d(staged, rows).size:
            raise InvariantError(f"{name}: rows {np.intersect1d(staged, rows)[:5]} are both cached and staged")

    def __repr__(self) -> str:
        return (f"LRUCachedEmbeddings({self.name!r}, nvectors={self.nvectors()}, featuresize={self.featuresize()}, "
                f"{self.sets} sets x {self.ways} ways, {self.replacement})")


class Ahead(NamedTuple):
    """A prefetched batch: its host indices, its slots on the device, the stamp of its
    placement, whether every row found a slot, and how many lookups its table had seen when
    the prefetch started."""
    flat: np.ndarray
    slots: Any
    stamp: int
    placed: bool
    since: int


def _sync_counts(g: LG.Group) -> list[bool]:
    """Wait for the counts of placement group ``g``'s tables (rows admitted, written back,
    whether a row was left out: one launch and one wait for all, :func:`.lru_group.mail`),
    account their moves to the manager and say, per table, whether some row found no way."""
    return [t._account_counts(counts) for t, counts in zip(g.tables, LG.mail(g))]


def _slot_type(tables: Sequence[LRUCachedEmbeddings]) -> type:
    """The type of the slots a lookup of these tables reads (int32 while every table's slots,
    staging rows included, number below 2**31)."""
    return np.int32 if all(t._W.shape[0] < 2 ** 31 for t in tables) else np.int64


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal index arrays. Views of the same memory are equal without reading it (comparing
    memory with itself could only say so: a prefetched batch that the caller changed in place
    is not detected either way, the prefetch keeps no copy); a full comparison read both arrays
    of a trainer's batch, 8 x 2.6 MB, for 3 ms a step beside the CPU threads moving rows.
    Different batches usually differ in their first entries, which are compared first."""
    if a is b or _same_memory(a, b):
        return True
    return a.shape == b.shape and np.array_equal(a[:64], b[:64]) and np.array_equal(a, b)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _unmap(backend: Any, handle: Any, host: np.ndarray) -> None:
    """Undo a mapping of ``host`` (passed only to keep it alive until this runs)."""
    backend.unmap(handle)


def _place_work(tables: list[LRUCachedEmbeddings], flats: list[np.ndarray], blocks: list[np.ndarray],
                after: list) -> Callable[[], bool]:
    """The device work of prefetching ``flats[i]`` into ``tables[i]`` (validated, joined, none
    with staged rows; copied into page-locked ``blocks[i]``, all of one type): each table is
    busy until it finishes (:meth:`~LRUCachedEmbeddings._join`),
    except for lookups of a batch prefetched before (:meth:`~LRUCachedEmbeddings.resolve`) and
    the update of the batch in flight. Both keep their slots: each table's lock is the stamp of
    the oldest prefetched batch not yet looked up, else of the batch looked up last (taken now,
    in the caller's thread). Work queued before this prefetch is done before it starts, except
    the update of the batch looked up last where that is the only work queued on every table
    since its lookup (``after``: each table's ``_before_update``, the events to wait for
    instead, handed to the prefetcher as ``work.after``). That update writes only its batch's
    slots and dirty bits, so then the lock keeps that batch's ways too, even with later batches
    queued, and the placement need not wait for the update: the DLRM trainer does not wait
    for its update on the host, and the next placement would start behind it. On the
    prefetcher's stream the placement's front is a CUDA graph replayed (:mod:`.lru_front`)."""
    locks, events, since = [], [], [t._lookups for t in tables]
    relaxed = all(a is not None for a in after)
    for t in tables:
        stamps = [s for s in (t._ahead[0].stamp if t._ahead else 0,
                              t._inflight_stamp if relaxed or not t._ahead else 0) if s]
        locks.append(min(stamps) if stamps else None)
        t._inflight = threading.Event()
        events.append(t._inflight)

    def work() -> bool:
        be = tables[0].backend
        cpu = time.thread_time()
        try:
            now = []
            for t in tables:
                t._clock += 1
                now.append(t._clock)
            # the batches go up as they are (int32 below 2**31 rows: half the bytes), widened there
            g, front = LF.place(tables, [f.size for f in flats], now, [lk or n for lk, n in zip(locks, now)], blocks)
            # copied out of the front's arrays, which the next placement overwrites; of the type lookups use
            slots = LG.slots(g, LG.place_front(g, front)).astype(_slot_type(tables))
            placed = [not left_out for left_out in _sync_counts(g)]
            for i, t in enumerate(tables):
                with t._ahead_lock:
                    t._ahead.append(Ahead(flats[i], slots[g.span(i)], now[i], placed[i], since[i]))
            return all(placed)
        finally:
            be.sync()  # this thread's stream: every write of the prefetch has landed
            cpu = (time.thread_time() - cpu) / len(tables)
            for t in tables:
                t.prefetch_cpu_s += cpu
            for ev in events:
                ev.set()
    work.after = after if relaxed else None
    return work
