"""`CachedEmbeddings`: a software cache of hot rows in the fast device over a table in the slow device.

The dissertation's section 5.4.  The base table is a CachedArray in the slow device (PM).  A
pointer table (one int64 per row: the address of the row's primary copy, with the low bits
used as cached flag and lock bit) says where each row is; rows move into a ring of cache pages
in the fast device (DRAM) when a lookup touches them (`access_and_cache`, the Forward context)
and are written back a page at a time, oldest first (`flush_dirty`).  Updates write to wherever
the row currently lives.  The cache pages, the pointer table and the back-edges are CachedArrays
allocated in the fast device through the manager, so its telemetry sees them, and row copies are
reported to it too.

Policies (section 5.6.1): ``simple`` (no indirection: every row read from PM), ``static`` (fill
the cache once with a given hot set, or random rows, then never cache again) and ``dynamic``
(cache on forward access until full; flush the oldest pages when the limit is reached).

Beyond the dissertation, the dynamic policy keeps a per-row access count (one byte per row in
the fast device, halved every ``age_window`` cache sizes of accesses) and, once the cache has
filled, caches a missed row only when it was accessed at least ``admit`` times in that window
(a TinyLFU-style doorkeeper): under Zipf(1) most misses are rows seen once, and caching them
flushed hot rows.  With a 10% cache this lifts the steady-state hit rate from about 0.78 to
about 0.82 (an oracle holding the true top 10% gets 0.84).

The table pins its arrays for as long as it is open (kernels hold raw views of them); `close`
releases them.  Sizes (`cachelower`, `cacheslack`) are counted in rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np

from cachedarrays import CachedArray, Manager, evict, unsafe_free, writable
from cachedarrays.errors import InvariantError

from . import config
from .kernels import cache as K
from .kernels.rowaccess import entries
from .protocol import Context, EmbeddingTable, Forward, RowSource
from .simple import _codec_for, _storage

POLICIES = ("simple", "static", "dynamic")
PAGE_BYTES = 256 << 10
PAGES_PER_CACHE = 32  # flushing drops whole pages, so a page is a small part of the cache


_NO_FREQ = np.empty(0, np.uint8)


def _nchunks(n: int) -> int:
    """Work items for a parallel pass over ``n`` indices: a few per thread, none empty."""
    return max(1, min(n, 4 * numba.get_num_threads()))


def open_base(base: Any, manager: Manager | None, name: str) -> tuple[CachedArray, Manager, Any]:
    """A cached table's base: ``base`` in the slow device (a plain array is copied into a new
    CachedArray there), pinned for as long as the table is open. Returns the CachedArray, its
    manager and the pinned view."""
    if isinstance(base, CachedArray):
        manager = base.manager
    elif manager is None:
        raise TypeError(f"{name}: a manager is needed to place a plain array in the slow device")
    else:
        base = CachedArray(np.asarray(base), manager, place="slow")
    if manager.policy.in_fast(base.object):
        evict(base)
    return base, manager, writable(base)


def cache_size(cache_rows: int | None, cache_fraction: float, nvectors: int, name: str) -> int:
    """Rows a cache of ``cache_rows`` (or ``cache_fraction`` of ``nvectors`` rows, at least one)
    holds; ValueError naming the table unless between 1 and ``nvectors``."""
    rows = int(cache_rows) if cache_rows is not None else max(1, int(round(cache_fraction * nvectors)))
    if not 1 <= rows <= nvectors:
        raise ValueError(f"{name}: cache of {rows} rows must hold between 1 and {nvectors} rows")
    return rows


class BaseRows:
    """What every cached table (CPU or GPU) shares: the table protocol's shape, read from its
    base (``_base``: the base rows as stored, ``_dtype``: their element type, ``base_array``),
    and the form of its traffic report (``name``, ``policy``, ``rows_written_back``,
    ``_rowbytes``, ``cached_rows``; ``telemetry`` built with :meth:`_traffic`)."""

    def _traffic(self, hits: int, misses: int, cached: int, **extra: Any) -> dict:
        """The telemetry keys every cached table reports, then ``extra``."""
        return {
            "table": self.name, "policy": self.policy, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "rows_cached": cached, "rows_written_back": self.rows_written_back,
            "bytes_slow_to_fast": cached * self._rowbytes, "bytes_fast_to_slow": self.rows_written_back * self._rowbytes,
            "cached_rows_now": self.cached_rows, **extra,
        }

    def hitrate(self) -> float:
        return self.telemetry()["hit_rate"]

    def eltype(self) -> np.dtype:
        return self._dtype

    def featuresize(self) -> int:
        return int(self._base.shape[1])

    def nvectors(self) -> int:
        return int(self._base.shape[0])

    def example(self) -> Any:
        return self.base_array


class CachedEmbeddings(BaseRows, EmbeddingTable):
    """An embedding table whose hot rows are cached in the fast device.

    ``base`` is a 2-d CachedArray (moved to the slow device if it is not there) or an
    array-like, copied into a new CachedArray in the slow device of ``manager`` (updates then go
    to that copy, never to the caller's array). Either way the base table and the cache start on
    a cache line (regions are 64-byte aligned), as ``SimpleEmbedding`` places its rows.
    ``cache_rows`` (or ``cache_fraction`` of the rows) bounds the cache:
    ``cachelower + cacheslack == cache_rows``; ``cacheslack`` defaults to a tenth of it (at
    least one page).  ``hot`` gives the rows the static policy caches (default: random rows
    drawn with ``seed``).  ``second_chance`` (default on) lets a flush keep rows that were hit
    since they were cached, moving them to the newest page (a CLOCK-style refinement of the
    dissertation's plain oldest-page-first flush, which ``second_chance=False`` restores).
    ``admit`` and ``age_window`` set the dynamic policy's admission filter (see the module
    docstring); ``admit=1`` caches every miss, as in the dissertation.
    """

    def __init__(self, base: Any, manager: Manager | None = None, *, policy: str = "dynamic",
                 cache_rows: int | None = None, cache_fraction: float = 0.1, cacheslack: int | None = None,
                 page_rows: int | None = None, hot: Any = None, seed: int = 0, second_chance: bool = True,
                 admit: int = 2, age_window: float = 10.0, name: str = "table") -> None:
        view = self._open_base(base, manager, policy, second_chance, name)
        if view.ndim != 2 or not view.flags.c_contiguous:
            raise ValueError(f"{name}: table must be a row-major 2-d array, got shape {view.shape}")
        self._codec, storage_dtype = _codec_for(view.dtype)
        self._dtype = view.dtype
        self._base = _storage(view, storage_dtype)
        nvectors, featuresize = self._base.shape
        self._rowbytes = featuresize * self._base.itemsize
        self.counts = np.zeros(3, np.int64)  # hits, misses, rows cached
        self.rows_written_back = 0
        self.flushes = 0
        self._dirty = False
        self._cache = self._ptr = self._slots = self._backedge = self._ref = None
        self._freq = np.empty(0, np.uint8)  # per-row access counts (dynamic policy only)
        self._since_ageing = 0
        self._filling = True  # no flush since the cache was last empty: cache every miss
        self._lookups_open = self._lookups_pending = 0  # static policy: Forward blocks whose hits are pending
        if admit < 1 or age_window <= 0:
            raise ValueError(f"{name}: admit must be >= 1 and age_window > 0, got {admit}, {age_window}")
        self.admit, self.age_window = int(admit), float(age_window)
        self.state = np.zeros(5, np.int64)
        self.cachelower = self.cacheslack = 0
        if policy == "simple":
            return
        rows = cache_size(cache_rows, cache_fraction, nvectors, name)
        self.page_rows = int(page_rows or max(1, min(-(-rows // PAGES_PER_CACHE), PAGE_BYTES // max(1, self._rowbytes))))
        ring = -(-rows // self.page_rows) * self.page_rows
        self._cache = self._fast((ring, featuresize), storage_dtype)
        # The pointer table plus one entry: ``_slots[nvectors]`` counts the cached rows the lookup
        # kernels read (see ``rowaccess.record_hits``), so hits need no pass of their own.
        self._slots = self._fast(np.append(entries(self._base, np.arange(nvectors)), 0))
        self._ptr = self._slots[:nvectors]
        self._backedge = self._fast(np.full(ring, -1, np.int64))
        self._ref = self._fast(np.zeros(ring, np.uint8))
        if policy == "dynamic":
            self._freq = self._fast(np.zeros(nvectors, np.uint8))
        self.state[:] = (0, 0, rows, ring, 0)
        slack = min(rows, int(cacheslack if cacheslack is not None else max(self.page_rows, rows // 10)))
        self._set_bounds(rows - slack, slack)
        if policy == "static":
            self._fill_static(hot, seed)

    def _open_base(self, base: Any, manager: Manager | None, policy: str, second_chance: bool, name: str) -> Any:
        """Check the policy and open ``base`` (:func:`open_base`); its view's array."""
        if policy not in POLICIES:
            raise ValueError(f"{name}: unknown policy {policy!r}; choose from {POLICIES}")
        self.base_array, self.manager, pin = open_base(base, manager, name)
        self.name, self.policy, self.second_chance = name, policy, second_chance
        self._pins = [pin]
        return pin.array

    def _fast(self, shape_or_data: Any, dtype: Any = None) -> np.ndarray:
        arr = CachedArray(shape_or_data, self.manager, dtype, place="fast")
        view = writable(arr)
        self._pins.append(view)
        return view.array

    def _fill_static(self, hot: Any, seed: int) -> None:
        limit = int(self.state[K.LIMIT])
        if hot is None:
            rows = np.random.default_rng(seed).choice(self.nvectors(), size=limit, replace=False)
        else:
            rows = np.asarray(hot, dtype=np.int64).ravel()
            if rows.size and (rows.min() < 0 or rows.max() >= self.nvectors()):
                raise IndexError(f"{self.name}: hot rows must be in [0, {self.nvectors()})")
        self._hot = rows
        self._refill()

    def _refill(self) -> None:
        rows = self._hot
        limit = int(self.state[K.LIMIT])
        t0 = time.perf_counter()
        h0 = int(self.state[K.HEAD])
        K.access_and_cache_serial(self._base, self._cache, self._ptr, self._backedge, self._ref, _NO_FREQ,
                                  self.state, rows.astype(np.int64)[:limit], 0, self.counts)
        self._admitted(h0, time.perf_counter() - t0)
        self.counts[:] = 0  # the fill is not traffic of the workload

    # ------------------------------------------------------------------ table protocol
    @contextmanager
    def rows(self, context: Context | None, indices: np.ndarray | None = None,
             writable: bool = False) -> Iterator[RowSource]:
        """Forward context with indices: `access_and_cache` (dynamic policy, which counts hits and
        misses as it goes); for the static policy the lookup kernels count the hits they read
        through the pointer table (fused, no extra pass), added to the telemetry when the block ends."""
        self._check_open()
        counting = False
        if isinstance(context, Forward) and indices is not None:
            if self.policy == "dynamic":
                self.access_and_cache(indices)
            elif self.policy == "simple":
                self.counts[1] += np.size(indices)
            else:
                counting = True
                if self._lookups_open == 0:  # blocks may nest: one table can serve two features of an ensemble
                    self._slots[-1] = 0
                    self._lookups_pending = 0
                self._lookups_open += 1
                self._lookups_pending += np.size(indices)
        if writable:
            self._dirty = True
        if self.policy == "simple":
            yield RowSource(self._base, None, None, self._codec, self._dtype)
            return
        try:
            yield RowSource(self._base, self._cache, self._slots, self._codec, self._dtype)
        finally:
            if counting:
                self._lookups_open -= 1
                if self._lookups_open == 0:
                    hits = int(self._slots[-1])
                    self.counts[0] += hits
                    self.counts[1] += self._lookups_pending - hits

    # ------------------------------------------------------------------ Table 5.4
    def access_and_cache(self, indices: np.ndarray) -> None:
        """Cache the rows of ``indices`` that are not cached, while room lasts (flushing first if full)."""
        if self.isfull():
            if self._dirty:
                self.flush_dirty()
            else:
                self.flush_clean()
        idx = np.ascontiguousarray(indices).ravel()
        if idx.size == 0:
            return
        t0 = time.perf_counter()
        self.state[K.ADMIT] = 1 if self._filling or self._freq.size == 0 else self.admit
        h0 = int(self.state[K.HEAD])
        self._admission(idx, self.counts)
        self._age(idx.size)
        self._admitted(h0, time.perf_counter() - t0)

    def _admission(self, idx: np.ndarray, counts: np.ndarray) -> None:
        """The admission kernel over ``idx`` (``state[ADMIT]``, ``_freq``); ``counts += (hits,
        misses, cached)``. New rows take ring positions from ``HEAD`` on."""
        if self._small(idx):
            K.access_and_cache_serial(self._base, self._cache, self._ptr, self._backedge, self._ref, self._freq,
                                      self.state, idx, self.state[K.ADMIT], counts)
        else:
            K.access_and_cache(self._base, self._cache, self._ptr, self._backedge, self._ref, self._freq,
                               self.state, idx, _nchunks(idx.size), counts)

    def _admitted(self, h0: int, seconds: float) -> None:
        """Ring positions ``[h0, HEAD)`` were just cached (their rows copied from the slow device)."""
        self._account_cached(int(self.state[K.HEAD]) - h0, seconds)

    def _age(self, accesses: int) -> None:
        """Halve the access counts every ``age_window`` cache sizes of accesses, so they follow a drifting hot set."""
        self._since_ageing += accesses
        if self._freq.size and self._since_ageing >= self.age_window * int(self.state[K.LIMIT]):
            np.right_shift(self._freq, 1, out=self._freq)
            self._since_ageing = 0

    def access(self, indices: np.ndarray) -> None:
        """Count an access to ``indices`` without caching (every context but Forward)."""
        self._count(indices)

    def _count(self, indices: np.ndarray, counts: np.ndarray | None = None) -> None:
        """``counts`` (default: the table's) ``+= (hits, misses)`` of ``indices``, caching nothing."""
        counts = self.counts if counts is None else counts
        idx = np.ascontiguousarray(indices).ravel()
        if self.policy == "simple":
            counts[1] += idx.size
        elif self._small(idx):
            K.count_hits_serial(self._ptr, idx, counts)
        elif idx.size:
            K.count_hits(self._ptr, idx, _nchunks(idx.size), counts)

    def _small(self, idx: np.ndarray) -> bool:
        """Whether a pass over ``idx`` runs on the calling thread (the lookups' threshold)."""
        return config.serial(idx.size * self.featuresize())

    def set_cachelower(self, rows: int) -> None:
        """Flushes stop once the cache holds at most ``rows`` rows."""
        self._set_bounds(int(rows), self.cacheslack)

    def set_cacheslack(self, rows: int) -> None:
        """The cache may grow to ``cachelower + rows`` rows before it is full."""
        self._set_bounds(self.cachelower, int(rows))

    def _set_bounds(self, lower: int, slack: int) -> None:
        ring = int(self.state[K.RING])
        if lower < 0 or slack < 0 or lower + slack > ring or lower + slack < 1:
            raise ValueError(f"{self.name}: cachelower ({lower}) + cacheslack ({slack}) must be between 1 and the "
                             f"{ring} rows allocated for the cache")
        self.cachelower, self.cacheslack = lower, slack
        self.state[K.LIMIT] = lower + slack

    @property
    def cached_rows(self) -> int:
        return int(self.state[K.HEAD] - self.state[K.TAIL])

    def isfull(self) -> bool:
        return self.policy != "simple" and self.cached_rows >= self.state[K.LIMIT]

    def flush_clean(self, target: int | None = None) -> None:
        """Drop the oldest pages until at most ``target`` (default ``cachelower``) rows stay; no write-back.

        Refused when rows were updated since they were cached (their only copy is in the cache).
        """
        if self._dirty:
            raise ValueError(f"{self.name}: the cache holds updated rows; flush_clean would lose them, use flush_dirty")
        self._flush(target, writeback=False)

    def flush_dirty(self, target: int | None = None) -> None:
        """Write back and drop the oldest pages until at most ``target`` (default ``cachelower``) rows stay."""
        self._flush(target, writeback=True)

    def _flush(self, target: int | None, writeback: bool) -> None:
        if self.policy == "simple":
            return
        target = self.cachelower if target is None else int(target)
        spare = self.second_chance and target > 0
        t0 = time.perf_counter()
        written = 0
        while self.cached_rows > target:
            tail, page = int(self.state[K.TAIL]), self.page_rows
            stop = min((tail // page + 1) * page, int(self.state[K.HEAD]))
            written += K.flush_page(self._base, self._cache, self._ptr, self._backedge, self._ref, self.state,
                                    stop, writeback, spare)
        self._flushed(written, time.perf_counter() - t0)

    def _flushed(self, written: int, seconds: float) -> None:
        """Count a flush that wrote ``written`` rows back in ``seconds``; an empty cache is clean."""
        self.flushes += 1
        self._filling = self.cached_rows == 0
        if self.cached_rows == 0:
            self._dirty = False
        if written:
            self.rows_written_back += written
            self.manager.account(self.manager.fast, self.manager.slow, written * self._rowbytes, seconds)

    def writeback(self) -> None:
        """Copy every cached row back to the base table and keep it cached (e.g. before a checkpoint)."""
        if self.policy == "simple" or not self._dirty:
            return
        t0 = time.perf_counter()
        written = int(K.write_back_live(self._base, self._cache, self._backedge, self.state))
        self._dirty = False
        self.rows_written_back += written
        if written:
            self.manager.account(self.manager.fast, self.manager.slow, written * self._rowbytes,
                                 time.perf_counter() - t0)

    def invalidate(self) -> None:
        """Drop every cached row without writing it back, after the base table was replaced
        (e.g. by loading a checkpoint); a static table then caches its hot set again."""
        if self.policy == "simple":
            return
        self._dirty = False
        self.flush_clean(0)
        if self.policy == "static":
            self._refill()

    def _account_cached(self, rows: int, seconds: float) -> None:
        if rows:
            self.manager.account(self.manager.slow, self.manager.fast, rows * self._rowbytes, seconds)

    # ------------------------------------------------------------------ reporting and checking
    def telemetry(self) -> dict:
        hits, misses, cached = (int(c) for c in self.counts)
        return self._traffic(hits, misses, cached, flushes=self.flushes, cachelower=self.cachelower,
                             cacheslack=self.cacheslack)

    def reset_counters(self) -> None:
        self.counts[:] = 0

    def check(self) -> None:
        """Cached flag <=> pointer into a live cache slot; back-edges unique and consistent; size within bounds."""
        if self.policy == "simple":
            return
        ptr, back = self._ptr, self._backedge
        head, tail, limit, ring = (int(v) for v in self.state[:4])
        name = self.name
        if np.any(ptr & K.LOCKED):
            raise InvariantError(f"{name}: rows {np.flatnonzero(ptr & K.LOCKED)[:5]} are still locked")
        if not 0 <= head - tail <= min(limit, ring):
            raise InvariantError(f"{name}: {head - tail} cached rows, limit {limit} (cachelower + cacheslack), ring {ring}")
        cached = np.flatnonzero(ptr & K.CACHED)
        uncached = np.flatnonzero((ptr & K.CACHED) == 0)
        home = entries(self._base, uncached)
        if np.any(ptr[uncached] != home):
            bad = uncached[ptr[uncached] != home][:5]
            raise InvariantError(f"{name}: uncached rows {bad} do not point at their base rows")
        offset = (ptr[cached] >> 2) - self._cache.ctypes.data
        slots = offset // self._cache.strides[0]
        inside = (offset % self._cache.strides[0] == 0) & (slots >= 0) & (slots < ring)
        live = np.zeros(ring, bool)
        live[np.arange(tail, head) % ring] = True
        if not np.all(inside) or not np.all(live[slots]):
            bad = cached[~(inside & live[np.clip(slots, 0, ring - 1)])][:5]
            raise InvariantError(f"{name}: cached rows {bad} point outside the live cache pages")
        if np.any(back[slots] != cached):
            raise InvariantError(f"{name}: back-edges of rows {cached[back[slots] != cached][:5]} disagree")
        if cached.size != head - tail or np.any(back[~live] != -1):
            raise InvariantError(f"{name}: {cached.size} rows marked cached but {head - tail} slots live "
                                 f"(or a free slot keeps a back-edge)")

    def close(self) -> None:
        """Write back the cache (if it holds updates), then release and free the fast-device arrays."""
        if not self._pins:
            return
        if self._dirty:
            self.flush_dirty(0)
        else:
            self.flush_clean(0)
        views, self._pins = self._pins, []
        for v in views:
            v.release()
        unsafe_free([v for v in views[1:]])
        self._cache = self._ptr = self._slots = self._backedge = self._ref = None
        self._freq = np.empty(0, np.uint8)

    def _check_open(self) -> None:
        if not self._pins:
            raise RuntimeError(f"{self.name}: table is closed")

    def __repr__(self) -> str:
        return (f"CachedEmbeddings({self.name!r}, {self.policy}, nvectors={self.nvectors()}, "
                f"featuresize={self.featuresize()}, cached={self.cached_rows})")
