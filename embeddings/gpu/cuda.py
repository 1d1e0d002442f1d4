"""The CUDA kernels (CuPy ``RawKernel`` source, compiled by NVRTC on first use) and their launchers.

Lookups: one thread group per bag; each thread owns float4 (or float, where rows are not 16-byte
aligned) chunks of the row and keeps its accumulator in registers. A bag's rows are added one by
one in index order, ``acc += r`` (eight rows loaded ahead for memory parallelism), then multiplied
by ``1 / n`` for mean pooling; weighted bags ``acc = fma(w, r, acc)``. That is the order of the CPU
kernels (``embeddings.kernels.lookup`` as compiled), which CI checks. Unchecked device batches are
validated inside the lookup kernel itself: a bad index or offset sets a flag in mapped host memory
and the host raises after the kernel (the output is new, so nothing of the caller's is written).

Updates (the plan in :mod:`.ops`): positions sorted by row; a warp takes 32 sorted entries at once
(their rows, positions and bags loaded together into shared memory), and its thread groups take
the unique rows of at most ``CHUNK`` entries that begin there, one group a row: the group sums the
row's gradient rows in batch order and applies the step. A longer row (the
hot rows of a Zipf batch have ~10^5 entries) is cut into chunks of ``max(CHUNK, ceil(sqrt(n)))``
entries summed in parallel, then one group adds the chunk sums in chunk order and applies the
step: deterministic, and exactly the order :func:`.reference.update` uses. Every add and multiply
of an update is explicitly rounded (``__fadd_rn``/``__fmul_rn``: no fma contraction), so the numpy
reference reproduces it bit for bit, row-wise Adagrad's warp-shuffle sum of squares included.
SGD with ``deterministic=False`` skips the plan: each block sorts a tile of the batch's entries in
shared memory and subtracts each row's sum over the tile from the row by atomic adds, in whatever
order they land (:func:`.reference.sgd_any` applies the entries one by one in batch order).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float4 f4(float x, float y, float z, float w) {
    float4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r;
}
__device__ __forceinline__ float4 vadd(float4 a, float4 b) {
    return f4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
__device__ __forceinline__ float vadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float4 vfma(float w, float4 a, float4 c) {
    return f4(fmaf(w, a.x, c.x), fmaf(w, a.y, c.y), fmaf(w, a.z, c.z), fmaf(w, a.w, c.w));
}
__device__ __forceinline__ float vfma(float w, float a, float c) { return fmaf(w, a, c); }
/* c + s * a and c - s * a with two roundings (no fma contraction): what the numpy reference computes. */
__device__ __forceinline__ float4 vaxpy(float s, float4 a, float4 c) {
    return f4(__fadd_rn(c.x, __fmul_rn(s, a.x)), __fadd_rn(c.y, __fmul_rn(s, a.y)),
              __fadd_rn(c.z, __fmul_rn(s, a.z)), __fadd_rn(c.w, __fmul_rn(s, a.w)));
}
__device__ __forceinline__ float vaxpy(float s, float a, float c) { return __fadd_rn(c, __fmul_rn(s, a)); }
__device__ __forceinline__ float4 vsubs(float4 c, float s, float4 a) {
    return f4(__fsub_rn(c.x, __fmul_rn(s, a.x)), __fsub_rn(c.y, __fmul_rn(s, a.y)),
              __fsub_rn(c.z, __fmul_rn(s, a.z)), __fsub_rn(c.w, __fmul_rn(s, a.w)));
}
__device__ __forceinline__ float vsubs(float c, float s, float a) { return __fsub_rn(c, __fmul_rn(s, a)); }
__device__ __forceinline__ float4 vscale(float4 a, float s) { return f4(a.x * s, a.y * s, a.z * s, a.w * s); }
__device__ __forceinline__ float vscale(float a, float s) { return a * s; }
__device__ __forceinline__ void vzero(float4 &a) { a = f4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void vzero(float &a) { a = 0.f; }
__device__ __forceinline__ float vsumsq(float4 a) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(a.x, a.x), __fmul_rn(a.y, a.y)), __fmul_rn(a.z, a.z)),
                     __fmul_rn(a.w, a.w));
}
__device__ __forceinline__ float vsumsq(float a) { return __fmul_rn(a, a); }

/* Bag b is [s, e): from CSR offsets, or of fixed width k when off is null. */
__device__ __forceinline__ void bag_range(const i64* off, i64 k, i64 b, i64 &s, i64 &e) {
    if (off) { s = off[b]; e = off[b + 1]; } else { s = b * k; e = s + k; }
}

/* The bag holding position p: the last b with off[b] <= p (or p / k). */
__device__ __forceinline__ i64 bag_of(const i64* off, i64 B, i64 k, i64 p) {
    if (!off) return p / k;
    i64 lo = 0, hi = B;  /* off[lo] <= p < off[hi] */
    while (hi - lo > 1) { i64 m = (lo + hi) >> 1; if (off[m] <= p) lo = m; else hi = m; }
    return lo;
}

#define UNROLL 8

/* Pooled lookup: blockDim.x threads per bag (each a chunk of FT vectors of T per row), blockDim.y bags per block.
   bad non-null: the batch is unchecked device input; an index outside [0, n) or offsets that are not a CSR
   partition of [0, L) set *bad (host memory mapped into the device) and leave the bag unwritten. */
template <typename T, typename I>
__device__ void pooled_body(const T* __restrict__ W, int FT, const I* __restrict__ idx, const i64* __restrict__ off,
                            i64 k, const float* __restrict__ w, int mean, T* __restrict__ out, i64 ostride, i64 B,
                            i64 n, i64 L, int* bad) {
    i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= B) return;
    i64 s, e;
    bag_range(off, k, b, s, e);
    if (bad && off && !(0 <= s && s <= e && e <= L && (b > 0 || s == 0) && (b < B - 1 || e == L))) {
        *bad = 1;
        return;
    }
    float scale = 1.0f;
    if (mean && e > s) scale = 1.0f / (float)(e - s);
    for (int c = threadIdx.x; c < FT; c += blockDim.x) {
        T acc;
        vzero(acc);
        i64 j = s;
        if (w) {
            for (; j < e; ++j) {
                i64 v = (i64)idx[j];
                if (bad && (u64)v >= (u64)n) { *bad = 1; return; }
                acc = vfma(w[j], W[v * FT + c], acc);
            }
        } else {
            for (; j + UNROLL <= e; j += UNROLL) {  /* all loads first (memory parallelism), adds in index order */
                i64 v[UNROLL];
                bool ok = true;
#pragma unroll
                for (int t = 0; t < UNROLL; ++t) { v[t] = (i64)idx[j + t]; ok &= (u64)v[t] < (u64)n; }
                if (bad && !ok) { *bad = 1; return; }
                T r[UNROLL];
#pragma unroll
                for (int t = 0; t < UNROLL; ++t) r[t] = W[v[t] * FT + c];
#pragma unroll
                for (int t = 0; t < UNROLL; ++t) acc = vadd(acc, r[t]);
            }
            for (; j < e; ++j) {
                i64 v = (i64)idx[j];
                if (bad && (u64)v >= (u64)n) { *bad = 1; return; }
                acc = vadd(acc, W[v * FT + c]);
            }
        }
        out[b * ostride + c] = vscale(acc, scale);
    }
}

/* The update plan: perm sorts the batch positions by row (stable: a row's entries in batch order) and srow[q] is
   the row of sorted entry q, so a row's entries are a run [q, e) of equal srow. A row of more than C entries is
   "long": its entries are cut into chunks of chunk_len(n, C) (the last one shorter), each summed in order, and the
   chunk sums are added in chunk order. */
__device__ __forceinline__ i64 chunk_len(i64 n, i64 C) {
    i64 s = (i64)sqrt((double)n);  /* ceil(sqrt(n)), exactly */
    while (s * s < n) ++s;
    while (s > 1 && (s - 1) * (s - 1) >= n) --s;
    return s > C ? s : C;
}

/* The end of the run of row r that starts at q: a scan of at most C + 1 entries; if the run is longer, a binary
   search (exact) or q + C + 1 (!exact: enough to tell a long row). */
template <typename I>
__device__ __forceinline__ i64 run_end(const I* __restrict__ srow, i64 L, i64 q, I r, i64 C, bool exact) {
    i64 lim = min(L, q + C + 1), e = q + 1;
    while (e < lim && srow[e] == r) ++e;
    if (e < lim || e == L || !exact) return e;
    i64 lo = e - 1, hi = L;  /* srow[lo] == r < srow[hi] (hi == L: past the end) */
    while (hi - lo > 1) { i64 m = (lo + hi) >> 1; if (srow[m] == r) lo = m; else hi = m; }
    return hi;
}

/* Sum of the gradient contributions of sorted entries [q0, q1), vector c of the row, in entry order
   (N entries loaded ahead): acc += g (unweighted sum) or acc += coef * g (coef = w[p], 1/n for mean, or
   w[p] * (1/n)). */
template <typename T, int N>
struct Entries {
    const T* __restrict__ grad; i64 gstride; const i64* __restrict__ perm; i64 q0, q1;
    const i64* __restrict__ off; i64 B, k; const float* __restrict__ w; int mean;

    __device__ __forceinline__ T load(int c, i64 q, float &coef) const {
        i64 p = perm[q];
        i64 b = bag_of(off, B, k, p);
        coef = 1.0f;
        if (mean) { i64 s, e; bag_range(off, k, b, s, e); coef = __fdiv_rn(1.0f, (float)(e - s)); }
        if (w) coef = mean ? __fmul_rn(w[p], coef) : w[p];
        return grad[b * gstride + c];
    }
    __device__ __forceinline__ T operator()(int c) const {
        const bool scaled = w || mean;
        T acc;
        vzero(acc);
        i64 q = q0;
        for (; q + N <= q1; q += N) {
            float cf[N];
            T g[N];
#pragma unroll
            for (int t = 0; t < N; ++t) g[t] = load(c, q + t, cf[t]);
#pragma unroll
            for (int t = 0; t < N; ++t) acc = scaled ? vaxpy(cf[t], g[t], acc) : vadd(acc, g[t]);
        }
        for (; q < q1; ++q) {
            float cf;
            T g = load(c, q, cf);
            acc = scaled ? vaxpy(cf, g, acc) : vadd(acc, g);
        }
        return acc;
    }
};

/* A long row's chunk sums P[c0 .. c0 + nch), added in chunk order (UNROLL loaded ahead). */
template <typename T>
struct Partials {
    const T* __restrict__ P; int FT; i64 c0, nch;

    __device__ __forceinline__ T operator()(int c) const {
        T acc;
        vzero(acc);
        i64 j = 0;
        for (; j + UNROLL <= nch; j += UNROLL) {
            T p[UNROLL];
#pragma unroll
            for (int t = 0; t < UNROLL; ++t) p[t] = P[(c0 + j + t) * FT + c];
#pragma unroll
            for (int t = 0; t < UNROLL; ++t) acc = vadd(acc, p[t]);
        }
        for (; j < nch; ++j) acc = vadd(acc, P[(c0 + j) * FT + c]);
        return acc;
    }
};

/* Apply a row's accumulated gradient (src(c): vector c of it) to table row r; blockDim.x (a power of two <= 32)
   threads per row. opt 0: SGD row -= lr * g; opt 1: row-wise Adagrad state[r] += mean(g^2),
   row -= lr / (sqrt(state[r]) + eps) * g. Every thread of the block must call this (the shuffles see whole warps). */
template <typename T, typename S>
__device__ __forceinline__ void apply_row(T* __restrict__ W, int FT, int F, float* __restrict__ state, int opt,
                                          float lr, float eps, i64 r, bool active, const S &src) {
    const int G = blockDim.x;
    float mult = lr;
    if (opt == 1) {
        float g2 = 0.f;
        if (active)
            for (int c = threadIdx.x; c < FT; c += G) g2 = __fadd_rn(g2, vsumsq(src(c)));
        for (int o = G / 2; o > 0; o >>= 1) g2 = __fadd_rn(g2, __shfl_xor_sync(0xffffffffu, g2, o, G));
        float old = (active && threadIdx.x == 0) ? state[r] : 0.f;
        old = __shfl_sync(0xffffffffu, old, 0, G);
        if (!active) return;
        float st = __fadd_rn(old, __fdiv_rn(g2, (float)F));
        if (threadIdx.x == 0) state[r] = st;
        mult = __fdiv_rn(lr, __fadd_rn(__fsqrt_rn(st), eps));
    }
    if (!active) return;
    for (int c = threadIdx.x; c < FT; c += G) {
        T acc = src(c);
        W[r * FT + c] = vsubs(W[r * FT + c], mult, acc);
    }
}

/* The gradient contributions of sorted entries [q0, q1) of a window of 32 entries from qw, in entry order (as
   Entries sums them): each entry's bag and coefficient from the window's shared arrays (wb, wc), or, past the
   window's end (a run that began in its last entries), loaded as Entries loads them. */
template <typename T>
struct WindowEntries {
    const T* __restrict__ grad; i64 gstride; const i64* __restrict__ perm; i64 q0, q1, qw;
    const i64* wb; const float* wc; const i64* __restrict__ off; i64 B, k; const float* __restrict__ w; int mean;

    __device__ __forceinline__ T add(int c, T acc) const {
        const bool scaled = w || mean;
        i64 q = q0, qe = min(q1, qw + 32);
        for (; q + 4 <= qe; q += 4) {
            T g[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) g[t] = grad[wb[q + t - qw] * gstride + c];
#pragma unroll
            for (int t = 0; t < 4; ++t) acc = scaled ? vaxpy(wc[q + t - qw], g[t], acc) : vadd(acc, g[t]);
        }
        for (; q < qe; ++q) {
            T g = grad[wb[q - qw] * gstride + c];
            acc = scaled ? vaxpy(wc[q - qw], g, acc) : vadd(acc, g);
        }
        const Entries<T, 1> past{grad, gstride, perm, q, q1, off, B, k, w, mean};
        for (; q < q1; ++q) {
            float cf;
            T g = past.load(c, q, cf);
            acc = scaled ? vaxpy(cf, g, acc) : vadd(acc, g);
        }
        return acc;
    }
    __device__ __forceinline__ T operator()(int c) const {
        T acc;
        vzero(acc);
        return add(c, acc);
    }
};

#define WARPS 8  /* warps per block of the short rows' update (256 threads) */
#define AHEAD 2  /* runs an SGD thread group updates at once */

/* Rows of at most C entries, a warp per window of 32 sorted entries. The window's rows, positions, bags and
   coefficients are loaded at once (coalesced) into shared memory, then the warp's thread groups take the runs that
   begin in the window in turn (a run may go on past its end; only rows of more than C entries are left to the long
   rows' kernels), SGD's AHEAD runs at once. A row's loads then wait on the window's one load, not on a chain of
   three per entry (sorted row, position, gradient row): on the H100 at 40 a bag 1.3-1.7x faster than a thread group
   per entry, bit for bit the same (no list of unique rows: the plan has no host sync for their count). */
template <typename T, typename I>
__device__ void update_short_body(T* W, int FT, int F, float* state, const T* grad, i64 gstride, const I* srow,
                                  const i64* perm, i64 L, i64 C, const i64* off, i64 B, i64 k, const float* w,
                                  int mean, int opt, float lr, float eps) {
    __shared__ i64 bags[WARPS][32];  /* entry lane's bag */
    __shared__ float coefs[WARPS][32];
    __shared__ int heads[WARPS][32];  /* the lanes where the window's runs begin, and their rows and ends */
    __shared__ i64 rows[WARPS][32];
    __shared__ i64 ends[WARPS][32];
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, wp = tid >> 5, lane = tid & 31;
    const i64 qw = ((i64)blockIdx.x * WARPS + wp) * 32, q = qw + lane;
    const bool valid = q < L;
    const i64 r = valid ? (i64)srow[q] : -1;  /* rows are checked: -1 and -2 are no row */
    i64 prev = __shfl_up_sync(0xffffffffu, r, 1);
    if (lane == 0) prev = q > 0 && valid ? (i64)srow[q - 1] : -2;
    float coef = 1.0f;
    i64 b = 0;
    if (valid) {
        i64 p = perm[q];
        b = bag_of(off, B, k, p);
        if (mean) { i64 s, e; bag_range(off, k, b, s, e); coef = __fdiv_rn(1.0f, (float)(e - s)); }
        if (w) coef = mean ? __fmul_rn(w[p], coef) : w[p];
    }
    bags[wp][lane] = b;
    coefs[wp][lane] = coef;
    const bool head = valid && r != prev;
    const unsigned starts = __ballot_sync(0xffffffffu, head);
    i64 e = 0;
    if (head) {
        const unsigned later = lane < 31 ? starts >> (lane + 1) : 0u;
        if (later) {
            e = q + __ffs(later);
        } else {  /* the window's last run: it may go on past the window */
            i64 lim = min(L, q + C + 1);
            e = min(qw + 32, L);
            while (e < lim && (i64)srow[e] == r) ++e;
        }
    }
    const bool mine = head && e - q <= C;
    const unsigned runs = __ballot_sync(0xffffffffu, mine);
    if (mine) {
        const int h = __popc(runs & ((1u << lane) - 1u));
        heads[wp][h] = lane;
        rows[wp][h] = r;
        ends[wp][h] = e;
    }
    __syncwarp();
    const int G = blockDim.x, per = 32 / G, n = __popc(runs);
    if (opt == 0) {
        const bool scaled = w || mean;
        for (int h0 = lane / G; h0 < n; h0 += per * AHEAD)
            for (int c = threadIdx.x; c < FT; c += G) {
                T old[AHEAD], g0[AHEAD];  /* every run's first loads before any use */
#pragma unroll
                for (int u = 0; u < AHEAD; ++u) {
                    const int h = h0 + per * u;
                    if (h < n) {
                        old[u] = W[rows[wp][h] * FT + c];
                        g0[u] = grad[bags[wp][heads[wp][h]] * gstride + c];
                    }
                }
#pragma unroll
                for (int u = 0; u < AHEAD; ++u) {
                    const int h = h0 + per * u;
                    if (h >= n) continue;
                    const int l = heads[wp][h];
                    T acc;
                    vzero(acc);
                    acc = scaled ? vaxpy(coefs[wp][l], g0[u], acc) : vadd(acc, g0[u]);
                    WindowEntries<T> rest{grad, gstride, perm, qw + l + 1, ends[wp][h], qw, bags[wp], coefs[wp], off,
                                          B, k, w, mean};
                    W[rows[wp][h] * FT + c] = vsubs(old[u], lr, rest.add(c, acc));
                }
            }
        return;
    }
    for (int h0 = 0; h0 < n; h0 += per) {  /* uniform trips: apply_row's shuffles need the whole warp */
        const int h = h0 + lane / G;
        const bool on = h < n;
        i64 row = 0, q0 = 0, q1 = 0;
        if (on) { row = rows[wp][h]; q0 = qw + heads[wp][h]; q1 = ends[wp][h]; }
        WindowEntries<T> src{grad, gstride, perm, q0, q1, qw, bags[wp], coefs[wp], off, B, k, w, mean};
        apply_row(W, FT, F, state, opt, lr, eps, row, on, src);
    }
}

/* NL long rows and NC chunk sums: the numbers given, or (counts not null: those are bounds) the plan's own. */
__device__ __forceinline__ void long_counts(const u64* counts, i64& NL, i64& NC) {
    if (!counts) return;
    u64 x = *counts;
    NL = (i64)(x >> 40);
    NC = (i64)(x & (((u64)1 << 40) - 1));
}

/* Chunk j of the long rows (slot: the last with lbase[slot] <= j) into P[j]. */
template <typename T>
__device__ void chunk_sums_body(T* P, int FT, const T* grad, i64 gstride, const i64* perm, const i64* lstart,
                                const i64* lend, const i64* lbase, i64 NL, i64 NC, const u64* counts, i64 C,
                                const i64* off, i64 B, i64 k, const float* w, int mean) {
    i64 j = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    long_counts(counts, NL, NC);
    if (j >= NC) return;
    i64 lo = 0, hi = NL;
    while (hi - lo > 1) { i64 m = (lo + hi) >> 1; if (lbase[m] <= j) lo = m; else hi = m; }
    i64 s = lstart[lo], e = lend[lo], cl = chunk_len(e - s, C);
    i64 q0 = s + (j - lbase[lo]) * cl;
    i64 q1 = min(q0 + cl, e);
    Entries<T, UNROLL> src{grad, gstride, perm, q0, q1, off, B, k, w, mean};
    for (int c = threadIdx.x; c < FT; c += blockDim.x) P[j * FT + c] = src(c);
}

/* Long row of slot sl: its chunk sums in order, then the optimizer step. */
template <typename T, typename I>
__device__ void update_long_body(T* W, int FT, int F, float* state, const T* P, const I* srow, const i64* lstart,
                                 const i64* lend, const i64* lbase, i64 NL, const u64* counts, i64 C, int opt,
                                 float lr, float eps) {
    i64 sl = (i64)blockIdx.x * blockDim.y + threadIdx.y, NC = 0;
    long_counts(counts, NL, NC);
    bool active = sl < NL;
    i64 r = 0, c0 = 0, nch = 0;
    if (active) {
        i64 s = lstart[sl], n = lend[sl] - s, cl = chunk_len(n, C);
        r = (i64)srow[s];
        c0 = lbase[sl];
        nch = (n + cl - 1) / cl;
    }
    Partials<T> src{P, FT, c0, nch};
    apply_row(W, FT, F, state, opt, lr, eps, r, active, src);
}

#define POOLED(NAME, T, I) \
extern "C" __global__ void NAME(const T* W, int FT, const I* idx, const i64* off, i64 k, const float* w, int mean, \
                                T* out, i64 ostride, i64 B, i64 n, i64 L, int* bad) { \
    pooled_body<T, I>(W, FT, idx, off, k, w, mean, out, ostride, B, n, L, bad); }
POOLED(pooled_v4_i32, float4, int)
POOLED(pooled_v4_i64, float4, i64)
POOLED(pooled_v1_i32, float, int)
POOLED(pooled_v1_i64, float, i64)

#define UPDATE(SUFFIX, T, I) \
extern "C" __global__ void update_short_##SUFFIX(T* W, int FT, int F, float* state, const T* grad, i64 gstride, \
        const I* srow, const i64* perm, i64 L, i64 C, const i64* off, i64 B, i64 k, const float* w, int mean, int opt, \
        float lr, float eps) { \
    update_short_body<T, I>(W, FT, F, state, grad, gstride, srow, perm, L, C, off, B, k, w, mean, opt, lr, eps); } \
extern "C" __global__ void update_long_##SUFFIX(T* W, int FT, int F, float* state, const T* P, const I* srow, \
        const i64* lstart, const i64* lend, const i64* lbase, i64 NL, const u64* counts, i64 C, int opt, float lr, \
        float eps) { \
    update_long_body<T, I>(W, FT, F, state, P, srow, lstart, lend, lbase, NL, counts, C, opt, lr, eps); }
UPDATE(v4_i32, float4, int)
UPDATE(v4_i64, float4, i64)
UPDATE(v1_i32, float, int)
UPDATE(v1_i64, float, i64)

/* SGD in any order (SGD(deterministic=False)): atomic subtraction from a table row (vector adds on sm_90). */
__device__ __forceinline__ void red_sub(float4* p, float4 s) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(p, f4(-s.x, -s.y, -s.z, -s.w));
#else
    float* q = (float*)p;
    atomicAdd(q, -s.x); atomicAdd(q + 1, -s.y); atomicAdd(q + 2, -s.z); atomicAdd(q + 3, -s.w);
#endif
}
__device__ __forceinline__ void red_sub(float* p, float s) { atomicAdd(p, -s); }

/* SGD in any order, by tiles: a block takes TILE = 2^BITS consecutive entries of the batch and sorts them by (row,
   position) in shared memory (bitonic); a thread group per run of one row sums the run's gradient contributions in
   batch order (Entries, as the planned update does) and subtracts lr * sum from the row by atomic adds, in the order they land.
   A hot row costs one atomic add per tile instead of one per entry (an entry's own atomics made Zipf batches 2-3x
   slower); a row with one entry rounds as the planned update rounds it. No plan: the batch was confirmed valid before. */
template <typename T, typename I, int BITS>
__device__ void sgd_any_body(T* W, int FT, const T* __restrict__ grad, i64 gstride, const I* __restrict__ idx, i64 L,
                             const i64* __restrict__ off, i64 B, i64 k, const float* __restrict__ w, int mean,
                             float lr) {
    const int TILE = 1 << BITS;
    __shared__ u64 key[TILE];
    __shared__ i64 pos[TILE];
    const i64 t0 = (i64)blockIdx.x * TILE;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
    for (int p = tid; p < TILE; p += nt)
        key[p] = t0 + p < L ? ((u64)(i64)idx[t0 + p] << BITS) | (u64)p : ~(u64)0;
    __syncthreads();
    for (int size = 2; size <= TILE; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < TILE / 2; i += nt) {
                int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                u64 a = key[lo], b = key[hi];
                if ((a > b) == ((lo & size) == 0)) { key[lo] = b; key[hi] = a; }
            }
            __syncthreads();
        }
    for (int p = tid; p < TILE; p += nt) pos[p] = t0 + (i64)(key[p] & (u64)(TILE - 1));
    __syncthreads();
    const int n = (int)min((i64)TILE, L - t0);
    for (int p = threadIdx.y; p < n; p += blockDim.y) {
        u64 r = key[p] >> BITS;
        if (p > 0 && (key[p - 1] >> BITS) == r) continue;
        int e = p + 1;
        while (e < n && (key[e] >> BITS) == r) ++e;
        Entries<T, 4> src{grad, gstride, pos, p, e, off, B, k, w, mean};
        for (int c = threadIdx.x; c < FT; c += blockDim.x) red_sub(W + (i64)r * FT + c, vscale(src(c), lr));
    }
}

#define SGD_ANY(SUFFIX, T, I, BITS) \
extern "C" __global__ void sgd_any_##BITS##_##SUFFIX(T* W, int FT, const T* grad, i64 gstride, const I* idx, i64 L, \
        const i64* off, i64 B, i64 k, const float* w, int mean, float lr) { \
    sgd_any_body<T, I, BITS>(W, FT, grad, gstride, idx, L, off, B, k, w, mean, lr); }
SGD_ANY(v4_i32, float4, int, 7)
SGD_ANY(v4_i64, float4, i64, 7)
SGD_ANY(v1_i32, float, int, 7)
SGD_ANY(v1_i64, float, i64, 7)
SGD_ANY(v4_i32, float4, int, 9)
SGD_ANY(v4_i64, float4, i64, 9)
SGD_ANY(v1_i32, float, int, 9)
SGD_ANY(v1_i64, float, i64, 9)

#define CHUNKS(NAME, T) \
extern "C" __global__ void NAME(T* P, int FT, const T* grad, i64 gstride, const i64* perm, const i64* lstart, \
        const i64* lend, const i64* lbase, i64 NL, i64 NC, const u64* counts, i64 C, const i64* off, i64 B, i64 k, \
        const float* w, int mean) { \
    chunk_sums_body<T>(P, FT, grad, gstride, perm, lstart, lend, lbase, NL, NC, counts, C, off, B, k, w, mean); }
CHUNKS(chunk_sums_v4, float4)
CHUNKS(chunk_sums_v1, float)

/* srow[q] = idx[perm[q]]: the sorted rows, read contiguously by the kernels above. */
#define SORTED_ROWS(NAME, I) \
extern "C" __global__ void NAME(const I* idx, const i64* perm, i64 L, I* srow) { \
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < L; q += (i64)gridDim.x * blockDim.x) \
        srow[q] = idx[perm[q]]; }
SORTED_ROWS(sorted_rows_i32, int)
SORTED_ROWS(sorted_rows_i64, i64)

/* key[q] = t << 40 | (idx[q] & (2^40 - 1)): one sort orders several batches' entries, each within its own */
#define SORT_KEYS(NAME, I) \
extern "C" __global__ void NAME(const I* idx, i64 L, i64 t, i64* key) { \
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < L; q += (i64)gridDim.x * blockDim.x) \
        key[q] = (t << 40) | ((i64)idx[q] & 0xFFFFFFFFFFLL); }
SORT_KEYS(sort_keys_i32, int)
SORT_KEYS(sort_keys_i64, i64)

/* The long rows (more than C entries): run [lstart, lend) per slot; slot and first chunk sum from one atomic
   (count << 40 | chunks), so lbase increases with the slot. Slots are in no particular row order; the arithmetic
   does not depend on it. */
#define LONG_ROWS(NAME, I) \
extern "C" __global__ void NAME(const I* srow, i64 L, i64 C, u64* counter, i64* lstart, i64* lend, i64* lbase) { \
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < L; q += (i64)gridDim.x * blockDim.x) { \
        if (q > 0 && srow[q] == srow[q - 1]) continue; \
        i64 e = run_end(srow, L, q, srow[q], C, true), n = e - q; \
        if (n <= C) continue; \
        i64 cl = chunk_len(n, C); \
        u64 old = atomicAdd(counter, ((u64)1 << 40) + (u64)((n + cl - 1) / cl)); \
        i64 slot = (i64)(old >> 40); \
        lstart[slot] = q; \
        lend[slot] = e; \
        lbase[slot] = (i64)(old & (((u64)1 << 40) - 1)); } }
LONG_ROWS(long_rows_i32, int)
LONG_ROWS(long_rows_i64, i64)

/* Validation of unchecked device input (before anything is written): flags[0] = 1 for an index outside [0, n),
   flags[1] = 1 for offsets that are not a CSR partition of [0, L), flags[2] = 1 for a non-finite gradient.
   flags is host memory mapped into the device; the host reads it after a sync and, on a 1, finds the CPU error. */
#define CHECK(NAME, I) \
extern "C" __global__ void NAME(const I* idx, i64 L, i64 n, const i64* off, i64 B, const float* g, i64 grows, int F, \
                                i64 gstride, int* flags) { \
    i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x, step = (i64)gridDim.x * blockDim.x; \
    if (idx) for (i64 i = t0; i < L; i += step) if ((u64)(i64)idx[i] >= (u64)n) flags[0] = 1; \
    if (off) { \
        for (i64 b = t0; b < B; b += step) if (off[b + 1] < off[b]) flags[1] = 1; \
        if (t0 == 0 && (off[0] != 0 || off[B] != L)) flags[1] = 1; \
    } \
    if (g && gstride == F) { for (i64 i = t0; i < grows * F; i += step) if (!isfinite(g[i])) flags[2] = 1; } \
    else if (g) for (i64 i = t0; i < grows * F; i += step) { /* rows apart: a 64-bit division an element */ \
        i64 r = i / F; \
        if (!isfinite(g[r * gstride + (i - r * F)])) flags[2] = 1; } }
CHECK(check_i32, int)
CHECK(check_i64, i64)

/* n words (or bytes) of device memory into page-locked host memory through its mapped address:
   stores over PCIe, which queue behind no copy-engine transfer (CudaBackend.pull); words: only the
   first min(*count, n) when count is not null (a length the device holds) */
extern "C" __global__ void pull_u64(const u64* src, u64* dst, i64 n, const i64* count) {
    i64 m = count && *count < n ? *count : n;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (i64)gridDim.x * blockDim.x) dst[i] = src[i];
}
extern "C" __global__ void pull_u8(const unsigned char* src, unsigned char* dst, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) dst[i] = src[i];
}

/* one thread: wait until every one of the n flags in page-locked host memory (read through its
   mapped address) is nonzero (CudaBackend.wait_flags); *err = 1 if one is not 1 (its writer
   failed), 2 if timeout_ns passed first */
extern "C" __global__ void wait_flags(const volatile i64* flags, int n, i64 timeout_ns, int* err) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        bool all = true, failed = false;
        for (int i = 0; i < n; ++i) { i64 f = flags[i]; all = all && f != 0; failed = failed || (f != 0 && f != 1); }
        if (all) { if (failed) *err = 1; break; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if ((i64)(t - t0) > timeout_ns) { *err = 2; break; }
        __nanosleep(1000);
    }
    __threadfence_system();
}
"""

