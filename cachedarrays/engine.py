"""The copy engine: copies between device ranges that complete in the background.

`CopyEngine.submit` takes a copy of ``nbytes`` from one device range to another and returns a
`Completion` at once.  The engine knows devices only through their *memory space* (``"host"``
or ``"cuda:N"``) and their byte views; it knows nothing of objects or regions.

- host <-> host copies run on worker threads (``workers`` of them, default 1) with a plain
  memcpy that releases the GIL, so a copy proceeds on another core while the program computes:
  a prefetch from PM into DRAM overlaps the work on the current object on a CPU-only machine.
- copies that touch a GPU are handed to that GPU's copier (`devices.gpu.CudaCopier`): CUDA
  streams and events, one stream per direction, so uploads, downloads and compute overlap.

A copy may depend on earlier completions (``after``): the region it reads is still being filled,
or the region it overwrites is still being read.  Dependencies only point to copies submitted
earlier, and every lane runs its jobs in submission order, so the globally oldest unfinished job
can always run: waiting on a dependency inside a worker cannot deadlock.

Waiting is accounted: `Completion.wait` returns the seconds the caller was blocked, which the
manager records as *exposed* copy time; the rest of a copy's duration was *hidden* behind
whatever the program did meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterable, Protocol, Sequence

import numba
import numpy as np

from .copy import _memcpy


class Waitable(Protocol):
    """Something a region must not be reused before: a copy, or a consumer's use of the bytes."""

    def done(self) -> bool: ...

    def wait(self) -> float: ...


class Completion:
    """The pending copy between two device ranges.

    ``error`` holds the exception of a failed copy (set before the completion becomes done).
    ``cuda_end`` / ``cuda_start`` are CUDA events for copies that run on a stream; for those,
    the copy is done when the end event has completed, and GPU consumers wait on the event
    instead of blocking the host (`devices.gpu.stream_wait`).
    """

    __slots__ = ("src", "dst", "nbytes", "submitted", "started", "finished", "error", "waited",
                 "cuda_start", "cuda_end", "gpu_uses", "issued", "_done", "_event", "__weakref__")

    def __init__(self, src: str, dst: str, nbytes: int, background: bool = True):
        self.src = src
        self.dst = dst
        self.nbytes = nbytes
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.finished: float | None = None
        self.error: BaseException | None = None
        self.waited = 0.0
        self.cuda_start = None
        self.cuda_end = None
        self.gpu_uses: list = []  # CUDA events recorded on consumer streams that waited on this copy
        self.issued = False
        self._done = False  # remembered once true: the manager asks in-flight copies at every allocation
        self._event = threading.Event() if background else None  # a copy on this thread needs none

    @property
    def pair(self) -> str:
        return f"{self.src}->{self.dst}"

    def __repr__(self) -> str:
        state = "failed" if self.error else ("done" if self.done() else "in flight")
        return f"<Completion {self.pair} {self.nbytes} B {state}>"

    # ---------------------------------------------------------------- worker side
    def start(self) -> None:
        self.started = time.perf_counter()

    def finish(self, error: BaseException | None = None, cuda_start=None, cuda_end=None) -> None:
        """Mark the copy issued: done at once on the host, or when ``cuda_end`` completes."""
        self.error = error
        self.cuda_start, self.cuda_end = cuda_start, cuda_end
        if self.started is None:
            self.started = time.perf_counter()
        self.finished = time.perf_counter()
        self.issued = True
        if self._event is not None:
            self._event.set()

    # ---------------------------------------------------------------- consumer side
    def done(self) -> bool:
        if self._done:
            return True
        if not self.issued:
            return False
        self._done = self.cuda_end is None or self.error is not None or bool(self.cuda_end.done)
        return self._done

    def wait(self, account: bool = True) -> float:
        """Block until the copy is done; returns the seconds spent blocked (0 if it was done).

        With ``account`` the blocked time counts as exposed; reporting waits pass False.
        """
        if self.done():
            return 0.0
        t0 = time.perf_counter()
        self.wait_issued()
        if self.cuda_end is not None and self.error is None:
            self.cuda_end.synchronize()
        blocked = time.perf_counter() - t0
        if account:
            self.waited += blocked
        return blocked

    def wait_issued(self) -> None:
        """Block until the copy has been run (host) or put on its stream (GPU)."""
        if not self.issued:
            self._event.wait()

    def duration(self) -> float:
        """Seconds the copy itself took (valid once done)."""
        if self.cuda_end is not None and self.error is None:
            from .devices.gpu import elapsed
            return elapsed(self.cuda_start, self.cuda_end)
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def exposed(self) -> float:
        """Seconds of this copy that a consumer waited for (host waits and GPU stream waits), over
        the stream waits whose consumers got there: a copier thread may add a wait while this runs,
        and CUDA times only events that completed."""
        uses = [use for use in list(self.gpu_uses) if use.done]
        if not uses:
            return self.waited
        from .devices.gpu import elapsed
        gpu = max(max(0.0, elapsed(use, self.cuda_end)) for use in uses)
        return max(self.waited, gpu)


