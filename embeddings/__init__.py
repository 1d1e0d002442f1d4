"""Embedding tables with numba kernels (dissertation sections 5.2-5.3).

Public API
----------
* Table protocol (Table 5.2): ``eltype(t)``, ``featuresize(t)``, ``nvectors(t)``, ``example(t)``
  and ``t.rows(context, indices, writable)`` with the contexts ``Forward`` / ``Update`` / None
  (:mod:`embeddings.protocol`).
* ``SimpleEmbedding(data, name=..., align=True)``: a row-major ``(nvectors, featuresize)`` table
  over a numpy array or any object with ``__array__`` (a CachedArray); float32, float64, float16
  or bfloat16 storage, always float32 accumulation (:mod:`embeddings.simple`). A numpy array
  whose rows are off their cache lines is copied onto them once (``table.data``; updates go
  there), unless ``align=False`` (:mod:`embeddings.aligned`).
* ``lookup(t, indices, offsets=None, *, mode=None, weights=None)`` and ``lookup_into(out, ...)``:
  non-reducing, CSR-pooled or fixed-width ``(batch, k)`` pooled, sum or mean, optional per-sample
  weights; ``out`` may be a column slice of a wider array (:mod:`embeddings.lookup`);
  ``aligned_empty(shape)`` allocates one on a cache line, as ``lookup`` does (:mod:`embeddings.aligned`).
* ``pullback(t, grad, indices, offsets=None, *, mode, weights, optimizer)`` with ``SGD`` or
  ``RowwiseAdagrad``: reindexing into a CSR of unique rows, then one fused accumulate-and-apply
  pass; no table gradient is ever materialised. ``sparse_gradient`` exposes the accumulated
  rows for inspection (:mod:`embeddings.pullback`, :mod:`embeddings.optim`).
* ``Ensemble(tables)``: ``lookup`` / ``lookup_into`` / ``pullback`` of many tables in one
  parallel region, into a ``(batch, tables, featuresize)`` array (:mod:`embeddings.ensemble`).
* ``embeddings.distributions``: seeded uniform and LFSR-scrambled Zipf index streams.

Tables in GPU memory (:mod:`embeddings.gpu`): a ``SimpleEmbedding`` over a CuPy array, a JAX
GPU array or a CachedArray whose primary copy is on a ``GPU`` device runs ``lookup``,
``lookup_into``, ``pullback`` and ``Ensemble`` on CUDA kernels (float32 tables; same API, same
errors; ``lookup`` returns a JAX array on the GPU, ``lookup_into`` writes a CuPy array).

Bad input raises before anything is written: ``IndexError`` (table, position, value),
``ValueError`` (offsets, shapes), ``TypeError`` (dtypes), ``FloatingPointError`` (NaN/inf
gradient).

Plugging in
-----------
* CachedArray: ``SimpleEmbedding`` reaches its data only through ``simple._ndarray_view`` (a
  context manager held for the duration of each kernel call), which pins a CachedArray with
  ``cachedarrays.readable`` / ``writable`` while a kernel runs.
* Cached tables (``embeddings.cached.CachedEmbeddings``, section 5.4): ``rows()`` returns a
  ``RowSource`` whose ``slots`` is the int64 pointer table (``slots[r] >> 2`` is the address of
  the row's copy; low bit set: that copy is in ``cache``), after running ``access_and_cache`` on
  the given indices in ``rows(Forward, indices)``. Every kernel (lookup, update, ensemble) then
  reads and writes rows through that indirection; see :mod:`embeddings.kernels.rowaccess`.
* Kernels never see Python objects: tables reach them as (base, cache, slots, codec) and a
  ``spec`` tuple that makes the feature size a compile-time constant (sizes 8, 16, 32, 64, 128,
  256 get explicit ``<8 x float>`` SIMD code with a register accumulator; others a generic loop).
* Concurrency: two concurrent ``pullback`` calls on the same table are not safe (they would
  share its rows); reindexing buffers are per Python thread.
"""

from . import distributions
from .aligned import aligned_empty
from .cached import CachedEmbeddings
from .ensemble import Ensemble
from .lookup import lookup, lookup_into
from .optim import SGD, RowwiseAdagrad
from .protocol import (FORWARD, UPDATE, Context, EmbeddingTable, Forward, RowSource, Update, eltype,
                       example, featuresize, nvectors)
from .pullback import UpdatePlan, pullback, sparse_gradient
from .simple import SimpleEmbedding

__all__ = [
    "CachedEmbeddings", "FORWARD", "UPDATE", "Context", "EmbeddingTable", "Ensemble", "Forward", "RowSource",
    "RowwiseAdagrad", "SGD", "SimpleEmbedding", "Update", "UpdatePlan", "aligned_empty", "distributions", "eltype",
    "example", "featuresize", "lookup", "lookup_into", "nvectors", "pullback", "sparse_gradient",
]
