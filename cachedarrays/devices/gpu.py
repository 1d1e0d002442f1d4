"""GPU: a heap over one allocation in GPU memory, and the CUDA side of the copy engine.

Nothing here is imported until a `GPU` device is created (CuPy is an optional extra:
``pip install 'cachedarrays[gpu]'``).  Facts measured on an H100 (PCIe Gen5 x16, CuPy 14.2,
JAX 0.11.2) that the choices below rest on:

- host->GPU 54.0 GB/s and GPU->host 54.8 GB/s from pinned memory, the same from an anonymous
  mmap registered with ``cudaHostRegister``; pageable memory only 6.6 / 10.1 GB/s.  So the
  manager page-locks its host heaps once (`pagelock`), and copies run as DMA on copy streams.
- ``cudaHostRegister`` of a MAP_SHARED mapping of a file on an ordinary file system fails
  ("invalid argument"); tmpfs and anonymous memory work.  A PM heap that cannot be page-locked
  has its GPU traffic staged through two pinned DRAM buffers (`CudaCopier`), chunk by chunk.
- ``jax.dlpack.from_dlpack`` of a CuPy view at byte offsets 0, 64, 128, 256 and 4096 into one
  allocation is zero-copy and aliases the region, so the heap's 64-byte alignment is enough
  for JAX to take regions without a copy.
- A 2 GiB host->GPU copy on its own stream overlapped a JAX matmul chain completely, so
  uploads, downloads and device-to-device copies each get a stream of their own.
- GPU->GPU copies: 2.69 TB/s (read + write), the ``h100`` bandwidth profile.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
import weakref

import numpy as np

from ..engine import Completion, host_copy
from ..errors import DeviceUnavailableError, OutOfMemoryError
from ..units import format_size, parse_size
from .device import Device
from .perf import Bandwidth, resolve

STAGING_CHUNK = 8 << 20  # bytes per pinned staging buffer (two per direction)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


_CUPY = None  # CuPy, once a device was found (asked on every event and address: a driver call each)


def cupy():
    """Import CuPy and check that a CUDA device is present; a clear error otherwise."""
    global _CUPY
    if _CUPY is not None:
        return _CUPY
    try:
        import cupy as cp
    except ImportError as e:
        raise DeviceUnavailableError("a GPU device needs CuPy, which is not installed: "
                                     "pip install 'cachedarrays[gpu]' (CuPy and the JAX CUDA plugin)") from e
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver, or a driver without devices
        raise DeviceUnavailableError(f"no CUDA device is usable here: {e}") from e
    if count == 0:
        raise DeviceUnavailableError("no CUDA device is present on this machine")
    _CUPY = cp
    return cp


def memory_info(device: int | None = None) -> tuple[int, int]:
    """(free, total) bytes of CUDA device ``device`` (None: the current one), outside every
    allocation: what a new heap or budget can still take."""
    cp = cupy()
    if device is None:
        free, total = cp.cuda.runtime.memGetInfo()
    else:
        with cp.cuda.Device(device):
            free, total = cp.cuda.runtime.memGetInfo()
    return int(free), int(total)


def available() -> bool:
    """Whether a `GPU` device can be created here."""
    try:
        cupy()
    except DeviceUnavailableError:
        return False
    return True


class GPU(Device):
    """A heap over ``capacity`` bytes of one CUDA device's memory (one plain ``cudaMalloc``).

    `view` returns CuPy uint8 arrays; `cachedarrays.readable` hands JAX zero-copy arrays of them.
    ``capacity`` may not exceed the device's free memory (the error says both sizes).
    """

    kind = "gpu"
    tier = 0

    def __init__(self, capacity: int | str, device: int = 0, *, name: str = "GPU",
                 bandwidth: Bandwidth | str | tuple[float, float] | None = None):
        cp = cupy()
        count = cp.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise DeviceUnavailableError(f"no CUDA device {device}: this machine has {count} (0..{count - 1})")
        nbytes = parse_size(capacity)
        free, total = memory_info(device)
        if nbytes > free:
            raise OutOfMemoryError(f"GPU capacity {format_size(nbytes)} is larger than the free memory of "
                                   f"cuda:{device} ({format_size(free)} free of {format_size(total)})")
        with cp.cuda.Device(device):
            self._memory = cp.cuda.Memory(nbytes)  # not CuPy's pool: the heap sub-allocates
            buffer = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(self._memory, 0))
        self.index = device
        self.memory_space = f"cuda:{device}"
        super().__init__(buffer, name, resolve(bandwidth, "h100"))

    def address(self, offset: int = 0) -> int:
        return self.buffer.data.ptr + offset

    def free_memory(self) -> int:
        """Bytes of this CUDA device's memory free now, outside every allocation (this heap's included)."""
        return memory_info(self.index)[0]

    def defragment(self, move_callback):
        cp = cupy()

        def move(old: int, new: int, nbytes: int) -> None:
            with cp.cuda.Device(self.index):
                chunk = self.buffer[old:old + nbytes].copy()  # the ranges may overlap
                self.buffer[new:new + nbytes] = chunk
                cp.cuda.Device(self.index).synchronize()
            move_callback(old, new, nbytes)
        return self.heap.defragment(move)

    def close(self) -> None:
        if self.closed:
            return
        cp = cupy()
        cp.cuda.Device(self.index).synchronize()
        super().close()
        self.buffer = cp.empty(0, dtype=cp.uint8)
        self._memory = None  # freed once no view (CuPy or JAX) aliases it


# ---------------------------------------------------------------------- page-locking host heaps
def pagelock(dev: Device) -> bool:
    """Register a host device's buffer with CUDA so GPU copies are DMA; warn and return False
    where the OS refuses (a file mapping on an ordinary file system).

    The registration lasts until :func:`pageunlock` or, for a device dropped without its
    manager's ``close``, until the array that owns the buffer's memory is collected, just before
    that memory goes: a registration left over a range the OS has unmapped would be found by a
    later buffer mapped at the same addresses, whose own registration CUDA then refuses, and the
    GPU would read the old pages through the mapped address while the CPU reads the new ones."""
    if dev.page_locked or dev.buffer.nbytes == 0:
        return dev.page_locked
    cp = cupy()
    addr = dev.address(0)
    try:
        cp.cuda.runtime.hostRegister(addr, dev.buffer.nbytes, HOST_REGISTER_FLAGS)
    except Exception as e:
        warnings.warn(f"{dev.name} ({dev.kind}) cannot be page-locked for the GPU ({e}); its copies to and "
                      f"from the GPU are staged through pinned buffers", RuntimeWarning, stacklevel=3)
        return False
    dev.page_locked = True
    dev._unlock = weakref.finalize(_owner(dev.buffer), _unregister, addr, dev.name)
    dev._unlock.atexit = False  # the process's end releases both
    return True


def pageunlock(dev: Device) -> None:
    if dev._unlock is not None:
        dev._unlock()
        dev._unlock = None
    dev.page_locked = False


def page_locked_at(addr: int) -> bool:
    """Whether host address ``addr`` is page-locked for CUDA (allocated pinned or registered)."""
    rt = cupy().cuda.runtime
    try:
        return rt.pointerGetAttributes(addr).type == 1  # cudaMemoryTypeHost
    except rt.CUDARuntimeError:
        return False


def _owner(buffer: np.ndarray) -> np.ndarray:
    """The array at the root of ``buffer``'s views: every NumPy view of the buffer keeps it, and
    its memory goes only after it."""
    while isinstance(buffer.base, np.ndarray):
        buffer = buffer.base
    return buffer


def _unregister(addr: int, name: str) -> None:
    try:
        cupy().cuda.runtime.hostUnregister(addr)
    except Exception as e:  # at a collection: nothing to raise into
        warnings.warn(f"{name}: its host memory could not be unregistered from CUDA ({e})", RuntimeWarning)


# ---------------------------------------------------------------------- events and stream waits
def elapsed(start, end) -> float:
    """Seconds between two completed CUDA events."""
    return cupy().cuda.get_elapsed_time(start, end) / 1e3


class CudaUse:
    """A consumer's use of a region on a stream, up to the event recorded when the view was released."""

    __slots__ = ("cuda_event", "_done")

    def __init__(self, stream=None):
        cp = cupy()
        self.cuda_event = cp.cuda.Event()  # timed: it may mark where a consumer waited on a copy
        self.cuda_event.record(stream if stream is not None else cp.cuda.get_current_stream())
        self._done = False

    def done(self) -> bool:
        # a use stays done: remembered, as drains and fills are asked again and again (each
        # question of the event is a driver call)
        if not self._done:
            self._done = bool(self.cuda_event.done)
        return self._done

    def wait(self) -> float:
        """Block until the consumer's work is done; returns the seconds blocked (the Waitable protocol)."""
        t0 = time.perf_counter()
        self.cuda_event.synchronize()
        return time.perf_counter() - t0