def wait_all(waitables: Iterable[Waitable]) -> float:
    """Wait for every item; returns the seconds blocked."""
    return sum(w.wait() for w in waitables)


@numba.njit(nogil=True, cache=True)
def _memcpy_nogil(dst_addr, src_addr, nbytes):
    _memcpy(dst_addr, src_addr, nbytes)


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy contiguous uint8 ``src`` into ``dst`` on this thread without holding the GIL."""
    if dst.size != src.size:
        raise ValueError(f"copy between {src.size}-byte and {dst.size}-byte buffers")
    if src.size:
        _memcpy_nogil(np.uintp(dst.ctypes.data), np.uintp(src.ctypes.data), np.uintp(src.size))


class _HostLane:
    """Worker threads running host memcpy jobs in submission order."""

    def __init__(self, workers: int):
        self.workers = workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, completion: Completion, dst: np.ndarray, src: np.ndarray, after: Sequence[Waitable]) -> None:
        with self._lock:
            if not self._threads:
                for i in range(self.workers):
                    t = threading.Thread(target=self._run, name=f"cachedarrays-copy-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
        self._queue.put((completion, dst, src, tuple(after)))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            completion, dst, src, after = job
            error = None
            try:
                for dep in after:
                    dep.wait()
                completion.start()
                host_copy(dst, src)
            except BaseException as e:  # reported through the completion, never lost in a thread
                error = e
            completion.finish(error)

    def close(self) -> None:
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            for t in self._threads:
                t.join()
            self._threads.clear()


class CopyEngine:
    """Submits copies between device ranges; see the module docstring.

    ``workers``: host copy threads (1 keeps a core free for the program's compute).
    """

    def __init__(self, workers: int = 1):
        if workers < 1:
            raise ValueError(f"a copy engine needs at least one worker, got {workers}")
        self._host = _HostLane(workers)
        self._copiers: dict[int, object] = {}
        self.fault = None  # tests set a callable(src_name, dst_name, nbytes) that may raise

    def submit(self, dst, dst_offset: int, src, src_offset: int, nbytes: int,
               after: Sequence[Waitable] = ()) -> Completion:
        """Start copying ``nbytes`` from ``src`` at ``src_offset`` to ``dst`` at ``dst_offset``."""
        completion = Completion(src.name, dst.name, nbytes)
        after = [w for w in after if not w.done()]
        if self.fault is not None:
            try:
                self.fault(src.name, dst.name, nbytes)
            except BaseException as e:
                completion.finish(e)
                return completion
        if src.memory_space == "host" and dst.memory_space == "host":
            self._host.submit(completion, dst.view(dst_offset, nbytes), src.view(src_offset, nbytes), after)
        else:
            self._copier(src, dst).submit(completion, dst, dst_offset, src, src_offset, nbytes, after)
        return completion

    def copy_now(self, dst, dst_offset: int, src, src_offset: int, nbytes: int,
                 after: Sequence[Waitable] = ()) -> Completion:
        """Copy on the calling thread where both sides are host memory (the parallel memcpy), else
        submit and wait; returns the done completion (a failure is in its ``error``)."""
        if src.memory_space != "host" or dst.memory_space != "host" or self.fault is not None:
            completion = self.submit(dst, dst_offset, src, src_offset, nbytes, after)
            completion.wait()
            return completion
        from .copy import copy_bytes
        completion = Completion(src.name, dst.name, nbytes, background=False)
        wait_all(after)
        completion.start()
        try:
            copy_bytes(dst.view(dst_offset, nbytes), src.view(src_offset, nbytes))
        except Exception as e:  # reported through the completion, as for background copies
            completion.finish(e)
            return completion
        completion.finish()
        return completion

    def _copier(self, src, dst):
        spaces = {s for s in (src.memory_space, dst.memory_space) if s != "host"}
        if len(spaces) > 1:
            raise ValueError(f"copies between two GPUs ({src.name} and {dst.name}) are not supported")
        index = int(spaces.pop().split(":")[1])
        copier = self._copiers.get(index)
        if copier is None:
            from .devices.gpu import CudaCopier
            copier = self._copiers[index] = CudaCopier(index)
        return copier

    def close(self) -> None:
        """Stop the worker threads (every submitted copy has completed first)."""
        self._host.close()
        for copier in self._copiers.values():
            copier.close()
        self._copiers.clear()
