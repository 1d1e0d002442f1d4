"""Row access inside kernels: the numba side of the table protocol's ``rows(context)``.

Every kernel reads and writes rows through a *row source*, three arguments:

* ``base``  – ``(nvectors, featuresize)`` C-contiguous storage (the table itself);
* ``cache`` – ``(nslots, featuresize)`` storage of the same dtype (rows held elsewhere, e.g. in
  DRAM while ``base`` lives in PM), or ``None``;
* ``slots`` – the pointer table (dissertation Figure 5.7), an int64 ``(nvectors,)`` array with
  one entry per row: the byte address of the row's primary copy shifted left by two
  (:func:`entry_of`), so a kernel finds the row with one load and one shift, whichever array
  holds it.  The low bit is the *cached* flag: ``slots[r] & 1`` means the address is a row of
  ``cache`` (the slot is :func:`slot_of`); otherwise it is ``base[r]``.  Bit 1 is a lock bit used
  while a thread moves the row (see ``embeddings.kernels.cache``); readers ignore it.  The arrays
  must not move while a table hands out its pointer table (a caching table pins them).  Encoding
  slots as ``slot << 2`` instead cost a flag test, a select and two address computations per
  row: at F=64 with every row in L2 that made a lookup through the table 1.50x a plain lookup,
  addresses 1.21x.  ``None`` means no indirection (``SimpleEmbedding``) and is resolved at
  compile time, so a plain table pays nothing for the indirection a caching table needs.  It may have one entry more than the table:
  ``slots[nvectors]`` then counts the cached rows the lookup kernels read (``record_hits``).

This is the dissertation's ``rowpointer(A, i, context)`` expressed with arrays instead of raw
pointers: a caching table (``CachedEmbeddings``) fills ``cache``/``slots`` in its ``rows(Forward,
indices)`` hook (``access_and_cache``) and the unchanged kernels then read and update through the
indirection.

Feature-size specialisation: kernels take a ``spec`` tuple. ``len(spec)`` is part of the numba
type (one entry per 8 floats, so the tuple stays small), so ``featuresize(spec, base)`` is a
compile-time constant when ``spec`` is not empty (see :func:`spec_for`), and a run-time value
when ``spec == ()``. Constant sizes let LLVM fully unroll the inner loops.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from .atomics import fetch_add
from .intrinsics import address_as_pointer, prefetch, stack_f32

LINE = 64
SPECIALISED = (8, 16, 32, 64, 128, 256)
_SPECS = {n: (False,) * (n // 8) for n in SPECIALISED}


def spec_for(featuresize: int) -> tuple:
    """The ``spec`` argument for a feature size: ``featuresize // 8`` entries, or ``()``."""
    return _SPECS.get(int(featuresize), ())


@njit(cache=True, inline="always")
def uidx(i):
    """``i`` as an unsigned index: numba then skips the negative-index wraparound (a sign test
    and an add per access) in the hot loops; only for indices known to be non-negative."""
    return np.uint64(i)