class JaxUse(CudaUse):
    """JAX's use of a region it received through DLPack, as a CUDA event.

    JAX runs a device's computations in dispatch order, so a tiny computation dispatched when
    the view is released is done only after every computation that read the region before.
    Importing its result into CuPy makes a side stream wait for it (the DLPack handshake in the
    other direction); an event recorded there lets copies wait for JAX on the GPU.
    """

    _stream = None
    _markers: dict = {}  # JAX device -> (a zero there, the jitted + 1 that makes the marker from it)

    def __init__(self, jax_device, after=None):
        """``after``: a JAX array on ``jax_device`` made by the last computation dispatched there
        (a kernel's output), which marks the same point without a marker computation: the side
        stream waits for it through the DLPack stream handshake alone."""
        cp = cupy()
        if JaxUse._stream is None:
            JaxUse._stream = cp.cuda.Stream(non_blocking=True)
        if after is not None:
            after.__dlpack__(stream=JaxUse._stream.ptr)
            super().__init__(JaxUse._stream)
            return
        entry = JaxUse._markers.get(jax_device)
        if entry is None:
            import jax
            import jax.numpy as jnp
            # one jitted call on a kept zero: two eager operations (zeros, + 1) cost about a
            # millisecond of host time a marker on an H100 host.  It computes on the device (not a
            # constant), so it runs in order after what JAX dispatched before.
            entry = JaxUse._markers[jax_device] = (jax.device_put(jnp.zeros((), jnp.int32), jax_device),
                                                   jax.jit(lambda x: x + 1))
        zero, plus_one = entry
        marker = plus_one(zero)
        with JaxUse._stream:
            cp.from_dlpack(marker)
        super().__init__(JaxUse._stream)


