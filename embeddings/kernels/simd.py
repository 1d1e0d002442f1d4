"""Explicit 8-wide float32 vector operations on raw pointers, for specialised feature sizes.

numba runs LLVM without the SLP vectoriser, so once a constant-length loop over a row is fully
unrolled it stays scalar. These intrinsics emit ``<8 x float>`` loads, adds/FMAs and stores
directly; the accumulator is a stack buffer (``stack_f32``), which LLVM promotes to vector
registers, giving the register-resident accumulator of the dissertation's kernels. The length
is ``8 * len(spec)`` floats, known at compile time.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_f = ir.FloatType()
_v8 = ir.VectorType(_f, 8)


def _is_spec(spec):
    return isinstance(spec, types.BaseTuple) and len(spec) > 0


def _is_fptr(p):
    return isinstance(p, types.CPointer) and p.dtype == types.float32


def _vptr(builder, p, i):
    return builder.bitcast(builder.gep(p, [ir.Constant(ir.IntType(64), 8 * i)]), _v8.as_pointer())


def _load(builder, p, i):
    return builder.load(_vptr(builder, p, i), align=4)


def _splat(builder, x):
    v = ir.Constant(_v8, ir.Undefined)
    v = builder.insert_element(v, x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(_v8, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))


@intrinsic
def vzero(typingctx, spec, acc):
    """acc[:F] = 0."""
    if not (_is_spec(spec) and _is_fptr(acc)):
        return None
    n = len(spec)

    def codegen(context, builder, sig, args):
        for i in range(n):
            builder.store(ir.Constant(_v8, [0.0] * 8), _vptr(builder, args[1], i), align=4)
        return context.get_dummy_value()

    return types.void(spec, acc), codegen


@intrinsic
def vadd4(typingctx, spec, acc, p0, p1, p2, p3):
    """acc[:F] += (p0 + p1) + (p2 + p3)."""
    if not (_is_spec(spec) and all(_is_fptr(p) for p in (acc, p0, p1, p2, p3))):
        return None
    n = len(spec)

    def codegen(context, builder, sig, args):
        a, q0, q1, q2, q3 = args[1:]
        for i in range(n):
            s = builder.fadd(builder.fadd(_load(builder, q0, i), _load(builder, q1, i)),
                             builder.fadd(_load(builder, q2, i), _load(builder, q3, i)))
            builder.store(builder.fadd(_load(builder, a, i), s), _vptr(builder, a, i), align=4)
        return context.get_dummy_value()

    return types.void(spec, acc, p0, p1, p2, p3), codegen


@intrinsic
def vfma(typingctx, spec, acc, p, w):
    """acc[:F] += w * p."""
    if not (_is_spec(spec) and _is_fptr(acc) and _is_fptr(p) and w == types.float32):
        return None
    n = len(spec)

    def codegen(context, builder, sig, args):
        a, q, x = args[1:]
        ws = _splat(builder, x)
        for i in range(n):
            v = builder.fadd(_load(builder, a, i), builder.fmul(ws, _load(builder, q, i)))
            builder.store(v, _vptr(builder, a, i), align=4)
        return context.get_dummy_value()

    return types.void(spec, acc, p, w), codegen


@intrinsic
def vscale_store(typingctx, spec, dst, acc, scale):
    """dst[:F] = scale * acc[:F]."""
    if not (_is_spec(spec) and _is_fptr(dst) and _is_fptr(acc) and scale == types.float32):
        return None
    n = len(spec)

    def codegen(context, builder, sig, args):
        d, a, x = args[1:]
        ws = _splat(builder, x)
        for i in range(n):
            builder.store(builder.fmul(ws, _load(builder, a, i)), _vptr(builder, d, i), align=4)
        return context.get_dummy_value()

    return types.void(spec, dst, acc, scale), codegen


@intrinsic
def vcopy(typingctx, spec, dst, src):
    """dst[:F] = src[:F]."""
    if not (_is_spec(spec) and _is_fptr(dst) and _is_fptr(src)):
        return None
    n = len(spec)

    def codegen(context, builder, sig, args):
        d, s = args[1:]
        for i in range(n):
            builder.store(_load(builder, s, i), _vptr(builder, d, i), align=4)
        return context.get_dummy_value()

    return types.void(spec, dst, src), codegen
