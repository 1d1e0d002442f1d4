"""Prefetching the next batch of GPU cached tables in the background (issue #19).

``start(tables, indices)`` validates each table's next batch in the calling thread (bad input
raises there, before anything moves), then runs the device work of the tables that can do it
off the caller's thread (:meth:`.lru.LRUCachedEmbeddings.prefetch_works`: the tables of one
kind together, placed by one set of kernels where they can be) on :data:`WORKERS` worker
threads, every thread on a CUDA stream of its own, after the work the caller has queued so far
(or after the events a work names as ``work.after``, the part of it the work depends on).
The row traffic of the next batch then overlaps the caller's work on its own stream: the DLRM
trainer starts it before the current batch's lookups, so it overlaps the whole step. The two
never touch the same slots: a prefetch locks the ways of the batches still in use. ``finish``
joins the workers and makes the caller's stream wait for them, so the next lookup sees every
row in place. Tables without ``prefetch_works`` (the host-bookkept
:class:`.cached.CachedEmbeddings`, whose bookkeeping runs numba on the host) are prefetched
synchronously by ``start`` through its ``fallback``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

WORKERS = 4
_pool: ThreadPoolExecutor | None = None


class Pending:
    """A background prefetch: one future per piece of work (a group of tables placed together,
    :meth:`.lru.LRUCachedEmbeddings.prefetch_works`), each its worker stream's event after it."""

    def __init__(self, backend: Any, futures: list[Future]) -> None:
        self.backend, self.futures = backend, futures


def in_background(table: Any) -> bool:
    """Whether ``table`` prefetches on a worker thread (its class offers ``prefetch_works``)."""
    return hasattr(table, "prefetch_works")


def start(tables: Sequence[Any], indices: Sequence[Any],
          fallback: Callable[[Any, Any], Any] | None) -> Pending | None:
    """Prefetch ``indices[t]`` into ``tables[t]``: validated now, the device work in the
    background where a table offers it, else ``fallback(table, indices)`` now (None: every
    table must offer it)."""
    global _pool
    if fallback is None:
        for t in tables:
            if not in_background(t):
                raise TypeError(f"{getattr(t, 'name', t)}: cannot prefetch in the background, and no fallback was given")
    works, backend, kinds = [], None, {}
    for t, idx in zip(tables, indices):
        if in_background(t):
            kinds.setdefault(type(t), []).append((t, idx))
            backend = t.backend
    for kind, items in kinds.items():
        works += kind.prefetch_works([t for t, _ in items], [idx for _, idx in items])
    for t, idx in zip(tables, indices):
        if not in_background(t):
            fallback(t, idx)
    if not works:
        return None
    fence = backend.fence()
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="cachedarrays-prefetch")
    return Pending(backend, [_pool.submit(_run, backend, w, getattr(w, "after", None) or [fence]) for w in works])


def _run(backend: Any, work: Callable[[], Any], fences: list) -> Any:
    with backend.stream():
        for fence in fences:
            backend.follow(fence)
        work()
        return backend.fence()


def finish(pending: Pending | None) -> None:
    """Wait for a background prefetch (raising its error, if any) and order the caller's stream
    after it."""
    if pending is not None:
        wait(pending.futures)  # every table's work ends before an error is raised
        events = [f.result() for f in pending.futures]
        for ev in events:
            pending.backend.follow(ev)
