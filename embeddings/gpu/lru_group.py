"""Placing the next batch of several ``lru`` tables at once (the table-batched prefetch).

One table's placement (:meth:`.lru.LRUCachedEmbeddings._place`) is a dozen small device steps over
its batch; for the eight tables of a DLRM step that is a hundred launches, eight sorts and sixteen
copy kernels, and their fixed costs, not the rows moved, decided the step time. Here the tables'
batches are placed together, as FBGEMM's table-batched embeddings do: one probe over the
concatenated indices, which compacts the entries that miss, one sort of their keys, which number the
sets of all tables one after the other (so each table's misses stay grouped by set, the tables one
after the other), one victim selection, one write-back (:func:`write_back`: one block, one copy, CPU
threads at home in the background), one read of the rows that move (:func:`read`: by default a
kernel through the mapped host addresses of a share of them beside CPU threads gathering the rest
into one block, whose pieces the device copies up as the threads' flags say they are gathered), one
settle. Each kernel finds its table's parameters and arrays (tags, stamps, dirty bits, rows, the
mapped base table, Adagrad's accumulators) in a small table of pointers, :attr:`Group.dev`.
Everything before the host learns how many rows move is one function, :func:`front`, of shapes the
batch's size fixes, that queues no host wait and ends by storing the counts and the read's rows into
page-locked memory: the host waits once for all of it, and a prefetch replays it as one CUDA graph
(:mod:`.lru_front`).

The decisions are the per-table ones: a row's set, its rank among its set's misses, the way it
takes, what goes home, all as if each table had been placed alone; the numpy forms below place
table by table with :mod:`.lru_kernels` and are what CI runs, and a GPU test compares the two.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from ..kernels.scatter import THREADS, scatter_later
from ..kernels.signalled import Gathering, gather_signalled
from . import cuda
from . import lru_kernels as LK

# a table's row of the pointer table (:attr:`Group.dev`): parameters, then device pointers
FIELDS = ("P_SETS", "P_WAYS", "P_R", "P_SBASE", "P_NOW", "P_LOCK", "P_TAGS", "P_STAMP", "P_DIRTY", "P_COUNTS", "P_W",
          "P_HOME", "P_DSTATE", "P_HSTATE", "P_USES")  # P_USES: 0 under lru
P_W, P_HOME, P_DSTATE, P_HSTATE = (FIELDS.index(f) for f in ("P_W", "P_HOME", "P_DSTATE", "P_HSTATE"))

SOURCE = LK.SOURCE_HEAD + f"""
/* per table, a row of NF int64: parameters, then device pointers */
#define NF {len(FIELDS)}
enum {{ {", ".join(FIELDS[:13])},
       {", ".join(FIELDS[13:])} }};""" + r"""

__device__ __forceinline__ int table_of(const i64* bounds, int T, i64 x) {  /* last t with bounds[t] <= x */
    int lo = 0, hi = T - 1;
    while (lo < hi) { int mid = (lo + hi + 1) >> 1; if (bounds[mid] <= x) lo = mid; else hi = mid - 1; }
    return lo;
}

/* every entry probed: a hit's slot stamped (and its use counted under lfu), slot[i] = its slot or -1;
   *misses += the entries that miss. Their keys ((sbase + set) * Rmax + row; none for a hit) go to
   key[i] (when key is not null), or, compacted, the misses' keys and entries to ck[j], ci[j] for the
   first cap of them, in no set order (a sort follows). Loops block by block, so that each warp's
   misses take one atomic between them. */
extern "C" __global__ void tb_probe(const i64* idx, i64 n, const i64* off, int T, const i64* tabs, i64 Rmax, i64 none,
                                    i64* slot, i64* key, unsigned long long* misses, i64* ck, i64* ci, i64 cap) {
    for (i64 base = (i64)blockIdx.x * blockDim.x; base < n; base += (i64)gridDim.x * blockDim.x) {
        i64 i = base + threadIdx.x, k = none;
        bool miss = false;
        if (i < n) {
            const i64* P = tabs + table_of(off, T, i) * NF;
            const i64* tags = (const i64*)P[P_TAGS];
            int ways = (int)P[P_WAYS];
            i64 r = idx[i], s = set_of(r, P[P_SETS]), first = s * ways, found = -1;
            for (int w = 0; w < ways; ++w) if (tags[first + w] == r) { found = first + w; break; }
            if (found >= 0) {
                int* stamp = (int*)P[P_STAMP];
                int now = (int)P[P_NOW];
                int* uses = (int*)P[P_USES];
                /* lfu: one more batch of use for a slot no earlier probe under now stamped; of the entries
                   hitting it, the one whose exchange finds the old stamp counts it */
                if (!uses) stamp[found] = now;
                else if (stamp[found] != now && atomicExch(stamp + found, now) != now) uses[found] += 1;
            }
            slot[i] = found;
            miss = found < 0;
            if (miss) k = (P[P_SBASE] + s) * Rmax + r;
            if (key) key[i] = k;
        }
        unsigned mask = __ballot_sync(0xffffffffu, miss);
        if (mask) {
            int lane = threadIdx.x & 31;
            unsigned long long at = 0;
            if (lane == 0) at = atomicAdd(misses, (unsigned long long)__popc(mask));
            at = __shfl_sync(0xffffffffu, at, 0);
            if (miss && ck) {
                i64 j = (i64)at + __popc(mask & ((1u << lane) - 1u));
                if (j < cap) { ck[j] = k; ci[j] = i; }
            }
        }
    }
}