NULL = np.uint64(0)  # a null pointer argument


@lru_cache(maxsize=None)
def compiled(source: str) -> Any:
    """``source`` compiled into a module (NVRTC, cached by CuPy on disk)."""
    import cupy as cp
    return cp.RawModule(code=source, options=("--std=c++14",))


def module() -> Any:
    """The compiled module of :data:`SOURCE`."""
    return compiled(SOURCE)


def launch(source: str, name: str, n: int, args: tuple, most: int = 65536) -> None:
    """Kernel ``name`` of ``source``, as a grid-stride launch over ``n`` items of at most ``most``
    blocks of 256 threads."""
    compiled(source).get_function(name)(*grid_1d(n, most=most), args)


def vec4(F: int, *arrays: Any) -> bool:
    """Whether rows can move as float4: F a multiple of 4, every array 16-byte aligned with a row
    stride of a multiple of 16 bytes."""
    return F % 4 == 0 and all(a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0 for a in arrays)


@lru_cache(maxsize=None)
def kernel(name: str) -> Any:
    """One kernel of :data:`SOURCE`."""
    return module().get_function(name)


def ptr(a: Any) -> Any:
    """A CuPy array as a kernel argument, or a null pointer for None."""
    return NULL if a is None else a


def grid_1d(n: int, block: int = 256, most: int = 65536) -> tuple[tuple[int], tuple[int]]:
    """A grid-stride launch over ``n`` items."""
    return (max(1, min(most, -(-n // block))),), (block,)


@lru_cache(maxsize=None)
def group(FT: int, pow2: bool) -> tuple[int, int]:
    """(threads per row, rows per 256-thread block) for rows of ``FT`` vectors; a power of two
    of at most 32 threads where the group shuffles (updates), else up to 256."""
    if pow2:
        g = 1
        while g < FT and g < 32:
            g *= 2
    else:
        g = max(1, min(FT, 256))
    return g, max(1, 256 // g)
