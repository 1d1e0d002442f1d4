"""Devices: heaps over preallocated buffers (`DRAM`, `PM`). They know nothing of objects."""

from .device import Device
from .dram import DRAM
from .heap import ALIGN, PAGE, Block, Heap
from .perf import Bandwidth, PROFILES
from .pm import PM

__all__ = ["ALIGN", "PAGE", "Bandwidth", "Block", "DRAM", "Device", "Heap", "PM", "PROFILES"]
