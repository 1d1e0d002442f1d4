"""Synthetic DLRM data whose labels a model can learn.

Dense features are standard normal; indices per table come from ``embeddings.distributions``
(uniform, or Zipf with LFSR-scrambled ranks), one per sample, a fixed number per bag, or a
variable number (1..k) per bag. Labels are Bernoulli draws from a hidden *teacher*:

    logit = 1.5 * x.w / sqrt(d) + 1.5 * sum_t s_t / sqrt(T) + 0.75 * (x.v / sqrt(d)) * s_0 - 0.5

where ``s_t`` is the mean over the bag of a fixed pseudo-random unit-variance score of each row
(a splitmix64 hash of table and row, so even 10M-row tables need no stored teacher weights).
A model that learns the dense weights and the hot rows reaches an AUC well above 0.5.

Every batch is a pure function of ``(seed, split, batch number)``, so runs, resumed runs and the
PyTorch baseline see identical data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embeddings import distributions as D

from .batch import Batch

_SPLITS = {"train": 0, "test": 1}
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def row_scores(indices: np.ndarray, table: int, seed: int) -> np.ndarray:
    """The teacher's score of each row: a splitmix64 hash mapped to uniform(-sqrt3, sqrt3)."""
    with np.errstate(over="ignore"):
        z = indices.astype(np.uint64) + np.uint64((int(seed) * 0x9E3779B97F4A7C15 + (int(table) + 1) * 0xD1B54A32D192ED03)
                                                  & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return ((u - 0.5) * np.sqrt(12.0)).astype(np.float32)


@dataclass
class Teacher:
    """The hidden model that draws labels (see the module docstring)."""

    dense_dim: int
    ntables: int
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(np.random.SeedSequence([int(self.seed), 0x7EAC]))
        self.w = rng.standard_normal(self.dense_dim).astype(np.float32)
        self.v = rng.standard_normal(self.dense_dim).astype(np.float32)

    def logits(self, batch: Batch) -> np.ndarray:
        d = np.sqrt(self.dense_dim)
        dense = batch.dense @ self.w / d
        cross = batch.dense @ self.v / d
        s = np.zeros((len(batch), self.ntables), np.float32)
        for t in range(self.ntables):
            idx, off = batch.bags(t)
            sc = row_scores(idx, t, self.seed)
            sums = np.add.reduceat(sc, off[:-1]) if sc.size else np.zeros(len(batch), np.float32)
            counts = np.diff(off)
            sums[counts == 0] = 0.0
            s[:, t] = sums / np.maximum(counts, 1)
        return (1.5 * dense + 1.5 * s.sum(1) / np.sqrt(self.ntables) + 0.75 * cross * s[:, 0] - 0.5).astype(np.float32)


class SyntheticData:
    """Reproducible batches: ``data.batch(i, split="train")``; iterate with ``data.batches(start, n)``."""

    def __init__(self, table_sizes, dense_dim: int, batch_size: int, *, num_indices: int = 1,
                 fixed: bool = True, distribution: str = "uniform", alpha: float = 1.0, seed: int = 0,
                 pooled_single: bool = False):
        if distribution not in ("uniform", "zipf"):
            raise ValueError(f"index distribution must be 'uniform' or 'zipf', got {distribution!r}")
        if num_indices < 1:
            raise ValueError(f"need at least one index per lookup, got {num_indices}")
        self.table_sizes = [int(n) for n in table_sizes]
        self.dense_dim = int(dense_dim)
        self.batch_size = int(batch_size)
        self.num_indices = int(num_indices)
        self.fixed = bool(fixed)
        self.distribution = distribution
        self.alpha = float(alpha)
        self.seed = int(seed)
        self.pooled_single = pooled_single
        self.teacher = Teacher(self.dense_dim, len(self.table_sizes), self.seed)

    def _draw(self, n: int, size: int, table: int, stream: int) -> np.ndarray:
        if self.distribution == "uniform":
            return D.uniform(n, size, seed=stream, table=table)
        ranks = D.zipf_ranks(n, size, self.alpha, seed=stream, table=table)
        return D.lfsr_permutation(n, self.seed * 1_000_003 + table)[ranks]

    def batch(self, i: int, split: str = "train") -> Batch:
        ss = np.random.SeedSequence([self.seed, _SPLITS[split], int(i)])
        stream = int(ss.generate_state(1, np.uint64)[0] >> np.uint64(2))
        rng = np.random.default_rng(ss)
        B, k = self.batch_size, self.num_indices
        dense = rng.standard_normal((B, self.dense_dim), dtype=np.float32)
        offsets = None
        if k == 1 and self.fixed and not self.pooled_single:
            indices = [self._draw(n, B, t, stream) for t, n in enumerate(self.table_sizes)]
        elif self.fixed:
            indices = [self._draw(n, (B, k), t, stream) for t, n in enumerate(self.table_sizes)]
        else:
            indices, offsets = [], []
            for t, n in enumerate(self.table_sizes):
                counts = rng.integers(1, k + 1, B)
                off = np.zeros(B + 1, np.int64)
                np.cumsum(counts, out=off[1:])
                offsets.append(off)
                indices.append(self._draw(n, int(off[-1]), t, stream))
        b = Batch(dense, indices, np.zeros(B, np.float32), offsets)
        p = 1.0 / (1.0 + np.exp(-self.teacher.logits(b).astype(np.float64)))
        b.labels = (rng.random(B) < p).astype(np.float32)
        return b

    def batches(self, start: int, count: int, split: str = "train"):
        for i in range(start, start + count):
            yield self.batch(i, split)
