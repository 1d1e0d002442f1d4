"""A batch loader that prepares the next batches on a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_DONE = object()


class Prefetcher:
    """Iterate ``make(i)`` for ``i`` in ``range(start, stop)``, computed ``depth`` batches ahead
    on one daemon thread. Exceptions in the worker are re-raised in the consumer.

    ``wait_seconds`` accumulates the time the consumer spent blocked (the *data loading* phase).
    """

    def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int = 2):
        self._make = make
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(start, stop), daemon=True, name="dlrm-loader")
        self._thread.start()

    def _run(self, start: int, stop: int) -> None:
        try:
            for i in range(start, stop):
                if self._stop.is_set():
                    return
                item = self._make(i)
                while not self._stop.is_set():
                    try:
                        self._q.put((i, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._q.put((None, e))
            return
        self._q.put((None, _DONE))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        import time

        while True:
            t0 = time.perf_counter()
            i, item = self._q.get()
            self.wait_seconds += time.perf_counter() - t0
            if item is _DONE:
                return
            if i is None:
                raise item
            yield i, item

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
