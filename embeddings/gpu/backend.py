"""Backends: where the GPU path's arrays live and what runs its kernels.

The driver (:mod:`.ops`: validation, update plan, dispatch) is written once against this small
interface. ``CudaBackend`` runs it on a GPU (CuPy arrays, the :mod:`.cuda` kernels);
``ReferenceBackend`` runs the same driver on the host (numpy arrays stand in for device memory,
the Pallas kernel of :mod:`.reference` in interpret mode does the lookups, a numpy transcription
of the CUDA update kernels the updates), so CI without a GPU tests everything but the CUDA source.

Checks of unchecked device batches do not stop the host: kernels set flags (three per batch:
index, offsets, gradient) in host memory the device writes through its mapped address, and the
driver reads them after the next synchronisation, before anything is written.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any

import numpy as np

from cachedarrays.devices.gpu import HOST_REGISTER_FLAGS, page_locked_at

from ..kernels.checks import copy_checked_each

from . import cuda, reference


SMALL = 1 << 16  # bytes: arrays up to this size come to the host through a page-locked block
# bytes of chunk sums an update may allocate for the most long rows its batch allows rather than
# wait for their count (a DLRM table's batch of 327,680 entries, rows of 64 floats: 5 MB)
SCRATCH = 16 << 20
# seconds a device stream waits for host threads' flags (wait_flags) before it gives up with an
# error: the gather it waits for takes milliseconds; this only bounds a wait that went wrong
FLAG_TIMEOUT_S = 10.0


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of four sizes an octave (at most 25% more; 4 KiB at least).
    CuPy's page-locked pool reuses a freed block only for a request of exactly its size, so
    transfers whose size changes every call (the rows a placement moves) would otherwise
    page-lock fresh memory each time and keep every freed block."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max((nbytes - 1).bit_length() - 3, 0)
    return -(-nbytes // step) * step


class Plan:
    """An update's plan: ``perm`` sorts the batch positions by row (stable), ``srow[q]`` is the row
    of sorted entry ``q``, so each row's entries are a run of equal ``srow``; the runs of more than
    ``reference.CHUNK`` entries (long rows) are ``[lstart[s], lend[s])`` with their chunk sums at
    ``lbase[s]...``; ``NL`` long rows and ``NC`` chunk sums in all. With ``counts`` (a one-element
    device array, ``NL << 40 | NC``) the two numbers stay on the device, where the update's
    kernels read them, and ``NL`` and ``NC`` are their bounds: planning then does not wait for
    the GPU (beside a prefetch that wait cost the DLRM step's update about 1 ms on the H100)."""

    __slots__ = ("perm", "srow", "lstart", "lend", "lbase", "NL", "NC", "counts")

    def __init__(self, perm, srow, lstart, lend, lbase, NL: int, NC: int, counts: Any = None) -> None:
        self.perm, self.srow, self.lstart, self.lend, self.lbase = perm, srow, lstart, lend, lbase
        self.NL, self.NC, self.counts = NL, NC, counts

    def sizes(self) -> tuple[int, int]:
        """The number of long rows and of chunk sums (read from the device, a wait, when they are there)."""
        if self.counts is None:
            return self.NL, self.NC
        return _unpack(int(self.counts.get()[0]))


def _unpack(x: int) -> tuple[int, int]:
    """``(NL, NC)`` of the long rows' counter as the kernels leave it, ``NL << 40 | NC``."""
    return x >> 40, x & ((1 << 40) - 1)


def long_row_bounds(L: int, C: int) -> tuple[int, int]:
    """The most long rows (runs of more than ``C`` equal entries) ``L`` sorted entries can hold,
    ``L // (C + 1)``, and the most chunk sums they can need: a run of ``n`` has ``ceil(n / cl)``
    chunks of ``cl >= C`` entries (:func:`.reference.chunk_len`), at most ``ceil(n / C)``, and the
    runs' lengths add up to at most ``L``."""
    most = L // (C + 1)
    return most, (L + most * (C - 1)) // C


def checked_index_blocks(backends: list, flats: list[np.ndarray], bounds: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Host batches ``flats[i]`` (1-d, contiguous) of tables of ``bounds[i]`` rows on
    ``backends[i]``, copied into page-locked blocks of the type the rows fit (int32 below 2**31
    rows) with their range checked in the same parallel pass (:func:`~embeddings.kernels.checks.
    copy_checked_each`): the blocks, and each batch's first position out of range (or -1). One
    allocation per kind of backend and type, each batch's block the next slice of it, so the
    blocks of one type go up in one copy (:meth:`CudaBackend.upload_blocks`)."""
    kinds: dict = {}
    for i, (be, n) in enumerate(zip(backends, bounds)):
        kinds.setdefault((type(be), np.int32 if n < 2 ** 31 else np.int64), []).append(i)
    blocks: list = [None] * len(flats)
    for (_, dtype), ids in kinds.items():
        whole = backends[ids[0]].bounce((sum(int(flats[i].size) for i in ids),), dtype)
        at = 0
        for i in ids:
            blocks[i] = whole[at:at + flats[i].size]
            at += flats[i].size
    return blocks, copy_checked_each(flats, bounds, blocks)


def counts_stay(L: int, C: int, F: int) -> bool:
    """Whether the long rows' counts of a batch of ``L`` entries with rows of ``F`` floats stay
    on the device: the chunk sums for their bounds fit :data:`SCRATCH` bytes."""
    return long_row_bounds(L, C)[1] * F * 4 <= SCRATCH


class ReferenceBackend:
    """numpy arrays as "device" arrays. ``device_indices``: treat numpy index arrays as already on
    the device (validated by the check flags, as CuPy/JAX indices are) instead of host arrays."""

    xp = np

    def __init__(self, device_indices: bool = False) -> None:
        self.device_indices = device_indices
        self.registered: dict[int, int] = {}  # address -> bytes of what mapped() registered

    def is_device(self, x: Any) -> bool:
        return self.device_indices and isinstance(x, np.ndarray)

    def asarray(self, x: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def flags(self, n: int) -> np.ndarray:
        return np.zeros(n, np.int32)

    def sync(self) -> None:
        pass

    def pinned(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    bounce = pinned

    def upload(self, dst: Any, src: np.ndarray) -> None:
        dst[...] = src

    def download(self, dst: np.ndarray, src: Any) -> None:
        dst[...] = src

    pull = download

    def upload_blocks(self, blocks: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        dst = _blocks_out(np, blocks, out)
        if dst.size:
            np.concatenate(blocks, out=dst)
        return dst

    def aside(self, lane: int = 0) -> Any:
        return contextlib.nullcontext()

    def download_aside(self, pairs: list[tuple[np.ndarray, Any]]) -> Any:
        for dst, src in pairs:
            self.download(dst, src)
        return None

    def clock(self) -> float:
        return time.perf_counter()  # the work queued before has run

    def elapsed(self, start: Any, end: Any) -> float:
        return end - start

    def mapped(self, host: np.ndarray, register: bool = True, name: str = "array") -> tuple[np.ndarray, Any]:
        """``host`` itself; ``register`` is recorded in :attr:`registered` as CUDA would page-lock
        it, so that tests see every registration undone."""
        if not register or host.nbytes == 0:
            return host, None
        ptr = host.ctypes.data
        if ptr in self.registered:
            raise ValueError(f"{name}: host memory at {ptr:#x} is already registered")
        self.registered[ptr] = host.nbytes
        return host, ptr

    def unmap(self, handle: Any) -> None:
        if handle is not None:
            self.registered.pop(handle)

    def fence(self) -> Any:
        return None

    def wait(self, fence: Any) -> None:
        pass

    def stream(self) -> Any:
        return contextlib.nullcontext()

    def follow(self, fence: Any) -> None:
        pass

    def wait_flags(self, flags: np.ndarray, err: np.ndarray, timeout_s: float = FLAG_TIMEOUT_S) -> None:
        """:meth:`CudaBackend.wait_flags` on the host, which runs work as it is queued: wait here."""
        deadline = time.monotonic() + timeout_s
        while not np.all(flags):
            if time.monotonic() > deadline:
                err[0] = 2
                return
            time.sleep(1e-4)
        if np.any(flags != 1):
            err[0] = 1

    def check(self, flags, slot: int, idx, n: int, off, grad) -> None:
        """Set ``flags[slot + 0/1/2]`` for a bad index, bad offsets, a non-finite gradient."""
        if idx is not None and idx.size and ((idx < 0) | (idx >= n)).any():
            flags[slot] = 1
        if off is not None and (off[0] != 0 or off[-1] != (idx.size if idx is not None else 0)
                                or (off[1:] < off[:-1]).any()):
            flags[slot + 1] = 1
        if grad is not None and grad.size and not np.isfinite(grad).all():
            flags[slot + 2] = 1

    def pooled(self, out, W, idx, off, k, w, mean, flags=None, slot: int = 0) -> None:
        if flags is not None:  # an unchecked batch: the CUDA kernel checks as it reads
            self.check(flags, slot, idx, W.shape[0], off, None)
            if flags[slot] or flags[slot + 1]:
                flags[slot] = 1  # the kernel has one flag for both
                return
        reference.pooled_into(out, W, idx, off, k, w, mean)

    def argsort(self, idx) -> np.ndarray:
        return np.argsort(idx, kind="stable").astype(np.int64)

    def argsorts(self, idxs: list) -> list[np.ndarray]:
        """:meth:`argsort` of each array."""
        return [self.argsort(idx) for idx in idxs]

    def sorted_rows(self, idx, perm) -> np.ndarray:
        return idx[perm]

    def long_rows(self, srows: list, C: int, F: int | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]]:
        """For each sorted batch: (first entries, ends and first chunk sums of the runs of more
        than ``C`` entries, how many, chunk sums in all), in row order (counted on the host,
        whatever the row size ``F``)."""
        return [self._long_rows(srow, C) for srow in srows]

    @staticmethod
    def _long_rows(srow: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        L = srow.size
        heads = np.flatnonzero(np.concatenate(([True], srow[1:] != srow[:-1])))
        ends = np.append(heads[1:], L)
        long = (ends - heads) > C
        lstart, lend = heads[long].astype(np.int64), ends[long].astype(np.int64)
        nch = np.array([-(-int(n) // reference.chunk_len(int(n), C)) for n in lend - lstart], np.int64)
        lbase = (np.cumsum(nch) - nch).astype(np.int64)
        return lstart, lend, lbase, int(lstart.size), int(nch.sum())

    def update(self, W, state, grad, plan: Plan, off, B, k, w, mean, opt, lr, eps) -> None:
        F = W.shape[1]
        reference.update(W, state, grad, plan.perm, plan.srow, off, B, k, w, mean, opt, lr, eps,
                         4 if F % 4 == 0 else 1)

    def sgd_any(self, W, grad, idx, off, B, k, w, mean, lr) -> None:
        reference.sgd_any(W, grad, idx, off, B, k, w, mean, lr)


class CudaBackend:
    """CuPy arrays on the current CUDA device; every kernel on CuPy's current stream."""

    def __init__(self) -> None:
        from cachedarrays.devices.gpu import cupy
        self.xp = cupy()
        self._local = threading.local()

    def is_device(self, x: Any) -> bool:
        return isinstance(x, self.xp.ndarray) or (hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray)
                                                   and x.__dlpack_device__()[0] != 1)  # 1: kDLCPU

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """On the device: CuPy arrays as they are, other device arrays (JAX) through DLPack without
        a copy, host arrays uploaded (:meth:`_upload_copy`, not CuPy's own page-locked buffer of
        exactly their size: uploads of changing sizes, such as a step's misses, would each
        page-lock fresh memory and keep it)."""
        cp = self.xp
        if type(x) is cp.ndarray and (dtype is None or x.dtype == dtype):
            return x
        if isinstance(x, np.ndarray) and x.ndim:
            return self._upload_copy(x, x.dtype if dtype is None else dtype)
        if not isinstance(x, cp.ndarray) and hasattr(x, "__dlpack__") and self.is_device(x):
            x = cp.from_dlpack(x)
        return cp.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` on the host. Up to :data:`SMALL` bytes (counts, sizes) :meth:`pull`-ed into a
        page-locked block, then an event: CuPy's own copy goes to pageable memory, and while such
        a copy waits for its stream it holds up every other thread's CUDA calls (on the H100 a
        kernel launch of the training step waited 1.2-1.7 ms for the prefetch thread's count of
        rows); and a copy would queue behind the bulk transfers of the same direction."""
        x = self.asarray(x)
        if x.nbytes > SMALL:
            return x.get()
        x = self.xp.ascontiguousarray(x)
        host = self.bounce(x.shape, x.dtype)
        self.pull(host, x)
        self.wait(self.fence())
        return host

    def pull(self, dst: np.ndarray, src: Any, count: Any = None) -> None:
        """Copy contiguous device ``src`` into page-locked host ``dst`` on the current stream,
        without waiting, by a kernel that stores through ``dst``'s mapped address (unified
        addressing: the host pointer): no copy engine. A :meth:`download` queues behind the
        transfers of its direction already queued on any stream (one engine takes them in turn):
        on the H100 a placement's count of rows waited 2.3 ms behind the 125 MB of its rows
        going home. For what is small and needed now: the stores cross PCIe at a few GB/s.
        ``count`` (a device int64, arrays of 8-byte elements only): copy only the first
        ``count`` elements, a length known on the device alone (queued work may set it)."""
        nbytes = int(src.nbytes)
        if nbytes == 0:
            return
        if dst.nbytes != nbytes or not dst.flags.c_contiguous or not src.flags.c_contiguous:
            raise ValueError(f"pull: {nbytes} contiguous device bytes need as many contiguous host bytes, got "
                             f"{dst.nbytes} (contiguous: {dst.flags.c_contiguous}, source: {src.flags.c_contiguous})")
        if not page_locked_at(dst.ctypes.data):
            raise ValueError("pull: the host array must be page-locked (pinned or bounce), or the kernel's stores "
                             "would fault the device")
        words = nbytes % 8 == 0 and src.data.ptr % 8 == 0 and dst.ctypes.data % 8 == 0
        if count is not None and not (words and src.itemsize == 8):
            raise ValueError(f"pull: a device count bounds arrays of 8-byte elements, got {src.dtype}")
        n = nbytes // 8 if words else nbytes
        args = (src, np.uint64(dst.ctypes.data), np.int64(n))
        cuda.kernel("pull_u64" if words else "pull_u8")(*cuda.grid_1d(n, most=1024),
                                                        args + (cuda.ptr(count),) if words else args)

    def flags(self, n: int) -> np.ndarray:
        """``n`` zeroed int32 flags in page-locked host memory that kernels write through its mapped
        address (unified addressing: the same pointer). Taken in turn from a ring per thread, so a
        call that raised before its checks finished cannot set a later call's flags."""
        ring = getattr(self._local, "ring", None)
        if ring is None or ring.size < 64 * n:
            size = max(4096, 64 * n)
            ring = self._local.ring = self.pinned((size,), np.int32)
            self._local.cursor = 0
        at = self._local.cursor if self._local.cursor + n <= ring.size else 0
        self._local.cursor = at + n
        view = ring[at:at + n]
        view[:] = 0
        return view

    def sync(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def pinned(self, shape: Any, dtype: Any) -> np.ndarray:
        """A host array in page-locked memory (what an asynchronous upload reads)."""
        n = int(np.prod(shape))
        mem = self.xp.cuda.alloc_pinned_memory(max(1, n * np.dtype(dtype).itemsize))
        return np.frombuffer(mem, dtype, n).reshape(shape)

    def bounce(self, shape: Any, dtype: Any) -> np.ndarray:
        """:meth:`pinned` for one transfer of a size that changes from call to call: taken from
        blocks of :func:`size_class` sizes, which the pool hands out again once freed. Page-locking
        fresh memory is slow (about as slow as the copy) and holds up other threads' CUDA calls
        meanwhile, and each freed block of a new size would stay in the pool for good."""
        n = int(np.prod(shape))
        mem = self.xp.cuda.alloc_pinned_memory(size_class(max(1, n * np.dtype(dtype).itemsize)))
        return np.frombuffer(mem, dtype, n).reshape(shape)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Copy page-locked host ``src`` into contiguous device ``dst`` on the current stream,
        without waiting: ``src`` must not change until a later :meth:`fence` is passed."""
        cp = self.xp
        rt = cp.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice,
                       cp.cuda.get_current_stream().ptr)

    def upload_blocks(self, blocks: list[np.ndarray], out: Any = None) -> Any:
        """Page-locked host ``blocks`` (of one type) one after the other as one device array (into
        ``out`` when given), copied up without waiting: the caller keeps them until a later
        :meth:`fence` is passed. Blocks that follow each other in host memory (slices of one
        allocation) go up in one copy."""
        cp = self.xp
        rt = cp.cuda.runtime
        dst = _blocks_out(cp, blocks, out)
        stream = cp.cuda.get_current_stream().ptr
        at, run = 0, None  # run: [device address, host address, bytes] of adjacent blocks not yet copied
        for b in blocks:
            if b.size:
                if run is not None and run[1] + run[2] == b.ctypes.data:
                    run[2] += b.nbytes
                else:
                    if run is not None:
                        rt.memcpyAsync(*run, rt.memcpyHostToDevice, stream)
                    run = [dst.data.ptr + at * dst.itemsize, b.ctypes.data, b.nbytes]
            at += b.size
        if run is not None:
            rt.memcpyAsync(*run, rt.memcpyHostToDevice, stream)
        return dst

    def _upload_copy(self, x: np.ndarray, dtype: Any) -> Any:
        """Host ``x`` as a device array of ``dtype``: copied into a :meth:`bounce` block and up
        without waiting (not a synchronous copy from pageable memory, which also stalls other
        threads' launches). This thread holds the block until an event says the copy has read
        it; then it goes back to the pool."""
        dst = self.xp.empty(x.shape, dtype)
        if x.size == 0:
            return dst
        host = self.bounce(x.shape, dtype)
        np.copyto(host, x, casting="unsafe")
        self.upload(dst, host)
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = collections.deque()
        held.append((self.fence(), host))
        while held and held[0][0].done:
            held.popleft()
        return dst

    def download(self, dst: np.ndarray, src: Any) -> None:
        """Copy contiguous device ``src`` into page-locked host ``dst`` on the current stream,
        without waiting: ``dst`` holds it once a later :meth:`fence` is passed."""
        cp = self.xp
        rt = cp.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost,
                       cp.cuda.get_current_stream().ptr)

    @contextlib.contextmanager
    def aside(self, lane: int = 0) -> Any:
        """A context in which this thread's work goes to side stream ``lane`` (one per thread and
        lane): after the work queued so far on the current stream, beside what is queued on it
        later. Lanes keep unrelated side work (a copy home, a kernel reading host memory) from
        queueing behind each other."""
        after = self.fence()
        sides = self._local.__dict__.setdefault("sides", {})
        side = sides.get(lane)
        if side is None:
            side = sides[lane] = self.xp.cuda.Stream(non_blocking=True)
        side.wait_event(after)
        with side:
            yield

    def download_aside(self, pairs: list[tuple[np.ndarray, Any]]) -> Any:
        """:meth:`download` of each ``(dst, src)`` :meth:`aside` (lane 0); a fence for :meth:`wait`."""
        with self.aside():
            for dst, src in pairs:
                self.download(dst, src)
            return self.fence()

    def mapped(self, host: np.ndarray, register: bool = True, name: str = "array") -> tuple[Any, Any]:
        """``host`` as a device array that kernels read and write in place, over PCIe (the
        host memory's mapped address), and a handle for :meth:`unmap` (None: nothing to undo).
        Page-locked memory is taken as it is; pageable memory is page-locked first when
        ``register``, else refused (memory that a manager's level owns is page-locked by the
        devices layer or not at all: registering part of it here would collide with that)."""
        cp = self.xp
        rt = cp.cuda.runtime
        ptr, nbytes = host.ctypes.data, host.nbytes
        if nbytes == 0:
            return cp.empty(host.shape, host.dtype), None
        handle = None
        if not page_locked_at(ptr):
            if not register:
                raise ValueError(f"{name}: needs its rows in page-locked host memory (the DRAM level of a manager "
                                 f"over a GPU); this level's memory is not page-locked")
            rt.hostRegister(ptr, nbytes, HOST_REGISTER_FLAGS)
            handle = ptr
        dptr = rt.pointerGetAttributes(ptr).devicePointer
        mem = cp.cuda.UnownedMemory(dptr, nbytes, host, device_id=cp.cuda.Device().id)
        return cp.ndarray(host.shape, host.dtype, cp.cuda.MemoryPointer(mem, 0), strides=host.strides), handle

    def unmap(self, handle: Any) -> None:
        """Undo :meth:`mapped` (after the work that used the mapping has finished)."""
        if handle is not None:
            self.sync()
            self.xp.cuda.runtime.hostUnregister(handle)

    def fence(self) -> Any:
        """An event after the work queued so far on the current stream."""
        ev = self.xp.cuda.Event(disable_timing=True)
        ev.record()
        return ev

    def wait(self, fence: Any) -> None:
        if fence is not None:
            fence.synchronize()

    def clock(self) -> Any:
        """A timing event after the work queued so far on the current stream (for :meth:`elapsed`)."""
        ev = self.xp.cuda.Event()
        ev.record()
        return ev

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds of device time between two passed :meth:`clock` events."""
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3

    def stream(self) -> Any:
        """A context in which this thread's CuPy work goes to a stream of its own (one per thread)."""
        st = getattr(self._local, "stream", None)
        if st is None:
            st = self._local.stream = self.xp.cuda.Stream(non_blocking=True)
        return st

    def follow(self, fence: Any) -> None:
        """Make the current stream wait (on the device, not the host) for ``fence``."""
        if fence is not None:
            self.xp.cuda.get_current_stream().wait_event(fence)

    def wait_flags(self, flags: np.ndarray, err: Any, timeout_s: float = FLAG_TIMEOUT_S) -> None:
        """Make the current stream wait, on the device, until every int64 of page-locked
        ``flags`` is nonzero: stores of host threads (:mod:`~embeddings.kernels.signalled`),
        which one GPU thread reads through their mapped address, a microsecond apart. Work
        queued after this runs once they are, with no host thread in between; it runs after a
        failure too, so it checks ``err`` (a device int32): 1 if a flag is not 1 (its writer
        failed), 2 if ``timeout_s`` passed first (nothing then waits for ever). Queue it only once
        the writers need neither the GIL nor CUDA (:meth:`~embeddings.kernels.signalled.Gathering.
        running`): until this kernel ends, a thread's synchronous CUDA call or first launch of a
        kernel (which loads it) waits for it, holding the GIL if it held it."""
        cuda.kernel("wait_flags")((1,), (1,), (np.uint64(flags.ctypes.data), np.int32(flags.size),
                                               np.int64(timeout_s * 1e9), err))

    def check(self, flags, slot: int, idx, n: int, off, grad) -> None:
        """One kernel over indices, offsets and gradient (any of them None)."""
        base = np.uint64(flags.ctypes.data + 4 * slot)
        L = 0 if idx is None else idx.size
        B = 0 if off is None else off.size - 1
        name = "check_i32" if idx is not None and idx.dtype == np.int32 else "check_i64"
        rows = 0 if grad is None else grad.shape[0]
        F = 0 if grad is None else grad.shape[1]
        work = max(L, B, rows * F, 1)
        cuda.kernel(name)(*cuda.grid_1d(work), (
            cuda.ptr(idx if L else None), np.int64(L), np.int64(n), cuda.ptr(off), np.int64(B),
            cuda.ptr(grad if rows * F else None), np.int64(rows), np.int32(F),
            np.int64(0 if grad is None else grad.strides[0] // 4), base))

    def pooled(self, out, W, idx, off, k, w, mean, flags=None, slot: int = 0) -> None:
        B, F = out.shape
        v4 = cuda.vec4(F, W, out)
        FT = F // 4 if v4 else F
        g, rows = cuda.group(FT, pow2=False)
        name = _POOLED[v4, idx.dtype == np.int32]
        bad = cuda.NULL if flags is None else np.uint64(flags.ctypes.data + 4 * slot)  # index and offset errors
        cuda.kernel(name)((-(-B // rows),), (g, rows),
                          (W, np.int32(FT), idx, cuda.ptr(off), np.int64(k), cuda.ptr(w), np.int32(mean), out,
                           np.int64(out.strides[0] // (16 if v4 else 4)), np.int64(B), np.int64(W.shape[0]),
                           np.int64(idx.size), bad))

    def argsort(self, idx) -> Any:
        return self.xp.argsort(idx)  # CuPy's sorts are stable (thrust stable_sort_by_key)

    def argsorts(self, idxs: list) -> list[Any]:
        """:meth:`argsort` of each array, as one sort of the arrays' entries keyed by (array,
        entry): a thrust sort waits for the GPU before it returns, and eight of them (a DLRM
        step's tables) cost 2.6 ms of host time beside a prefetch. The low 40 bits of an entry
        make its key (valid indices are below 2**40; an invalid one, refused later by the
        checks, still sorts within its own array, so every permutation stays in range)."""
        if len(idxs) < 2:
            return [self.argsort(idx) for idx in idxs]
        cp = self.xp
        sizes = [int(i.size) for i in idxs]
        key = cp.empty(sum(sizes), np.int64)
        at = 0
        for t, (idx, n) in enumerate(zip(idxs, sizes)):
            if n:
                name = "sort_keys_i32" if idx.dtype == np.int32 else "sort_keys_i64"
                cuda.kernel(name)(*cuda.grid_1d(n), (idx, np.int64(n), np.int64(t), key[at:at + n]))
            at += n
        perm = cp.argsort(key)
        out, at = [], 0
        for n in sizes:
            out.append(perm[at:at + n] - at)
            at += n
        return out

    def sorted_rows(self, idx, perm) -> Any:
        srow = self.xp.empty(perm.size, idx.dtype)
        name = "sorted_rows_i32" if idx.dtype == np.int32 else "sorted_rows_i64"
        cuda.kernel(name)(*cuda.grid_1d(perm.size), (idx, perm, np.int64(perm.size), srow))
        return srow

    def long_rows(self, srows: list, C: int, F: int | None = None) -> list[tuple]:
        """Each sorted batch's long rows' runs, in slot order. Their counts stay on the device
        (:attr:`Plan.counts`), with bounds for the host (:func:`long_row_bounds`), when chunk sums
        of ``F`` floats for the bounds fit in :data:`SCRATCH` bytes for every batch; otherwise (or
        without ``F``) the host waits once for all the counts."""
        cp = self.xp
        counter = cp.zeros(len(srows), cp.uint64)
        runs, bounds = [], []
        for i, srow in enumerate(srows):
            L = int(srow.size)
            bounds.append(long_row_bounds(L, C))
            lstart, lend, lbase = (cp.empty(bounds[-1][0] + 1, cp.int64) for _ in range(3))
            name = "long_rows_i32" if srow.dtype == np.int32 else "long_rows_i64"
            cuda.kernel(name)(*cuda.grid_1d(L), (srow, np.int64(L), np.int64(C), counter[i:], lstart, lend, lbase))
            runs.append((lstart, lend, lbase))
        if F is not None and all(counts_stay(int(s.size), C, F) for s in srows):
            return [(*r, *b, counter[i:i + 1]) for i, (r, b) in enumerate(zip(runs, bounds))]
        return [(*r, *_unpack(int(x))) for r, x in zip(runs, self.to_host(counter))]

    def update(self, W, state, grad, plan: Plan, off, B, k, w, mean, opt, lr, eps) -> None:
        F = W.shape[1]
        L = plan.perm.size
        v4 = cuda.vec4(F, W, grad)
        FT = F // 4 if v4 else F
        g, rows = cuda.group(FT, pow2=True)
        vt = "v4" if v4 else "v1"
        suffix = f"{vt}_{'i32' if plan.srow.dtype == np.int32 else 'i64'}"
        C = np.int64(reference.CHUNK)
        common = (cuda.ptr(off), np.int64(B), np.int64(k), cuda.ptr(w), np.int32(mean))
        step = (np.int32(opt), np.float32(lr), np.float32(eps))
        gstride = np.int64(grad.strides[0] // (16 if v4 else 4))
        if plan.NL:  # with counts on the device: grids for the bounds, the kernels' own counts inside
            P = self.xp.empty((plan.NC, F), np.float32)
            cuda.kernel(f"chunk_sums_{vt}")(
                (-(-plan.NC // rows),), (g, rows),
                (P, np.int32(FT), grad, gstride, plan.perm, plan.lstart, plan.lend, plan.lbase, np.int64(plan.NL),
                 np.int64(plan.NC), cuda.ptr(plan.counts), C) + common)
            cuda.kernel(f"update_long_{suffix}")(
                (-(-plan.NL // rows),), (g, rows),
                (W, np.int32(FT), np.int32(F), cuda.ptr(state), P, plan.srow, plan.lstart, plan.lend, plan.lbase,
                 np.int64(plan.NL), cuda.ptr(plan.counts), C) + step)
        cuda.kernel(f"update_short_{suffix}")(
            (-(-L // 256),), (g, rows),  # a warp per 32 entries; g * rows is 256, the 8 warps its shared arrays hold
            (W, np.int32(FT), np.int32(F), cuda.ptr(state), grad, gstride, plan.srow, plan.perm, np.int64(L), C)
            + common + step)

    def sgd_any(self, W, grad, idx, off, B, k, w, mean, lr) -> None:
        """SGD by atomic adds of each row's sum over a tile of sorted entries (``SGD(deterministic=
        False)``; no plan), a thread per entry of a tile. Tiles of 128 entries, 512 for rows over
        128 floats: on an H200 (64 and 256 floats, 1 and 40 a bag, uniform and Zipf) within 4% of
        the fastest of tiles of 128-512 entries with 64-512 threads in 7 of 8 cases (13% at 256
        floats, 1 a bag, Zipf); Zipf at 40 a bag 2.6x and 2.1x faster than an atomic add per entry."""
        F = W.shape[1]
        L = int(idx.size)
        v4 = cuda.vec4(F, W, grad)
        FT = F // 4 if v4 else F
        bits = 7 if F <= 128 else 9
        g, _ = cuda.group(FT, pow2=True)
        name = f"sgd_any_{bits}_{'v4' if v4 else 'v1'}_{'i32' if idx.dtype == np.int32 else 'i64'}"
        cuda.kernel(name)((-(-L // (1 << bits)),), (g, (1 << bits) // g),
                          (W, np.int32(FT), grad, np.int64(grad.strides[0] // (16 if v4 else 4)), idx, np.int64(L),
                           cuda.ptr(off), np.int64(B), np.int64(k), cuda.ptr(w), np.int32(mean), np.float32(lr)))


def _blocks_out(xp: Any, blocks: list[np.ndarray], out: Any) -> Any:
    """Where :meth:`CudaBackend.upload_blocks` puts ``blocks``: ``out`` (checked: as many elements
    of their type, contiguous) or a new array."""
    n = sum(int(b.size) for b in blocks)
    if out is None:
        return xp.empty(n, blocks[0].dtype)
    if out.dtype != blocks[0].dtype or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"upload_blocks: {n} elements of {blocks[0].dtype} need as many in a contiguous output, got "
                         f"{out.size} of {out.dtype} (contiguous: {out.flags.c_contiguous})")
    return out


_POOLED = {(v4, i32): f"pooled_{'v4' if v4 else 'v1'}_{'i32' if i32 else 'i64'}"
           for v4 in (False, True) for i32 in (False, True)}


_cuda: CudaBackend | None = None


def cuda_backend() -> CudaBackend:
    """The process's CUDA backend (created on first use: imports CuPy)."""
    global _cuda
    if _cuda is None:
        _cuda = CudaBackend()
    return _cuda
