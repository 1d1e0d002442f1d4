"""A device: a heap over one preallocated, pre-faulted buffer.

Devices know nothing of objects: they hand out offsets and byte views, and carry
a performance model (read and write bandwidth) that telemetry uses to report a
modeled movement time.  Subclasses supply the buffer (`DRAM`, `PM`).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from .heap import DeadEnds, Heap, PAGE
from .perf import Bandwidth


_MADV_POPULATE_READ = 22  # Linux 5.14+
_libc = None


def _populate_read(buffer: np.ndarray) -> bool:
    """Map every page of ``buffer`` for reading with one ``madvise(MADV_POPULATE_READ)``; False if unsupported.

    On a reopened 2 GiB pool file in the page cache this took 3-6 ms where reading a byte of each
    page took 13-84 ms.
    """
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = buffer.ctypes.data - buffer.ctypes.data % PAGE
        return _libc.madvise(start, buffer.ctypes.data + buffer.nbytes - start, _MADV_POPULATE_READ) == 0
    except (OSError, AttributeError):
        return False


def prefault(buffer: np.ndarray, preserve: bool = False) -> None:
    """Touch every page of ``buffer`` so that later accesses do not pay for first-touch faults.

    With ``preserve`` the pages are mapped for reading (keeping contents), otherwise written with zeros.
    """
    if preserve:
        if buffer.nbytes and not _populate_read(buffer):
            int(buffer[::PAGE].sum(dtype=np.uint64))
    else:
        buffer[::PAGE] = 0


class Device:
    """Base class of memory devices: allocation through a `Heap`, bytes through `view`.

    ``memory_space`` says where the bytes live (``"host"``, or ``"cuda:N"`` for a GPU); the copy
    engine needs nothing else to move them.  ``tier`` orders kinds of device from fastest (0, GPU)
    to slowest (PM); a manager's levels must not go from a slower tier to a faster one.
    ``page_locked`` is set when a host device's buffer was registered with CUDA, so that copies
    to and from a GPU are DMA transfers; `cuda_reachable` says whether CUDA copies and kernels
    reach the bytes at all.
    """

    kind = "device"
    tier = 1
    memory_space = "host"
    page_locked = False
    _unlock: Any = None  # undoes the registration that set page_locked (:func:`.gpu.pagelock`)

    def __init__(self, buffer: np.ndarray, name: str, bandwidth: Bandwidth):
        self.buffer = buffer
        self.name = name
        self.bandwidth = bandwidth
        self.heap = Heap(buffer.nbytes)
        self.capacity = self.heap.capacity
        self.closed = False

    @property
    def cuda_reachable(self) -> bool:
        """Whether CUDA copies and kernels reach this device's bytes: GPU memory, or host memory
        page-locked for the GPU."""
        return self.memory_space != "host" or self.page_locked

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, capacity={self.capacity}, "
                f"used={self.heap.used_bytes})")

    # allocation, delegated to the heap
    def allocate(self, nbytes: int) -> int | None:
        self._check_open()
        return self.heap.allocate(nbytes)

    def free(self, offset: int) -> None:
        self.heap.free(offset)

    def evictfrom(self, start: int, nbytes: int, callback: Callable[[int, int], object],
                  movable: Callable[[int], bool] | None = None, dead_ends: DeadEnds | None = None) -> int | None:
        self._check_open()
        return self.heap.evictfrom(start, nbytes, callback, movable, dead_ends)

    def room_possible(self, nbytes: int, movable: Callable[[int], bool] | None = None) -> bool:
        self._check_open()
        return self.heap.room_possible(nbytes, movable)

    def defragment(self, move_callback: Callable[[int, int, int], None]) -> list[tuple[int, int, int]]:
        """Compact the heap; bytes are moved here, before ``move_callback`` updates references."""
        def move(old: int, new: int, nbytes: int) -> None:
            self.buffer[new:new + nbytes] = self.buffer[old:old + nbytes]  # numpy handles the overlap
            move_callback(old, new, nbytes)
        return self.heap.defragment(move)

    def check(self) -> None:
        self.heap.check()

    @property
    def used_bytes(self) -> int:
        return self.heap.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.heap.free_bytes

    # bytes
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of ``[offset, offset + nbytes)``."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise IndexError(f"range [{offset}, {offset + nbytes}) is outside {self.name} (capacity {self.capacity})")
        return self.buffer[offset:offset + nbytes]

    def address(self, offset: int = 0) -> int:
        """Virtual address of ``offset`` (for alignment checks and zero-copy interop)."""
        return self.buffer.ctypes.data + offset

    def persist(self, offset: int, nbytes: int) -> None:
        """Make ``[offset, offset + nbytes)`` durable; volatile devices have nothing to do."""

    def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"device {self.name} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
