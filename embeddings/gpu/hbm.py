"""Arrays a GPU cached table keeps in its manager's fast level (HBM), pinned while it is open.

The table's kernels hold raw views of these arrays, so each stays pinned (``writable``) from
its allocation until the table drops it or closes; allocating through the manager keeps the
HBM budget (``--fast-budget``) and the telemetry exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cachedarrays import CachedArray, Manager, unsafe_free, writable


class DeviceArrays:
    """The fast-level arrays of one table (``name`` in error messages)."""

    def __init__(self, manager: Manager, name: str) -> None:
        self.manager, self.name = manager, name
        self._views: list = []

    def new(self, shape: tuple, dtype: Any = np.float32) -> Any:
        """A new array in the fast level (a CuPy array on a GPU), pinned until dropped."""
        try:
            arr = CachedArray(shape, self.manager, dtype, place="fast")
        except MemoryError as e:
            raise MemoryError(f"{self.name}: {shape} {np.dtype(dtype)} does not fit {self.manager.fast.name}: {e}") \
                from None
        view = writable(arr)
        self._views.append(view)
        return view.array

    def drop(self, arr: Any) -> None:
        """Free ``arr`` (one of this table's arrays)."""
        for i, v in enumerate(self._views):
            if v.array is arr:
                del self._views[i]
                v.release()
                unsafe_free([v])
                return

    def close(self) -> None:
        """Free every array."""
        views, self._views = self._views, []
        for v in views:
            v.release()
        unsafe_free(views)

    def __bool__(self) -> bool:
        return bool(self._views)
