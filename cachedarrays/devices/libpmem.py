"""ctypes binding to the few libpmem calls the PM device needs.

libpmem is optional: `load()` returns None when ``libpmem.so.1`` cannot be loaded
or when ``CACHEDARRAYS_LIBPMEM=0`` is set, and the PM device falls back to mmap.
"""

from __future__ import annotations

import ctypes
import os


class LibPmem:
    """The loaded library with typed entry points."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.pmem_map_file.restype = ctypes.c_void_p
        lib.pmem_map_file.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint,
                                      ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
        lib.pmem_unmap.restype = ctypes.c_int
        lib.pmem_unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_persist.restype = None
        lib.pmem_persist.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_msync.restype = ctypes.c_int
        lib.pmem_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_is_pmem.restype = ctypes.c_int
        lib.pmem_is_pmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_errormsg.restype = ctypes.c_char_p

    def map_file(self, path: str) -> tuple[int, int, bool]:
        """Map an existing file whole; returns (address, length, is_pmem)."""
        mapped = ctypes.c_size_t(0)
        is_pmem = ctypes.c_int(0)
        addr = self.lib.pmem_map_file(os.fsencode(path), 0, 0, 0, ctypes.byref(mapped), ctypes.byref(is_pmem))
        if not addr:
            raise OSError(f"pmem_map_file({path!r}) failed: {self.lib.pmem_errormsg().decode(errors='replace')}")
        return addr, mapped.value, bool(is_pmem.value)

    def unmap(self, addr: int, length: int) -> None:
        self.lib.pmem_unmap(addr, length)

    def persist(self, addr: int, length: int, is_pmem: bool) -> None:
        if is_pmem:
            self.lib.pmem_persist(addr, length)
        elif self.lib.pmem_msync(addr, length) != 0:
            raise OSError(f"pmem_msync failed: {self.lib.pmem_errormsg().decode(errors='replace')}")


_cached: LibPmem | None | bool = False


def load() -> LibPmem | None:
    """The libpmem binding, or None when disabled or not installed."""
    global _cached
    if os.environ.get("CACHEDARRAYS_LIBPMEM", "1") == "0":
        return None
    if _cached is False:
        try:
            _cached = LibPmem(ctypes.CDLL("libpmem.so.1"))
        except OSError:
            _cached = None
    return _cached