class DeviceClock:
    """Device time of a GPU program's progress, from the CUDA events its work reaches.

    The program `note`s an event after each piece of work it dispatches (an executor notes its
    kernels' use records); `stamp` returns the latest one, so a stamp taken at the host-side use of
    an object marks where the GPU will be when that use's work starts.  `seconds` turns stamps into
    seconds after the first, once the GPU got there (it waits for the last).  Host time of
    asynchronous dispatch says only how fast Python ran ahead of the GPU.
    """

    def __init__(self):
        self._latest = None

    def note(self, event) -> None:
        self._latest = event

    def stamp(self):
        if self._latest is None:
            self._latest = cupy().cuda.Event()
            self._latest.record()
        return self._latest

    def seconds(self, stamps: list) -> list[float]:
        if not stamps:
            return []
        stamps[-1].synchronize()
        first, memo = stamps[0], {}
        out = []
        for s in stamps:
            if id(s) not in memo:
                s.synchronize()
                memo[id(s)] = max(0.0, elapsed(first, s))
            out.append(memo[id(s)])
        return out


def wait_on_stream(waitables, stream, mark=None) -> None:
    """Make ``stream`` wait for copies and uses (on the GPU where they run on a stream, else on
    the host).  ``mark`` is an event at the point where the consumer's own work reaches the wait,
    or a function that makes one, called only when a copy is still running (default: one
    recorded on ``stream`` now); telemetry counts a copy's time after it as exposed."""
    cp = cupy()
    for w in waitables:
        if isinstance(w, Completion):
            w.wait_issued()
            if w.cuda_end is not None and w.error is None and not w.cuda_end.done:
                if mark is None:
                    mark = cp.cuda.Event()
                    mark.record(stream)
                elif callable(mark):
                    mark = mark()
                w.gpu_uses.append(mark)
                stream.wait_event(w.cuda_end)
        elif getattr(w, "cuda_event", None) is not None:
            stream.wait_event(w.cuda_event)
        else:
            w.wait()


