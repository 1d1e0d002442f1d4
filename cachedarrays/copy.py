"""Byte copies between regions: glibc memcpy split over threads by a numba kernel.

A single ``np.copyto`` runs on one core; on this machine two threads stream
noticeably more, and splitting into 1 MiB pieces also keeps the copy away from
the slow path glibc's memmove takes at some source/destination alignments.
``llvm.memcpy`` is emitted through an intrinsic (not a ctypes pointer) so the
kernel can be cached by numba.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

PARALLEL_THRESHOLD = 16 << 20  # below this one memcpy wins: a thread pool's wake-up costs more
CHUNK = 2 << 20


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """``memcpy((void*)dst, (void*)src, nbytes)`` on integer addresses."""
    def codegen(context, builder, signature, args):
        d, s, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, 1)
        return context.get_dummy_value()
    return types.void(types.uintp, types.uintp, types.uintp), codegen


@numba.njit(parallel=True, cache=True)
def _parallel_memcpy(dst_addr, src_addr, nbytes, chunk):
    for c in numba.prange((nbytes + chunk - 1) // chunk):
        lo = c * chunk
        _memcpy(dst_addr + lo, src_addr + lo, min(chunk, nbytes - lo))


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy the contiguous uint8 array ``src`` into ``dst`` (same length, no overlap)."""
    n = src.size
    if dst.size != n:
        raise ValueError(f"copy between {src.size}-byte and {dst.size}-byte buffers")
    if n >= PARALLEL_THRESHOLD:
        _parallel_memcpy(np.uintp(dst.ctypes.data), np.uintp(src.ctypes.data), np.uintp(n), np.uintp(CHUNK))
    else:
        np.copyto(dst, src)


def warmup() -> None:
    """Load (or compile) the copy kernel now, so the first real copy is not charged for it."""
    a = np.zeros(PARALLEL_THRESHOLD, dtype=np.uint8)
    copy_bytes(np.empty_like(a), a)
