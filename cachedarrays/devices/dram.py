"""DRAM: the fast device, an anonymous private mapping faulted in up front."""

from __future__ import annotations

import mmap

import numpy as np

from ..units import parse_size
from .device import Device, prefault
from .perf import Bandwidth, resolve


class DRAM(Device):
    """A heap over ``capacity`` bytes of anonymous memory.

    ``bandwidth`` feeds the performance model: a `Bandwidth`, a profile name, a
    ``(read, write)`` pair in GB/s, or ``"probe"`` (default) to measure this machine.
    """

    kind = "dram"

    def __init__(self, capacity: int | str, *, name: str = "DRAM",
                 bandwidth: Bandwidth | str | tuple[float, float] | None = None):
        nbytes = parse_size(capacity)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mmap = mmap.mmap(-1, nbytes, flags=flags)
        buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        prefault(buffer)
        super().__init__(buffer, name, resolve(bandwidth, "probe"))

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.buffer = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # views (e.g. JAX arrays) still alias the mapping; it is unmapped when they die
