"""The set-associative cache's device work (:mod:`.lru`), as CUDA kernels and as numpy.

Each function takes numpy arrays (the reference backend: what CI runs) or CuPy arrays (a GPU:
one kernel each, CuPy ``RawKernel`` source compiled by NVRTC on first use) and does the same
thing with both; the GPU tests compare the two. Arrays that stand for host memory on a GPU are
CuPy views of its mapped address (the kernels read and write it over PCIe).

* :func:`probe` – each index's slot if its set holds the row (the slot is stamped), else the
  row as a miss;
* :func:`victims` – for the distinct misses sorted by set, the ``k``-th least recently used way
  of the set (``k``: the miss's rank in its set), unless that way is locked;
* :func:`swap` – into each victim slot: write the row it held back home if dirty, read the new
  row in (rows, then each slot's Adagrad accumulator), then :func:`settle` the tags;
* :func:`copy_rows` – ``dst[drow] = src[srow]`` row by row (staging, write-back).

Sets are Fibonacci hashes of the row number (:func:`set_of`), the same on both sides.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

MIX = 0x9E3779B97F4A7C15

SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ i64 set_of(i64 r, i64 sets) {
    return (i64)((((u64)r * 0x9E3779B97F4A7C15ull) >> 32) % (u64)sets);
}

extern "C" __global__ void lru_probe(const i64* idx, i64 n, const i64* tags, int* stamp, i64 sets, int ways,
                                     int now, i64* slot, i64* missed) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = idx[i], first = set_of(r, sets) * ways, found = -1;
        for (int w = 0; w < ways; ++w) if (tags[first + w] == r) { found = first + w; break; }
        if (found >= 0) stamp[found] = now;
        slot[i] = found;
        missed[i] = found >= 0 ? -1 : r;
    }
}

/* ways ordered by (stamp, way): the k-th is the victim unless its stamp reaches lock */
extern "C" __global__ void lru_victims(const i64* sets_, const i64* rank, i64 m, const int* stamp, int ways, int lock,
                                       i64* victim) {
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += (i64)gridDim.x * blockDim.x) {
        i64 first = sets_[j] * ways, k = rank[j], v = -1;
        if (k < ways) {
            for (int w = 0; w < ways; ++w) {
                i64 key = (i64)stamp[first + w] * ways + w;
                int below = 0;
                for (int u = 0; u < ways; ++u) below += ((i64)stamp[first + u] * ways + u) < key;
                if (below == k) { if (stamp[first + w] < lock) v = first + w; break; }
            }
        }
        victim[j] = v;
    }
}

#define SWAP(NAME, T) \
extern "C" __global__ void NAME(T* dev, T* home, const i64* rows, const i64* victim, i64 m, int FT, \
                                const i64* tags, const bool* dirty) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 j = i / FT, c = i - j * FT, v = victim[j]; \
        if (v < 0) continue; \
        i64 old = tags[v]; \
        if (old >= 0 && dirty[v]) home[old * FT + c] = dev[v * FT + c]; \
        dev[v * FT + c] = home[rows[j] * FT + c]; } }
SWAP(lru_swap_v4, float4)
SWAP(lru_swap_v1, float)

extern "C" __global__ void lru_settle(const i64* rows, const i64* victim, i64 m, i64* tags, int* stamp, bool* dirty,
                                      int now, unsigned long long* counts) {
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += (i64)gridDim.x * blockDim.x) {
        i64 v = victim[j];
        if (v < 0) continue;
        atomicAdd(&counts[0], 1ull);
        if (tags[v] >= 0 && dirty[v]) atomicAdd(&counts[1], 1ull);
        tags[v] = rows[j]; stamp[v] = now; dirty[v] = false;
    }
}

/* dst[drow[r]] = src[srow[r]] for r < n; a null index array means drow[r] = dbase + r (srow likewise) */
#define COPY(NAME, T) \
extern "C" __global__ void NAME(T* dst, const i64* drow, i64 dbase, const T* src, const i64* srow, i64 sbase, i64 n, \
                                int FT) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 r = i / FT, c = i - r * FT; \
        i64 d = drow ? drow[r] : dbase + r, s = srow ? srow[r] : sbase + r; \
        dst[d * FT + c] = src[s * FT + c]; } }
COPY(lru_copy_v4, float4)
COPY(lru_copy_v1, float)
"""

_NULL = np.uint64(0)


@lru_cache(maxsize=1)
def _module() -> Any:
    import cupy as cp
    return cp.RawModule(code=SOURCE, options=("--std=c++14",))


HOST_BLOCKS = 32  # blocks of a kernel on host memory: on the H100, 32 read random rows at 37 GB/s, a full grid at 13


