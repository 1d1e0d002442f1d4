"""Arrays whose rows start on cache lines.

numpy places large arrays 16 bytes past a page boundary, so a 64-byte row of a ``(n, 16)``
float32 array straddles two cache lines and every other 32-byte vector store of the lookup
kernels splits one. torch allocates its outputs on 64-byte boundaries; lookups into such a
buffer ran 5-14% faster here (16384 rows of F=16/64/256, both k=1 and k=40), so every array the
library allocates for lookups comes from :func:`aligned_empty`, and callers of ``lookup_into``
can use it for theirs.

Tables matter more: a random row of 256 bytes that starts 16 bytes off a line touches five lines
instead of four. Pooled lookups (16384 bags of 40 from 1M rows, uniform or Zipf, 2 threads) from
a table 16 bytes off a line took 1.2x (F=256) to 1.8x (F=64) the time of the same rows on a line,
and 2.2-2.6x at F=24 (96-byte rows, every other one then on three lines), so ``SimpleEmbedding``
copies a numpy table whose rows are misplaced (:func:`rows_aligned`) into :func:`aligned_copy`
unless told not to.
"""

from __future__ import annotations

import math

import numpy as np

from cachedarrays.copy import copy_bytes

LINE = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: object = np.float32, align: int = LINE) -> np.ndarray:
    """An uninitialised array like ``np.empty(shape, dtype)`` whose data starts on an
    ``align``-byte boundary (zero-copy into JAX, which wants 64)."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = math.prod(int(n) for n in shape) * dt.itemsize  # np.prod took 3 of 6 us per call
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dt).reshape(shape)


def rows_aligned(a: np.ndarray) -> bool:
    """Whether the rows of the 2-d array ``a`` sit on cache lines as well as its row stride allows.

    True when the first row starts a multiple of ``gcd(row stride, 64)`` bytes past a line: then
    every row starts at the same offsets within its lines as in a table that starts on a line
    (all on a line for a stride of a multiple of 64 bytes; for 96-byte rows, alternately 0 and 32
    bytes in, two lines each, where 16 bytes off a line would make every other row touch three).
    Empty arrays are aligned.

    Padding rows to a multiple of 64 bytes was measured and left out: F=24 (96-byte rows, pooled
    k=40, 1M rows) ran the same at a 128-byte stride as contiguous from a line, F=20 slower, F=12
    11% faster for a third more memory and a table that is no longer C-contiguous.
    """
    if a.size == 0:
        return True
    return a.ctypes.data % math.gcd(int(a.strides[0]), LINE) == 0


def rows_on_lines(a: np.ndarray) -> bool:
    """Whether every row of the 2-d array ``a`` starts on a cache line (what streaming stores
    of whole rows need: a misaligned one faults)."""
    return a.ctypes.data % LINE == 0 and a.strides[0] % LINE == 0


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` (same shape and dtype, always writeable) starting on a cache
    line. Copied by ``cachedarrays.copy.copy_bytes`` (two threads from 16 MB): a 256 MB table took
    24 ms here (10 GB/s, first touch of the new memory included) against numpy's 43 ms, and
    several times that while the kernel had to find fresh memory for it."""
    out = aligned_empty(a.shape, a.dtype)
    if a.flags.c_contiguous:
        copy_bytes(out.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8))
    else:
        np.copyto(out, a)
    return out
