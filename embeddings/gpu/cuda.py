"""The CUDA kernels (CuPy ``RawKernel`` source, compiled by NVRTC on first use) and their launchers.

One thread group per output row (a bag, or a unique table row in an update); each thread owns
float4 (or float, where rows are not 16-byte aligned) chunks of the row and keeps its accumulator
in registers, so no kernel here needs shared memory or a barrier; the update's row-wise Adagrad
sums squares across its group with warp shuffles.

Summation order is the CPU kernels' (``embeddings.kernels.lookup``, as compiled: its source
groups four rows as ``acc + ((r0 + r1) + (r2 + r3))`` but under ``fastmath`` LLVM emits the
sequential chain, which CI checks): a bag's rows one by one in index order, ``acc += r`` (four
rows loaded ahead), then a multiply by ``1 / n`` for mean pooling; weighted bags
``acc = fma(w, r, acc)`` one by one. An update
accumulates a unique row's gradient over its entries in batch order (``acc += coef * g``) and
applies ``row = fma(-mult, acc, row)``, the CPU plan path's arithmetic (the CPU's SGD on small
batches subtracts each contribution separately, so SGD agrees to rounding, not bit for bit).
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
    return f4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float vadd(float a, float b) { return a + b; }
__device__ __forceinline__ float4 vfma(float w, float4 a, float4 c) {
    return f4(fmaf(w, a.x, c.x), fmaf(w, a.y, c.y), fmaf(w, a.z, c.z), fmaf(w, a.w, c.w));
}
__device__ __forceinline__ float vfma(float w, float a, float c) { return fmaf(w, a, c); }
__device__ __forceinline__ float4 vscale(float4 a, float s) { return f4(a.x * s, a.y * s, a.z * s, a.w * s); }
__device__ __forceinline__ float vscale(float a, float s) { return a * s; }
__device__ __forceinline__ void vzero(float4 &a) { a = f4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void vzero(float &a) { a = 0.f; }
__device__ __forceinline__ float vsumsq(float4 a) { return ((a.x * a.x + a.y * a.y) + a.z * a.z) + a.w * a.w; }
__device__ __forceinline__ float vsumsq(float a) { return a * a; }

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

/* Pooled lookup: blockDim.x threads per bag (each a chunk of FT vectors of T per row), blockDim.y bags per block. */
template <typename T, typename I>
__device__ void pooled_body(const T* __restrict__ W, int FT, const I* __restrict__ idx, const i64* __restrict__ off,
                            i64 k, const float* __restrict__ w, int mean, T* __restrict__ out, i64 ostride, i64 B) {
    i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= B) return;
    i64 s, e;
    bag_range(off, k, b, s, e);
    float scale = 1.0f;
    if (mean && e > s) scale = 1.0f / (float)(e - s);
    for (int c = threadIdx.x; c < FT; c += blockDim.x) {
        T acc;
        vzero(acc);
        i64 j = s;
        if (w) {
            for (; j < e; ++j) acc = vfma(w[j], W[(i64)idx[j] * FT + c], acc);
        } else {
            for (; j + 4 <= e; j += 4) {
                T r0 = W[(i64)idx[j] * FT + c];
                T r1 = W[(i64)idx[j + 1] * FT + c];
                T r2 = W[(i64)idx[j + 2] * FT + c];
                T r3 = W[(i64)idx[j + 3] * FT + c];
                acc = vadd(vadd(vadd(vadd(acc, r0), r1), r2), r3);  /* loads first (memory parallelism), adds in index order */
            }
            for (; j < e; ++j) acc = vadd(acc, W[(i64)idx[j] * FT + c]);
        }
        out[b * ostride + c] = vscale(acc, scale);
    }
}

/* A unique row's accumulated gradient, chunk c: its entries (sorted keys q0..q1, low pbits bits the batch position) in order. */
template <typename T>
__device__ __forceinline__ T row_grad(const T* __restrict__ grad, i64 gstride, int c, const i64* __restrict__ keys,
                                      i64 q0, i64 q1, i64 mask, const i64* __restrict__ off, i64 B, i64 k,
                                      const float* __restrict__ w, int mean) {
    T acc;
    vzero(acc);
    for (i64 q = q0; q < q1; ++q) {
        i64 p = keys[q] & mask;
        i64 b = bag_of(off, B, k, p);
        T g = grad[b * gstride + c];
        if (w || mean) {
            float coef = 1.0f;
            if (mean) { i64 s, e; bag_range(off, k, b, s, e); coef = 1.0f / (float)(e - s); }
            if (w) coef = mean ? w[p] * coef : w[p];
            acc = vfma(coef, g, acc);
        } else {
            acc = vadd(acc, g);
        }
    }
    return acc;
}

/* Fused update: blockDim.x (a power of two <= 32) threads per unique row, blockDim.y rows per block.
   opt 0: SGD row -= lr * g; opt 1: row-wise Adagrad state[r] += mean(g^2), row -= lr * g / (sqrt(state[r]) + eps). */
template <typename T>
__device__ void update_body(T* __restrict__ W, int FT, int F, float* __restrict__ state, const T* __restrict__ grad,
                            i64 gstride, const i64* __restrict__ keys, int pbits, const i64* __restrict__ starts, i64 U,
                            const i64* __restrict__ off, i64 B, i64 k, const float* __restrict__ w, int mean, int opt,
                            float lr, float eps) {
    const int G = blockDim.x;
    i64 u = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    bool active = u < U;
    i64 mask = ((i64)1 << pbits) - 1;
    i64 q0 = 0, q1 = 0, r = 0;
    if (active) { q0 = starts[u]; q1 = starts[u + 1]; r = keys[q0] >> pbits; }
    float mult = lr;
    if (opt == 1) {  /* every thread of the block takes this branch: the shuffles see whole warps */
        float g2 = 0.f;
        if (active)
            for (int c = threadIdx.x; c < FT; c += G) g2 += vsumsq(row_grad(grad, gstride, c, keys, q0, q1, mask, off, B, k, w, mean));
        for (int o = G / 2; o > 0; o >>= 1) g2 += __shfl_xor_sync(0xffffffffu, g2, o, G);
        float old = (active && threadIdx.x == 0) ? state[r] : 0.f;
        old = __shfl_sync(0xffffffffu, old, 0, G);
        if (!active) return;
        float st = old + g2 / (float)F;
        if (threadIdx.x == 0) state[r] = st;
        mult = lr / (sqrtf(st) + eps);
    }
    if (!active) return;
    for (int c = threadIdx.x; c < FT; c += G) {
        T acc = row_grad(grad, gstride, c, keys, q0, q1, mask, off, B, k, w, mean);
        W[r * FT + c] = vfma(-mult, acc, W[r * FT + c]);
    }
}

#define POOLED(NAME, T, I) \
extern "C" __global__ void NAME(const T* W, int FT, const I* idx, const i64* off, i64 k, const float* w, int mean, \
                                T* out, i64 ostride, i64 B) { pooled_body<T, I>(W, FT, idx, off, k, w, mean, out, ostride, B); }
POOLED(pooled_v4_i32, float4, int)
POOLED(pooled_v4_i64, float4, i64)
POOLED(pooled_v1_i32, float, int)
POOLED(pooled_v1_i64, float, i64)

#define UPDATE(NAME, T) \
extern "C" __global__ void NAME(T* W, int FT, int F, float* state, const T* grad, i64 gstride, const i64* keys, int pbits, \
                                const i64* starts, i64 U, const i64* off, i64 B, i64 k, const float* w, int mean, int opt, \
                                float lr, float eps) { \
    update_body<T>(W, FT, F, state, grad, gstride, keys, pbits, starts, U, off, B, k, w, mean, opt, lr, eps); }
UPDATE(update_v4, float4)
UPDATE(update_v1, float)

/* keys[i] = (idx[i] << pbits) | i: sorting them groups a row's entries in batch order. */
#define KEYS(NAME, I) \
extern "C" __global__ void NAME(const I* idx, i64 L, int pbits, i64* keys) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < L; i += (i64)gridDim.x * blockDim.x) \
        keys[i] = ((i64)idx[i] << pbits) | i; }
KEYS(make_keys_i32, int)
KEYS(make_keys_i64, i64)

/* heads[i] = 1 where sorted key i starts a new row. */
extern "C" __global__ void row_heads(const i64* keys, i64 L, int pbits, int* heads) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < L; i += (i64)gridDim.x * blockDim.x)
        heads[i] = (i == 0 || (keys[i] >> pbits) != (keys[i - 1] >> pbits)) ? 1 : 0;
}

/* Validation (before anything is written): res[slot] = min(res[slot], first bad position). */
#define BAD_INDEX(NAME, I) \
extern "C" __global__ void NAME(const I* idx, i64 L, i64 n, u64* res) { \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < L; i += (i64)gridDim.x * blockDim.x) { \
        i64 v = (i64)idx[i]; if (v < 0 || v >= n) atomicMin(res, (u64)i); } }
BAD_INDEX(bad_index_i32, int)
BAD_INDEX(bad_index_i64, i64)

extern "C" __global__ void bad_offset(const i64* off, i64 B, u64* res) {
    for (i64 b = (i64)blockIdx.x * blockDim.x + threadIdx.x; b < B; b += (i64)gridDim.x * blockDim.x)
        if (off[b + 1] < off[b]) atomicMin(res, (u64)b);
}

extern "C" __global__ void nonfinite_row(const float* g, i64 rows, int F, i64 stride, u64* res) {
    i64 n = rows * F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / F;
        if (!isfinite(g[r * stride + (i - r * F)])) atomicMin(res, (u64)r);
    }
}
"""

NULL = np.uint64(0)  # a null pointer argument


@lru_cache(maxsize=1)
def module() -> Any:
    """The compiled module (NVRTC, cached by CuPy on disk)."""
    import cupy as cp
    return cp.RawModule(code=SOURCE, options=("--std=c++14",))


def kernel(name: str) -> Any:
    """One kernel of :data:`SOURCE`."""
    return module().get_function(name)


def ptr(a: Any) -> Any:
    """A CuPy array as a kernel argument, or a null pointer for None."""
    return NULL if a is None else a


def grid_1d(n: int, block: int = 256, most: int = 65536) -> tuple[tuple[int], tuple[int]]:
    """A grid-stride launch over ``n`` items."""
    return (max(1, min(most, -(-n // block))),), (block,)


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
