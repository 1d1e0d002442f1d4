"""SGD updates written in place: the weights and momentum buffers are overwritten where they are.

As a kernel like any other (`cnn.kernels.sgd_momentum_steps`), an update's results are new JAX
arrays that the executor copies into the parameter objects: on the GPU one dispatch and one
device-to-device copy per weight and per momentum buffer, 238 of a DenseNet-41 step's 788 output
copies. Done in place (`Executor.call_into` with ``in_place``), an update is one loop over the
parameters' own bytes: a numba kernel on the host, one CUDA kernel for a whole group of parameters
on the GPU (their addresses in a small table), in GPU memory or in page-locked host memory.

Both compute what the JAX kernels compute on the same device, bit for bit (``v' = mu * v + g``,
``w' = w - lr * v'``, or ``w' = w - lr * g`` without momentum): XLA's CPU code fuses each multiply
and add into one fused multiply-add (one rounding), as the numba loop does (``llvm.fma.f32``);
its GPU code rounds the product and the sum each, as the CUDA kernel does (``__fmul_rn``,
``__fadd_rn``, ``__fsub_rn``: no contraction). Both were measured against XLA on random values
(CPU: 6 million on a 2-core Zen 4; GPU: 2**20 on an H100): every bit equal, where the other
rounding differs in 3-28% of the elements.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma.f32``)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@njit(cache=True, nogil=True)
def _sgd(w, g, lr):  # pragma: no cover - numba only
    for i in range(w.size):
        w[i] = _fma32(-lr, g[i], w[i])


@njit(cache=True, nogil=True)
def _sgd_momentum(w, g, v, lr, mu):  # pragma: no cover - numba only
    for i in range(w.size):
        nv = _fma32(mu, v[i], g[i])
        v[i] = nv
        w[i] = _fma32(-lr, nv, w[i])


def sgd_host(arrays: Sequence[np.ndarray], lr: np.float32, mu: np.float32 | None = None) -> None:
    """In place on host arrays ``(w1..wn, g1..gn)`` or, with momentum ``mu``, ``(w1..wn, g1..gn,
    v1..vn)``: what `cnn.kernels.sgd_steps` / `sgd_momentum_steps` return, written into w and v."""
    n = len(arrays) // (2 if mu is None else 3)
    flat = [a.reshape(-1) for a in arrays]
    for i in range(n):
        if mu is None:
            _sgd(flat[i], flat[n + i], np.float32(lr))
        else:
            _sgd_momentum(flat[i], flat[n + i], flat[2 * n + i], np.float32(lr), np.float32(mu))


SOURCE = r"""
/* the tensors one after the other: element i is element i - start[t] of tensor t */
__device__ __forceinline__ int tensor_of(const long long* start, int T, long long i) {
    int lo = 0, hi = T - 1;
    while (lo < hi) { int mid = (lo + hi + 1) >> 1; if (start[mid] <= i) lo = mid; else hi = mid - 1; }
    return lo;
}

/* ptr: w1..wT, g1..gT (, v1..vT when momentum); start: T + 1 offsets */
extern "C" __global__ void sgd_update(const long long* ptr, const long long* start, int T, float lr, float mu,
                                      int momentum) {
    long long total = start[T];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int t = tensor_of(start, T, i);
        long long j = i - start[t];
        float* w = (float*)ptr[t];
        float step = ((const float*)ptr[T + t])[j];
        if (momentum) {
            float* v = (float*)ptr[2 * T + t];
            step = __fadd_rn(__fmul_rn(mu, v[j]), step);
            v[j] = step;
        }
        w[j] = __fsub_rn(w[j], __fmul_rn(lr, step));
    }
}
"""

_module = None
_tables: dict[tuple, object] = {}  # (device, addresses, sizes) -> the table on that device
TABLES_KEPT = 1024


def _table(pointers: Sequence[int], sizes: Sequence[int]):
    """The device table of ``pointers`` and the tensors' start offsets, made once per layout (a
    parameter group's addresses stay the same from step to step while nothing moves it)."""
    import cupy as cp
    key = (cp.cuda.Device().id, tuple(pointers), tuple(sizes))
    table = _tables.get(key)
    if table is None:
        starts = np.concatenate([[0], np.cumsum(sizes)])
        table = cp.asarray(np.concatenate([np.asarray(pointers, np.int64), starts]).astype(np.int64))
        if len(_tables) >= TABLES_KEPT:
            del _tables[next(iter(_tables))]
        _tables[key] = table
    return table


def sgd_cuda(pointers: Sequence[int], sizes: Sequence[int], lr: np.float32, mu: np.float32 | None = None) -> None:
    """`sgd_host` on CuPy's current stream over device addresses ``pointers`` (same order as its
    arrays; GPU memory or page-locked host memory) of float32 tensors of ``sizes[t]`` elements for
    the n weights: one kernel for the whole group."""
    global _module
    import cupy as cp
    n = len(pointers) // (2 if mu is None else 3)
    total = int(sum(sizes[:n]))
    if total == 0:
        return
    if _module is None:
        _module = cp.RawModule(code=SOURCE)
    table = _table(pointers, sizes[:n])
    start = table[len(pointers):]
    blocks = min(4096, -(-total // 256))
    _module.get_function("sgd_update")((blocks,), (256,), (table, start, np.int32(n), np.float32(lr),
                                                           np.float32(0 if mu is None else mu), np.int32(mu is not None)))


class InPlace:
    """An update the executor may run in place of a kernel whose outputs overwrite its targets:
    ``host(arrays, *args)`` on host arrays, ``cuda(pointers, sizes, *args)`` on device addresses,
    for operands of ``dtype`` only (others go through the kernel)."""

    def __init__(self, host, cuda, dtype) -> None:
        self.host, self.cuda, self.dtype = host, cuda, np.dtype(dtype)


SGD = InPlace(sgd_host, sgd_cuda, np.float32)
