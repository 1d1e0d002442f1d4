"""Normalising and validating a lookup batch before any kernel runs.

A batch is either non-reducing (one output row per index) or pooled (bags in CSR form:
``indices[offsets[b]:offsets[b+1]]`` is bag ``b``; a fixed-width ``(batch, k)`` index array is
turned into CSR offsets ``0, k, 2k, ...``). Every check happens here, before anything is
written: bad indices raise ``IndexError`` (naming table, position and value), bad offsets
``ValueError``, wrong dtypes ``TypeError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels.checks import first_bad_offset, is_range, out_of_range

_EMPTY_W = np.empty(0, np.float32)


@dataclass(frozen=True)
class Bags:
    """A validated batch. ``offsets`` is None for a non-reducing lookup."""

    indices: np.ndarray  # 1-d int32 or int64, C-contiguous
    offsets: np.ndarray | None  # 1-d int64 (nbags + 1) or None
    weights: np.ndarray  # 1-d float32 aligned with indices, or empty
    mean: bool
    shape: tuple[int, ...]  # shape of the caller's index array

    @property
    def nout(self) -> int:
        """Number of output rows."""
        return self.indices.size if self.offsets is None else self.offsets.size - 1

    def singles(self) -> bool:
        """Whether this is a pooled batch of exactly one index per bag without weights (2-d
        ``(batch, 1)`` indices, or CSR offsets ``0, 1, ..., n``): each output row is then one
        table row, for sum and mean alike, and the lookup runs as a gather (a plain copy per
        row, streaming stores for large outputs, no accumulator)."""
        return (self.offsets is not None and self.weights.size == 0 and self.indices.size == self.nout
                and (len(self.shape) == 2 or bool(is_range(self.offsets))))


def _as_index_array(x: object, what: str, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: {what} must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.size and a.dtype.itemsize >= 8 and a.max() > np.iinfo(np.int64).max:
        raise IndexError(f"{name}: {what} value {int(a.max())} out of range")
    if a.dtype != np.int32 and a.dtype != np.int64:
        a = a.astype(np.int64)
    return np.ascontiguousarray(a)


def make_bags(name: str, nvectors: int, indices: object, offsets: object | None = None,
              weights: object | None = None, mode: str | None = None, known_valid: bool = False) -> Bags:
    """Validate and normalise a lookup batch for a table called ``name`` with ``nvectors`` rows.

    ``mode`` None means non-reducing for 1-d indices without offsets and "sum" otherwise.
    ``known_valid``: the index values are known to be in range (equal to a batch checked
    before), so their range check, a read of every index, is skipped; all else is checked.
    """
    if mode not in (None, "sum", "mean"):
        raise ValueError(f"{name}: mode must be 'sum' or 'mean', got {mode!r}")
    idx = _as_index_array(indices, "indices", name)
    shape = idx.shape
    if offsets is not None:
        if idx.ndim != 1:
            raise ValueError(f"{name}: indices with offsets must be 1-d, got shape {idx.shape}")
        off = _as_index_array(offsets, "offsets", name).astype(np.int64, copy=False)
        if off.ndim != 1 or off.size == 0:
            raise ValueError(f"{name}: offsets must be 1-d with nbags + 1 entries")
        if off[0] != 0 or off[-1] != idx.size:
            raise ValueError(f"{name}: offsets must start at 0 and end at len(indices)={idx.size}, "
                             f"got {int(off[0])} .. {int(off[-1])}")
        b = first_bad_offset(off)
        if b >= 0:
            raise ValueError(f"{name}: offsets not monotone at bag {b}: {int(off[b])} > {int(off[b + 1])}")
    elif idx.ndim == 2:
        nb, k = idx.shape
        off = np.arange(0, nb * k + 1, max(k, 1), dtype=np.int64) if k > 0 else np.zeros(nb + 1, np.int64)
    elif idx.ndim == 1:
        off = None
        if mode is not None:
            raise ValueError(f"{name}: mode={mode!r} needs offsets or a 2-d (batch, k) index array")
    else:
        raise ValueError(f"{name}: indices must be 1-d (with or without offsets) or 2-d, got {idx.shape}")
    flat = idx.reshape(-1)
    p = -1 if known_valid else out_of_range(flat, nvectors)
    if p >= 0:
        pos = tuple(int(i) for i in np.unravel_index(p, shape)) if len(shape) > 1 else p
        raise IndexError(f"{name}: index {int(flat[p])} at position {pos} is out of range "
                         f"for a table of {nvectors} rows")
    if weights is None:
        w = _EMPTY_W
    else:
        w = np.asarray(weights)
        if w.dtype.kind != "f":
            raise TypeError(f"{name}: per-sample weights must be floating point, got {w.dtype}")
        if w.shape != shape:
            raise ValueError(f"{name}: weights shape {w.shape} differs from indices shape {shape}")
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
        if off is None:
            raise ValueError(f"{name}: per-sample weights need a pooled lookup")
    return Bags(flat, off, w, mode == "mean", shape)
