"""``SimpleEmbedding``: a row-major table over a numpy array or any array-like object.

The array is obtained through one hook, :func:`_ndarray_view`; this is the only place that
knows how to turn the user's ``data`` object into a numpy view.  A CachedArray is pinned with
``cachedarrays.readable`` (lookups) or ``cachedarrays.writable`` (updates) for the duration of
each kernel call, so the policy sees every use and nothing moves under a kernel.  The table
keeps the original ``data`` object, never a cached view of it, except that a numpy array whose
rows are off their cache lines is copied once onto them (``align``, see ``SimpleEmbedding``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np

from cachedarrays import CachedArray, readable
from cachedarrays import writable as writable_view

from .aligned import aligned_copy, rows_aligned
from .gpu import device_array
from .kernels import codecs
from .protocol import Context, EmbeddingTable, RowSource

try:  # ml_dtypes ships with jax; it is the usual home of numpy's bfloat16
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover
    _bfloat16 = None


@contextmanager
def _ndarray_view(data: Any, writable: bool) -> Iterator[np.ndarray]:
    """Yield a numpy view of ``data`` for the duration of one kernel call (the integration hook).

    numpy arrays pass through. Other objects go through ``__array__``: for reading any result
    will do (a copy is correct, only slow); for writing the object must hand out its own memory
    (``__array__(copy=False)``), because an update written into a copy would be lost silently.
    """
    if isinstance(data, np.ndarray):
        yield data
        return
    if isinstance(data, CachedArray):
        with (writable_view(data) if writable else readable(data)) as view:
            yield view
        return
    if not writable:
        yield np.asarray(data)
        return
    try:
        view = data.__array__(copy=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot update {type(data).__name__} in place: it gives no writable view "
                        f"without a copy ({e})") from e
    yield view


def _codec_for(dtype: np.dtype) -> tuple[Any, np.dtype]:
    """(codec marker, kernel storage dtype) for a table element type."""
    if dtype == np.float32 or dtype == np.float64:
        return codecs.NATIVE, dtype
    if dtype == np.float16:
        return codecs.F16, np.dtype(np.uint16)
    if _bfloat16 is not None and dtype == _bfloat16:
        return codecs.BF16, np.dtype(np.uint16)
    raise TypeError(f"embedding tables store float32, float64, float16 or bfloat16, not {dtype}")


def _storage(view: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return view if view.dtype == dtype else view.view(dtype)


class SimpleEmbedding(EmbeddingTable):
    """A plain embedding table over a row-major ``(nvectors, featuresize)`` array.

    ``data`` is a numpy array, a CachedArray (pinned for each kernel call; its region starts on a
    cache line) or any object with ``__array__`` (read through it on every call; updates need a
    view without a copy). ``table.data`` is the array the table reads and updates.

    ``align`` (default True): a numpy array whose rows do not start on cache lines
    (:func:`~embeddings.aligned.rows_aligned`; numpy puts large arrays 16 bytes past a page) is
    copied once onto lines, and ``table.data`` is that copy, so ``pullback`` updates it and not
    the caller's array (read-only stays read-only). Cost: one copy of the table (time and memory,
    like the ``astype`` that made the array); random-row lookups then touch a line less per row
    and ran 1.2-2.6x faster. ``align=False`` keeps the caller's memory as is: updates write
    through to it, lookups run at the speed of its placement.
    ``copied`` says whether a copy was made.
    """

    def __init__(self, data: Any, name: str = "table", *, align: bool = True) -> None:
        self.name = name
        if not isinstance(align, (bool, np.bool_)):
            raise TypeError(f"{name}: align must be True or False, got {align!r}")
        self._plain: tuple[Any, RowSource] | None = None  # (data, its RowSource) for numpy data
        self.copied = False
        if isinstance(data, CachedArray) or device_array(data):  # shape and type without a view (may be on a GPU)
            shape, dtype = tuple(data.shape), np.dtype(data.dtype)
            if len(shape) != 2:
                raise ValueError(f"{name}: table must be 2-d (nvectors, featuresize), got {shape}")
            self._codec, self._storage_dtype = _codec_for(dtype)
            flags = getattr(data, "flags", None)
            if flags is not None and not flags.c_contiguous:
                raise ValueError(f"{name}: table must be row-major (C-contiguous)")
            self._dtype, self._shape = dtype, shape
            self.data = data
            return
        with _ndarray_view(data, writable=False) as view:
            if view.ndim != 2:
                raise ValueError(f"{name}: table must be 2-d (nvectors, featuresize), got {view.shape}")
            self._codec, self._storage_dtype = _codec_for(view.dtype)
            if not view.flags.c_contiguous:
                raise ValueError(f"{name}: table must be row-major (C-contiguous)")
            self._dtype = view.dtype
            self._shape = view.shape
        self.copied = bool(align) and isinstance(data, np.ndarray) and not rows_aligned(data)
        if self.copied:
            copy = aligned_copy(data)
            copy.flags.writeable = data.flags.writeable
            data = copy
        self.data = data

    def eltype(self) -> np.dtype:
        return self._dtype

    def featuresize(self) -> int:
        return int(self._shape[1])

    def nvectors(self) -> int:
        return int(self._shape[0])

    def example(self) -> Any:
        return self.data

    def rows(self, context: Context | None, indices: np.ndarray | None = None,
             writable: bool = False) -> AbstractContextManager[RowSource]:
        """The table's RowSource for one kernel call. numpy data needs no pinning, so its
        RowSource is built once and reused (a per-call context manager and dataclass were a
        measurable part of a small lookup); anything else goes through :func:`_ndarray_view`."""
        data = self.data
        if isinstance(data, np.ndarray):
            if writable and not data.flags.writeable:
                raise ValueError(f"{self.name}: table data is read-only")
            plain = self._plain
            if plain is None or plain[0] is not data:
                plain = self._plain = (data, RowSource(_storage(data, self._storage_dtype), None, None,
                                                       self._codec, self._dtype))
            return nullcontext(plain[1])
        return self._rows_view(writable)

    @contextmanager
    def _rows_view(self, writable: bool) -> Iterator[RowSource]:
        with _ndarray_view(self.data, writable) as view:
            if not isinstance(view, np.ndarray):
                raise TypeError(f"{self.name}: rows are in GPU memory; the CPU kernels cannot read them "
                                f"(lookup, pullback and Ensemble take the GPU path for such tables)")
            if writable and not view.flags.writeable:
                raise ValueError(f"{self.name}: table data is read-only")
            yield RowSource(_storage(view, self._storage_dtype), None, None, self._codec, self._dtype)

    def __repr__(self) -> str:
        return f"SimpleEmbedding({self.name!r}, nvectors={self._shape[0]}, featuresize={self._shape[1]}, {self._dtype})"
