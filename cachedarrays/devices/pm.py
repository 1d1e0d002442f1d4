"""PM: the slow device, a heap over a memory-mapped file (DAX-mapped where the file system allows).

The file starts with a one-page header (magic, layout version, capacity, heap
start) so that a file of the wrong kind or size is refused instead of being
overwritten, and so that a pool can be reopened later.  libpmem is used through
ctypes when it loads (``pmem_map_file``; ``pmem_persist`` on real persistent
memory, ``pmem_msync`` otherwise); without it the file is mapped with Python's
``mmap`` and made durable with ``flush``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import struct
import tempfile
import weakref

import numpy as np

from ..errors import PMFormatError
from ..units import parse_size
from . import libpmem
from .device import Device, prefault
from .heap import PAGE
from .perf import Bandwidth, resolve

MAGIC = b"CAPMPOOL"
VERSION = 1
HEAP_START = PAGE
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, reserved, capacity, heap start
DEFAULT_CAPACITY = "1GiB"


def read_header(path: str) -> tuple[int, int]:
    """Validate the header of an existing pool file and return (capacity, heap_start)."""
    size = os.path.getsize(path)
    if size < _HEADER.size:
        raise PMFormatError(f"{path} is {size} bytes, too small to be a cachedarrays PM pool (refusing to overwrite it)")
    with open(path, "rb") as f:
        magic, version, _, capacity, heap_start = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise PMFormatError(f"{path} is not a cachedarrays PM pool (magic {magic!r}, expected {MAGIC!r}); refusing to overwrite it")
    if version != VERSION:
        raise PMFormatError(f"{path} has pool layout version {version}; this library reads version {VERSION}")
    if size != heap_start + capacity:
        raise PMFormatError(f"{path} is {size} bytes but its header describes {heap_start + capacity} "
                            f"(capacity {capacity} + header {heap_start}): truncated or resized")
    return capacity, heap_start


def _create_file(path: str, capacity: int, exclusive: bool) -> None:
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o644)
    try:
        total = HEAP_START + capacity
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError:
            os.ftruncate(fd, total)
        os.pwrite(fd, _HEADER.pack(MAGIC, VERSION, 0, capacity, HEAP_START), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"PM directory {directory!r} does not exist (or is not a directory)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"PM directory {directory!r} is not writable")


class PM(Device):
    """A heap over a file-backed mapping.

    ``path`` may be None (a new file in a fresh temporary directory, removed at
    close), an existing directory (a new uniquely named file there, removed at
    close), a new file name (created and kept), or an existing pool file
    (reopened: its bytes are kept; ``capacity`` must match or be None).
    ``use_libpmem`` (default: when loadable) picks the libpmem or the plain mmap path.
    """

    kind = "pm"
    tier = 2

    def __init__(self, path: str | os.PathLike | None = None, capacity: int | str | None = None, *,
                 name: str = "PM", bandwidth: Bandwidth | str | tuple[float, float] | None = None,
                 use_libpmem: bool | None = None):
        requested = parse_size(capacity) if capacity is not None else None
        self.path, self.reopened, scratch_dir, scratch_file = self._prepare(path, requested)
        self._cleanup = weakref.finalize(self, _remove_scratch, scratch_file, scratch_dir)
        capacity_, heap_start = read_header(self.path)
        lib = libpmem.load() if use_libpmem in (None, True) else None
        if use_libpmem and lib is None:
            raise OSError("use_libpmem=True but libpmem.so.1 could not be loaded (install libpmem1, "
                          "and check CACHEDARRAYS_LIBPMEM is not 0)")
        self.uses_libpmem = lib is not None
        raw, self.is_pmem, self._persist_raw = self._map(lib, self.path)
        buffer = raw[heap_start:heap_start + capacity_]
        prefault(buffer, preserve=self.reopened)
        self._raw = raw
        self._heap_start = heap_start
        super().__init__(buffer, name, resolve(bandwidth, "optane"))

    @staticmethod
    def _prepare(path, requested: int | None) -> tuple[str, bool, str | None, str | None]:
        """Find or create the pool file; returns (file, reopened, scratch dir, scratch file)."""
        if path is None:
            directory = tempfile.mkdtemp(prefix="cachedarrays-pm-")
            file = os.path.join(directory, "pool.pm")
            _create_file(file, requested or parse_size(DEFAULT_CAPACITY), exclusive=True)
            return file, False, directory, file
        path = os.fspath(path)
        if os.path.isdir(path):
            _check_directory(path)
            fd, file = tempfile.mkstemp(prefix="cachedarrays-", suffix=".pm", dir=path)
            os.close(fd)
            _create_file(file, requested or parse_size(DEFAULT_CAPACITY), exclusive=False)
            return file, False, None, file
        if os.path.exists(path):
            capacity, _ = read_header(path)
            if requested is not None and requested != capacity:
                raise PMFormatError(f"{path} is a pool of {capacity} bytes, but capacity {requested} was requested")
            if not os.access(path, os.R_OK | os.W_OK):
                raise PermissionError(f"PM file {path!r} is not readable and writable")
            return path, True, None, None
        _check_directory(os.path.dirname(os.path.abspath(path)))
        _create_file(path, requested or parse_size(DEFAULT_CAPACITY), exclusive=True)
        return path, False, None, None

    @staticmethod
    def _map(lib, path: str):
        if lib is not None:
            addr, length, is_pmem = lib.map_file(path)
            cbuf = (ctypes.c_uint8 * length).from_address(addr)
            weakref.finalize(cbuf, lib.unmap, addr, length)  # unmapped only once no view aliases it
            raw = np.frombuffer(cbuf, dtype=np.uint8)

            def persist_raw(offset: int, nbytes: int) -> None:
                lib.persist(addr + offset, nbytes, is_pmem)
            return raw, is_pmem, persist_raw
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

        def flush(offset: int, nbytes: int) -> None:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            mm.flush(start, offset + nbytes - start)
        return np.frombuffer(mm, dtype=np.uint8), False, flush

    def persist(self, offset: int, nbytes: int) -> None:
        """Make ``[offset, offset + nbytes)`` of the heap durable (pmem_persist, pmem_msync or msync)."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise IndexError(f"persist range [{offset}, {offset + nbytes}) is outside {self.name} (capacity {self.capacity})")
        if nbytes:
            self._persist_raw(self._heap_start + offset, nbytes)

    def close(self) -> None:
        """Persist everything and drop the mapping (it is unmapped once no view aliases it)."""
        if self.closed:
            return
        self._persist_raw(0, self._heap_start + self.capacity)
        super().close()
        self.buffer = self._raw = np.empty(0, dtype=np.uint8)
        self._persist_raw = None
        self._cleanup()


def _remove_scratch(file: str | None, directory: str | None) -> None:
    if file is not None and os.path.exists(file):
        os.unlink(file)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
