"""One mini-batch of DLRM input."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    """``dense`` (B, d) float32; ``indices[t]`` per table: 1-d (one index per sample), 2-d
    ``(B, k)`` fixed bags, or 1-d CSR with ``offsets[t]`` (B + 1 entries); ``labels`` (B,) float32."""

    dense: np.ndarray
    indices: list[np.ndarray]
    labels: np.ndarray
    offsets: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def pooled(self) -> bool:
        return self.offsets is not None or (len(self.indices) > 0 and self.indices[0].ndim == 2)

    def flat(self, t: int) -> np.ndarray:
        """Table ``t``'s lookups' indices as one 1-d array (a view where they are 2-d): the
        first part of :meth:`bags`, without building offsets."""
        return self.indices[t].reshape(-1)

    def bags(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Table ``t``'s lookups as CSR ``(indices, offsets)``, whatever the stored form."""
        idx = self.indices[t]
        if self.offsets is not None:
            return self.flat(t), self.offsets[t]
        if idx.ndim == 2:
            B, k = idx.shape
            return self.flat(t), np.arange(0, B * k + 1, max(k, 1), dtype=np.int64)
        return idx, np.arange(idx.size + 1, dtype=np.int64)
