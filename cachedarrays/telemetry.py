"""Counters the manager and policies keep: copies per device pair, allocations, occupancy.

Times come in two kinds and are always labelled: *measured* (the copy's own duration: wall clock
on a copy thread, CUDA events on a stream) and *modeled* (bytes over the device model's
bandwidth, see `devices.perf`).  Measured time splits into *exposed* (a consumer waited for the
copy) and *hidden* (the copy ran while the program did other work).
"""

from __future__ import annotations

import collections
import time
from typing import Mapping

TIMELINE_LENGTH = 100_000


class Telemetry:
    """Mutable counters; `snapshot()` returns plain dicts safe to serialise as JSON."""

    def __init__(self, devices: Mapping[str, object]):
        self._devices = dict(devices)
        self.t0 = time.perf_counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.copies: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        self.high_water = {name: 0 for name in devices}
        self.timeline: collections.deque[tuple[float, dict[str, int]]] = collections.deque(maxlen=TIMELINE_LENGTH)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def allocated(self, device, nbytes: int) -> None:
        self.counters[f"allocations:{device.name}"] += 1
        self.counters[f"bytes_allocated:{device.name}"] += nbytes
        used = device.used_bytes
        if used > self.high_water[device.name]:
            self.high_water[device.name] = used
        self._sample()

    def freed(self, device, nbytes: int) -> None:
        self.counters[f"frees:{device.name}"] += 1
        self.counters[f"bytes_freed:{device.name}"] += nbytes
        self._sample()

    def copied(self, src, dst, nbytes: int, measured: float, modeled: float) -> None:
        entry = self.copies[(src.name, dst.name)]
        entry[0] += nbytes
        entry[1] += 1
        entry[2] += measured
        entry[3] += modeled

    def timed(self, src, dst, seconds: float, exposed: float) -> None:
        """A copy counted by `copied` has finished: it took ``seconds``, of which a consumer waited ``exposed``."""
        entry = self.copies[(src.name, dst.name)]
        entry[2] += seconds
        entry[4] += min(exposed, seconds)

    def _sample(self) -> None:
        self.timeline.append((time.perf_counter() - self.t0,
                              {name: dev.used_bytes for name, dev in self._devices.items()}))

    def reset(self) -> None:
        """Zero every counter and the timeline (high-water marks restart from current use)."""
        self.counters.clear()
        self.copies.clear()
        self.timeline.clear()
        self.high_water = {name: dev.used_bytes for name, dev in self._devices.items()}
        self.t0 = time.perf_counter()

    def snapshot(self) -> dict:
        copies = {
            f"{s}->{d}": {"bytes": int(v[0]), "count": int(v[1]), "measured_seconds": v[2], "modeled_seconds": v[3],
                          "exposed_seconds": v[4], "hidden_seconds": max(0.0, v[2] - v[4])}
            for (s, d), v in sorted(self.copies.items())
        }
        return {
            "copies": copies,
            "bytes_moved": {k: v["bytes"] for k, v in copies.items()},
            "measured_movement_seconds": sum(v["measured_seconds"] for v in copies.values()),
            "modeled_movement_seconds": sum(v["modeled_seconds"] for v in copies.values()),
            "exposed_movement_seconds": sum(v["exposed_seconds"] for v in copies.values()),
            "hidden_movement_seconds": sum(v["hidden_seconds"] for v in copies.values()),
            "counters": dict(self.counters),
            "occupancy": {name: {"used": dev.used_bytes, "capacity": dev.capacity,
                                 "high_water": self.high_water[name]}
                          for name, dev in self._devices.items()},
            "timeline": [(t, dict(u)) for t, u in self.timeline],
        }
