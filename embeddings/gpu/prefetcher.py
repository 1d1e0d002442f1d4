"""Prefetching the next batch of GPU cached tables in the background (issue #19).

``start(tables, indices)`` validates each table's next batch in the calling thread (bad input
raises there, before anything moves), then runs the device work of the tables that can do it
off the caller's thread (:meth:`.lru.LRUCachedEmbeddings.prefetch_work`) in one worker thread
on a CUDA stream of its own, after the work the caller has queued so far (the current batch's
lookups): the row traffic of the next batch then overlaps the current batch's dense work and
embedding update on the caller's stream. Those never touch the same slots: a prefetch locks
the ways of the batch in flight. ``finish`` joins the worker and makes the caller's stream wait
for it, so the next lookup sees every row in place. Tables without ``prefetch_work`` (the
host-bookkept :class:`.cached.CachedEmbeddings`, whose bookkeeping runs numba on the host) are
prefetched synchronously by ``start``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_pool: ThreadPoolExecutor | None = None


class Pending:
    """A background prefetch: its worker's future (the worker's stream's last event)."""

    def __init__(self, backend: Any, future: Future) -> None:
        self.backend, self.future = backend, future


def start(tables: Sequence[Any], indices: Sequence[Any], fallback: Callable[[Any, Any], Any]) -> Pending | None:
    """Prefetch ``indices[t]`` into ``tables[t]``: validated now, the device work in the
    background where a table offers it, else ``fallback(table, indices)`` now."""
    global _pool
    works, backend = [], None
    for t, idx in zip(tables, indices):
        if hasattr(t, "prefetch_work"):
            works.append(t.prefetch_work(idx))
            backend = t.backend
        else:
            fallback(t, idx)
    if not works:
        return None
    fence = backend.fence()
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="cachedarrays-prefetch")
    return Pending(backend, _pool.submit(_run, backend, works, fence))


def _run(backend: Any, works: list, fence: Any) -> Any:
    with backend.stream():
        backend.follow(fence)
        for w in works:
            w()
        return backend.fence()


def finish(pending: Pending | None) -> None:
    """Wait for a background prefetch (raising its error, if any) and order the caller's stream
    after it."""
    if pending is not None:
        pending.backend.follow(pending.future.result())
