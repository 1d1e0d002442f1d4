"""One ``lru`` table's part of placing a batch, and the kernels the table-batched placement
(:mod:`.lru_group`, which :mod:`.lru` uses for one table too) shares with it.

Every array keeps the batch's length (entries that are not a distinct miss carry -1), so that
nothing waits for a size on the host.

* :func:`probe` – each index's slot if its set holds the row (the slot is stamped), else a key
  that sorts the misses by set and row;
* :func:`distinct` – over the sorted keys, where each distinct miss starts;
* :func:`victims` – for each distinct miss, the ``k``-th way of its set in eviction order
  (``k``: the miss's rank in its set; :func:`eviction_keys`: least recently used first, or
  under ``lfu`` used in the fewest batches first), unless that way is locked;
* :func:`settle` – after the victims' dirty rows went home and the new rows came in, record the
  new tags;
* :func:`slots` – every index of a miss gets its distinct miss's slot;
* :func:`copy_rows` – ``dst[drow] = src[srow]`` row by row (staging and whole-cache write-backs);
* :func:`mark_dirty` – the slots an update wrote.

:func:`probe`, :func:`victims` and :func:`settle` are numpy only: they are the numpy forms of
one table's part of :mod:`.lru_group`'s kernels, which do all tables at once on a GPU. The others
take numpy arrays (the reference backend: what CI runs) or CuPy arrays (one kernel each, CuPy
``RawKernel`` source compiled by NVRTC on first use) and do the same with both; GPU tests
compare the two. Arrays that stand for host memory on a GPU are CuPy views of its mapped
address (the kernels read and write it over PCIe). Sets are Fibonacci hashes of the row number
(:func:`set_of`), the same on both sides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import cuda

MIX = 0x9E3779B97F4A7C15

SOURCE_HEAD = r"""
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ i64 set_of(i64 r, i64 sets) {
    return (i64)((((u64)r * 0x9E3779B97F4A7C15ull) >> 32) % (u64)sets);
}

__device__ __forceinline__ i64 lower_bound(const i64* a, i64 n, i64 x) {
    i64 lo = 0, hi = n;
    while (lo < hi) { i64 mid = (lo + hi) >> 1; if (a[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
}

"""

SOURCE = SOURCE_HEAD + r"""
/* over sorted keys: first[i] when entry i starts a distinct miss, row[i] its row (-1 otherwise) */
extern "C" __global__ void lru_distinct(const i64* sk, i64 n, i64 R, i64 none, bool* first, i64* row) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 k = sk[i];
        bool f = k != none && (i == 0 || sk[i - 1] != k);
        first[i] = f;
        row[i] = f ? k % R : -1;
    }
}

/* each sorted miss entry's slot: its distinct miss's (the first entry of its run of equal keys) */
extern "C" __global__ void lru_slots(const i64* sk, const i64* order, const i64* victim, i64 n, i64 none, i64* slot) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 k = sk[i];
        if (k != none) slot[order[i]] = victim[lower_bound(sk, n, k)];
    }
}

/* dirty[min(slot[i], nslots)] = true: the slots an update wrote (staged rows share entry nslots) */
#define DIRTY(NAME, I) \
extern "C" __global__ void NAME(const I* slot, i64 n, i64 nslots, bool* dirty) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) { \
        i64 s = slot[i]; dirty[s < nslots ? s : nslots] = true; } }
DIRTY(lru_dirty_i32, int)
DIRTY(lru_dirty_i64, i64)

/* dst[drow[r]] = src[srow[r]] for r < n (r < *count when count is not null); a null index array
   means drow[r] = dbase + r (srow likewise) */
#define COPY(NAME, T) \
extern "C" __global__ void NAME(T* dst, const i64* drow, i64 dbase, const T* src, const i64* srow, i64 sbase, i64 n, \
                                int FT, const i64* count) { \
    if (count && *count < n) n = *count; \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 r = i / FT, c = i - r * FT; \
        i64 d = drow ? drow[r] : dbase + r, s = srow ? srow[r] : sbase + r; \
        dst[d * FT + c] = src[s * FT + c]; } }
