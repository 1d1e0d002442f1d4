"""Lookup kernels: non-reducing gather and pooled (sum / mean, optional weights) lookups.

Each operation has a sequential *chunk* function that processes a contiguous range of output
rows and a parallel *driver* that splits the batch into chunks with ``prange``. The ensemble
kernels reuse the chunk functions over (table, chunk) work items.

Performance notes (2-core AVX2 box, 1M-row tables far larger than L3): the gather is bound by
memory latency, so each chunk keeps a software prefetch ``dist`` index positions ahead of the
row it is summing (across bag boundaries; positions are contiguous inside a chunk). Rows are
summed four at a time into an accumulator that lives on the stack (so in vector registers once
LLVM unrolls the loops) when the feature size is specialised, and in a per-thread array
otherwise. Rows are accessed through raw-pointer views (no reference counting per row). Through
a pointer table, each chunk also counts the cached rows it read (``hit_of``, ``record_hits`` in
``rowaccess``: one atomic add per chunk, compiled away for plain tables), so a caching table
needs no separate pass over the indices for its hit/miss telemetry. Output
rows must be contiguous (``out.strides[1] == 4``); the row stride is free, so ``out`` can be a
column slice of a wider array.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from numba import types
from numba.extending import overload

from .codecs import load
from .intrinsics import stack_f32, store_fence
from .rowaccess import (accumulator, featuresize, hit_of, out_ptr, out_row, prefetch_ahead, record_hits, row_of,
                        row_ptr, uidx)
from .simd import vadd4, vcopy, vcopy_stream, vfma, vscale_store, vzero


@njit(cache=True)
def reciprocal(n):
    """``1 / n`` correctly rounded: compiled without fastmath (and not inlined into the fastmath
    kernels in numba's IR), so LLVM cannot swap the division for a reciprocal estimate on some
    CPUs and mean pooling is the same bits on every machine."""
    return np.float32(1.0) / n


@njit(cache=True, fastmath=True)
def gather_chunk(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream):
    """out[i] = row(idx[i]) for i in [i0, i1); ``stream`` is only honoured by the SIMD version."""
    F = featuresize(spec, base)
    nbytes = F * base.itemsize
    hits = 0
    for i in range(i0, i1):
        prefetch_ahead(base, cache, slots, idx, i, dist, i1, nbytes)
        hits += hit_of(slots, idx[i])
        row = row_of(base, cache, slots, idx[i], F)
        o = out_row(out, i, F)
        for k in range(F):
            o[k] = load(codec, row[k])
    record_hits(base, slots, hits)


@njit(cache=True, fastmath=True)
def pooled_chunk(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist, heap):
    """out[b] = (weighted) sum or mean of rows idx[offsets[b]:offsets[b+1]] for b in [b0, b1).

    ``heap`` is a float32 scratch vector (featuresize long) owned by the calling thread, used as
    the accumulator when the feature size is not specialised.
    """
    F = featuresize(spec, base)
    nbytes = F * base.itemsize
    pend = offsets[b1]
    has_w = weights.size > 0
    one = np.float32(1.0)
    acc = accumulator(spec, heap)
    hits = 0
    for b in range(b0, b1):
        s = offsets[b]
        e = offsets[b + 1]
        for k in range(F):
            acc[k] = 0.0
        j = s
        while j + 4 <= e:
            for q in range(4):
                prefetch_ahead(base, cache, slots, idx, j + q, dist, pend, nbytes)
            hits += (hit_of(slots, idx[j]) + hit_of(slots, idx[j + 1])) + (
                hit_of(slots, idx[j + 2]) + hit_of(slots, idx[j + 3]))
            r0 = row_of(base, cache, slots, idx[j], F)
            r1 = row_of(base, cache, slots, idx[j + 1], F)
            r2 = row_of(base, cache, slots, idx[j + 2], F)
            r3 = row_of(base, cache, slots, idx[j + 3], F)
            if has_w:
                w0 = weights[j]
                w1 = weights[j + 1]
                w2 = weights[j + 2]
                w3 = weights[j + 3]
                for k in range(F):
                    acc[k] += (w0 * load(codec, r0[k]) + w1 * load(codec, r1[k])) + (
                        w2 * load(codec, r2[k]) + w3 * load(codec, r3[k]))
            else:
                for k in range(F):
                    acc[k] += (load(codec, r0[k]) + load(codec, r1[k])) + (
                        load(codec, r2[k]) + load(codec, r3[k]))
            j += 4
        while j < e:
            prefetch_ahead(base, cache, slots, idx, j, dist, pend, nbytes)
            hits += hit_of(slots, idx[j])
            r0 = row_of(base, cache, slots, idx[j], F)
            w0 = weights[j] if has_w else one
            for k in range(F):
                acc[k] += w0 * load(codec, r0[k])
            j += 1
        scale = one
        if mean and e > s:
            scale = reciprocal(np.float32(e - s))
        o = out_row(out, b, F)
        for k in range(F):
            o[k] = acc[k] * scale
    record_hits(base, slots, hits)


@njit(cache=True, fastmath=True)
def gather_chunk_simd(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream):
    """:func:`gather_chunk` for float32 rows of a specialised feature size (vector copies);
    with ``stream``, non-temporal stores (:func:`~.simd.vcopy_stream`: every output row on a
    64-byte boundary, which the caller checks)."""
    nbytes = 8 * len(spec) * 4
    hits = 0
    for i in range(i0, i1):
        prefetch_ahead(base, cache, slots, idx, i, dist, i1, nbytes)
        hits += hit_of(slots, idx[uidx(i)])
        if stream:
            vcopy_stream(spec, out_ptr(out, i), row_ptr(base, cache, slots, idx[uidx(i)]))
        else:
            vcopy(spec, out_ptr(out, i), row_ptr(base, cache, slots, idx[uidx(i)]))
    if stream:
        store_fence()
    record_hits(base, slots, hits)


@njit(cache=True, fastmath=True)
def pooled_chunk_simd(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist, heap):
    """:func:`pooled_chunk` for float32 rows of a specialised feature size: the accumulator is
    a stack buffer of ``<8 x float>`` vectors that LLVM keeps in registers."""
    nbytes = 8 * len(spec) * 4
    pend = offsets[b1]
    has_w = weights.size > 0
    one = np.float32(1.0)
    acc = stack_f32(spec)
    hits = 0
    for b in range(b0, b1):
        s = offsets[uidx(b)]
        e = offsets[uidx(b + 1)]
        vzero(spec, acc)
        j = s
        if has_w:
            while j < e:
                prefetch_ahead(base, cache, slots, idx, j, dist, pend, nbytes)
                hits += hit_of(slots, idx[uidx(j)])
                vfma(spec, acc, row_ptr(base, cache, slots, idx[uidx(j)]), weights[uidx(j)])
                j += 1
        else:
            while j + 4 <= e:
                for q in range(4):
                    prefetch_ahead(base, cache, slots, idx, j + q, dist, pend, nbytes)
                hits += (hit_of(slots, idx[uidx(j)]) + hit_of(slots, idx[uidx(j + 1)])) + (
                    hit_of(slots, idx[uidx(j + 2)]) + hit_of(slots, idx[uidx(j + 3)]))
                vadd4(spec, acc, row_ptr(base, cache, slots, idx[uidx(j)]),
                      row_ptr(base, cache, slots, idx[uidx(j + 1)]),
                      row_ptr(base, cache, slots, idx[uidx(j + 2)]),
                      row_ptr(base, cache, slots, idx[uidx(j + 3)]))
                j += 4
            while j < e:
                prefetch_ahead(base, cache, slots, idx, j, dist, pend, nbytes)
                hits += hit_of(slots, idx[uidx(j)])
                vfma(spec, acc, row_ptr(base, cache, slots, idx[uidx(j)]), one)
                j += 1
        scale = one
        if mean and e > s:
            scale = reciprocal(np.float32(e - s))
        vscale_store(spec, out_ptr(out, b), acc, scale)
    record_hits(base, slots, hits)


def gather_chunk_any(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream):  # pragma: no cover
    """Compile-time choice between the SIMD and the generic gather chunk."""
    raise NotImplementedError


def pooled_chunk_any(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist,
                     heap):  # pragma: no cover
    """Compile-time choice between the SIMD and the generic pooled chunk."""
    raise NotImplementedError


def _simd(spec, base, codec):
    return (isinstance(spec, types.BaseTuple) and len(spec) > 0 and base.dtype == types.float32
            and isinstance(codec, types.Float))


@overload(gather_chunk_any)
def _gather_chunk_any(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream):
    f = gather_chunk_simd if _simd(spec, base, codec) else gather_chunk

    def impl(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream):
        f(spec, out, base, cache, slots, codec, idx, i0, i1, dist, stream)

    return impl


@overload(pooled_chunk_any)
def _pooled_chunk_any(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist, heap):
    f = pooled_chunk_simd if _simd(spec, base, codec) else pooled_chunk

    def impl(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist, heap):
        f(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, b0, b1, dist, heap)

    return impl


@njit(cache=True)
def nchunks_for(n, nthreads, per_thread):
    """Number of work chunks for ``n`` items: a few per thread for load balance."""
    c = nthreads * per_thread
    if c > n:
        c = n
    return max(c, 1)


@njit(parallel=True, cache=True, fastmath=True)
def gather(spec, out, base, cache, slots, codec, idx, dist, nthreads, stream):
    """Parallel non-reducing lookup into ``out`` (len(idx), featuresize); ``stream``: see
    :func:`gather_chunk_simd`."""
    n = idx.size
    nc = nchunks_for(n, nthreads, 4)
    for c in prange(nc):
        gather_chunk_any(spec, out, base, cache, slots, codec, idx, c * n // nc, (c + 1) * n // nc, dist, stream)


@njit(parallel=True, cache=True, fastmath=True)
def pooled(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, dist, nthreads):
    """Parallel pooled lookup into ``out`` (len(offsets) - 1, featuresize)."""
    B = offsets.size - 1
    F = base.shape[1]
    nc = nchunks_for(B, nthreads, 4)
    for c in prange(nc):
        heap = np.empty(F, np.float32)
        pooled_chunk_any(spec, out, base, cache, slots, codec, idx, offsets, weights, mean,
                         c * B // nc, (c + 1) * B // nc, dist, heap)


@njit(cache=True, fastmath=True)
def gather_serial(spec, out, base, cache, slots, codec, idx, dist, stream):
    """:func:`gather` on the calling thread (small batches: no parallel-region start-up)."""
    gather_chunk_any(spec, out, base, cache, slots, codec, idx, 0, idx.size, dist, stream)


@njit(cache=True, fastmath=True)
def pooled_serial(spec, out, base, cache, slots, codec, idx, offsets, weights, mean, dist):
    """:func:`pooled` on the calling thread (small batches: no parallel-region start-up)."""
    heap = np.empty(base.shape[1], np.float32)
    pooled_chunk_any(spec, out, base, cache, slots, codec, idx, offsets, weights, mean,
                     0, offsets.size - 1, dist, heap)
