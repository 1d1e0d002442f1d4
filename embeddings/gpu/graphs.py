"""Capturing device work as a CUDA graph, as :mod:`.lru_front` and :mod:`.update_graph` replay it.

A capture runs in relaxed mode, so the other Python thread's CUDA calls (the training step
beside a prefetch, a prefetch beside the training step) go on during it, and takes the arrays
the work allocates from a memory pool of its own: nothing else allocates from it, so no other
work reuses their memory between replays. Work that cannot be captured stays eager; the first
failure of each kind warns. Each kind keeps its graphs in :class:`Entries`, one entry per group
of tables and shapes.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


def capture(xp: Any, stream: Any, work: Callable[[], Any], counts: collections.Counter, warned: list[bool],
            what: str) -> tuple[Any, Any, Any] | None:
    """``work()`` captured on ``stream`` (which it must launch on): ``(graph, what work returned,
    the pool of its arrays)``, counted in ``counts["captured"]``; None when the capture failed,
    counted in ``counts["capture failed"]``, the first such (``warned[0]`` unset) warning that
    ``what`` runs step by step."""
    pool = xp.cuda.MemoryPool()
    try:
        with xp.cuda.using_allocator(pool.malloc):
            stream.begin_capture(CAPTURE_RELAXED)
            try:
                out = work()
            finally:
                graph = stream.end_capture()
    except Exception as e:  # work that cannot be captured: its caller runs it eagerly
        counts["capture failed"] += 1
        if not warned[0]:
            warned[0] = True
            warnings.warn(f"{what} could not be captured as a CUDA graph ({type(e).__name__}: {e}); it runs step by "
                          "step", RuntimeWarning, stacklevel=4)
        return None
    counts["captured"] += 1
    return graph, out, pool


class Entry:
    """A graph of work on some tables: the tables (weak references), the graph once captured,
    the pool of its arrays, how many times it ran eagerly, whether its capture failed."""

    def __init__(self, tables: list) -> None:
        self.tables = [weakref.ref(t) for t in tables]
        self.graph: Any = None
        self.pool: Any = None
        self.runs = 0
        self.failed = False

    def ready(self, capture: Callable[[], None]) -> bool:
        """Whether the graph is there to replay: captured now (by ``capture()``) on the entry's
        second run unless a capture failed before; False: run the work eagerly (counted as a run)."""
        if self.graph is None and self.runs and not self.failed:
            capture()
        if self.graph is None:
            self.runs += 1
            return False
        return True

    def alive(self) -> bool:
        return all(r() is not None for r in self.tables)

    def of(self, tables: list) -> bool:
        return len(tables) == len(self.tables) and all(r() is t for r, t in zip(self.tables, tables))

    def serves(self, table: Any) -> bool:
        return any(r() is table for r in self.tables)


class Entries:
    """Entries by key, shared by threads: those of collected tables dropped, at most ``most``
    kept (the least recently used dropped first), and a closing table's dropped by :meth:`forget`."""

    def __init__(self) -> None:
        self._d: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, tables: list, make: Callable[[], Entry], most: int) -> Entry:
        """The entry of ``key`` for ``tables`` (made by ``make()`` when there is none, or when its
        tables are other objects that reuse the ids in ``key``)."""
        with self._lock:
            for k in [k for k, e in self._d.items() if not e.alive()]:
                del self._d[k]
            entry = self._d.get(key)
            if entry is not None and not entry.of(tables):
                del self._d[key]
                entry = None
            if entry is None:
                entry = self._d[key] = make()
                while len(self._d) > most:
                    self._d.popitem(last=False)
            self._d.move_to_end(key)
            return entry

    def forget(self, table: Any) -> None:
        """Drop the entries with ``table`` (it is closing: their memory goes back)."""
        with self._lock:
            for k in [k for k, e in self._d.items() if e.serves(table)]:
                del self._d[k]

    def values(self) -> list[Entry]:
        with self._lock:
            return list(self._d.values())

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
