"""A region's fill that is not issued yet: a write whose data waits elsewhere until something needs it.

A kernel's output lives in its producer's buffer (JAX's) before it is copied into the region of
the object that stores it, and the next kernel often reads it from there and the object dies
right after, unread: the copy was for nothing. `Manager.fill_later` makes such a write the
region's *fill*, deferred. The manager issues it (`Deferred.issue`) the first time anything must
see the bytes: a view of them (`Manager.ready`, `Manager.ready_on`), a copy from or into the region
(a policy moving the object), `Manager.wait_all`; and cancels it when the region is freed first.
Issued, it stands for the write it made (``done``, ``wait`` and, on a GPU, ``cuda_event`` are
the write's), so every rule about fills (readers wait for them, copies are ordered after them)
holds unchanged.
"""

from __future__ import annotations

from typing import Any, Callable


class Deferred:
    """A write of a region's bytes, run by `issue` at most once, or never after `cancel`.

    ``write()`` makes the write (or queues it on a GPU stream) and returns what marks its end (a
    `Waitable`, or None when it is done on return)."""

    __slots__ = ("_write", "_end")

    def __init__(self, write: Callable[[], Any]):
        self._write: Callable[[], Any] | None = write
        self._end: Any = None

    @property
    def pending(self) -> bool:
        """Neither issued nor cancelled."""
        return self._write is not None

    def issue(self) -> None:
        """Make the write now, unless it was made or cancelled already."""
        write, self._write = self._write, None
        if write is not None:
            self._end = write()

    def cancel(self) -> None:
        """Drop the write: the bytes it would have written are never read."""
        self._write = None

    def done(self) -> bool:
        return self._write is None and (self._end is None or self._end.done())

    def wait(self) -> float:
        self.issue()
        return 0.0 if self._end is None else self._end.wait()

    @property
    def error(self) -> BaseException | None:
        """The error of an issued write whose end reports one (a copy's), else None."""
        return getattr(self._end, "error", None)

    @property
    def cuda_event(self) -> Any:
        """The CUDA event at the end of an issued write made on a stream (None otherwise)."""
        return getattr(self._end, "cuda_event", None)

    def __repr__(self) -> str:
        return f"<Deferred {'pending' if self.pending else 'issued' if self._end is not None else 'done'}>"
