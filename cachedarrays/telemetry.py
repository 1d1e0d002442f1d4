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
        self.counters: collections.Counter[str] = collections.Counter()
        self.copies: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        # occupancy over time, one change per entry (seconds, device name, its used bytes), on top
        # of every device's use before the first (``_base``); `snapshot` expands it
        self.timeline: collections.deque[tuple[float, str, int]] = collections.deque()
        self.reset()  # the base, the high-water marks and t0
        self._keys = {name: tuple(f"{k}:{name}" for k in ("allocations", "bytes_allocated", "frees", "bytes_freed"))
                      for name in devices}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def allocated(self, device, nbytes: int) -> None:
        name = device.name
        keys = self._keys[name]
        self.counters[keys[0]] += 1
        self.counters[keys[1]] += nbytes
        used = device.used_bytes
        if used > self.high_water[name]:
            self.high_water[name] = used
        self._sample(name, used)

    def freed(self, device, nbytes: int) -> None:
        name = device.name
        keys = self._keys[name]
        self.counters[keys[2]] += 1
        self.counters[keys[3]] += nbytes
        self._sample(name, device.used_bytes)

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

    def _sample(self, name: str, used: int) -> None:
        timeline = self.timeline
        if len(timeline) >= TIMELINE_LENGTH:  # the oldest change folds into the base
            _, old, value = timeline.popleft()
            self._base[old] = value
        timeline.append((time.perf_counter() - self.t0, name, used))

    def _occupancy_timeline(self) -> list[tuple[float, dict[str, int]]]:
        """``(seconds, {device: used bytes})`` after each allocation or free."""
        current = dict(self._base)
        out = []
        for t, name, used in self.timeline:
            current[name] = used
            out.append((t, dict(current)))
        return out

    def reset(self) -> None:
        """Zero every counter and the timeline (high-water marks restart from current use)."""
        self.counters.clear()
        self.copies.clear()
        self.timeline.clear()
        self._base = {name: dev.used_bytes for name, dev in self._devices.items()}
        self.high_water = dict(self._base)
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
            "timeline": self._occupancy_timeline(),
        }