# ---------------------------------------------------------------------- the copier
class CudaCopier:
    """Copies touching one GPU: a stream and a submitting thread per direction (h2d, d2h, d2d).

    The thread waits for host-side dependencies and turns GPU-side ones into stream waits, then
    issues ``cudaMemcpyAsync`` between events; page-locked host memory is copied directly, other
    host memory is staged through two pinned buffers so the copy still runs at DMA speed.
    """

    DIRECTIONS = ("h2d", "d2h", "d2d")

    def __init__(self, index: int):
        cp = cupy()
        self.index = index
        with cp.cuda.Device(index):
            self.streams = {d: cp.cuda.Stream(non_blocking=True) for d in self.DIRECTIONS}
        self._queues = {d: queue.SimpleQueue() for d in self.DIRECTIONS}
        self._threads = {}
        self._staging: dict[str, list] = {}
        self._lock = threading.Lock()

    def submit(self, completion: Completion, dst: Device, dst_offset: int, src: Device, src_offset: int,
               nbytes: int, after) -> None:
        direction = "h2d" if src.memory_space == "host" else ("d2h" if dst.memory_space == "host" else "d2d")
        with self._lock:
            if direction not in self._threads:
                t = threading.Thread(target=self._run, args=(direction,), name=f"cachedarrays-cuda-{direction}",
                                     daemon=True)
                t.start()
                self._threads[direction] = t
        self._queues[direction].put((completion, dst, dst_offset, src, src_offset, nbytes, tuple(after)))

    def _run(self, direction: str) -> None:
        cp = cupy()
        cp.cuda.Device(self.index).use()
        stream = self.streams[direction]
        while True:
            job = self._queues[direction].get()
            if job is None:
                return
            completion, dst, dst_offset, src, src_offset, nbytes, after = job
            try:
                wait_on_stream(after, stream)
                completion.start()
                start = cp.cuda.Event()
                start.record(stream)
                host = dst if direction == "d2h" else src
                if direction == "d2d" or host.page_locked:
                    cp.cuda.runtime.memcpyAsync(dst.address(dst_offset), src.address(src_offset), nbytes,
                                                _MEMCPY_DEFAULT, stream.ptr)
                elif direction == "h2d":
                    self._staged_upload(dst.address(dst_offset), src.view(src_offset, nbytes), stream)
                else:
                    self._staged_download(dst.view(dst_offset, nbytes), src.address(src_offset), stream)
                    completion.finish()  # the host copies of the last chunk are done
                    continue
                end = cp.cuda.Event()
                end.record(stream)
                completion.finish(cuda_start=start, cuda_end=end)
            except BaseException as e:  # reported through the completion with the device pair
                completion.finish(e)

    def _buffers(self, direction: str):
        if direction not in self._staging:
            cp = cupy()
            bufs = []
            for _ in range(2):
                mem = cp.cuda.alloc_pinned_memory(STAGING_CHUNK)
                bufs.append((mem, np.frombuffer(mem, dtype=np.uint8, count=STAGING_CHUNK), [None]))
            self._staging[direction] = bufs
        return self._staging[direction]

    def _staged_upload(self, dst_addr: int, src: np.ndarray, stream) -> None:
        cp = cupy()
        bufs = self._buffers("h2d")
        for k, lo in enumerate(range(0, src.size, STAGING_CHUNK)):
            n = min(STAGING_CHUNK, src.size - lo)
            mem, view, event = bufs[k % 2]
            if event[0] is not None:
                event[0].synchronize()  # the buffer's previous chunk has left for the GPU
            host_copy(view[:n], src[lo:lo + n])
            cp.cuda.runtime.memcpyAsync(dst_addr + lo, mem.ptr, n, _MEMCPY_DEFAULT, stream.ptr)
            event[0] = cp.cuda.Event(disable_timing=True)
            event[0].record(stream)

    def _staged_download(self, dst: np.ndarray, src_addr: int, stream) -> None:
        cp = cupy()
        bufs = self._buffers("d2h")
        pending = None
        for k, lo in enumerate(list(range(0, dst.size, STAGING_CHUNK)) + [None]):
            if lo is not None:
                n = min(STAGING_CHUNK, dst.size - lo)
                mem, view, event = bufs[k % 2]
                cp.cuda.runtime.memcpyAsync(mem.ptr, src_addr + lo, n, _MEMCPY_DEFAULT, stream.ptr)
                event[0] = cp.cuda.Event(disable_timing=True)
                event[0].record(stream)
            if pending is not None:  # finish the previous chunk while this one is in flight
                plo, pn, (_, pview, pevent) = pending
                pevent[0].synchronize()
                host_copy(dst[plo:plo + pn], pview[:pn])
            pending = (lo, n, bufs[k % 2]) if lo is not None else None

    def close(self) -> None:
        for direction, t in list(self._threads.items()):
            self._queues[direction].put(None)
            t.join()
        self._threads.clear()
        for stream in self.streams.values():
            stream.synchronize()