def row_major(a: np.ndarray) -> np.ndarray:
    """A 2-d array whose rows are contiguous, as the kernels take an output or gradient: ``a``
    itself when C-contiguous, else a C-contiguous view of the same rows at their full stride (as
    many columns as the stride holds, e.g. a column slice's whole parent rows).

    The kernels find a row by ``ctypes.data`` and ``strides[0]`` only (:func:`out_ptr`,
    :func:`out_row`) and touch the feature size's columns only, so both arrays are the same
    output to them; numba compiles a kernel per array layout, and the view spares every kernel a
    second compile for strided outputs (a third of a second to five seconds each). The view's
    last row may reach past the end of ``a``'s buffer: nothing reads or writes there."""
    if a.flags.c_contiguous or a.ndim != 2 or a.shape[0] == 0:
        return a
    isz = a.itemsize
    if a.strides[1] != isz or a.strides[0] < a.shape[1] * isz or a.strides[0] % isz:
        return a
    return np.lib.stride_tricks.as_strided(a, (a.shape[0], a.strides[0] // isz), (a.strides[0], isz),
                                           writeable=a.flags.writeable)


@njit(cache=True, inline="always")
def featuresize(spec, base):
    """Feature size: ``8 * len(spec)`` (a constant) when specialised, else the array's."""
    if len(spec) > 0:
        return 8 * len(spec)
    return base.shape[1]


def accumulator(spec, heap):  # pragma: no cover - numba only
    """A float32 scratch vector of the feature size: on the stack (registers) when ``spec``
    is specialised, else ``heap`` (a per-thread array)."""
    raise NotImplementedError


@overload(accumulator, inline="always")
def _accumulator(spec, heap):
    if isinstance(spec, types.BaseTuple) and len(spec) > 0:
        n = 8 * len(spec)
        return lambda spec, heap: carray(stack_f32(spec), n)
    return lambda spec, heap: heap


def row_address(base, cache, slots, r):  # pragma: no cover - numba only
    """Byte address of the storage row holding logical row ``r``."""
    raise NotImplementedError


@overload(row_address, inline="always")
def _row_address(base, cache, slots, r):
    if isinstance(slots, types.NoneType):
        return lambda base, cache, slots, r: base.ctypes.data + r * base.strides[0]

    return lambda base, cache, slots, r: slots[uidx(r)] >> 2


@njit(cache=True, inline="always")
def entry_of(arr, i):
    """The pointer-table entry, flags clear, that points at row ``i`` of the 2-d array ``arr``."""
    return (arr.ctypes.data + i * arr.strides[0]) << 2


@njit(cache=True, inline="always")
def slot_of(cache, e):
    """The row of ``cache`` that the entry ``e`` (with the cached flag) points at."""
    return ((e >> 2) - cache.ctypes.data) // cache.strides[0]


def entries(arr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """:func:`entry_of` for many rows, in numpy (building and checking pointer tables)."""
    return (arr.ctypes.data + np.asarray(rows, np.int64) * arr.strides[0]) << 2


@njit(cache=True, inline="always")
def row_of(base, cache, slots, r, F):
    """The storage row holding logical row ``r`` as a length-``F`` array.

    Built from a raw pointer (``carray``), so it carries no reference count: a plain ``base[r]``
    view would call NRT incref/decref for every row looked up.
    """
    return carray(address_as_pointer(row_address(base, cache, slots, r), base), F)


@njit(cache=True, inline="always")
def row_ptr(base, cache, slots, r):
    """Typed pointer to the storage row holding logical row ``r``."""
    return address_as_pointer(row_address(base, cache, slots, r), base)


@njit(cache=True, inline="always")
def out_ptr(out, b):
    """Typed pointer to row ``b`` of a 2-d array."""
    return address_as_pointer(out.ctypes.data + b * out.strides[0], out)


@njit(cache=True, inline="always")
def out_row(out, b, F):
    """Row ``b`` of a 2-d array whose rows are contiguous (any row stride), without refcounting."""
    return carray(address_as_pointer(out.ctypes.data + b * out.strides[0], out), F)


def prefetch_slot(slots, idx, k, end):  # pragma: no cover - numba only
    """Prefetch the pointer-table entry of row ``idx[k]`` (if ``k < end``); nothing for plain tables."""
    raise NotImplementedError


@overload(prefetch_slot, inline="always")
def _prefetch_slot(slots, idx, k, end):
    if isinstance(slots, types.NoneType):
        return lambda slots, idx, k, end: None

    def impl(slots, idx, k, end):
        if k < end:
            prefetch(slots.ctypes.data + idx[uidx(k)] * slots.itemsize)

    return impl


@njit(cache=True, inline="always")
def prefetch_ahead(base, cache, slots, idx, j, dist, end, nbytes):
    """Prefetch row ``idx[j + dist]`` and, through a pointer table, the entry of ``idx[j + 2 dist]``:
    the row prefetch must read the entry, so the entry is fetched one distance earlier still."""
    jp = j + dist
    if jp < end:
        prefetch_row(base, cache, slots, idx[uidx(jp)], nbytes)
        prefetch_slot(slots, idx, jp + dist, end)


@njit(cache=True, inline="always")
def prefetch_row(base, cache, slots, r, nbytes):
    """Prefetch every cache line of logical row ``r`` (``nbytes`` long)."""
    prefetch_span(row_address(base, cache, slots, r), nbytes)


@njit(cache=True, inline="always")
def prefetch_span(addr, nbytes):
    """Prefetch every cache line of the ``nbytes`` starting at byte address ``addr``.

    One prefetch per 64 bytes from the start (a constant, unrolled count when ``nbytes`` is a
    compile-time constant), plus one for the last byte when ``addr`` is not 64-byte aligned and
    the span so straddles one more line (a perfectly predicted branch for a given array).
    """
    off = 0
    while off < nbytes:
        prefetch(addr + off)
        off += LINE
    if addr & (LINE - 1):
        prefetch(addr + nbytes - 1)


def hit_of(slots, r):  # pragma: no cover - numba only
    """1 when logical row ``r`` is cached (its pointer-table entry has the cached bit), else 0;
    a constant 0 for plain tables."""
    raise NotImplementedError


@overload(hit_of, inline="always")
def _hit_of(slots, r):
    if isinstance(slots, types.NoneType):
        return lambda slots, r: 0

    def impl(slots, r):
        return slots[uidx(r)] & 1

    return impl


def record_hits(base, slots, hits):  # pragma: no cover - numba only
    """Add a chunk's hit count to the table's hit counter, when it keeps one.

    A caching table may give the kernels a pointer table one entry longer than the table
    (``slots.size > base.shape[0]``); the extra entry ``slots[nvectors]`` then counts the cached
    rows that lookups read (one atomic add per chunk), so the table needs no separate pass to
    count hits.  Nothing for plain tables or a pointer table without the entry.
    """
    raise NotImplementedError


@overload(record_hits, inline="always")
def _record_hits(base, slots, hits):
    if isinstance(slots, types.NoneType):
        return lambda base, slots, hits: None

    def impl(base, slots, hits):
        n = base.shape[0]
        if slots.size > n:
            fetch_add(slots, n, hits)

    return impl
