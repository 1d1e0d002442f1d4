"""cachedarrays: object-level heterogeneous memory management for machine learning.

Devices (`GPU`, `DRAM`, `PM`) supply memory; the `Manager` tracks objects and their
regions and exposes the data management API; a `Policy` decides placement and
movement; `CachedArray` is what programs hold.  A `Pool` keeps named arrays in a
PM file across restarts and crashes (`persistent`, `Manager.persist`).
"""

import os

# numba's OpenMP workers spin and then sleep when a parallel region ends. libgomp's default spin
# (300,000 rounds, ~5 ms here) next to XLA's thread pool on a small machine made every
# parallel-region launch cost 10-16 ms: a tiny DLRM step took 120 ms instead of 5 ms. Not spinning
# at all (PASSIVE alone) makes every region wake a sleeping worker, 50-80 us on this VM, which was
# most of a 16384-row lookup and doubled a DLRM-sized sequence of small kernels. 3000 rounds spin
# ~50 us: kernels called back to back start in ~2 us, and an idle worker gives its core back
# after ~50 us. Both variables are read when an OpenMP runtime starts (numba's at the first
# parallel kernel call; torch's too, in the same process); values the user set win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
# JAX takes 75% of a GPU's memory when it starts on it, which a `GPU` heap (CuPy's allocation)
# then cannot get; JAX allocating as it goes leaves the heap its share.  Read when JAX starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from .annotations import Preserved, cleanup, evict, noescape, onobjects, prefetch, preserve, softevict, unsafe_free
from .array import (CachedArray, Status, assign, cuda_reachable, device_pointer, jax_array, readable, release,
                    release_together, similar, writable, write_later, write_now)
from .devices import DRAM, GPU, PM, Bandwidth, Device, Heap
from .errors import (CachedArraysError, CopyError, DeviceUnavailableError, InvariantError, ObjectNotFoundError,
                     OutOfMemoryError, PersistentObjectError, PinnedError, PMCorruptError, PMFormatError,
                     PoolLockedError, PoolMismatchError, StatusError, UseAfterFreeError)
from .manager import Manager, Object, Region
from .policies import CorrelationPrefetchPolicy, LRUPolicy, Policy, TwoLevelCachePolicy
from .pool import Pool, persistent
from .units import format_size, parse_size

__all__ = [
    "Bandwidth", "CachedArray", "CachedArraysError", "CopyError", "CorrelationPrefetchPolicy", "DRAM", "Device",
    "DeviceUnavailableError", "GPU", "Heap", "InvariantError", "LRUPolicy", "Manager", "Object", "ObjectNotFoundError",
    "OutOfMemoryError", "PM", "PMCorruptError", "PMFormatError", "PersistentObjectError", "PinnedError", "Policy", "Preserved",
    "Pool", "PoolLockedError", "PoolMismatchError", "Region", "Status", "StatusError", "TwoLevelCachePolicy",
    "UseAfterFreeError", "assign", "cleanup", "cuda_reachable", "device_pointer", "evict", "format_size", "jax_array",
    "noescape", "onobjects", "parse_size",
    "persistent", "prefetch", "preserve", "readable", "release", "release_together", "similar", "softevict", "unsafe_free", "writable",
    "write_later", "write_now",
]