/* the compacted keys past the misses (all of them if the misses overflowed cap: a placement of
   nothing, which the host runs again uncompacted) made hits */
extern "C" __global__ void tb_pad(i64* ck, i64* ci, i64 cap, const unsigned long long* misses, i64 none) {
    unsigned long long m = *misses;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < cap; j += (i64)gridDim.x * blockDim.x)
        if (m > (unsigned long long)cap || j >= (i64)m) { ck[j] = none; ci[j] = 0; }
}

/* a way's place in the order of eviction (lru_kernels.eviction_keys) */
__device__ __forceinline__ i64 eviction_key(const int* stamp, const int* uses, i64 slot, int lock) {
    i64 s = stamp[slot];
    return ((i64)(s >= lock) << 62) | (uses ? (i64)uses[slot] << 31 : 0) | s;
}

/* one thread per table: its hits and misses (misses: sorted keys inside its sets' range); nothing
   if the compacted misses overflowed (missed not null and above cap) */
extern "C" __global__ void tb_count(const i64* sk, i64 n, const i64* off, const i64* sbase, int T, const i64* tabs,
                                    i64 Rmax, const unsigned long long* missed, i64 cap) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || (missed && *missed > (unsigned long long)cap)) return;
    i64 misses = lower_bound(sk, n, sbase[t + 1] * Rmax) - lower_bound(sk, n, sbase[t] * Rmax);
    unsigned long long* counts = (unsigned long long*)tabs[t * NF + P_COUNTS];
    counts[0] += (unsigned long long)(off[t + 1] - off[t] - misses);
    counts[1] += (unsigned long long)misses;
}

extern "C" __global__ void tb_victims(const i64* sk, const bool* first, const i64* pos, i64 n, const i64* sbase, int T,
                                      const i64* tabs, i64 Rmax, i64* victim, i64* tid) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 v = -1, t = -1;
        if (first[i]) {
            i64 g = sk[i] / Rmax;
            t = table_of(sbase, T, g);
            const i64* P = tabs + t * NF;
            const int* stamp = (const int*)P[P_STAMP];
            const int* uses = (const int*)P[P_USES];
            int ways = (int)P[P_WAYS], lock = (int)P[P_LOCK];
            i64 base = (g - sbase[t]) * ways, k = pos[i] - pos[lower_bound(sk, n, g * Rmax)];
            if (k < ways) {  /* the k-th way in (key, way) order: k + 1 passes, each taking the next lowest */
                i64 last = 0;
                int at = -1;
                for (i64 r = 0; r <= k; ++r) {
                    i64 best = 0;
                    int bw = -1;
                    for (int w = 0; w < ways; ++w) {
                        i64 key = eviction_key(stamp, uses, base + w, lock);
                        bool after = at < 0 || key > last || (key == last && w > at);
                        if (after && (bw < 0 || key < best)) { best = key; bw = w; }
                    }
                    last = best; at = bw;
                }
                if (stamp[base + at] < lock) v = base + at;
            }
            if (v < 0) ((long long*)P[P_COUNTS])[4] = 1;
        }
        victim[i] = v;
        tid[i] = t;
    }
}

/* for each victim: the row it holds if that goes home (dirty), and keys that order the write-backs
   and the reads by (table, row): host address order within each table; cnt += write-backs, reads */
extern "C" __global__ void tb_moves(const i64* victim, const i64* tid, const i64* row, i64 n, const i64* tabs,
                                    i64 Rmax, i64 big, i64* old, i64* wkey, i64* rkey, unsigned long long* cnt) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 v = victim[i], o = -1, wk = big, rk = big;
        if (v >= 0) {
            i64 t = tid[i];
            const i64* P = tabs + t * NF;
            i64 held = ((const i64*)P[P_TAGS])[v];
            if (held >= 0 && ((const bool*)P[P_DIRTY])[v]) { o = held; wk = t * Rmax + held; atomicAdd(&cnt[0], 1ull); }
            rk = t * Rmax + row[i];
            atomicAdd(&cnt[1], 1ull);
        }
        old[i] = o; wkey[i] = wk; rkey[i] = rk;
    }
}

/* the first *count moves j: slot slot[j] of table tab[j] <-> its host row hrow[j] (down: to the host) */
#define TB_MOVE(NAME, T_) \
extern "C" __global__ void NAME(const i64* slot, const i64* tab, const i64* hrow, const i64* count, i64 n, int FT, \
                                const i64* tabs, int devf, int homef, int down) { \
    if (*count < n) n = *count; \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 j = i / FT, c = i - j * FT; \
        const i64* P = tabs + tab[j] * NF; \
        T_* dev = (T_*)P[devf]; T_* home = (T_*)P[homef]; \
        if (!dev) continue; \
        if (down) home[hrow[j] * FT + c] = dev[slot[j] * FT + c]; \
        else dev[slot[j] * FT + c] = home[hrow[j] * FT + c]; } }
TB_MOVE(tb_move_v4, float4)
TB_MOVE(tb_move_v1, float)

/* out[j] = slot slot[j] of table tab[j], for the n rows going home (one contiguous block) */
#define TB_GATHER(NAME, T_) \
extern "C" __global__ void NAME(const i64* slot, const i64* tab, i64 n, int FT, const i64* tabs, T_* out) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 j = i / FT, c = i - j * FT; \
        out[i] = ((const T_*)tabs[tab[j] * NF + P_W])[slot[j] * FT + c]; } }
