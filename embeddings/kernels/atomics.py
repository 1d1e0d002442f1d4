"""Atomic operations on int64 array elements inside numba kernels.

numba has no public CPU atomics; these intrinsics emit LLVM ``cmpxchg`` and
``atomicrmw`` (``lock cmpxchg`` / ``lock xadd`` / ``xchg`` on x86) with
sequentially consistent ordering, so they also act as fences: a row copied
before ``atomic_store`` is visible to any thread that sees the stored value.
They are plain LLVM instructions, so kernels using them stay cacheable.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _element_pointer(context, builder, arrty, arr, idx, idxty):
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [i], wraparound=False)


def _int64_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1


@intrinsic
def cas(typingctx, arr, idx, expected, new):
    """``old = arr[idx]; if old == expected: arr[idx] = new``, atomically; returns ``old``."""
    if not (_int64_array(arr) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a, i, e, n = args
        ptr = _element_pointer(context, builder, sig.args[0], a, i, sig.args[1])
        e = context.cast(builder, e, sig.args[2], types.int64)
        n = context.cast(builder, n, sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, e, n, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(arr, idx, expected, new), codegen


def _rmw(op: str):
    @intrinsic
    def rmw(typingctx, arr, idx, value):
        if not (_int64_array(arr) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a, i, v = args
            ptr = _element_pointer(context, builder, sig.args[0], a, i, sig.args[1])
            v = context.cast(builder, v, sig.args[2], types.int64)
            return builder.atomic_rmw(op, ptr, v, "seq_cst")

        return types.int64(arr, idx, value), codegen

    return rmw


fetch_add = _rmw("add")
"""``old = arr[idx]; arr[idx] += value`` atomically; returns ``old``."""

exchange = _rmw("xchg")
"""``old = arr[idx]; arr[idx] = value`` atomically (a publishing store); returns ``old``."""
