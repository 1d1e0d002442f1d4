"""The set-associative cache's device work (:mod:`.lru`), as CUDA kernels and as numpy.

Every array keeps the batch's length (entries that are not a distinct miss carry -1), so that
nothing waits for a size on the host. Each function takes numpy arrays (the reference backend: what CI runs) or CuPy arrays (a GPU:
one kernel each, CuPy ``RawKernel`` source compiled by NVRTC on first use) and does the same
thing with both; the GPU tests compare the two. Arrays that stand for host memory on a GPU are
CuPy views of its mapped address (the kernels read and write it over PCIe).

* :func:`probe` – each index's slot if its set holds the row (the slot is stamped), else a key
  that sorts the misses by set and row;
* :func:`distinct` – over the sorted keys, where each distinct miss starts (and the batch's hits
  and misses counted);
* :func:`victims` – for each distinct miss, the ``k``-th least recently used way of its set
  (``k``: the miss's rank in its set), unless that way is locked;
* :func:`settle` – after the victims' dirty rows went home and the new rows came in
  (:func:`copy_rows`), record the new tags;
* :func:`slots` – every index of a miss gets its distinct miss's slot;
* :func:`copy_rows` – ``dst[drow] = src[srow]`` row by row, for a count the device knows.

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

__device__ __forceinline__ i64 lower_bound(const i64* a, i64 n, i64 x) {
    i64 lo = 0, hi = n;
    while (lo < hi) { i64 mid = (lo + hi) >> 1; if (a[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
}

/* slot of each index whose set holds it (stamped), else -1; key: set * R + row for a miss, sets * R for a hit */
extern "C" __global__ void lru_probe(const i64* idx, i64 n, const i64* tags, int* stamp, i64 sets, int ways,
                                     int now, i64 R, i64* slot, i64* key) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = idx[i], s = set_of(r, sets), first = s * ways, found = -1;
        for (int w = 0; w < ways; ++w) if (tags[first + w] == r) { found = first + w; break; }
        if (found >= 0) stamp[found] = now;
        slot[i] = found;
        key[i] = found >= 0 ? sets * R : s * R + r;
    }
}

/* over sorted keys: first[i] when entry i starts a distinct miss, row[i] its row (-1 otherwise);
   counts (may be null) += hits, misses */
extern "C" __global__ void lru_distinct(const i64* sk, i64 n, i64 R, i64 none, bool* first, i64* row,
                                        unsigned long long* counts) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 k = sk[i];
        bool f = k != none && (i == 0 || sk[i - 1] != k);
        first[i] = f;
        row[i] = f ? k % R : -1;
        if (counts) {
            if (k != none && (i + 1 == n || sk[i + 1] == none)) {
                atomicAdd(&counts[0], (unsigned long long)(n - i - 1));
                atomicAdd(&counts[1], (unsigned long long)(i + 1));
            } else if (i == 0 && k == none) atomicAdd(&counts[0], (unsigned long long)n);
        }
    }
}

/* for each distinct miss (first), of rank k among its set's (pos: inclusive count of firsts): the
   k-th way ordered by (stamp, way) unless its stamp reaches lock; -1 otherwise (and *left = 1) */
extern "C" __global__ void lru_victims(const i64* sk, const bool* first, const i64* pos, i64 n, i64 R,
                                       const int* stamp, int ways, int lock, i64* victim, long long* left) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 v = -1;
        if (first[i]) {
            i64 s = sk[i] / R, base = s * ways, k = pos[i] - pos[lower_bound(sk, n, s * R)];
            if (k < ways) {
                for (int w = 0; w < ways; ++w) {
                    i64 key = (i64)stamp[base + w] * ways + w;
                    int below = 0;
                    for (int u = 0; u < ways; ++u) below += ((i64)stamp[base + u] * ways + u) < key;
                    if (below == k) { if (stamp[base + w] < lock) v = base + w; break; }
                }
            }
            if (v < 0) *left = 1;
        }
        victim[i] = v;
    }
}

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

/* each sorted miss entry's slot: its distinct miss's (the first entry of its run of equal keys) */
extern "C" __global__ void lru_slots(const i64* sk, const i64* order, const i64* victim, i64 n, i64 none, i64* slot) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 k = sk[i];
        if (k != none) slot[order[i]] = victim[lower_bound(sk, n, k)];
    }
}

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


def probe(idx: Any, tags: Any, stamp: Any, sets: int, ways: int, now: int, R: int) -> tuple[Any, Any]:
    """(slot of each index or -1, its key): a hit's slot gets stamp ``now`` and key ``sets * R``
    (above every miss's), a miss of row ``r`` in set ``s`` has key ``s * R + r`` (``R``: rows of
    the table), so that sorting the keys groups the misses by set, each distinct row once."""
    n = int(idx.size)
    if _host(idx):
        s = set_of(idx, sets)
        first = s * ways
        match = tags[first[:, None] + np.arange(ways)] == idx[:, None]
        hit = match.any(axis=1)
        slot = np.where(hit, first + match.argmax(axis=1), -1)
        stamp[slot[hit]] = now
        return slot, np.where(hit, sets * R, s * R + idx)
    import cupy as cp
    slot, key = cp.empty(n, np.int64), cp.empty(n, np.int64)
    if n:
        _launch("lru_probe", n, (idx, np.int64(n), tags, stamp, np.int64(sets), np.int32(ways), np.int32(now),
                                 np.int64(R), slot, key))
    return slot, key


def distinct(sk: Any, R: int, none: int, counts: Any = None) -> tuple[Any, Any]:
    """Over sorted keys ``sk``: (whether each entry starts a distinct miss, its row there else -1);
    ``counts[0] +=`` hits, ``counts[1] +=`` misses unless ``counts`` is None."""
    n = int(sk.size)
    if _host(sk):
        miss = sk != none
        first = miss.copy()
        first[1:] &= sk[1:] != sk[:-1]
        if counts is not None:
            k = int(miss.sum())
            counts[0] += n - k
            counts[1] += k
        return first, np.where(first, sk % R, -1)
    import cupy as cp
    first, row = cp.empty(n, np.bool_), cp.empty(n, np.int64)
    if n:
        _launch("lru_distinct", n, (sk, np.int64(n), np.int64(R), np.int64(none), first, row,
                                    _NULL if counts is None else counts))
    return first, row


def victims(sk: Any, first: Any, pos: Any, R: int, stamp: Any, ways: int, lock: int, left: Any) -> Any:
    """For each distinct miss (``first``; ``pos``: inclusive running count of ``first``) of rank
    ``k`` among its set's: the slot of the ``k``-th way ordered by (stamp, way), or -1 when
    ``k >= ways`` or that way's stamp reaches ``lock`` (then ``left[0] = 1``); -1 elsewhere."""
    n = int(sk.size)
    if _host(sk):
        s = np.where(first, sk // R, 0)
        rank = np.where(first, pos - pos[np.searchsorted(sk, s * R)], ways)
        base = s * ways
        at = base[:, None] + np.arange(ways)
        order = np.argsort(stamp[at].astype(np.int64) * ways + np.arange(ways), axis=1)
        way = np.take_along_axis(order, np.minimum(rank, ways - 1)[:, None], axis=1)[:, 0]
        v = base + way
        v = np.where((rank < ways) & (stamp[v] < lock), v, -1)
        if np.any(first & (v < 0)):
            left[0] = 1
        return v
    import cupy as cp
    out = cp.empty(n, np.int64)
    if n:
        _launch("lru_victims", n, (sk, first, pos, np.int64(n), np.int64(R), stamp, np.int32(ways), np.int32(lock),
                                   out, left))
    return out


def _vec(F: int, *arrays: Any) -> tuple[str, int]:
    v4 = F % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    return ("v4", F // 4) if v4 else ("v1", F)


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


def slots(sk: Any, order: Any, victim: Any, none: int, slot: Any) -> None:
    """``slot[order[i]] =`` the victim of the distinct miss of sorted entry ``i``, for every miss."""
    n = int(sk.size)
    if _host(sk):
        miss = sk != none
        slot[order[miss]] = victim[np.searchsorted(sk, sk[miss])]
        return
    if n:
        _launch("lru_slots", n, (sk, order, victim, np.int64(n), np.int64(none), slot))


def copy_rows(dst: Any, drow: Any, src: Any, srow: Any, n: int, dbase: int = 0, sbase: int = 0,
              count: Any = None, blocks: int | None = None) -> None:
    """``dst[drow] = src[srow]`` for ``n`` rows, or for the first ``count`` (a device scalar: a
    size nobody waits for) when given; a None index array stands for ``base + arange(n)``.
    ``blocks``: at most this many blocks (default :data:`HOST_BLOCKS`: one side is host memory)."""
    if n == 0:
        return
    if _host(dst):
        if count is not None:
            n = min(n, int(count))
        d = np.arange(dbase, dbase + n) if drow is None else drow[:n]
        s = np.arange(sbase, sbase + n) if srow is None else srow[:n]
        dst[d] = src[s]
        return
    F = dst.shape[1] if dst.ndim == 2 else 1
    vt, FT = _vec(F, dst, src)
    _launch(f"lru_copy_{vt}", n * FT, (dst, _NULL if drow is None else drow, np.int64(dbase), src,
                                       _NULL if srow is None else srow, np.int64(sbase), np.int64(n), np.int32(FT),
                                       _NULL if count is None else count),
            HOST_BLOCKS if blocks is None else blocks)
