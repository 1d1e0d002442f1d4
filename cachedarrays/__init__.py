"""cachedarrays: object-level heterogeneous memory management for machine learning.

Devices (`DRAM`, `PM`) supply memory; the `Manager` tracks objects and their
regions and exposes the data management API; policies decide placement.
"""

from .devices import DRAM, PM, Bandwidth, Device, Heap
from .errors import (CachedArraysError, InvariantError, OutOfMemoryError, PinnedError, PMFormatError,
                     StatusError, UseAfterFreeError)
from .manager import Manager, Object, Region
from .units import format_size, parse_size

__all__ = [
    "Bandwidth", "CachedArraysError", "DRAM", "Device", "Heap", "InvariantError", "Manager", "Object",
    "OutOfMemoryError", "PM", "PMFormatError", "PinnedError", "Region", "StatusError", "UseAfterFreeError",
    "format_size", "parse_size",
]
