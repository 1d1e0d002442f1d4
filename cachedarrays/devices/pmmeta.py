"""The on-file layout of a PM pool and its crash-consistent metadata (layout version 2).

A pool file is::

    page 0                          header: what the file is, and the commit record
    [meta_start, +2 * slot_size)    two metadata slots, A and B (copy-on-write, ping-pong)
    [heap_start, +capacity)         the heap

The metadata is what the device keeps for the layer above it: the heap's allocation state (the
*extents*: ``(offset, requested)`` of every block that must stay occupied after a reopen) and an
opaque *blob* (the pool layer's name table).  Devices know nothing of objects; the blob is bytes.

Header (little endian)::

      0  8s   magic "CAPMPOOL"             |
      8  u32  layout version               |  the static part, written once when the
     12  u32  flags (0)                    |  file is created; version 1 ends at 32
     16  u64  heap capacity                |
     24  u64  heap start                   |
     32  u64  metadata start (v2)          |
     40  u64  slot size (v2)               |
     48  16B  BLAKE2b-128 of bytes [0, 48) (v2)
     64  u64  committed sequence number: the commit record, one aligned 8-byte store
    128  u64  pid of the process that last opened the pool for writing
    136  u64  1 while a writer has the pool open, 0 after a clean close

Slot::

      0  8s   magic "CAMETA02"
      8  u64  sequence number
     16  u64  payload length
     24  f64  commit time (Unix seconds)
     32  16B  BLAKE2b-128 of bytes [0, 32) and the payload
     64  ...  payload: u64 n, n x (u64 offset, u64 requested), then the blob

Commit protocol.  Commit ``s + 1`` writes the slot ``(s + 1) % 2`` -- never the slot holding the
committed state ``s`` -- persists it, then stores ``s + 1`` in the commit record and persists
that.  The caller has persisted every byte the new state refers to before it calls `commit`.

Crash argument.  A crash before the commit record's store leaves the record at ``s`` and slot
``s % 2`` untouched: the pool opens at ``s`` (a torn or complete slot ``s + 1`` is ignored and
reported as an interrupted commit).  The record is one aligned 8-byte store, which persistent
memory makes failure-atomic and which sits in one disk sector, so after the store the record says
``s + 1`` and slot ``(s + 1) % 2`` was already durable.  A record that names a slot whose magic,
sequence number or checksum do not match is therefore not a crash but corruption (a damaged
medium, a hand-edited file): opening refuses with `PMCorruptError`, naming the slot, and repairs
nothing -- the other slot holds an older state whose data may since have been reused.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import PMCorruptError, PMFormatError, PMMetadataFullError
from .heap import PAGE, round_up

MAGIC = b"CAPMPOOL"
SLOT_MAGIC = b"CAMETA02"
VERSION = 2
READS = (1, 2)  # layout versions this library opens

_STATIC_V1 = struct.Struct("<8sIIQQ")      # magic, version, flags, capacity, heap start
_STATIC_V2 = struct.Struct("<8sIIQQQQ")    # ... metadata start, slot size
_DIGEST = 16
RECORD_AT = 64                             # the commit record
PID_AT, OPEN_AT = 128, 136
_SLOT_HEAD = struct.Struct("<8sQQd")       # magic, seq, payload length, time
SLOT_HEADER_BYTES = 64
_U64 = struct.Struct("<Q")


def digest(*parts: bytes) -> bytes:
    """BLAKE2b-128 of the concatenated parts (the checksum of the header and of the slots)."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


