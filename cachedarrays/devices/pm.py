"""PM: the slow device, a heap over a memory-mapped file (DAX-mapped where the file system allows).

The file starts with a one-page header (magic, layout version, capacity, heap start) so that a
file of the wrong kind or size is refused instead of being overwritten, and so that a pool can
be reopened later.  Layout version 2 adds two metadata slots between the header and the heap
(`pmmeta`): the heap's allocation state and an opaque blob for the layer above, committed
crash-consistently with `commit`.  A reopened pool restores the committed blocks as occupied;
they stay *unclaimed* until the layer above takes them back (`claim`).  Version-1 files (no
metadata) still open as a plain heap whose bytes are kept but whose allocations are not.

One process at a time: the device holds an exclusive ``flock`` on the file while it is open, and
a second opener gets `PoolLockedError` naming the holder's pid.

libpmem is used through ctypes when it loads (``pmem_map_file``; ``pmem_persist`` on real
persistent memory, ``pmem_msync`` otherwise); without it the file is mapped with Python's
``mmap`` and made durable with ``flush`` (msync).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import shutil
import tempfile
import weakref
from typing import Callable, Iterator

import numpy as np

from ..errors import InvariantError, PMCorruptError, PMFormatError, PoolLockedError
from ..units import parse_size
from . import libpmem
from .device import Device, prefault
from .perf import Bandwidth, resolve
from .pmmeta import EMPTY, MAGIC, PID_AT, VERSION, Committed, Layout, MetaArea, read_layout

__all__ = ["DEFAULT_CAPACITY", "MAGIC", "PM", "VERSION", "read_header"]

DEFAULT_CAPACITY = "1GiB"


def read_header(path: str) -> tuple[int, int]:
    """Validate the header of an existing pool file and return (capacity, heap_start)."""
    layout = read_layout(path)
    return layout.capacity, layout.heap_start


def _create_file(path: str, capacity: int, slot_size: int | None) -> int:
    """Create a new pool file at ``path`` (which must not exist) and return a locked descriptor of it.

    The file is built under a temporary name, locked, synced and then linked into place, so a crash
    mid-creation leaves no half-written pool at ``path`` and no other process can open it unlocked.
    """
    layout = Layout.new(capacity, slot_size)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".creating-", suffix=".pm", dir=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(fd, 0, layout.file_size)
        except OSError:
            os.ftruncate(fd, layout.file_size)
        os.pwrite(fd, layout.header(), 0)
        os.fsync(fd)
        os.link(tmp, path)  # FileExistsError if someone created ``path`` meanwhile
        _fsync_directory(directory)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return fd


def _fsync_directory(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _lock_holder(fd: int) -> int | None:
    """The pid holding a lock on ``fd``'s file, from /proc/locks (None when it cannot be told)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if key in fields and "->" not in fields:
                    return int(fields[fields.index(key) - 1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _header_pid(fd: int) -> int | None:
    """The writer pid a version-2 header records (None when there is none)."""
    try:
        head = os.pread(fd, PID_AT + 8, 0)
        if len(head) == PID_AT + 8 and int.from_bytes(head[8:12], "little") >= 2:
            return int.from_bytes(head[PID_AT:PID_AT + 8], "little") or None
    except OSError:
        pass
    return None


def _open_locked(path: str) -> int:
    """An O_RDWR descriptor of an existing pool file, exclusively locked; `PoolLockedError` if it is held."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _lock_holder(fd) or _header_pid(fd)
        os.close(fd)
        who = "an unknown process" if pid is None else ("this process" if pid == os.getpid() else f"pid {pid}")
        raise PoolLockedError(f"{path} is open for writing by {who} (flock); only one process may open a pool "
                              f"at a time: close it there (or wait for that process to end)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    ``meta_size`` sets the bytes of each of the two metadata slots of a new file (default:
    `pmmeta.default_slot_size`).

    After a reopen, ``recovery`` says whether the previous writer closed the pool (see
    `Recovery`), and the committed blocks are occupied but unclaimed until `claim`.
    """

    kind = "pm"
    tier = 2

    def __init__(self, path: str | os.PathLike | None = None, capacity: int | str | None = None, *,
                 name: str = "PM", bandwidth: Bandwidth | str | tuple[float, float] | None = None,
                 use_libpmem: bool | None = None, meta_size: int | str | None = None):
        requested = parse_size(capacity) if capacity is not None else None
        slot = parse_size(meta_size) if meta_size is not None else None
        self.path, self.reopened, scratch_dir, scratch_file, lock_fd = self._prepare(path, requested, slot)
        self._cleanup = weakref.finalize(self, _release, lock_fd, scratch_file, scratch_dir)
        try:
            layout = read_layout(self.path)
            if requested is not None and requested != layout.capacity:
                raise PMFormatError(f"{self.path} is a pool of {layout.capacity} bytes, but capacity {requested} was requested")
            lib = libpmem.load() if use_libpmem in (None, True) else None
            if use_libpmem and lib is None:
                raise OSError("use_libpmem=True but libpmem.so.1 could not be loaded (install libpmem1, "
                              "and check CACHEDARRAYS_LIBPMEM is not 0)")
            self.uses_libpmem = lib is not None
            raw, self.is_pmem, self._persist_raw = self._map(lib, self.path)
            self.layout = layout
            # through the attribute, so that every durable write (data and metadata) passes one place
            me = weakref.ref(self)
            self._meta = (MetaArea(raw, layout, lambda off, n: me()._persist_raw(off, n), self.path)
                          if layout.version >= 2 else None)
            committed, note = self._meta.read() if self._meta is not None else (EMPTY, None)
            buffer = raw[layout.heap_start:layout.file_size]
            prefault(buffer, preserve=self.reopened)
        except BaseException:
            self._cleanup()
            raise
        self._raw = raw
        self._heap_start = layout.heap_start
        super().__init__(buffer, name, resolve(bandwidth, "optane"))
        try:
            self.heap.restore(list(committed.extents))
        except ValueError as e:
            self._cleanup()
            raise PMCorruptError(f"{self.path}: the committed heap state is not valid ({e}); nothing was changed") from None
        self._committed: Committed = committed
        self._unclaimed: dict[int, int] = dict(committed.extents)
        self._claim: int | None = None
        self._check_hooks: list[Callable[[], None]] = []
        self.recovery: Recovery | None = None
        if self._meta is not None:
            was_open, pid = self._meta.mark_open()
            self.recovery = Recovery(self.path, committed.seq, committed.time, was_open and self.reopened, pid, note)

    @staticmethod
    def _prepare(path, requested: int | None, slot: int | None) -> tuple[str, bool, str | None, str | None, int]:
        """Find or create the pool file and lock it; returns (file, reopened, scratch dir, scratch file, fd)."""
        if path is None:
            directory = tempfile.mkdtemp(prefix="cachedarrays-pm-")
            file = os.path.join(directory, "pool.pm")
            return file, False, directory, file, _create_file(file, requested or parse_size(DEFAULT_CAPACITY), slot)
        path = os.fspath(path)
        if os.path.isdir(path):
            _check_directory(path)
            for _ in range(100):
                file = os.path.join(path, f"cachedarrays-{os.getpid()}-{os.urandom(6).hex()}.pm")
                try:
                    return file, False, None, file, _create_file(file, requested or parse_size(DEFAULT_CAPACITY), slot)
                except FileExistsError:
                    continue
            raise FileExistsError(f"could not find an unused file name in {path}")
        if os.path.exists(path):
            read_layout(path)  # refuse foreign files before anything else
            if not os.access(path, os.R_OK | os.W_OK):
                raise PermissionError(f"PM file {path!r} is not readable and writable")
            return path, True, None, None, _open_locked(path)
        _check_directory(os.path.dirname(os.path.abspath(path)))
        return path, False, None, None, _create_file(path, requested or parse_size(DEFAULT_CAPACITY), slot)

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

    # ------------------------------------------------------------------ durability
    def persist(self, offset: int, nbytes: int) -> None:
        """Make ``[offset, offset + nbytes)`` of the heap durable (pmem_persist, pmem_msync or msync)."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise IndexError(f"persist range [{offset}, {offset + nbytes}) is outside {self.name} (capacity {self.capacity})")
        if nbytes:
            self._persist_raw(self._heap_start + offset, nbytes)

    @property
    def persistent(self) -> bool:
        """Whether this file can hold committed metadata (layout version 2 and later)."""
        return self._meta is not None

    @property
    def committed(self) -> Committed:
        """The last committed state: sequence number, time, extents and the blob of the layer above."""
        return self._committed

    def commit(self, extents: list[tuple[int, int]], blob: bytes) -> Committed:
        """Atomically replace the committed state by ``extents`` (occupied blocks to restore) and ``blob``.

        The caller must have persisted every byte the new state refers to.  Each extent must be an
        occupied block of this heap with exactly that requested size.  On any error nothing is
        committed and the previous state stays.
        """
        self._check_open()
        if self._meta is None:
            raise PMFormatError(f"{self.path} has layout version 1: it has no metadata area to commit to; "
                                f"create a new pool file")
        extents = tuple(sorted((int(o), int(r)) for o, r in extents))
        for off, req in extents:
            if not self.heap.is_occupied(off) or self.heap.requested(off) != req:
                raise ValueError(f"{self.name}: cannot commit extent ({off}, {req} bytes): it is not an occupied block of that size")
        self._committed = self._meta.commit(self._committed, extents, bytes(blob))
        return self._committed

    # ------------------------------------------------------------------ reopened blocks
    @property
    def unclaimed(self) -> dict[int, int]:
        """Committed blocks restored at open that no region has claimed yet: offset -> requested bytes."""
        return dict(self._unclaimed)

    @contextlib.contextmanager
    def claim(self, offset: int) -> Iterator[None]:
        """Within the block, the next `allocate` returns the restored block at ``offset`` (its size must match).

        This is how the layer above turns a committed block back into a region through the
        manager's ordinary ``allocate``, without a window in which the block is free.
        """
        if offset not in self._unclaimed:
            raise ValueError(f"{self.name}: offset {offset} is not an unclaimed committed block")
        self._claim = offset
        try:
            yield
        finally:
            self._claim = None

    def allocate(self, nbytes: int) -> int | None:
        if self._claim is not None:
            offset, self._claim = self._claim, None
            if self._unclaimed[offset] != nbytes:
                raise ValueError(f"{self.name}: the committed block at {offset} holds {self._unclaimed[offset]} "
                                 f"bytes, not {nbytes}")
            del self._unclaimed[offset]
            return offset
        return super().allocate(nbytes)

    def defragment(self, move_callback: Callable[[int, int, int], None]) -> list[tuple[int, int, int]]:
        """Compact the heap; refused while blocks are committed: moving them in place is not crash-safe."""
        if self._committed.extents:
            raise RuntimeError(f"cannot defragment {self.name} ({self.path}): it holds {len(self._committed.extents)} "
                               f"committed blocks of a persistent pool, and moving them in place would lose the "
                               f"durable point if the process died mid-move")
        return super().defragment(move_callback)

    # ------------------------------------------------------------------ invariants and closing
    def add_check_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` at the end of every `check` (the layer above verifies what it keeps here)."""
        self._check_hooks.append(hook)

    def check(self) -> None:
        """The heap's invariants, the committed metadata (checksum re-read from the file, extents occupied),
        unclaimed blocks (an error: the pool was not opened), then the hooks."""
        super().check()
        if self._meta is not None:
            problem = self._meta.verify(self._committed)
            if problem:
                raise InvariantError(f"{self.name} ({self.path}): persistent metadata: {problem}")
        for off, req in self._committed.extents:
            if not self.heap.is_occupied(off) or self.heap.requested(off) != req:
                raise InvariantError(f"{self.name}: committed block ({off}, {req} bytes) is not an occupied block of that size")
        if self._unclaimed:
            raise InvariantError(f"{self.name} ({self.path}): {len(self._unclaimed)} committed blocks restored from the "
                                 f"pool file are not claimed: open the pool (cachedarrays.pool.Pool.open(manager)) "
                                 f"before using this manager")
        for hook in list(self._check_hooks):
            hook()

    def close(self) -> None:
        """Persist everything, record a clean close, release the lock and drop the mapping (it is
        unmapped once no view aliases it)."""
        if self.closed:
            return
        self._persist_raw(0, self._heap_start + self.capacity)
        if self._meta is not None:
            self._meta.mark_closed()
        super().close()
        self.buffer = self._raw = np.empty(0, dtype=np.uint8)
        self._meta = None
        self._persist_raw = None
        self._check_hooks.clear()
        self._cleanup()


class Recovery:
    """What a reopened pool knows about how its previous writer ended.

    ``unclean`` is True when the previous writer (``previous_pid``) did not close the pool (it was
    killed or crashed): everything it changed after the last commit (``seq``, made at ``time``)
    was never durable and is gone; ``note`` reports an interrupted commit that was discarded.
    """

    def __init__(self, path: str, seq: int, when: float, unclean: bool, previous_pid: int, note: str | None):
        self.path, self.seq, self.time, self.unclean, self.previous_pid, self.note = path, seq, when, unclean, previous_pid, note

    def __repr__(self) -> str:
        return f"Recovery(unclean={self.unclean}, seq={self.seq}, previous_pid={self.previous_pid})"


def _release(fd: int | None, file: str | None, directory: str | None) -> None:
    if fd is not None:
        os.close(fd)  # releases the flock
    if file is not None and os.path.exists(file):
        os.unlink(file)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
