"""The embedding table protocol (dissertation Table 5.2) and the access contexts.

Algorithms (``lookup``, ``pullback``, ``Ensemble``) only use this protocol, so a table type can
change where rows live without touching them:

* ``eltype(t)``, ``featuresize(t)``, ``nvectors(t)``, ``example(t)``: as in Table 5.2.
* ``t.rows(context, indices)``: a context manager yielding a :class:`RowSource`, the array form
  of ``rowpointer(A, i, context)``. ``context`` is :data:`FORWARD` (lookup), :data:`UPDATE`
  (optimizer step) or ``None`` (plain access). ``indices`` are the rows about to be touched
  (already range-checked), so a caching table can run ``access_and_cache`` on them in the
  Forward context before the kernels run; ``SimpleEmbedding`` ignores them.

How a cached table plugs in: subclass :class:`EmbeddingTable`, keep the full table as ``base``,
hold an int64 pointer table ``slots`` (one entry per row: the address of the row's copy, shifted
left by two; low bit set = the copy is in ``cache``) and a ``cache`` storage array of the same
dtype, and return
``RowSource(base, cache, slots, codec)`` from ``rows`` (``embeddings.cached.CachedEmbeddings``). The kernels
(``embeddings.kernels``) then resolve every row through ``slots`` (see
``embeddings.kernels.rowaccess``) for lookups and updates alike.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np


class Context:
    """Base class of access contexts; the context says why rows are being accessed."""

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class Forward(Context):
    """Rows are read by a lookup (a caching table may cache them now)."""


class Update(Context):
    """Rows are read and written by an optimizer step."""


FORWARD = Forward()
UPDATE = Update()


@dataclass(frozen=True)
class RowSource:
    """What kernels read rows from: see ``embeddings.kernels.rowaccess``.

    ``cache`` and ``slots`` are both None for a table without indirection; otherwise ``slots``
    is the int64 pointer table described in ``embeddings.kernels.rowaccess``. ``codec`` is the storage codec marker of ``embeddings.kernels.codecs``; ``dtype`` is the
    logical element type (float32, float64, bfloat16 or float16).
    """

    base: np.ndarray
    cache: np.ndarray | None
    slots: np.ndarray | None
    codec: Any
    dtype: np.dtype


class EmbeddingTable:
    """Abstract embedding table: ``nvectors`` rows of ``featuresize`` elements."""

    name: str = "table"

    def eltype(self) -> np.dtype:
        raise NotImplementedError

    def featuresize(self) -> int:
        raise NotImplementedError

    def nvectors(self) -> int:
        raise NotImplementedError

    def example(self) -> Any:
        """An instance of the backing array type (for allocating similar outputs)."""
        raise NotImplementedError

    def rows(self, context: Context | None, indices: np.ndarray | None = None,
             writable: bool = False) -> AbstractContextManager[RowSource]:
        """Context manager yielding the :class:`RowSource` for an access in ``context``."""
        raise NotImplementedError


def eltype(t: EmbeddingTable) -> np.dtype:
    """Element type of the stored rows."""
    return t.eltype()


def featuresize(t: EmbeddingTable) -> int:
    """Number of elements per row."""
    return t.featuresize()


def nvectors(t: EmbeddingTable) -> int:
    """Number of rows."""
    return t.nvectors()


def example(t: EmbeddingTable) -> Any:
    """The backing array, for ``similar``-style allocation of outputs."""
    return t.example()
