"""Embedding kernels for tables whose rows are in GPU memory (issue #19).

A ``SimpleEmbedding`` whose data is a CuPy array, a JAX array on a GPU, or a CachedArray whose
primary copy is on a ``GPU`` device takes this path in ``lookup``, ``lookup_into``, ``pullback``
and ``Ensemble``; everything else stays on the CPU kernels. Nothing here imports CuPy or JAX
until a table's data is found on a GPU.

* :mod:`.cuda` – the CUDA kernels (CuPy ``RawKernel`` source) that run on the GPU;
* :mod:`.reference` – the Pallas lookup (``interpret=True`` on a CPU) and a numpy update, same
  arithmetic in the same order: what CI checks against the numba kernels;
* :mod:`.backend` – CUDA and reference backends behind one driver;
* :mod:`.ops` – the driver: validation (before anything is written), update plan, dispatch;
* :mod:`.tables` – how a table's data becomes a device array for one call (pinning a CachedArray);
* :mod:`.cached` – ``CachedEmbeddings`` with its cache in HBM over a table in host memory and
  its bookkeeping on the host, and ``prefetch``; ``DeviceCache``, what both cached classes share;
* :mod:`.lru` – ``LRUCachedEmbeddings``: a set-associative cache whose tags, stamps and dirty
  bits are in HBM, run by the device itself, misses read through the base table's mapped
  address and evictions sent home as one block that CPU threads scatter in the background
  (:mod:`embeddings.kernels.scatter`; :mod:`.lru_group`: placing the batches of several tables with
  one set of CUDA kernels; :mod:`.lru_front`: the fixed-shape front of such a placement replayed
  as one CUDA graph; :mod:`.lru_kernels`: one table's steps and the kernels they share;
  every kernel with a numpy form);
* :mod:`.prefetcher` – the next batch's prefetch on worker threads with their own streams,
  overlapping the current batch's work;
* :mod:`.hbm` – the fast-level arrays a cached table keeps pinned while it is open.

Outputs: ``lookup`` returns a JAX array (zero-copy through DLPack from the CuPy output, so the
model's JAX code consumes it in place; a CuPy array where JAX has no GPU backend);
``lookup_into`` writes a given CuPy array (JAX arrays are immutable). Tables are float32.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def device_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array or a JAX array on a GPU (no import of either)."""
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return True
    if "jax" in sys.modules and mod.startswith(("jax", "jaxlib")):
        import jax
        if isinstance(x, jax.Array):
            try:
                return any(d.platform == "gpu" or d.platform == "cuda" for d in x.devices())
            except Exception:  # a tracer or a deleted array: not a table we can read
                return False
    return False


def table_on_gpu(table: Any) -> bool:
    """Whether ``table`` takes the GPU path: a SimpleEmbedding whose rows are on a GPU now (cheap
    for numpy data), or a GPU CachedEmbeddings (:mod:`.cached`, marked ``on_device`` so that this
    check imports nothing)."""
    if getattr(table, "on_device", False):
        return True
    from ..simple import SimpleEmbedding
    if type(table) is not SimpleEmbedding and not isinstance(table, SimpleEmbedding):
        return False
    data = table.data
    return not isinstance(data, np.ndarray) and on_gpu(data)


def on_gpu(data: Any) -> bool:
    """Whether a table's ``data`` is on a GPU now (a CachedArray: its primary copy)."""
    from cachedarrays import CachedArray
    if isinstance(data, CachedArray):
        m = data.manager
        return data.object.alive and m.primary(data.object).device.memory_space != "host"
    return device_array(data)
