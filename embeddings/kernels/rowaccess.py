"""Row access inside kernels: the numba side of the table protocol's ``rows(context)``.

Every kernel reads and writes rows through a *row source*, three arrays:

* ``base``  – ``(nvectors, featuresize)`` C-contiguous storage (the table itself);
* ``cache`` – ``(nslots, featuresize)`` storage of the same dtype (rows held elsewhere, e.g. in
  DRAM while ``base`` lives in PM);
* ``slots`` – per-row indirection, int32 ``(nvectors,)``: ``slots[r] >= 0`` means row ``r`` lives
  in ``cache[slots[r]]``, ``-1`` means it lives in ``base[r]``. An empty ``slots`` means no
  indirection at all (``SimpleEmbedding``), and the test on it is loop-invariant.

This is the dissertation's ``rowpointer(A, i, context)`` expressed with arrays instead of raw
pointers: a caching table (``CachedEmbeddings``) fills ``cache``/``slots`` in its ``rows(Forward,
indices)`` hook (``access_and_cache``) and the unchanged kernels then read through the
indirection.
"""

from __future__ import annotations

from numba import njit

from .intrinsics import prefetch

LINE = 64


@njit(cache=True, inline="always")
def row_of(base, cache, slots, r):
    """The storage row holding logical row ``r``."""
    if slots.size > 0:
        s = slots[r]
        if s >= 0:
            return cache[s]
    return base[r]


@njit(cache=True, inline="always")
def prefetch_row(base, cache, slots, r):
    """Issue prefetches for every cache line of logical row ``r``."""
    addr = base.ctypes.data + r * base.strides[0]
    if slots.size > 0:
        s = slots[r]
        if s >= 0:
            addr = cache.ctypes.data + s * cache.strides[0]
    nbytes = base.shape[1] * base.itemsize
    for off in range(0, nbytes, LINE):
        prefetch(addr + off)
    prefetch(addr + nbytes - 1)
