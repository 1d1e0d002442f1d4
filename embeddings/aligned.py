"""Output buffers that start on a cache line.

numpy places large arrays 16 bytes past a page boundary, so a 64-byte row of a ``(n, 16)``
float32 array straddles two cache lines and every other 32-byte vector store of the lookup
kernels splits one. torch allocates its outputs on 64-byte boundaries; lookups into such a
buffer ran 5-14% faster here (16384 rows of F=16/64/256, both k=1 and k=40), so every array the
library allocates for lookups comes from :func:`aligned_empty`, and callers of ``lookup_into``
can use it for theirs.
"""

from __future__ import annotations

import numpy as np

LINE = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: object = np.float32, align: int = LINE) -> np.ndarray:
    """An uninitialised array like ``np.empty(shape, dtype)`` whose data starts on an
    ``align``-byte boundary (zero-copy into JAX, which wants 64)."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dt).reshape(shape)
