"""cachedarrays: object-level heterogeneous memory management for machine learning.

Devices (`DRAM`, `PM`) supply memory; the `Manager` tracks objects and their
regions and exposes the data management API; a `Policy` decides placement and
movement; `CachedArray` is what programs hold.
"""

import os

# numba's OpenMP workers spin and then sleep by default; next to XLA's thread pool on a small
# machine that made every parallel-region launch cost 10-16 ms (2 us with PASSIVE): a tiny DLRM
# step went from 120 ms to 5 ms.  It must be set before the OpenMP runtime starts (at the first
# parallel kernel call); a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .annotations import cleanup, evict, noescape, onobjects, prefetch, preserve, softevict, unsafe_free
from .array import CachedArray, Status, readable, release, similar, writable
from .devices import DRAM, PM, Bandwidth, Device, Heap
from .errors import (CachedArraysError, InvariantError, OutOfMemoryError, PinnedError, PMFormatError,
                     StatusError, UseAfterFreeError)
from .manager import Manager, Object, Region
from .policies import LRUPolicy, Policy, TwoLevelCachePolicy
from .units import format_size, parse_size

__all__ = [
    "Bandwidth", "CachedArray", "CachedArraysError", "DRAM", "Device", "Heap", "InvariantError", "LRUPolicy",
    "Manager", "Object", "OutOfMemoryError", "PM", "PMFormatError", "PinnedError", "Policy", "Region", "Status",
    "StatusError", "TwoLevelCachePolicy", "UseAfterFreeError", "cleanup", "evict", "format_size", "noescape",
    "onobjects", "parse_size", "prefetch", "preserve", "readable", "release", "similar", "softevict",
    "unsafe_free", "writable",
]
