"""Explicit float32 vector operations on raw pointers, for specialised feature sizes.

numba runs LLVM without the SLP vectoriser, so once a constant-length loop over a row is fully
unrolled it stays scalar. These intrinsics emit ``<8 x float>`` (or ``<16 x float>``, see
:func:`_width`) loads, adds/FMAs and stores directly; the accumulator is a stack buffer
(``stack_f32``), which LLVM promotes to vector registers, giving the register-resident
accumulator of the dissertation's kernels. The length is ``8 * len(spec)`` floats, known at
compile time.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_f = ir.FloatType()


def _is_spec(spec):
    return isinstance(spec, types.BaseTuple) and len(spec) > 0


def _is_fptr(p):
    return isinstance(p, types.CPointer) and p.dtype == types.float32


WIDE = 16


def _vptr(builder, p, i, w=8):
    return builder.bitcast(builder.gep(p, [ir.Constant(ir.IntType(64), w * i)]), ir.VectorType(_f, w).as_pointer())


def _load(builder, p, i, w=8):
    return builder.load(_vptr(builder, p, i, w), align=4)


def _splat(builder, x, w=8):
    vt = ir.VectorType(_f, w)
    v = ir.Constant(vt, ir.Undefined)
    v = builder.insert_element(v, x, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), w), [0] * w)
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), zeros)


def _width(spec):
    """``(floats per vector, vectors per row)`` for a spec: ``<16 x float>`` for feature sizes of
    64 and up that are a multiple of 16, else ``<8 x float>``.

    Rows of 256 floats in 8-wide vectors need all 32 vector registers for the accumulator, and
    LLVM spilled two of them (a store-to-load chain per row); 16-wide vectors (one AVX-512
    instruction, or two AVX2 ones where there is no AVX-512) halve the count. Pooled Zipf
    lookups of 64 and 256 floats ran ~7-10% faster; 16 floats ran slower, so they stay 8-wide.
    Only the accumulating operations use it: stores go to arbitrary numpy rows, often 16 bytes
    off a cache line, where every 64-byte store would straddle two lines.
    """
    n = len(spec)
    if n >= 8 and n % (WIDE // 8) == 0:
        return WIDE, n * 8 // WIDE
    return 8, n


@intrinsic
def vzero(typingctx, spec, acc):
    """acc[:F] = 0."""
    if not (_is_spec(spec) and _is_fptr(acc)):
        return None
    vw, n = _width(spec)

    def codegen(context, builder, sig, args):
        for i in range(n):
            builder.store(ir.Constant(ir.VectorType(_f, vw), [0.0] * vw), _vptr(builder, args[1], i, vw), align=4)
        return context.get_dummy_value()

    return types.void(spec, acc), codegen


@intrinsic
def vadd4(typingctx, spec, acc, p0, p1, p2, p3):
    """acc[:F] += (p0 + p1) + (p2 + p3)."""
    if not (_is_spec(spec) and all(_is_fptr(p) for p in (acc, p0, p1, p2, p3))):
        return None
    vw, n = _width(spec)

    def codegen(context, builder, sig, args):
        a, q0, q1, q2, q3 = args[1:]
        for i in range(n):
            s = builder.fadd(builder.fadd(_load(builder, q0, i, vw), _load(builder, q1, i, vw)),
                             builder.fadd(_load(builder, q2, i, vw), _load(builder, q3, i, vw)))
            builder.store(builder.fadd(_load(builder, a, i, vw), s), _vptr(builder, a, i, vw), align=4)
        return context.get_dummy_value()

    return types.void(spec, acc, p0, p1, p2, p3), codegen


def _fma_codegen(vw, n):
    def codegen(context, builder, sig, args):
        a, q, x = args[1:]
        ws = _splat(builder, x, vw)
        for i in range(n):
            v = builder.fadd(_load(builder, a, i, vw), builder.fmul(ws, _load(builder, q, i, vw)))
            builder.store(v, _vptr(builder, a, i, vw), align=4)
        return context.get_dummy_value()

    return codegen


def _fma_ok(spec, acc, p, w):
    return _is_spec(spec) and _is_fptr(acc) and _is_fptr(p) and w == types.float32


@intrinsic
def vfma(typingctx, spec, acc, p, w):
    """acc[:F] += w * p, in the accumulating width of :func:`_width` (``p``: a table row)."""
    if not _fma_ok(spec, acc, p, w):
        return None
    return types.void(spec, acc, p, w), _fma_codegen(*_width(spec))


@intrinsic
def vfma8(typingctx, spec, acc, p, w):
    """acc[:F] += w * p in 8-wide vectors, for rows that may sit off a cache line (gradient rows
    of a numpy array) and for the update's read-modify-write of a table row: 16-wide, the fused
    F=256 update ran 15-30% slower."""
    if not _fma_ok(spec, acc, p, w):
        return None
    return types.void(spec, acc, p, w), _fma_codegen(8, len(spec))


@intrinsic
def vscale_store(typingctx, spec, dst, acc, scale):
    """dst[:F] = scale * acc[:F]."""
    if not (_is_spec(spec) and _is_fptr(dst) and _is_fptr(acc) and scale == types.float32):
        return None
    vw, n = 8, len(spec)  # stores: 8-wide (destinations need not be 64-byte aligned)

    def codegen(context, builder, sig, args):
        d, a, x = args[1:]
        ws = _splat(builder, x, vw)
        for i in range(n):
            builder.store(builder.fmul(ws, _load(builder, a, i, vw)), _vptr(builder, d, i, vw), align=4)
        return context.get_dummy_value()

    return types.void(spec, dst, acc, scale), codegen


@intrinsic
def vcopy(typingctx, spec, dst, src):
    """dst[:F] = src[:F]."""
    if not (_is_spec(spec) and _is_fptr(dst) and _is_fptr(src)):
        return None
    vw, n = 8, len(spec)  # stores: 8-wide (destinations need not be 64-byte aligned)

    def codegen(context, builder, sig, args):
        d, s = args[1:]
        for i in range(n):
            builder.store(_load(builder, s, i, vw), _vptr(builder, d, i, vw), align=4)
        return context.get_dummy_value()

    return types.void(spec, dst, src), codegen


@intrinsic
def vcopy_stream(typingctx, spec, dst, src):
    """dst[:F] = src[:F] with non-temporal (streaming) stores, 16 floats at a time (8 for an odd
    tail), for a ``dst`` on a 64-byte boundary (the caller checks: a misaligned streaming store
    faults).

    A normal store first reads its line into the cache (write-allocate), so a gather into an
    output that does not fit in cache moves three bytes for every two it needs, and pushes the
    table rows it just read out of L3. Streaming stores go to memory without that read; they are
    weakly ordered, so a kernel that issues them ends with :func:`~.intrinsics.store_fence`.
    16384 random rows of 256 floats (a 16 MB output): 1.14-1.54 -> 0.85-1.10 ms in the embeddings
    benchmark; smaller outputs stay in L3 and run faster with normal stores (``config.STREAM_MIN_BYTES``).
    """
    if not (_is_spec(spec) and _is_fptr(dst) and _is_fptr(src)):
        return None
    n8 = len(spec)

    def codegen(context, builder, sig, args):
        d, s = args[1:]
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for i in range(0, n8, 2):
            vw, align = (16, 64) if i + 1 < n8 else (8, 32)
            k = 8 * i // vw  # floats 8*i onwards, in vectors of vw
            store = builder.store(_load(builder, s, k, vw), _vptr(builder, d, k, vw), align=align)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(spec, dst, src), codegen