TB_GATHER(tb_gather_v4, float4)
TB_GATHER(tb_gather_v1, float)

/* slot slot[j] of table tab[j] = in[j], for the n rows coming in (one contiguous block); nothing
   if *err (the block's gather failed) */
#define TB_PUT(NAME, T_) \
extern "C" __global__ void NAME(const i64* slot, const i64* tab, i64 n, int FT, const i64* tabs, const T_* in, \
                                const int* err) { \
    if (err && *err) return; \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * FT; i += (i64)gridDim.x * blockDim.x) { \
        i64 j = i / FT, c = i - j * FT; \
        ((T_*)tabs[tab[j] * NF + P_W])[slot[j] * FT + c] = in[i]; } }
TB_PUT(tb_put_v4, float4)
TB_PUT(tb_put_v1, float)

/* every table's left-out flag (counts[4]) cleared: a placement's first step */
extern "C" __global__ void tb_unleft(const i64* tabs, int T) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) ((long long*)tabs[t * NF + P_COUNTS])[4] = 0;
}

/* every table's counts (5 each) into a (T, 5) block of page-locked host memory, through its mapped
   address, and after them the read's error word (0 when err is null) */
extern "C" __global__ void tb_mail(const i64* tabs, int T, const int* err, i64* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * 5) out[i] = ((const i64*)tabs[(i / 5) * NF + P_COUNTS])[i % 5];
    else if (i == T * 5) out[i] = err ? *err : 0;
}

/* the victims take their new rows; if *err (their read failed) they are emptied instead: what they
   held has gone home, and what they hold now is not known */
