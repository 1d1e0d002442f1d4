"""Devices: heaps over preallocated buffers (`GPU`, `DRAM`, `PM`). They know nothing of objects.

`GPU` imports CuPy only when one is created.
"""

from .device import Device
from .dram import DRAM
from .gpu import GPU
from .heap import ALIGN, PAGE, Block, DeadEnds, Heap
from .perf import Bandwidth, PROFILES
from .pm import PM

__all__ = ["ALIGN", "PAGE", "Bandwidth", "Block", "DeadEnds", "DRAM", "Device", "GPU", "Heap", "PM", "PROFILES"]
