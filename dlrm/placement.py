"""Where embedding tables live: the ``--policy dram|simple|static|dynamic`` choice (section 5.6.1).

This module is the only place in ``dlrm`` that knows about table types and devices:

* ``dram``: every table is a plain table over a CachedArray in the fast device (DRAM).
* ``simple``: every table is a plain table over a CachedArray in the slow device (PM); DRAM holds
  only lookup outputs and the dense computation.
* ``static`` / ``dynamic``: ``embeddings.cached.CachedEmbeddings`` over a base table in the slow
  device, with ``cache_fraction`` of its rows cacheable in DRAM (rows cached up front and frozen,
  or cached on access).

Tables are filled with the reference DLRM initialisation, uniform in +-sqrt(1/rows), from a
per-table seeded stream (chunked, so a 10M-row table needs no float64 temporary).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from cachedarrays import CachedArray, Manager, readable, writable
from embeddings.protocol import Context, EmbeddingTable, RowSource
from embeddings.simple import _codec_for, _storage

POLICIES = ("dram", "simple", "static", "dynamic")
_INIT_CHUNK = 1 << 20  # rows per initialisation chunk


class ManagedEmbedding(EmbeddingTable):
    """A plain embedding table over a CachedArray, pinned only while a kernel runs.

    ``rows`` takes ``readable(x)`` for lookups and ``writable(x)`` for updates, so the policy
    sees every use and the object cannot move under a kernel. (``SimpleEmbedding``'s integration
    hook calls ``x.__array__()``, which for a NotBusy CachedArray returns a *copy*: updates would
    be lost. This class is the work-around until that hook uses ``readable``/``writable``.)
    """

    def __init__(self, data: CachedArray, name: str = "table") -> None:
        if not isinstance(data, CachedArray):
            raise TypeError(f"{name}: ManagedEmbedding needs a CachedArray, got {type(data).__name__}")
        if len(data.shape) != 2:
            raise ValueError(f"{name}: table must be 2-d (nvectors, featuresize), got {data.shape}")
        self.data = data
        self.name = name
        self._codec, self._storage_dtype = _codec_for(data.dtype)
        self._dtype = data.dtype
        self._shape = tuple(data.shape)

    def eltype(self) -> np.dtype:
        return self._dtype

    def featuresize(self) -> int:
        return int(self._shape[1])

    def nvectors(self) -> int:
        return int(self._shape[0])

    def example(self) -> Any:
        return self.data

    @contextmanager
    def rows(self, context: Context | None, indices: np.ndarray | None = None,
             writable: bool = False) -> Iterator[RowSource]:
        with (_writable_view(self.data) if writable else readable(self.data)) as view:
            yield RowSource(_storage(view, self._storage_dtype), None, None, self._codec, self._dtype)

    def __repr__(self) -> str:
        return f"ManagedEmbedding({self.name!r}, nvectors={self._shape[0]}, featuresize={self._shape[1]})"


_writable_view = writable


def device_of(x: CachedArray) -> str:
    """Name of the device holding ``x``'s primary region."""
    return x.manager.primary(x.object).device.name


def allocate_table(manager: Manager, nrows: int, featuresize: int, where: str) -> CachedArray:
    """An uninitialised float32 (nrows, featuresize) CachedArray in the ``fast`` or ``slow`` device."""
    shape = (int(nrows), int(featuresize))
    nbytes = max(int(nrows) * int(featuresize) * 4, 1)
    if where == "slow":
        return CachedArray(shape, manager, np.float32, _object=manager.policy.alloc_slow(nbytes))
    if where == "fast":
        return CachedArray(shape, manager, np.float32, _object=manager.policy.alloc_fast(nbytes))
    raise ValueError(f"where must be 'fast' or 'slow', got {where!r}")


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


def cached_embeddings_class():
    """``embeddings.cached.CachedEmbeddings``, or None while it does not exist."""
    try:
        from embeddings.cached import CachedEmbeddings  # noqa: PLC0415 - optional, being written
    except ImportError:
        return None
    return CachedEmbeddings


def available_policies() -> tuple[str, ...]:
    return POLICIES if cached_embeddings_class() is not None else POLICIES[:2]


