"""Low-level numba intrinsics used by the embedding kernels.

* ``prefetch(addr)``: ``llvm.prefetch`` of a byte address into L2 (``prefetcht1``); lets a kernel
  start the memory access of a row it will need a few iterations later, which is what gives a
  random-row gather its memory-level parallelism.
* ``store_fence()``: a full fence after a kernel's streaming (non-temporal) stores, so they are
  visible before the parallel region ends.
* ``f32_bits`` / ``bits_f32``: bit casts between float32 and uint32 (bfloat16 conversion).
* ``half_to_f32`` / ``f32_to_half``: IEEE half <-> float32 through LLVM ``fpext``/``fptrunc``
  (numba has no float16 type; half data is stored as uint16 and converted here, F16C on x86).

All of them are plain LLVM instructions, so functions that use them stay cacheable.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_i8p = ir.IntType(8).as_pointer()


@intrinsic
def prefetch(typingctx, addr):
    """Prefetch the cache line holding byte address ``addr`` (an integer) into L2.

    Locality 2 (``prefetcht1``), not 3 (``prefetcht0``, into L1): a prefetch into L1 holds one of
    the core's few L1 miss buffers until its line arrives, so with ~8 KiB of rows in flight the
    loop stalled on full buffers and a random-row gather used half the read bandwidth. Into L2
    it draws on the L2's larger pool of outstanding misses, and the demand load a few
    iterations later finds the line in L2. Pooled lookups on this 2-core Zen 4 box, 1M rows, k=40
    uniform: F=16 2.46 -> 1.51 ms, F=64 10.6 -> 6.5 ms, F=256 39.5 -> 22-23 ms (49% -> ~80% of
    the sequential read bandwidth); ``prefetcht2`` measured the same as ``prefetcht1``.
    """
    if not isinstance(addr, types.Integer):
        return None
    sig = types.void(addr)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _i8p)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [_i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # rw=0 (read), locality=2 (into L2, see above), cache type=1 (data)
        builder.call(fn, [ptr, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """A sequentially consistent fence (``mfence`` on x86, ``dmb`` on ARM): orders the calling
    thread's earlier non-temporal stores, which bypass the cache and are otherwise weakly ordered,
    before its later memory operations. LLVM's weaker fences compile to nothing on x86."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):
    """Reinterpret a float32 as uint32."""
    if x != types.float32:
        return None
    sig = types.uint32(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as float32."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif x.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def half_to_f32(typingctx, x):
    """Convert IEEE binary16 bits (uint16) to float32."""
    if x != types.uint16:
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        h = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_half(typingctx, x):
    """Convert float32 to IEEE binary16 bits (uint16), rounding to nearest even."""
    if x != types.float32:
        return None
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))

    return sig, codegen


@intrinsic
def stack_f32(typingctx, spec):
    """Pointer to an uninitialised float32[8 * len(spec)] on the caller's stack.

    The buffer is an ``alloca`` in the caller's entry block: LLVM knows it aliases nothing else,
    so once the loops over it are unrolled it is promoted to vector registers (the register
    accumulator of the dissertation's kernels).
    """
    if not isinstance(spec, types.BaseTuple) or len(spec) == 0:
        return None
    n = 8 * len(spec)
    sig = types.CPointer(types.float32)(spec)

    def codegen(context, builder, signature, args):
        buf = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), n))
        return builder.bitcast(buf, ir.FloatType().as_pointer())

    return sig, codegen


@intrinsic
def address_as_pointer(typingctx, addr, like):
    """Turn an integer byte address into a pointer to ``like``'s element type (an array)."""
    if not isinstance(addr, types.Integer) or not isinstance(like, types.Array):
        return None
    sig = types.CPointer(like.dtype)(addr, like)

    def codegen(context, builder, signature, args):
        llty = context.get_data_type(like.dtype)
        return builder.inttoptr(args[0], llty.as_pointer())

    return sig, codegen