COPY(lru_copy_v4, float4)
COPY(lru_copy_v1, float)
"""

HOST_BLOCKS = 32  # blocks of a kernel on host memory (below)


def _launch(name: str, work: int, args: tuple, most: int = 65536) -> None:
    """A kernel of :data:`SOURCE` over ``work`` items. Kernels on host memory get few blocks
    (:data:`HOST_BLOCKS`): on the H100, 516,000 fresh random 256-byte rows read at 13.5 GB/s with
    32 blocks, 10.6 GB/s with 256, and blocks stalled on PCIe keep SMs from the other streams'
    work (the current batch's lookups and update)."""
    cuda.launch(SOURCE, name, work, args, most)


def _host(a: Any) -> bool:
    return isinstance(a, np.ndarray)


def set_of(rows: Any, sets: int) -> Any:
    """The set of each row (numpy or CuPy alike)."""
    h = rows.astype(np.uint64) * np.uint64(MIX)
    return ((h >> np.uint64(32)) % np.uint64(sets)).astype(np.int64)


def probe(idx: np.ndarray, tags: np.ndarray, stamp: np.ndarray, sets: int, ways: int, now: int,
          R: int, uses: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(slot of each index or -1, its key): a hit's slot gets stamp ``now`` and key ``sets * R``
    (above every miss's), a miss of row ``r`` in set ``s`` has key ``s * R + r`` (``R``: rows of
    the table), so that sorting the keys groups the misses by set, each distinct row once.
    ``uses`` (``lfu``): each slot's count of batches that used its row, one more for every slot
    this batch hits that no earlier probe under ``now`` stamped. numpy only (the GPU probes all
    tables at once: :mod:`.lru_group`)."""
    s = set_of(idx, sets)
    first = s * ways
    match = tags[first[:, None] + np.arange(ways)] == idx[:, None]
    hit = match.any(axis=1)
    slot = np.where(hit, first + match.argmax(axis=1), -1)
    if uses is not None:
        used = np.unique(slot[hit])
        uses[used[stamp[used] != now]] += 1
    stamp[slot[hit]] = now
    return slot, np.where(hit, sets * R, s * R + idx)


def distinct(sk: Any, R: int, none: int) -> tuple[Any, Any]:
    """Over sorted keys ``sk``: (whether each entry starts a distinct miss, its row there else -1)."""
    n = int(sk.size)
    if _host(sk):
        first = sk != none
        first[1:] &= sk[1:] != sk[:-1]
        return first, np.where(first, sk % R, -1)
    import cupy as cp
    first, row = cp.empty(n, np.bool_), cp.empty(n, np.int64)
    if n:
        _launch("lru_distinct", n, (sk, np.int64(n), np.int64(R), np.int64(none), first, row))
    return first, row


def eviction_keys(stamp: np.ndarray, uses: np.ndarray | None, lock: int) -> np.ndarray:
    """The order in which ways give up their rows, lowest key first (ties: the lower way):
    unlocked ways (stamp below ``lock``) before locked ones, then, under ``lfu``, fewer batches
    of use first, then the least recently used. Under ``lru`` (``uses`` None) this is the order
    of the stamps, as locked ways hold the latest ones."""
    s = stamp.astype(np.int64)
    key = ((s >= lock).astype(np.int64) << 62) | s
    if uses is not None:
        key |= uses.astype(np.int64) << 31
    return key


def victims(sk: np.ndarray, first: np.ndarray, pos: np.ndarray, R: int, stamp: np.ndarray, ways: int, lock: int,
            left: np.ndarray, uses: np.ndarray | None = None) -> np.ndarray:
    """For each distinct miss (``first``; ``pos``: inclusive running count of ``first``) of rank
    ``k`` among its set's: the slot of the ``k``-th way in :func:`eviction_keys` order, or -1
    when ``k >= ways`` or that way's stamp reaches ``lock`` (then ``left[0] = 1``); -1 elsewhere.
    numpy only (on the GPU: :mod:`.lru_group`)."""
    s = np.where(first, sk // R, 0)
    rank = np.where(first, pos - pos[np.searchsorted(sk, s * R)], ways)
    base = s * ways
    at = base[:, None] + np.arange(ways)
    order = np.argsort(eviction_keys(stamp[at], None if uses is None else uses[at], lock), axis=1, kind="stable")
    way = np.take_along_axis(order, np.minimum(rank, ways - 1)[:, None], axis=1)[:, 0]
    v = base + way
    v = np.where((rank < ways) & (stamp[v] < lock), v, -1)
    if np.any(first & (v < 0)):
        left[0] = 1
    return v


def vector_kind(F: int, *arrays: Any) -> tuple[str, int]:
    """("v4", F / 4) when rows of ``F`` floats of every array move as float4, else ("v1", F)."""
    return ("v4", F // 4) if cuda.vec4(F, *arrays) else ("v1", F)


def settle(rows: np.ndarray, victim: np.ndarray, tags: np.ndarray, stamp: np.ndarray, dirty: np.ndarray, now: int,
           counts: np.ndarray, uses: np.ndarray | None = None) -> None:
    """Record the moves: victims' tags, stamps ``now``, clean bits (and one batch of use under
    ``lfu``); ``counts[0] +=`` admitted rows, ``counts[1] +=`` rows written back (read before
    the tags change). numpy only."""
    ok = victim >= 0
    v = victim[ok]
    counts[0] += v.size
    counts[1] += int(((tags[v] >= 0) & dirty[v]).sum())
    tags[v], stamp[v], dirty[v] = rows[ok], now, False
    if uses is not None:
        uses[v] = 1


def slots(sk: Any, order: Any, victim: Any, none: int, slot: Any) -> None:
    """``slot[order[i]] =`` the victim of the distinct miss of sorted entry ``i``, for every miss."""
    n = int(sk.size)
    if _host(sk):
        miss = sk != none
        slot[order[miss]] = victim[np.searchsorted(sk, sk[miss])]
        return
    if n:
        _launch("lru_slots", n, (sk, order, victim, np.int64(n), np.int64(none), slot))


def mark_dirty(slot: Any, dirty: Any, nslots: int) -> None:
    """``dirty[min(slot, nslots)] = True``: the slots an update wrote, staged rows (slots from
    ``nslots`` on) on the one entry past the cache's. One kernel on a GPU (CuPy's scatter of a
    value cost 0.2 ms of host time a table)."""
    n = int(slot.size)
    if _host(slot):
        dirty[np.minimum(slot, nslots)] = True
        return
    if n:
        _launch("lru_dirty_i32" if slot.dtype == np.int32 else "lru_dirty_i64", n,
                (slot, np.int64(n), np.int64(nslots), dirty))


def copy_rows(dst: Any, drow: Any, src: Any, srow: Any, n: int, dbase: int = 0, sbase: int = 0) -> None:
    """``dst[drow] = src[srow]`` for ``n`` rows; a None index array stands for ``base + arange(n)``.
    One side is host memory: :data:`HOST_BLOCKS` blocks."""
    if n == 0:
        return
    if _host(dst):
        d = np.arange(dbase, dbase + n) if drow is None else drow[:n]
        s = np.arange(sbase, sbase + n) if srow is None else srow[:n]
        dst[d] = src[s]
        return
    F = dst.shape[1] if dst.ndim == 2 else 1
    vt, FT = vector_kind(F, dst, src)
    _launch(f"lru_copy_{vt}", n * FT, (dst, cuda.ptr(drow), np.int64(dbase), src,
                                       cuda.ptr(srow), np.int64(sbase), np.int64(n), np.int32(FT), cuda.NULL),
            HOST_BLOCKS)