def _launch(name: str, work: int, args: tuple, most: int = 65536) -> None:
    """A grid-stride launch over ``work`` items of at most ``most`` blocks of 256 threads. Kernels
    on host memory get few blocks (:data:`HOST_BLOCKS`): more requesters made the mapped reads
    slower (61,000 random 256-byte rows: 0.42 ms with 32 blocks, 1.13 ms with a full grid), and
    blocks stalled on PCIe keep SMs from the other stream's work (the current batch's update)."""
    block = 256
    _module().get_function(name)((max(1, min(most, -(-work // block))),), (block,), args)


def _host(a: Any) -> bool:
    return isinstance(a, np.ndarray)


def set_of(rows: Any, sets: int) -> Any:
    """The set of each row (numpy or CuPy alike)."""
    h = rows.astype(np.uint64) * np.uint64(MIX)
    return ((h >> np.uint64(32)) % np.uint64(sets)).astype(np.int64)


def probe(idx: Any, tags: Any, stamp: Any, sets: int, ways: int, now: int) -> tuple[Any, Any]:
    """(slot of each index or -1, the index where it missed else -1); hits' slots get stamp ``now``."""
    n = int(idx.size)
    if _host(idx):
        first = set_of(idx, sets) * ways
        match = tags[first[:, None] + np.arange(ways)] == idx[:, None]
        hit = match.any(axis=1)
        slot = np.where(hit, first + match.argmax(axis=1), -1)
        stamp[slot[hit]] = now
        return slot, np.where(hit, -1, idx)
    import cupy as cp
    slot, missed = cp.empty(n, np.int64), cp.empty(n, np.int64)
    if n:
        _launch("lru_probe", n, (idx, np.int64(n), tags, stamp, np.int64(sets), np.int32(ways), np.int32(now),
                                 slot, missed))
    return slot, missed


def victims(sets_: Any, rank: Any, stamp: Any, ways: int, lock: int) -> Any:
    """For misses in sets ``sets_`` with ranks ``rank`` in their sets: the slot of the ``rank``-th
    way ordered by (stamp, way), or -1 when ``rank >= ways`` or that way's stamp reaches ``lock``."""
    m = int(sets_.size)
    if _host(sets_):
        first = sets_ * ways
        at = first[:, None] + np.arange(ways)
        order = np.argsort(stamp[at].astype(np.int64) * ways + np.arange(ways), axis=1)
        way = np.take_along_axis(order, np.minimum(rank, ways - 1)[:, None], axis=1)[:, 0]
        v = first + way
        return np.where((rank < ways) & (stamp[v] < lock), v, -1)
    import cupy as cp
    out = cp.empty(m, np.int64)
    if m:
        _launch("lru_victims", m, (sets_, rank, np.int64(m), stamp, np.int32(ways), np.int32(lock), out))
    return out


def _vec(F: int, *arrays: Any) -> tuple[str, int]:
    v4 = F % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    return ("v4", F // 4) if v4 else ("v1", F)


def swap(dev: Any, home: Any, rows: Any, victim: Any, tags: Any, dirty: Any) -> None:
    """For each ``victim[j] >= 0``: the row it holds goes home if dirty, then ``rows[j]`` comes in
    (``dev``/``home``: 2-d row arrays, or 1-d per-row values such as an accumulator)."""
    m = int(victim.size)
    if _host(victim):
        ok = victim >= 0
        v, old = victim[ok], tags[victim[ok]]
        back = (old >= 0) & dirty[v]
        home[old[back]] = dev[v[back]]
        dev[v] = home[rows[ok]]
        return
    if m:
        F = dev.shape[1] if dev.ndim == 2 else 1
        vt, FT = _vec(F, dev, home)
        _launch(f"lru_swap_{vt}", m * FT, (dev, home, rows, victim, np.int64(m), np.int32(FT), tags, dirty),
                HOST_BLOCKS)


def settle(rows: Any, victim: Any, tags: Any, stamp: Any, dirty: Any, now: int, counts: Any) -> None:
    """Record the swap: victims' tags, stamps ``now``, clean bits; ``counts[0] +=`` admitted rows,
    ``counts[1] +=`` rows written back (read before the tags change)."""
    m = int(victim.size)
    if _host(victim):
        ok = victim >= 0
        v = victim[ok]
        counts[0] += v.size
        counts[1] += int(((tags[v] >= 0) & dirty[v]).sum())
        tags[v], stamp[v], dirty[v] = rows[ok], now, False
        return
    if m:
        _launch("lru_settle", m, (rows, victim, np.int64(m), tags, stamp, dirty, np.int32(now), counts))


def copy_rows(dst: Any, drow: Any, src: Any, srow: Any, n: int, dbase: int = 0, sbase: int = 0) -> None:
    """``dst[drow] = src[srow]`` for ``n`` rows; a None index array stands for ``base + arange(n)``."""
    if n == 0:
        return
    if _host(dst):
        d = np.arange(dbase, dbase + n) if drow is None else drow
        s = np.arange(sbase, sbase + n) if srow is None else srow
        dst[d] = src[s]
        return
    F = dst.shape[1] if dst.ndim == 2 else 1
    vt, FT = _vec(F, dst, src)
    _launch(f"lru_copy_{vt}", n * FT, (dst, _NULL if drow is None else drow, np.int64(dbase), src,
                                       _NULL if srow is None else srow, np.int64(sbase), np.int64(n), np.int32(FT)),
            HOST_BLOCKS)
