"""numba kernels behind the embedding tables; no Python objects reach them.

* ``rowaccess`` – how a kernel finds a row (``base``/``cache``/``slots`` indirection, prefetch,
  the ``spec`` tuple that makes the feature size a compile-time constant);
* ``codecs`` – float32 / bfloat16 / float16 storage, float32 arithmetic;
* ``intrinsics`` / ``simd`` – ``llvm.prefetch``, bit casts, stack buffers, ``<8 x float>`` ops;
* ``lookup`` – gather and pooled lookups (chunk functions plus parallel and serial drivers);
* ``reindex`` – the CSR update plan: radix sort of the batch's (row, position) keys (histogram,
  prefix sum, scatter), on one thread or split by row range; or a dense per-table map;
* ``update`` – fused accumulate-and-apply optimizer kernels (and reindex + update in one region);
* ``ensemble`` – many tables in one parallel region over (table, chunk) work items;
* ``checks`` – validation scans that run before anything is written;
* ``compiled`` – drops numba's cached kernels when any module here changed (numba itself
  checks only a kernel's own file, and the kernels inline each other's helpers).

Every function is ``njit(cache=True)``; drivers are ``parallel=True``; arithmetic kernels use
``fastmath=True`` (the finiteness check does not, so it can see NaN).
"""

from pathlib import Path as _Path

from .compiled import drop_stale as _drop_stale

_drop_stale(_Path(__file__).parent)