def make_tables(sizes: Sequence[int], featuresize: int, policy: str, manager: Manager,
                cache_fraction: float = 0.1, seed: int = 0, names: Sequence[str] | None = None,
                init: bool = True) -> list[EmbeddingTable]:
    """Create (and initialise) one embedding table per entry of ``sizes`` under ``policy``.

    ``manager`` must have the fast device (DRAM) and the slow device (PM) and a policy whose
    ``alloc_fast`` / ``alloc_slow`` place objects there (e.g. ``LRUPolicy()``).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if manager.policy is None:
        from cachedarrays import LRUPolicy
        manager.set_policy(LRUPolicy())
    names = [f"table{i}" for i in range(len(sizes))] if names is None else list(names)
    CE = None
    if policy in ("static", "dynamic"):
        CE = cached_embeddings_class()
        if CE is None:
            raise RuntimeError(f"--policy {policy} needs CachedEmbeddings (embeddings.cached), which is not "
                               "available in this checkout: CachedEmbeddings not available")
        if not 0.0 <= cache_fraction <= 1.0:
            raise ValueError(f"cache_fraction must be in [0, 1], got {cache_fraction}")
    tables: list[EmbeddingTable] = []
    for t, (n, name) in enumerate(zip(sizes, names)):
        where = "fast" if policy == "dram" else "slow"
        need = int(n) * int(featuresize) * 4
        dev = manager.fast if where == "fast" else manager.slow
        if need > dev.capacity:
            raise MemoryError(f"table {name} ({n} x {featuresize} float32, {need} bytes) does not fit the "
                              f"{dev.name} device ({dev.capacity} bytes); raise --fast-capacity or choose another policy")
        x = allocate_table(manager, n, featuresize, where)
        if init:
            init_table(x, seed, t)
        if CE is None:
            tables.append(ManagedEmbedding(x, name=name))
        else:
            rows = max(1, int(round(cache_fraction * int(n))))
            tables.append(CE(x, manager, policy=policy, cache_rows=rows, name=name))
    return tables


def table_array(t: EmbeddingTable) -> CachedArray | np.ndarray:
    """The full (base) array of a table, for checkpoints and tests."""
    for attr in ("base_array", "base", "data"):
        x = getattr(t, attr, None)
        if x is not None:
            return x
    raise TypeError(f"cannot find the backing array of {t!r}")


def read_table(t: EmbeddingTable) -> np.ndarray:
    """A copy of the table's current contents (every cached row written back first)."""
    flush(t, full=True)
    x = table_array(t)
    if isinstance(x, CachedArray):
        with readable(x) as a:
            return np.array(a)
    return np.array(x)


def write_table(t: EmbeddingTable, values: np.ndarray) -> None:
    """Overwrite the table's contents (for ``--load``); a cached table is emptied first (so no
    stale cached row survives) and told through ``invalidate()`` when it has one."""
    flush(t, full=True)
    x = table_array(t)
    if isinstance(x, CachedArray):
        with writable(x) as a:
            a[...] = values
    else:
        x[...] = values
    reset = getattr(t, "invalidate", None)  # a cached table must drop its now-stale cached rows
    if reset is not None:
        reset()


def flush(t: EmbeddingTable, full: bool = False) -> None:
    """Write back a cached table's dirty rows: down to its own lower bound (the end-of-run *cache
    flush* phase) or, with ``full``, every cached row (before reading or replacing the base)."""
    f = getattr(t, "flush_dirty", None)
    if f is None:
        return
    if full:
        try:
            f(0)
            return
        except TypeError:
            pass
    f()


def hitrate(t: EmbeddingTable) -> float | None:
    """The table's cache hit rate, or None for a table without a cache."""
    h = getattr(t, "hitrate", None)
    if h is None:
        tele = getattr(t, "telemetry", None)
        if tele is None:
            return None
        d = tele() if callable(tele) else tele
        return d.get("hitrate") if isinstance(d, dict) else None
    v = h() if callable(h) else h
    return None if v is None else float(v)


def table_devices(tables: Sequence[EmbeddingTable]) -> list[str]:
    out = []
    for t in tables:
        x = table_array(t)
        out.append(device_of(x) if isinstance(x, CachedArray) else "numpy")
    return out