def default_slot_size(capacity: int) -> int:
    """Bytes per metadata slot for a heap of ``capacity`` bytes: 1/512 of it, 64 KiB to 4 MiB.

    A slot holds the name table (about 150 bytes per object), so 64 KiB is some 400 objects
    and 4 MiB some 25,000; a commit writes only the bytes in use.
    """
    return min(4 << 20, max(64 << 10, round_up(capacity // 512, PAGE)))


@dataclass(frozen=True)
class Layout:
    """Where the parts of a pool file are; version 1 files have no metadata slots."""

    version: int
    capacity: int
    heap_start: int
    meta_start: int = 0
    slot_size: int = 0

    @property
    def file_size(self) -> int:
        return self.heap_start + self.capacity

    @classmethod
    def new(cls, capacity: int, slot_size: int | None = None) -> "Layout":
        """The layout of a new version-2 file with a heap of ``capacity`` bytes."""
        slot = round_up(slot_size or default_slot_size(capacity), PAGE)
        if slot < PAGE:
            raise ValueError(f"metadata slot size must be at least {PAGE} bytes, got {slot_size}")
        return cls(VERSION, capacity, PAGE + 2 * slot, PAGE, slot)

    def header(self) -> bytes:
        """The 64 static header bytes (commit record, pid and open flag start at zero)."""
        static = _STATIC_V2.pack(MAGIC, VERSION, 0, self.capacity, self.heap_start, self.meta_start, self.slot_size)
        return static + digest(static)


def read_layout(path: str) -> Layout:
    """Validate the header of an existing pool file; raise `PMFormatError` (or `PMCorruptError`) naming the problem."""
    size = os.path.getsize(path)
    if size < _STATIC_V1.size:
        raise PMFormatError(f"{path} is {size} bytes, too small to be a cachedarrays PM pool (refusing to overwrite it)")
    with open(path, "rb") as f:
        head = f.read(SLOT_HEADER_BYTES)
    magic, version, _, capacity, heap_start = _STATIC_V1.unpack_from(head)
    if magic != MAGIC:
        raise PMFormatError(f"{path} is not a cachedarrays PM pool (magic {magic!r}, expected {MAGIC!r}); refusing to overwrite it")
    if version not in READS:
        newer = " (written by a newer cachedarrays: upgrade to open it)" if version > VERSION else ""
        raise PMFormatError(f"{path} has pool layout version {version}; this library reads versions "
                            f"{', '.join(map(str, READS))}{newer}")
    if version == 1:
        layout = Layout(1, capacity, heap_start)
    else:
        if len(head) < SLOT_HEADER_BYTES:
            raise PMFormatError(f"{path} is {size} bytes, too small for a version-2 pool header: truncated")
        fields = _STATIC_V2.unpack_from(head)
        if head[48:64] != digest(head[:48]):
            raise PMCorruptError(f"{path}: the pool header fails its checksum (corrupted); refusing to open it")
        layout = Layout(2, capacity, heap_start, fields[5], fields[6])
        if not (PAGE <= layout.meta_start and layout.meta_start + 2 * layout.slot_size <= layout.heap_start):
            raise PMCorruptError(f"{path}: the header places the metadata slots at {layout.meta_start} "
                                 f"(+2 x {layout.slot_size}) but the heap at {heap_start}")
    if size != layout.file_size:
        raise PMFormatError(f"{path} is {size} bytes but its header describes {layout.file_size} "
                            f"(capacity {capacity} + header and metadata {heap_start}): truncated or resized")
    return layout


@dataclass(frozen=True)
class Committed:
    """The state of the last commit: its sequence number and time, the extents and the blob."""

    seq: int
    time: float
    extents: tuple[tuple[int, int], ...]
    blob: bytes


EMPTY = Committed(0, 0.0, (), b"")


def encode_slot(state: Committed) -> bytes:
    """The bytes of a slot holding ``state``."""
    ext = np.asarray(state.extents, dtype="<u8").reshape(-1, 2)
    payload = _U64.pack(len(ext)) + ext.tobytes() + state.blob
    head = _SLOT_HEAD.pack(SLOT_MAGIC, state.seq, len(payload), state.time)
    return head + digest(head, payload) + bytes(SLOT_HEADER_BYTES - len(head) - _DIGEST) + payload


def decode_slot(raw: np.ndarray) -> Committed | str:
    """The state in a slot's bytes, or a sentence saying why they are not a valid slot."""
    head = bytes(raw[:SLOT_HEADER_BYTES])
    magic, seq, length, when = _SLOT_HEAD.unpack_from(head)
    if magic != SLOT_MAGIC:
        return f"no slot magic (found {magic!r})"
    if length > raw.size - SLOT_HEADER_BYTES or length < _U64.size:
        return f"payload length {length} does not fit the slot"
    payload = bytes(raw[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + length])
    if head[32:48] != digest(head[:32], payload):
        return "checksum mismatch"
    (n,) = _U64.unpack_from(payload)
    if _U64.size + 16 * n > length:
        return f"{n} extents do not fit its payload of {length} bytes"
    ext = np.frombuffer(payload, dtype="<u8", count=2 * n, offset=_U64.size).reshape(-1, 2)
    extents = tuple((int(o), int(r)) for o, r in ext)
    return Committed(int(seq), float(when), extents, payload[_U64.size + 16 * n:])


class MetaArea:
    """The header's commit record and the two slots of a mapped version-2 pool file.

    ``raw`` is the whole file as a uint8 array; ``persist(offset, nbytes)`` makes a range of it
    durable (pmem_persist or msync).
    """

    def __init__(self, raw: np.ndarray, layout: Layout, persist: Callable[[int, int], None], path: str):
        self.raw, self.layout, self._persist, self.path = raw, layout, persist, path

    def _slot(self, seq: int) -> tuple[int, np.ndarray]:
        start = self.layout.meta_start + (seq % 2) * self.layout.slot_size
        return start, self.raw[start:start + self.layout.slot_size]

    def _u64(self, at: int) -> int:
        return int(self.raw[at:at + 8].view("<u8")[0])

    def _store_u64(self, at: int, value: int) -> None:
        self.raw[at:at + 8].view("<u8")[0] = value  # one aligned 8-byte store
        self._persist(at, 8)

    @property
    def record(self) -> int:
        """The committed sequence number as the header says it now."""
        return self._u64(RECORD_AT)

    def read(self) -> tuple[Committed, str | None]:
        """The committed state, and a note on an interrupted commit found beside it (or None).

        Raises `PMCorruptError` when the commit record names a slot that is not a valid commit.
        """
        seq = self.record
        nxt = decode_slot(self._slot(seq + 1)[1])
        note = None
        if isinstance(nxt, Committed) and nxt.seq == seq + 1:
            note = f"an interrupted commit ({seq + 1}) was found complete but not committed, and discarded"
        if seq == 0:
            return EMPTY, note
        state = decode_slot(self._slot(seq)[1])
        if isinstance(state, str) or state.seq != seq:
            why = state if isinstance(state, str) else f"it holds commit {state.seq}"
            other = decode_slot(self._slot(seq + 1)[1])
            older = (f"the other slot holds commit {other.seq}, whose data may since have been reused"
                     if isinstance(other, Committed) else f"the other slot is not valid either ({other})")
            raise PMCorruptError(
                f"{self.path}: metadata slot {'AB'[seq % 2]} should hold commit {seq} (the last durable point) "
                f"but {why}; {older}. The pool's durable state cannot be trusted; nothing was changed or repaired")
        return state, note

    def verify(self, expected: Committed) -> str | None:
        """Why the committed slot no longer matches ``expected`` (None when it does)."""
        if self.record != expected.seq:
            return f"commit record says {self.record}, the device committed {expected.seq}"
        if expected.seq == 0:
            return None
        state = decode_slot(self._slot(expected.seq)[1])
        if isinstance(state, str):
            return f"committed slot {'AB'[expected.seq % 2]}: {state}"
        if state != expected:
            return f"committed slot {'AB'[expected.seq % 2]} differs from the state the device committed"
        return None

    def commit(self, current: Committed, extents: tuple[tuple[int, int], ...], blob: bytes) -> Committed:
        """Write and persist the next slot, then the commit record; returns the new state."""
        state = Committed(current.seq + 1, time.time(), extents, blob)
        data = encode_slot(state)
        start, slot = self._slot(state.seq)
        if len(data) > slot.size:
            raise PMMetadataFullError(
                f"{self.path}: the metadata of this commit needs {len(data)} bytes but a slot holds {slot.size}; "
                f"create the pool with a larger meta_size (nothing was committed)")
        slot[:len(data)] = np.frombuffer(data, np.uint8)
        self._persist(start, len(data))
        self._store_u64(RECORD_AT, state.seq)
        return state

    def mark_open(self) -> tuple[bool, int]:
        """Record this process as the writer; returns (was the pool left open, the previous writer's pid)."""
        was_open, pid = self._u64(OPEN_AT) == 1, self._u64(PID_AT)
        self.raw[PID_AT:PID_AT + 16].view("<u8")[:] = (os.getpid(), 1)
        self._persist(PID_AT, 16)
        return was_open, pid

    def mark_closed(self) -> None:
        self._store_u64(OPEN_AT, 0)
