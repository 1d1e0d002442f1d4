"""DRAM: the fast device, an anonymous private mapping (huge pages where possible) faulted in up front."""

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
    ``huge_pages`` (default on) asks the kernel for transparent huge pages (``MADV_HUGEPAGE``)
    before the heap is faulted in: with the common ``madvise`` THP setting an anonymous mapping
    otherwise gets 4 KiB pages, and random row gathers through a pointer table (two dependent
    accesses per row) then pay two TLB misses; measured: a cached table's lookups 8-12% faster,
    plain tables unchanged.  Ignored where the kernel has no THP.
    """

    kind = "dram"
    tier = 1

    def __init__(self, capacity: int | str, *, name: str = "DRAM",
                 bandwidth: Bandwidth | str | tuple[float, float] | None = None, huge_pages: bool = True):
        nbytes = parse_size(capacity)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._mmap = mmap.mmap(-1, nbytes, flags=flags)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # no THP in this kernel
                pass
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
