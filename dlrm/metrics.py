"""Metrics (loss, accuracy, ROC AUC) and a per-phase timer."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

PHASES = ("data loading", "lookup", "dense fwd+bwd", "embedding update", "dense update", "cache flush")


def sigmoid(p: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(p, np.float64)))


def bce(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of sigmoid(logits) (stable form)."""
    p = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    return float(np.mean(np.maximum(p, 0) - p * y + np.log1p(np.exp(-np.abs(p)))))


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of samples where (sigmoid(logit) > 0.5) equals the label."""
    return float(np.mean((np.asarray(logits) > 0) == (np.asarray(labels) > 0.5)))


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a random positive > that of a random negative),
    ties counting one half (the Mann-Whitney U statistic with average ranks). NaN if a class is
    missing."""
    s = np.asarray(scores, np.float64).ravel()
    y = np.asarray(labels).ravel() > 0.5
    npos = int(y.sum())
    nneg = y.size - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(s.size, np.float64)
    # average rank (1-based) within each run of tied scores
    starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - npos * (npos + 1) / 2.0
    return float(u / (npos * nneg))


class PhaseTimer:
    """Accumulates wall seconds per named phase: ``with timer("lookup"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0
            self.counts[phase] += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.counts[phase] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    def table(self) -> dict[str, float]:
        out = {p: self.seconds.get(p, 0.0) for p in PHASES}
        for p, v in self.seconds.items():
            out.setdefault(p, v)
        return out
