"""Backends: where the GPU path's arrays live and what runs its kernels.

The driver (:mod:`.ops`: validation, update plan, dispatch) is written once against this small
interface. ``CudaBackend`` runs it on a GPU (CuPy arrays, the :mod:`.cuda` kernels);
``ReferenceBackend`` runs the same driver on the host (numpy arrays stand in for device memory,
the Pallas kernel of :mod:`.reference` in interpret mode does the lookups, a numpy transcription
of the CUDA update kernel the updates), so CI without a GPU tests everything but the CUDA source.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import cuda, reference


class ReferenceBackend:
    """numpy arrays as "device" arrays. ``device_indices``: treat numpy index arrays as already on
    the device (validated by :meth:`validate`, as CuPy/JAX indices are) instead of host arrays."""

    xp = np

    def __init__(self, device_indices: bool = False) -> None:
        self.device_indices = device_indices

    def is_device(self, x: Any) -> bool:
        return self.device_indices and isinstance(x, np.ndarray)

    def asarray(self, x: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def validate(self, idx, n, off, grad) -> tuple[int, int, int]:
        """(first out-of-range position, first bag with off[b+1] < off[b], first non-finite grad row), -1 for none."""
        bad_i = np.flatnonzero((idx.reshape(-1) < 0) | (idx.reshape(-1) >= n)) if idx is not None else ()
        bad_o = np.flatnonzero(off[1:] < off[:-1]) if off is not None else ()
        bad_g = np.flatnonzero(~np.isfinite(grad).all(axis=1)) if grad is not None and grad.size else ()
        return tuple(int(a[0]) if len(a) else -1 for a in (bad_i, bad_o, bad_g))

    def make_keys(self, idx, pbits: int) -> np.ndarray:
        return (idx.astype(np.int64) << pbits) | np.arange(idx.size, dtype=np.int64)

    def row_heads(self, keys, pbits: int) -> np.ndarray:
        rows = keys >> pbits
        return np.concatenate(([True], rows[1:] != rows[:-1])).astype(np.int32)

    def pooled(self, out, W, idx, off, k, w, mean) -> None:
        reference.pooled_into(out, W, idx, off, k, w, mean)

    def update(self, W, state, grad, keys, pbits, starts, U, off, B, k, w, mean, opt, lr, eps) -> None:
        reference.update(W, state, grad, keys, pbits, starts, U, off, B, k, w, mean, opt, lr, eps)


class CudaBackend:
    """CuPy arrays on the current CUDA device; every kernel on CuPy's current stream."""

    def __init__(self) -> None:
        from cachedarrays.devices.gpu import cupy
        self.xp = cupy()

    def is_device(self, x: Any) -> bool:
        return isinstance(x, self.xp.ndarray) or (hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray)
                                                   and x.__dlpack_device__()[0] != 1)  # 1: kDLCPU

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """On the device: CuPy arrays as they are, other device arrays (JAX) through DLPack without
        a copy, host arrays uploaded."""
        cp = self.xp
        if not isinstance(x, cp.ndarray) and not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__") \
                and self.is_device(x):
            x = cp.from_dlpack(x)
        return cp.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        return self.asarray(x).get()

    def validate(self, idx, n, off, grad) -> tuple[int, int, int]:
        """Every check in flight at once, then one host sync for the three answers."""
        cp = self.xp
        big = np.iinfo(np.int64).max
        res = cp.full(3, big, cp.uint64)
        if idx is not None and idx.size:
            name = "bad_index_i32" if idx.dtype == np.int32 else "bad_index_i64"
            cuda.kernel(name)(*cuda.grid_1d(idx.size), (idx, np.int64(idx.size), np.int64(n), res[0:]))
        if off is not None and off.size > 1:
            cuda.kernel("bad_offset")(*cuda.grid_1d(off.size - 1), (off, np.int64(off.size - 1), res[1:]))
        if grad is not None and grad.size:
            cuda.kernel("nonfinite_row")(*cuda.grid_1d(grad.size), (grad, np.int64(grad.shape[0]),
                                                                   np.int32(grad.shape[1]),
                                                                   np.int64(grad.strides[0] // 4), res[2:]))
        host = res.get()
        return tuple(-1 if v == big else int(v) for v in host)

    def make_keys(self, idx, pbits: int) -> Any:
        keys = self.xp.empty(idx.size, self.xp.int64)
        name = "make_keys_i32" if idx.dtype == np.int32 else "make_keys_i64"
        cuda.kernel(name)(*cuda.grid_1d(idx.size), (idx, np.int64(idx.size), np.int32(pbits), keys))
        return keys

    def row_heads(self, keys, pbits: int) -> Any:
        heads = self.xp.empty(keys.size, self.xp.int32)
        cuda.kernel("row_heads")(*cuda.grid_1d(keys.size), (keys, np.int64(keys.size), np.int32(pbits), heads))
        return heads

    def pooled(self, out, W, idx, off, k, w, mean) -> None:
        B, F = out.shape
        v4 = _vec4(F, W, out)
        FT = F // 4 if v4 else F
        g, rows = cuda.group(FT, pow2=False)
        name = f"pooled_{'v4' if v4 else 'v1'}_{'i32' if idx.dtype == np.int32 else 'i64'}"
        cuda.kernel(name)((-(-B // rows),), (g, rows),
                          (W, np.int32(FT), idx, cuda.ptr(off), np.int64(k), cuda.ptr(w), np.int32(mean), out,
                           np.int64(out.strides[0] // (16 if v4 else 4)), np.int64(B)))

    def update(self, W, state, grad, keys, pbits, starts, U, off, B, k, w, mean, opt, lr, eps) -> None:
        F = W.shape[1]
        v4 = _vec4(F, W, grad)
        FT = F // 4 if v4 else F
        g, rows = cuda.group(FT, pow2=True)
        cuda.kernel("update_v4" if v4 else "update_v1")(
            (-(-U // rows),), (g, rows),
            (W, np.int32(FT), np.int32(F), cuda.ptr(state), grad, np.int64(grad.strides[0] // (16 if v4 else 4)),
             keys, np.int32(pbits), starts, np.int64(U), cuda.ptr(off), np.int64(B), np.int64(k), cuda.ptr(w),
             np.int32(mean), np.int32(opt), np.float32(lr), np.float32(eps)))


def _vec4(F: int, *arrays: Any) -> bool:
    """Whether rows can move as float4: F a multiple of 4, every array 16-byte aligned with a row
    stride of a multiple of 16 bytes."""
    return F % 4 == 0 and all(a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0 for a in arrays)


_cuda: CudaBackend | None = None


def cuda_backend() -> CudaBackend:
    """The process's CUDA backend (created on first use: imports CuPy)."""
    global _cuda
    if _cuda is None:
        _cuda = CudaBackend()
    return _cuda
