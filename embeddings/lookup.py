"""Public lookup API: ``lookup`` allocates the output, ``lookup_into`` writes into a given array.

``lookup_into`` accepts any float32 2-d view (e.g. ``out[:, j*F:(j+1)*F]`` of the DLRM
interaction input), so the concatenation after an ensemble lookup costs nothing.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads

from . import config
from .aligned import aligned_empty, rows_on_lines
from .batch import Bags, make_bags
from .gpu import table_on_gpu
from .kernels import lookup as K
from .kernels.rowaccess import row_major, spec_for
from .protocol import FORWARD, EmbeddingTable, RowSource


def prefetch_distance(rowbytes: int) -> int:
    """How many index positions ahead the kernels prefetch: about 8 KiB of rows in flight
    (64-byte rows 128 ahead, 256-byte rows 32, 1 KiB rows 8).

    With skewed (Zipf) indices most rows hit in cache and the loop runs through them in 1-10 ns
    each, so a miss must be issued ~100 rows ahead to hide its latency: at 2 KiB, F=16 k=40 Zipf
    took 2.0 ms (1 thread) vs 1.4 ms at 8 KiB, F=256 45.6 vs 38.9 ms; uniform indices were
    indifferent (each row misses, memory parallelism bounds them either way).
    """
    return int(max(2, min(128, 8192 // max(rowbytes, 1))))


def check_out(out: np.ndarray, nrows: int, featuresize: int, name: str) -> None:
    """Refuse an output array of the wrong type or shape (before anything is written)."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise TypeError(f"{name}: output must be a float32 numpy array")
    if out.shape != (nrows, featuresize):
        raise ValueError(f"{name}: output shape {out.shape}, expected {(nrows, featuresize)}")
    if not out.flags.writeable:
        raise ValueError(f"{name}: output is read-only")


def streams(out: np.ndarray) -> bool:
    """Whether a non-reducing lookup writes ``out`` with streaming stores: at least
    ``config.STREAM_MIN_BYTES`` and every row on a 64-byte boundary (e.g. rows of a multiple of
    16 floats in an array from :func:`aligned_empty`, or a column slice of one at such an offset)."""
    return out.nbytes >= config.STREAM_MIN_BYTES and rows_on_lines(out)


def run_lookup(out: np.ndarray, src: RowSource, bags: Bags) -> None:
    """Dispatch one validated batch to the kernels."""
    if bags.nout == 0 or out.shape[1] == 0:
        return
    if out.strides[1] != out.itemsize:  # kernels need contiguous output rows
        tmp = aligned_empty(out.shape)
        run_lookup(tmp, src, bags)
        out[...] = tmp
        return
    dist = prefetch_distance(src.base.shape[1] * src.base.itemsize)
    spec = spec_for(out.shape[1])
    P = get_num_threads()
    serial = config.serial(bags.indices.size * out.shape[1])
    stream = streams(out)
    out = row_major(out)
    if bags.offsets is None or bags.singles():
        if serial:
            K.gather_serial(spec, out, src.base, src.cache, src.slots, src.codec, bags.indices, dist, stream)
        else:
            K.gather(spec, out, src.base, src.cache, src.slots, src.codec, bags.indices, dist, P, stream)
    elif serial:
        K.pooled_serial(spec, out, src.base, src.cache, src.slots, src.codec, bags.indices, bags.offsets,
                        bags.weights, bags.mean, dist)
    else:
        K.pooled(spec, out, src.base, src.cache, src.slots, src.codec, bags.indices, bags.offsets,
                 bags.weights, bags.mean, dist, P)


class _LazyGpuTables:
    """``embeddings.gpu.tables``, imported on first use (it imports the CUDA backend's module)."""

    def __getattr__(self, name: str):
        from .gpu import tables
        return getattr(tables, name)


gpu_tables = _LazyGpuTables()


def lookup_into(out: np.ndarray, table: EmbeddingTable, indices: object, offsets: object | None = None,
                *, mode: str | None = None, weights: object | None = None) -> np.ndarray:
    """Look rows up into ``out`` and return it.

    * 1-d ``indices`` without ``offsets``: non-reducing, ``out[i] = table[indices[i]]``.
    * 1-d ``indices`` with CSR ``offsets`` (nbags + 1 entries, first 0, last len(indices)), or
      2-d ``(batch, k)`` indices: pooled, ``out[b] = sum/mean of the bag's rows``, optionally
      scaled per index by ``weights`` (same shape as ``indices``). Empty bags give zero rows.
    """
    if table_on_gpu(table):
        result = gpu_tables.lookup(table, indices, offsets, mode, weights, out=out)
        if result is not NotImplemented:
            return result
    bags = make_bags(table.name, table.nvectors(), indices, offsets, weights, mode)
    check_out(out, bags.nout, table.featuresize(), table.name)
    with table.rows(FORWARD, bags.indices) as src:
        run_lookup(out, src, bags)
    return out


def lookup(table: EmbeddingTable, indices: object, offsets: object | None = None,
           *, mode: str | None = None, weights: object | None = None) -> np.ndarray:
    """Like :func:`lookup_into` but allocates a new float32 ``(nout, featuresize)`` array (on a
    cache line: :func:`~embeddings.aligned.aligned_empty`). A table whose rows are on a GPU gives
    a JAX array on that GPU (:mod:`embeddings.gpu`)."""
    if table_on_gpu(table):
        result = gpu_tables.lookup(table, indices, offsets, mode, weights)
        if result is not NotImplemented:
            return result
    bags = make_bags(table.name, table.nvectors(), indices, offsets, weights, mode)
    out = aligned_empty((bags.nout, table.featuresize()))
    with table.rows(FORWARD, bags.indices) as src:
        run_lookup(out, src, bags)
    return out