extern "C" __global__ void tb_settle(const i64* row, const i64* victim, const i64* tid, i64 n, const i64* tabs,
                                     const int* err) {
    bool failed = err && *err;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x) {
        i64 v = victim[j];
        if (v < 0) continue;
        const i64* P = tabs + tid[j] * NF;
        i64* tags = (i64*)P[P_TAGS];
        bool* dirty = (bool*)P[P_DIRTY];
        if (failed) { tags[v] = -1; dirty[v] = false; if (P[P_USES]) ((int*)P[P_USES])[v] = 0; continue; }
        unsigned long long* counts = (unsigned long long*)P[P_COUNTS];
        atomicAdd(&counts[2], 1ull);
        if (tags[v] >= 0 && dirty[v]) atomicAdd(&counts[3], 1ull);
        tags[v] = row[j]; ((int*)P[P_STAMP])[v] = (int)P[P_NOW]; dirty[v] = false;
        if (P[P_USES]) ((int*)P[P_USES])[v] = 1;
    }
}
"""


# a staged read gathers in at most this many pieces, each copied up and put as soon as every CPU
# thread has gathered its share (the device waits for their flags): only the last piece's copy and
# put follow the gather, and a piece costs the prefetch thread three launches, not Python per piece.
# DLRM step on the H100 (8 x 45M rows, lfu), one process, alternating rounds: 4 pieces 10.92 ms,
# 2 pieces 11.87, 1 piece 12.05; in another, 8 pieces 11.96 and 2 pieces 11.38; 8 gather threads
# instead of 4 changed nothing measurable (-0.01 ms a round in the median of 14)
READ_PIECES = 4
READ_PIECE_ROWS = 16384  # rows a piece has at least


def _launch(name: str, work: int, args: tuple, most: int = 65536) -> None:
    cuda.launch(SOURCE, name, work, args, most)


def _ptr(a: Any) -> int:
    return 0 if a is None else int(a.data.ptr)


class Group:
    """The tables placed together and what the kernels need of them: entry offsets ``off`` (each
    table's indices, one after the other), set offsets ``sbase`` (each table's sets numbered
    after the previous table's), this placement's stamp ``now`` and ``lock`` per table, and on
    a GPU the pointer table :attr:`dev`. Keys are ``(sbase[t] + set) * Rmax + row``; ``none``
    (above every key) marks a hit."""

    def __init__(self, tables: list, sizes: list[int], now: list[int], lock: list[int], into: Any = None) -> None:
        self.tables, self.now, self.lock = tables, now, lock
        self.T = len(tables)
        self.off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.sbase = np.concatenate([[0], np.cumsum([t.sets for t in tables])]).astype(np.int64)
        self.Rmax = max(t.nvectors() for t in tables)
        self.none = int(self.sbase[-1]) * self.Rmax
        self.host = isinstance(tables[0]._tags, np.ndarray)
        self.reads = tables[0].reads
        # set once this placement's CPU threads have gathered its rows (or its read is over): the
        # rows it sends home are scattered only then, not beside the gather on the same cores
        self.gathered = threading.Event()
        self.holds: list = []  # events after the device work that still reads this placement's arrays (the copy home)
        self.reading: Reading | None = None  # a staged or split read's host side, until :func:`finish_read`
        self.err: Any = None  # set by a read whose CPU gather failed (:meth:`~.backend.CudaBackend.wait_flags`)
        self.dev = self.doff = self.dsbase = None
        if not self.host:
            be = tables[0].backend
            rows = [[t.sets, t.ways, t.nvectors(), int(self.sbase[i]), now[i], lock[i],
                     _ptr(t._tags), _ptr(t._stamp), _ptr(t._dirty), _ptr(t._counts), _ptr(t._W), _ptr(t._hbase),
                     _ptr(t._dstate), _ptr(t._hstate_dev if t._dstate is not None else None), _ptr(t._uses)]
                    for i, t in enumerate(tables)]
            n = self.T * len(FIELDS)
            table = np.concatenate([np.array(rows, np.int64).ravel(), self.off, self.sbase])
            if into is None:
                whole = be.asarray(table)
            else:  # a buffer that stays where it is (a captured front reads it): up from a block this placement keeps
                self._up = be.bounce(table.shape, np.int64)
                self._up[...] = table
                be.upload(into, self._up)
                whole = into
            self.dev = whole[:n].reshape(self.T, len(FIELDS))
            self.doff, self.dsbase = (whole[n + i * (self.T + 1):n + (i + 1) * (self.T + 1)] for i in range(2))

    @staticmethod
    def words(T: int) -> int:
        """The int64 words of the device pointer table of ``T`` tables (with the two offset arrays)."""
        return T * len(FIELDS) + 2 * (T + 1)

    def span(self, t: int) -> slice:
        return slice(int(self.off[t]), int(self.off[t + 1]))

    def local(self, sk: np.ndarray, t: int) -> tuple[slice, np.ndarray]:
        """Table ``t``'s range of sorted keys and those keys as its own placement numbers them."""
        lo, hi = np.searchsorted(sk, self.sbase[t:t + 2] * self.Rmax)
        k = sk[lo:hi]
        tb = self.tables[t]
        return slice(int(lo), int(hi)), (k // self.Rmax - self.sbase[t]) * tb.nvectors() + k % self.Rmax


def probe(g: Group, idx: Any, cnt: Any, cap: int | None = None) -> tuple[Any, Any, Any]:
    """:func:`.lru_kernels.probe` for every table's entries, with the group's keys: (each entry's
    slot or -1, and the keys with the entry each came from). ``cap`` None: every entry's key
    (``none`` for a hit), entries None. Else the misses compacted: the keys and entries of the
    first ``cap`` of them (in no set order; the rest of the ``cap`` keys ``none``), all ``none``
    if they are more than ``cap`` (a placement of nothing: :func:`front`). ``cnt[2] +=`` the
    entries that miss, on the device."""
    n = int(idx.size)
    if g.host:
        slot, key = np.empty(n, np.int64), np.full(n, g.none, np.int64)
        for t, tb in enumerate(g.tables):
            s = g.span(t)
            slot[s], k = LK.probe(idx[s], tb._tags, tb._stamp, tb.sets, tb.ways, g.now[t], tb.nvectors(), tb._uses)
            miss = slot[s] < 0
            R = tb.nvectors()
            key[s] = np.where(miss, (k // R + g.sbase[t]) * g.Rmax + k % R, g.none)
        at = np.flatnonzero(slot < 0)
        cnt[2] += at.size
        if cap is None:
            return slot, key, None
        ck, ci = np.full(cap, g.none, np.int64), np.zeros(cap, np.int64)
        if at.size <= cap:
            ck[:at.size], ci[:at.size] = key[at], at
        return slot, ck, ci
    import cupy as cp
    slot = cp.empty(n, np.int64)
    key, ck, ci = (cp.empty(n, np.int64), None, None) if cap is None else (None, cp.empty(cap, np.int64),
                                                                           cp.empty(cap, np.int64))
    _launch("tb_probe", n, (idx, np.int64(n), g.doff, np.int32(g.T), g.dev, np.int64(g.Rmax), np.int64(g.none),
                            slot, cuda.ptr(key), cnt[2:], cuda.ptr(ck), cuda.ptr(ci), np.int64(cap or 0)))
    if cap is None:
        return slot, key, None
    _launch("tb_pad", cap, (ck, ci, np.int64(cap), cnt[2:], np.int64(g.none)))
    return slot, ck, ci


def count(g: Group, sk: Any, cnt: Any = None, cap: int | None = None) -> None:
    """Add each table's hits and misses to its counts; nothing if compacted misses overflowed
    ``cap`` (``cnt[2]``, the entries that missed, above it)."""
    if g.host:
        if cap is not None and cnt[2] > cap:
            return
        for t, tb in enumerate(g.tables):
            s, _ = g.local(sk, t)
            misses = s.stop - s.start
            tb._counts[0] += int(g.off[t + 1] - g.off[t]) - misses
            tb._counts[1] += misses
        return
    _launch("tb_count", g.T, (sk, np.int64(sk.size), g.doff, g.dsbase, np.int32(g.T), g.dev, np.int64(g.Rmax),
                              cuda.ptr(None if cap is None else cnt[2:]), np.int64(cap or 0)))


def victims(g: Group, sk: Any, first: Any, pos: Any) -> tuple[Any, Any]:
    """Each distinct miss's victim slot in its table (:func:`.lru_kernels.victims`) and its table."""
    n = int(sk.size)
    if g.host:
        victim, tid = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        for t, tb in enumerate(g.tables):
            s, k = g.local(sk, t)
            victim[s] = LK.victims(k, first[s], pos[s], tb.nvectors(), tb._stamp, tb.ways, g.lock[t], tb._counts[4:5],
                                   tb._uses)
            tid[s] = np.where(first[s], t, -1)
        return victim, tid
    import cupy as cp
    victim, tid = cp.empty(n, np.int64), cp.empty(n, np.int64)
    _launch("tb_victims", n, (sk, first, pos, np.int64(n), g.dsbase, np.int32(g.T), g.dev, np.int64(g.Rmax),
                              victim, tid))
    return victim, tid


def moves(g: Group, victim: Any, tid: Any, row: Any, cnt: Any) -> tuple[Any, Any, Any]:
    """(the row each victim holds if it goes home else -1, keys ordering the write-backs and the
    reads by table and row); ``cnt[0:2] +=`` [write-backs, reads], on the device."""
    n = int(victim.size)
    big = g.T * g.Rmax
    if g.host:
        old, wkey, rkey = np.full(n, -1, np.int64), np.full(n, big, np.int64), np.full(n, big, np.int64)
        for t, tb in enumerate(g.tables):
            at = np.flatnonzero((tid == t) & (victim >= 0))
            v = victim[at]
            held = tb._tags[v]
            back = (held >= 0) & tb._dirty[v]
            old[at[back]] = held[back]
            wkey[at[back]] = t * g.Rmax + held[back]
            rkey[at] = t * g.Rmax + row[at]
        cnt[0] += (old >= 0).sum()
        cnt[1] += (victim >= 0).sum()
        return old, wkey, rkey
    import cupy as cp
    old, wkey, rkey = cp.empty(n, np.int64), cp.empty(n, np.int64), cp.empty(n, np.int64)
    _launch("tb_moves", n, (victim, tid, row, np.int64(n), g.dev, np.int64(g.Rmax), np.int64(big), old, wkey, rkey,
                            cnt))
    return old, wkey, rkey


def write_back(g: Group, slot: Any, tab: Any, hrow: Any, count: Any, n: int) -> None:
    """Send the first ``count`` rows going home (``n``, as the host read it), ``j``: slot ``slot[j]`` of table ``tab[j]`` to
    host row ``hrow[j]`` (grouped by table). The rows are gathered into one block in device
    memory now, so that reads queued after this may overwrite their slots; the block goes to
    page-locked host memory in one copy on a second stream, beside those reads, and CPU threads
    write its rows into the host tables in the background (:func:`~embeddings.kernels.scatter.
    scatter_later`), beside the rest of the training step, once the placement's own CPU gather
    (staged and split reads) is done: run together, the two slowed each other (and the
    placement) 1.5-2x on the H100's host. Each table keeps that scatter as
    ``_home`` until :func:`drain`: whatever reads its host rows drains it first (the next
    placement here, before its reads; every other operation through the table's ``_join``).
    Written one by one over PCIe by the GPU, random rows went no faster than random reads and
    not beside them (10-12 ms each way a step over 45 GB of tables on the H100): a step paid
    for both. Adagrad's accumulators (4 bytes a row) go home directly."""
    drain(g.tables)
    be = g.tables[0].backend
    move(g, slot, tab, hrow, count, down=True, rows=False)
    if n == 0:
        return
    F = g.tables[0]._W.shape[1]
    block = gather(g, slot[:n], tab[:n])
    host, tabs, rows = be.bounce((n, F), np.float32), be.bounce((n,), np.int64), be.bounce((n,), np.int64)
    fence = be.download_aside([(host, block), (tabs, tab[:n]), (rows, hrow[:n])])
    g.holds.append(fence)
    sources = [block, tab, hrow]  # what the copy reads stays allocated until it has landed

    def landed() -> None:
        be.wait(fence)
        sources.clear()
        g.gathered.wait()

    home = scatter_later(landed, lambda: _per_table(g, tabs, rows, host))
    for tb in g.tables:
        tb._home = home


class Reading(NamedTuple):
    """What a staged or split read holds until the device has passed its copies
    (:func:`finish_read`): the CPU threads' gather, the page-locked block and flags they write,
    the device block the pieces go up into, and the timing of the share read through mapped
    addresses (``start``, ``end``; ``k`` rows) beside the gather of ``m``."""
    gathering: Gathering
    block: np.ndarray
    flags: np.ndarray
    up: Any
    start: Any
    end: Any
    k: int
    m: int


def read(g: Group, slot: Any, tab: Any, hrow: Any, count: Any, n: int, htab: np.ndarray | None,
         hrows: np.ndarray | None) -> None:
    """Bring in the first ``count`` rows (``n``, as the host read it), ``j``: host row ``hrow[j]``
    of table ``tab[j]`` into its slot ``slot[j]`` (grouped by table, host-address order within each), as the tables'
    ``reads`` says. Mapped reads: the GPU reads each row through its mapped host address.
    Staged reads: CPU threads gather the rows into one page-locked block
    (:func:`~embeddings.kernels.signalled.gather_signalled`, which finds the tables and rows of the
    first ``n`` moves in ``htab`` and ``hrows`` on the host) in up to :data:`READ_PIECES` pieces,
    and the device copies each piece up and puts its rows into their slots as soon as the
    threads' flags say it is gathered (:meth:`~.backend.CudaBackend.wait_flags`): every copy and
    put is queued as soon as the gathering threads run without the GIL, so no host thread stands
    between the gather and the device, and this returns while they gather (:func:`finish_read`
    joins them). No SM waits on PCIe (mapped reads stall the blocks that issue them, and slowed
    the current batch's update kernels beside them 2-3x on the H100), at the price of host
    threads. Split reads (the
    default): both at once, the GPU reading the first ``read_share`` of the rows (the first
    tables' rows) on a side stream while CPU threads gather the rest. The two are bound by
    different things (the GPU by the reach of its translation of host addresses, about 41,000
    random rows a ms over 92 GB on the H100; the CPU threads by the latency of host memory), so
    each takes its share in less time than either would take for all; each read's two rates set
    the next share (:func:`balance`). Adagrad's accumulators (4 bytes a row) are read through
    their mapped addresses either way. Work queued after this (the settle) checks
    :attr:`Group.err`, which a failed gather sets."""
    if g.reads == "mapped":
        move(g, slot, tab, hrow, count, down=False)
        return
    move(g, slot, tab, hrow, count, down=False, rows=False)
    be = g.tables[0].backend
    if n == 0:
        return
    k = round(g.tables[0].read_share * n) if g.reads == "split" else 0
    with be.aside(1):  # not behind the copy home on lane 0
        start = be.clock()
        move(g, slot[:k], tab[:k], hrow[:k], count, down=False, state=False)
        end = be.clock()
    m = n - k
    if m == 0:  # the GPU reads every row: what follows waits for it all the same
        be.follow(end)
        return
    F = g.tables[0]._W.shape[1]
    block, up = be.bounce((m, F), np.float32), be.xp.empty((m, F), np.float32)
    cuts = np.linspace(0, m, max(1, min(READ_PIECES, m // READ_PIECE_ROWS)) + 1).astype(np.int64)
    threads = max(1, min(THREADS, m // READ_PIECE_ROWS))
    flags = be.bounce(((cuts.size - 1) * threads,), np.int64)
    g.err = be.xp.zeros(1, np.int32)
    gathering = gather_signalled([tb._base for tb in g.tables], htab[k:n], hrows[k:n], block, cuts, flags,
                                 done=g.gathered.set)  # the rows going home may go now, not when the read is done
    g.reading = Reading(gathering, block, flags, up, start, end, k, m)
    if not gathering.running():  # a share still queued needs the GIL, which a wait for the device may hold
        gathering.join()  # so the device waits only once every flag is set
    for p, (a, b) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist())):
        be.wait_flags(flags[p * threads:(p + 1) * threads], g.err)
        be.upload(up[a:b], block[a:b])
        put(g, slot[k + a:k + b], tab[k + a:k + b], up[a:b], g.err)
    be.follow(end)


def finish_read(g: Group, err: int) -> None:
    """Once the device has passed a staged or split read (the host waited for work queued after
    it; ``err``: the read's error word as the host then has it): join its CPU threads, raise what
    went wrong (the settle has then emptied the ways the read was filling), and set the next
    read's share from the rates of this one's two parts."""
    r, g.reading = g.reading, None
    if r is None:
        return
    gathered = r.gathering.result()
    if err:
        raise RuntimeError(f"a placement of {g.tables[0].name}{' and more tables' if g.T > 1 else ''}: the device "
                           f"waited {'for a gather that failed' if err == 1 else 'too long for the gather'} of the "
                           "rows it brings in; their ways were emptied")
    if r.k and r.m:
        be = g.tables[0].backend
        balance(g.tables, r.k / max(be.elapsed(r.start, r.end), 1e-9), r.m / max(gathered, 1e-9))


def _per_table(g: Group, tabs: np.ndarray, rows: np.ndarray, block: np.ndarray) -> list:
    """The ``(host table, its rows, their part of the block)`` jobs of rows ``rows[j]`` of tables
    ``tabs[j]`` (grouped by table) on the host, for the CPU threads that move them."""
    cut = np.searchsorted(tabs, np.arange(g.T + 1))
    return [(tb._base, rows[cut[t]:cut[t + 1]], block[cut[t]:cut[t + 1]])
            for t, tb in enumerate(g.tables) if cut[t + 1] > cut[t]]


def balance(tables: list, gpu_rate: float, cpu_rate: float) -> None:
    """Move the tables' ``read_share`` halfway to where a split read's two parts would take as
    long at the rates (rows a second) the last one measured: the GPU's mapped reads and the CPU
    threads' gather (from the host's wait for the rows' numbers). Within ``[0.02, 0.98]``, so
    both rates keep being measured."""
    target = gpu_rate / (gpu_rate + cpu_rate)
    share = min(max((tables[0].read_share + target) / 2, 0.02), 0.98)
    for tb in tables:
        tb.read_share = share


def put(g: Group, slot: Any, tab: Any, block: Any, err: Any = None) -> None:
    """Rows ``block[j]`` into slot ``slot[j]`` of table ``tab[j]`` (the inverse of :func:`gather`);
    nothing if ``err`` (a device int32) is set when the device gets there."""
    n = int(slot.size)
    if g.host:
        if err is not None and err[0]:
            return
        for t, tb in enumerate(g.tables):
            at = np.flatnonzero(tab == t)
            tb._W[slot[at]] = block[at]
        return
    F = g.tables[0]._W.shape[1]
    vt, FT = LK.vector_kind(F, block, *(tb._W for tb in g.tables))
    _launch(f"tb_put_{vt}", n * FT, (slot, tab, np.int64(n), np.int32(FT), g.dev, block, cuda.ptr(err)))


def mail(g: Group) -> np.ndarray:
    """Every table's counts (five each, :attr:`~.lru.LRUCachedEmbeddings._counts`) as one
    ``(T, 5)`` host array, once the work queued so far has run: on a GPU one kernel stores them
    through the mapped address of page-locked memory (no copy engine, so not behind the rows
    going home) and the host waits once; one launch, not one copy per table. The read's error
    word comes with them (no second wait). Then the placement's staged or split read is over
    on the device, and its threads are joined (:func:`finish_read`, which raises what went
    wrong)."""
    if g.host:
        finish_read(g, 0 if g.err is None else int(g.err[0]))
        return np.stack([np.array(t._counts) for t in g.tables])
    be = g.tables[0].backend
    out = be.bounce((g.T * 5 + 1,), np.int64)
    _launch("tb_mail", g.T * 5 + 1, (g.dev, np.int32(g.T), cuda.ptr(g.err), np.uint64(out.ctypes.data)))
    be.wait(be.fence())
    finish_read(g, int(out[-1]))
    return out[:-1].reshape(g.T, 5)


def drain(tables: list) -> None:
    """Wait until the rows the tables' last placement sent home are in their host tables (and
    raise what went wrong on the way)."""
    for tb in tables:
        home, tb._home = tb._home, None
        if home is not None:
            home.result()


def gather(g: Group, slot: Any, tab: Any) -> Any:
    """Rows ``slot[j]`` of tables ``tab[j]`` as one ``(n, F)`` device block."""
    n = int(slot.size)
    F = g.tables[0]._W.shape[1]
    if g.host:
        block = np.empty((n, F), np.float32)
        for t, tb in enumerate(g.tables):
            at = np.flatnonzero(tab == t)
            block[at] = tb._W[slot[at]]
        return block
    import cupy as cp
    block = cp.empty((n, F), np.float32)
    vt, FT = LK.vector_kind(F, block, *(tb._W for tb in g.tables))
    _launch(f"tb_gather_{vt}", n * FT, (slot, tab, np.int64(n), np.int32(FT), g.dev, block))
    return block


def move(g: Group, slot: Any, tab: Any, hrow: Any, count: Any, down: bool, rows: bool = True,
         state: bool = True) -> None:
    """The first ``count`` moves ``j`` (at most ``slot.size``): rows (when ``rows``) and Adagrad's
    accumulators (when ``state``) between slot ``slot[j]`` of table ``tab[j]`` and its host row
    ``hrow[j]``, to the host when ``down``."""
    if g.host:
        c = min(int(count[0]), slot.size)
        for t, tb in enumerate(g.tables):
            at = np.flatnonzero(tab[:c] == t)
            for dev, home in tb._homes(rows=rows, state=state):
                if down:
                    home[hrow[at]] = dev[slot[at]]
                else:
                    dev[slot[at]] = home[hrow[at]]
        return
    n = int(slot.size)
    if n == 0:
        return
    F = g.tables[0]._W.shape[1]
    vt, FT = LK.vector_kind(F, *(a for tb in g.tables for a in (tb._W, tb._hbase)))
    for name, ft, devf, homef in ((f"tb_move_{vt}", FT, P_W, P_HOME), ("tb_move_v1", 1, P_DSTATE, P_HSTATE)):
        skip = not rows if devf == P_W else not state or all(tb._dstate is None for tb in g.tables)
        if skip:
            continue
        _launch(name, n * ft, (slot, tab, hrow, count, np.int64(n), np.int32(ft), g.dev, np.int32(devf),
                               np.int32(homef), np.int32(down)), LK.HOST_BLOCKS)


def settle(g: Group, row: Any, victim: Any, tid: Any) -> None:
    """:func:`.lru_kernels.settle` for every table's victims, or, if the read failed
    (:attr:`Group.err` set when the device gets there), the victims emptied: what they held
    has gone home, and what they hold now is not known."""
    if g.host:
        for t, tb in enumerate(g.tables):
            at = tid == t
            if g.err is not None and g.err[0]:
                v = victim[at][victim[at] >= 0]
                tb._tags[v], tb._dirty[v] = -1, False
                if tb._uses is not None:
                    tb._uses[v] = 0
                continue
            LK.settle(row[at], victim[at], tb._tags, tb._stamp, tb._dirty, g.now[t], tb._counts[2:4], tb._uses)
        return
    _launch("tb_settle", int(victim.size), (row, victim, tid, np.int64(victim.size), g.dev, cuda.ptr(g.err)))


class HostSide(NamedTuple):
    """Page-locked host arrays a :func:`front` fills for its placement's host side: the counts
    (rows going home, rows coming in, entries that missed) and, for as many rows as the front
    can move, the read's tables and host rows, for CPU threads to gather (None under mapped
    reads). On the host form: the front's own arrays."""
    cnt: np.ndarray
    tab: np.ndarray | None
    row: np.ndarray | None


class Front(NamedTuple):
    """A placement's decisions before any row moves (:func:`front`), which :func:`slots` reads
    after the placement (and the staging of what found no way): the probe's slots, the sorted
    keys and the entry of each, each sorted entry's distinct-miss flag, row, victim and table, the
    counts (on the device: :class:`HostSide`), and the rows going home (``w*``: victim slot,
    table, host row) and coming in (``r*``), each in host-address order, and what the host
    reads of them (:class:`HostSide`); then what running it again takes: the batch, the bound
    on its compacted misses (None: not compacted) and whether it counts hits and misses."""
    slot: Any
    sk: Any
    order: Any
    first: Any
    row: Any
    victim: Any
    tid: Any
    cnt: Any
    wslot: Any
    wtab: Any
    wrow: Any
    rslot: Any
    rtab: Any
    rrow: Any
    host: HostSide  # on the host once the front has run
    idx: Any
    cap: int | None
    counted: bool

    def overflowed(self) -> bool:
        """Whether more entries missed than the compacted front had room for (read once it has run)."""
        return self.cap is not None and int(self.host.cnt[2]) > self.cap


def host_side(g: Group, n: int, alloc: Any) -> HostSide:
    """A :class:`HostSide` for a front that moves ``n`` rows at most, from ``alloc(shape, dtype)``
    (the backend's ``bounce`` or ``pinned``)."""
    rows = g.reads != "mapped"
    return HostSide(alloc((3,), np.int64), alloc((n,), np.int64) if rows else None,
                    alloc((n,), np.int64) if rows else None)


def front(g: Group, idx: Any, xp: Any, counted: bool = True, hosts: HostSide | None = None,
          cap: int | None = None) -> Front:
    """A placement up to the rows that move: left-out flags cleared, hits stamped (and counted
    when ``counted``), each table's distinct misses given the least recently used ways of their
    sets whose stamps are below its ``lock``, the moves ordered; then the counts, and unless reads
    are mapped the tables and host rows of the rows coming in, stored into page-locked
    ``hosts`` (new when None) for the host, which waits once for all of them. Device work only,
    with shapes fixed by the batch's size: nothing waits, so it can be captured as one CUDA
    graph (:mod:`.lru_front`).

    ``cap``: everything after the probe runs over the first ``cap`` entries that miss,
    compacted, not over the whole batch (at 84% hits, a sixth of the sorting). Should more miss,
    the front places nothing and counts nothing (:meth:`Front.overflowed`), and :func:`ran`
    runs it again over the whole batch: the probe's stamps are the same under the same ``now``."""
    if g.host:
        for tb in g.tables:
            tb._counts[4] = 0
    else:
        _launch("tb_unleft", g.T, (g.dev, np.int32(g.T)))
    cnt = xp.zeros(3, np.int64)  # rows going home, rows coming in, entries that miss
    slot, key, entry = probe(g, idx, cnt, cap)
    order = xp.argsort(key)
    sk = key[order]
    if entry is not None:
        order = entry[order]
    if counted:
        count(g, sk, cnt, cap)
    first, row = LK.distinct(sk, g.Rmax, g.none)
    victim, tid = victims(g, sk, first, xp.cumsum(first))
    old, wkey, rkey = moves(g, victim, tid, row, cnt)
    out, into = _argsort(xp, wkey, g.T * g.Rmax), _argsort(xp, rkey, g.T * g.Rmax)
    rtab, rrow = tid[into], row[into]
    if g.host:
        h = HostSide(cnt, rtab, rrow)
    else:
        be = g.tables[0].backend
        h = host_side(g, int(key.size), be.bounce) if hosts is None else hosts
        be.pull(h.cnt, cnt)
        if h.tab is not None:  # the rows coming in, which the device alone has counted
            be.pull(h.tab, rtab, cnt[1:2])
            be.pull(h.row, rrow, cnt[1:2])
    return Front(slot, sk, order, first, row, victim, tid, cnt, victim[out], tid[out], old[out], victim[into],
                 rtab, rrow, h, idx, cap, counted)


def place(g: Group, idx: Any, xp: Any, counted: bool = True, cap: int | None = None) -> Front:
    """Place every table's batch: hits stamped, each table's distinct misses into the least
    recently used ways of their sets whose stamps are below its ``lock``, the rows they held
    written home if dirty (:func:`write_back`) and the new rows read in, in host-address order
    over the rows that move only. A row that finds no way keeps victim -1 and sets its table's
    left-out flag (``_counts[4]``). Hits and misses are counted when ``counted``. The host
    waits once after the :func:`front` (for the counts and the read's rows), and for a staged
    read's copies; the rows going home land in the host tables in the background (:func:`drain`)."""
    return place_front(g, ran(g, front(g, idx, xp, counted, cap=cap)))


def ran(g: Group, f: Front) -> Front:
    """Wait for front ``f``; if its compacted misses overflowed, the front run again over the
    whole batch (and waited for), which then stands for it."""
    if not g.host:
        be = g.tables[0].backend
        be.wait(be.fence())
    return ran(g, front(g, f.idx, g.tables[0].backend.xp, f.counted)) if f.overflowed() else f


def place_front(g: Group, f: Front) -> Front:
    """The rest of :func:`place` after its :func:`front` has run (:func:`ran`): the rows move and
    the ways settle."""
    back, coming = int(f.host.cnt[0]), int(f.host.cnt[1])
    write_back(g, f.wslot, f.wtab, f.wrow, f.cnt[0:1], back)
    try:
        read(g, f.rslot, f.rtab, f.rrow, f.cnt[1:2], coming, f.host.tab, f.host.row)
    except BaseException:
        g.gathered.set()  # the rows going home wait no longer than a read that failed
        g.err = g.tables[0].backend.xp.ones(1, np.int32)
        settle(g, f.row, f.victim, f.tid)  # the ways it was filling are emptied (their rows have gone home)
        raise
    if g.reading is None:
        g.gathered.set()  # nor longer than a read that gathers nothing on the host
    settle(g, f.row, f.victim, f.tid)
    return f


def _argsort(xp: Any, keys: Any, bound: int) -> Any:
    """``argsort(keys)`` for keys in ``[0, bound]``: of them as int32 where they fit (a radix
    sort of half the passes: 0.22 against 0.41 ms for 2.6M keys on the H100)."""
    return xp.argsort(keys.astype(np.int32) if bound < 2 ** 31 else keys)


def slots(g: Group, p: Front) -> Any:
    """The slot of every entry: a hit's from the probe, a miss's its distinct miss's victim."""
    LK.slots(p.sk, p.order, p.victim, g.none, p.slot)
    return p.slot
