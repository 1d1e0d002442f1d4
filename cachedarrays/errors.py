"""Exceptions raised by cachedarrays.

Each error names the problem and carries the numbers that explain it, so a
user can tell a heap that is full from one that is fragmented, or a freed
object from one that was never ours.
"""


class CachedArraysError(Exception):
    """Base class of every error this library raises on purpose."""


class OutOfMemoryError(CachedArraysError, MemoryError):
    """A device cannot satisfy an allocation, even after whatever eviction was allowed."""


class UseAfterFreeError(CachedArraysError, RuntimeError):
    """An object or region was used after it was freed."""


class StatusError(CachedArraysError, RuntimeError):
    """An array was accessed in a way its current status forbids."""


class PinnedError(CachedArraysError, RuntimeError):
    """An operation needed to move an object that is pinned by a live view."""


class PMFormatError(CachedArraysError, ValueError):
    """A persistent-memory file is not a cachedarrays pool, or has the wrong size or layout."""


class InvariantError(CachedArraysError, AssertionError):
    """`check()` found broken internal state; the message says which invariant and where."""


class CopyError(CachedArraysError, RuntimeError):
    """A copy between two devices failed; the message names the object and the device pair."""


class DeviceUnavailableError(CachedArraysError, RuntimeError):
    """A device cannot be created here: no such hardware, or its optional dependencies are missing."""


class PMCorruptError(PMFormatError):
    """A pool's persistent metadata failed its checksum or is inconsistent; nothing was repaired."""


class PoolLockedError(CachedArraysError, RuntimeError):
    """Another process (or another device in this one) has the pool file open for writing."""


class ObjectNotFoundError(CachedArraysError, KeyError):
    """A persistent pool holds no object of the given name."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class PoolMismatchError(CachedArraysError, ValueError):
    """A named object was opened with a shape or dtype other than the one stored with it."""


class PersistentObjectError(CachedArraysError, RuntimeError):
    """An operation would break a persistent pool's guarantees (e.g. freeing a named object behind its back)."""


class PMMetadataFullError(CachedArraysError, MemoryError):
    """A commit's metadata (the name table) does not fit a pool's metadata slot."""
