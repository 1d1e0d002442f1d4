"""Where embedding tables live: the ``--policy dram|simple|static|dynamic`` choice (section 5.6.1).

This module is the only place in ``dlrm`` that knows about table types and devices:

* ``dram``: every table is a `SimpleEmbedding` over a CachedArray in the fast device (DRAM).
* ``simple``: every table is a `SimpleEmbedding` over a CachedArray in the slow device (PM); DRAM
  holds only lookup outputs and the dense computation.
* ``static`` / ``dynamic``: `CachedEmbeddings` over a base table in the slow device, with
  ``cache_fraction`` of its rows cacheable in DRAM (rows cached up front and frozen, or cached
  on access). The static hot set is given (e.g. :func:`hot_rows` of sample batches) or random.

On a manager whose fast level is a GPU (``--device gpu``, :mod:`dlrm.gpu`), ``dram`` tables
are in HBM and the cached policies use the GPU ``CachedEmbeddings`` over tables in host DRAM
(``simple``: no cache rows, every row read from the host); ``lru`` (GPU only) caches rows in
sets of ways whose tags live in HBM, so the device itself finds and moves the rows
(:class:`embeddings.gpu.lru.LRUCachedEmbeddings`); ``lfu`` is the same cache whose missed rows
take the way used in the fewest batches rather than the least recently used one.

Tables are filled with the reference DLRM initialisation, uniform in +-sqrt(1/rows), from a
per-table seeded stream (chunked, so a 10M-row table needs no float64 temporary).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cachedarrays import CachedArray, LRUPolicy, Manager, assign, readable, writable
from embeddings import CachedEmbeddings, EmbeddingTable, SimpleEmbedding

from .data.batch import Batch

POLICIES = ("dram", "simple", "static", "dynamic")
GPU_POLICIES = ("lru", "lfu")  # policies only a GPU manager has: the set-associative cache's replacements
_INIT_CHUNK = 1 << 20  # rows per initialisation chunk


def allocate_table(manager: Manager, nrows: int, featuresize: int, where: str) -> CachedArray:
    """An uninitialised float32 (nrows, featuresize) CachedArray in the ``fast`` or ``slow`` device."""
    return CachedArray((int(nrows), int(featuresize)), manager, np.float32, place=where)


def init_table(x: CachedArray, seed: int, table: int) -> None:
    """Fill ``x`` with uniform(-sqrt(1/rows), sqrt(1/rows)) from the stream ``(seed, table)``."""
    n = x.shape[0]
    bound = np.float32(np.sqrt(1.0 / n))
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xE3B, int(table)]))
    with writable(x) as a:
        for s in range(0, n, _INIT_CHUNK):
            chunk = a[s:s + _INIT_CHUNK]
            rng.random(out=chunk, dtype=np.float32)
            chunk *= 2 * bound
            chunk -= bound


def hot_rows(batches: Iterable[Batch], ntables: int, counts: Sequence[int]) -> list[np.ndarray]:
    """Per table, the ``counts[t]`` rows looked up most often in ``batches`` (most frequent
    first, ties by row number; fewer when fewer rows occur): the hot set a ``static`` cache holds."""
    seen: list[list[np.ndarray]] = [[] for _ in range(ntables)]
    for b in batches:
        for t in range(ntables):
            seen[t].append(b.flat(t))
    out = []
    for t in range(ntables):
        rows, n = np.unique(np.concatenate(seen[t]) if seen[t] else np.zeros(0, np.int64), return_counts=True)
        top = np.argsort(-n, kind="stable")[:int(counts[t])]
        out.append(rows[top].astype(np.int64))
    return out


def cache_rows(nrows: int, cache_fraction: float) -> int:
    """Rows a static or dynamic cache of ``cache_fraction`` of an ``nrows``-row table holds."""
    return max(1, int(round(cache_fraction * int(nrows))))


def make_tables(sizes: Sequence[int], featuresize: int, policy: str, manager: Manager,
                cache_fraction: float = 0.1, seed: int = 0, names: Sequence[str] | None = None,
                init: bool = True, hot: Sequence[np.ndarray] | None = None,
                arrays: Sequence[CachedArray] | None = None, lru_reads: str = "split") -> list[EmbeddingTable]:
    """Create (and initialise) one embedding table per entry of ``sizes`` under ``policy``.

    ``manager`` must have the fast device (DRAM) and the slow device (PM) and a policy whose
    ``alloc_fast`` / ``alloc_slow`` place objects there (e.g. ``LRUPolicy()``). ``hot``: per
    table, the rows a ``static`` cache holds (see :func:`hot_rows`); random rows when None.
    ``arrays``: existing float32 ``(rows, featuresize)`` arrays to build the tables over instead of
    new ones (e.g. the named objects of a persistent pool); ``dram`` moves them into DRAM.
    ``lru_reads``: how an ``lru`` or ``lfu`` cache's missed rows come up (``LRUCachedEmbeddings(reads=)``).
    """
    if policy not in POLICIES + GPU_POLICIES:
        raise ValueError(f"policy must be one of {POLICIES + GPU_POLICIES}, got {policy!r}")
    if manager.policy is None:
        manager.set_policy(LRUPolicy())
    names = [f"table{i}" for i in range(len(sizes))] if names is None else list(names)
    on_gpu = manager.fast.memory_space != "host"
    if policy in GPU_POLICIES and not on_gpu:
        raise ValueError(f"policy {policy!r} is the GPU cache (tags in HBM): it needs a manager whose fast level is a GPU")
    cached = policy in ("static", "dynamic") + GPU_POLICIES or (on_gpu and policy == "simple")
    cache_class = CachedEmbeddings
    if policy in GPU_POLICIES:
        from embeddings.gpu.lru import LRUCachedEmbeddings as cache_class
    elif on_gpu and cached:
        from embeddings.gpu.cached import CachedEmbeddings as cache_class
    if cached and not 0.0 <= cache_fraction <= 1.0:
        raise ValueError(f"cache_fraction must be in [0, 1], got {cache_fraction}")
    tables: list[EmbeddingTable] = []
    for t, (n, name) in enumerate(zip(sizes, names)):
        where = "fast" if policy == "dram" else "slow"
        need = int(n) * int(featuresize) * 4
        dev = manager.fast if where == "fast" else manager.slow
        if need > dev.capacity:
            raise MemoryError(f"table {name} ({n} x {featuresize} float32, {need} bytes) does not fit the "
                              f"{dev.name} device ({dev.capacity} bytes); raise --fast-capacity or choose another policy")
        if arrays is None:
            # a GPU table is filled on the host, then moved: the same numbers as a CPU run's
            x = allocate_table(manager, n, featuresize, "slow" if on_gpu else where)
        else:
            x = arrays[t]
            if x.shape != (int(n), int(featuresize)) or x.dtype != np.float32:
                raise ValueError(f"table {name}: given array is {x.shape} {x.dtype}, expected ({n}, {featuresize}) float32")
        if init:
            init_table(x, seed, t)
        if where == "fast" and (on_gpu or arrays is not None) and not manager.policy.prefetch(x.object, force=True):
            raise MemoryError(f"table {name} could not be moved into {manager.fast.name}; raise "
                              f"{'--fast-budget' if on_gpu else '--fast-capacity'}")
        if cached:
            rows = cache_rows(n, cache_fraction) if policy != "simple" else 0
            hot_t = hot[t] if hot is not None and policy == "static" else None
            if policy in GPU_POLICIES:
                tables.append(cache_class(x, manager, cache_rows=rows, reads=lru_reads, replacement=policy, name=name))
                continue
            extra = {"manager": manager} if on_gpu else {}
            tables.append(cache_class(x, policy=policy, cache_rows=rows, hot=hot_t, name=name, **extra))
        else:
            tables.append(SimpleEmbedding(x, name=name))
    return tables


def is_cached(t: EmbeddingTable) -> bool:
    """Whether ``t`` is a cached table (the CPU class, the GPU one derived from it, or the GPU
    set-associative one)."""
    return isinstance(t, CachedEmbeddings) or getattr(t, "gpu_cache", False)


def table_array(t: EmbeddingTable) -> CachedArray | np.ndarray:
    """The full (base) array of a table, for checkpoints and tests."""
    return t.base_array if is_cached(t) else t.data


def read_table(t: EmbeddingTable) -> np.ndarray:
    """A copy of the table's current contents (cached rows are written back, and stay cached)."""
    if is_cached(t):
        t.writeback()
    x = table_array(t)
    if isinstance(x, CachedArray):
        with readable(x) as a:
            return np.array(a)
    return np.array(x)


def write_table(t: EmbeddingTable, values: np.ndarray) -> None:
    """Overwrite the table's contents (for ``--load``); a cached table drops its now-stale rows
    (a static one caches its hot set again)."""
    x = table_array(t)
    if isinstance(x, CachedArray):
        with writable(x) as a:
            assign(a, values)
    else:
        x[...] = values
    if is_cached(t):
        t.invalidate()


def flush(t: EmbeddingTable) -> None:
    """The *cache flush* phase: write back and drop a cached table's oldest pages down to its lower bound."""
    if is_cached(t):
        t.flush_dirty()


def make_room(t: EmbeddingTable) -> None:
    """Flush a full dynamic cache before a lookup, so the flush is timed as its own phase
    (``access_and_cache`` would otherwise do it inside the lookup). A static cache is full by
    design and never caches again: flushing it would only drop its hottest rows."""
    if is_cached(t) and t.policy == "dynamic" and t.isfull():
        t.flush_dirty()


def reset_counters(t: EmbeddingTable) -> None:
    """Start a cached table's hit/miss counts afresh (e.g. after a warm-up)."""
    if is_cached(t):
        t.reset_counters()


def hitrate(t: EmbeddingTable) -> float | None:
    """The table's cache hit rate, or None for a table without a cache."""
    return t.hitrate() if is_cached(t) else None


def table_devices(tables: Sequence[EmbeddingTable]) -> list[str]:
    out = []
    for t in tables:
        x = table_array(t)
        out.append(x.device if isinstance(x, CachedArray) else "numpy")
    return out
