"""Optimizers applied inside the fused pullback kernels (no dense gradient ever exists).

An optimizer is a small description (learning rate, epsilon) plus, for row-wise Adagrad, one
float32 accumulator per table row, created on first use and kept per table.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from .kernels import update as U
from .protocol import EmbeddingTable


@dataclass
class SGD:
    """Plain SGD: ``row -= lr * g``.

    ``deterministic=False`` lets a GPU table skip the update's plan (a sort of the whole batch):
    one kernel sums each row's entries within tiles of the batch and adds the sums to the row by
    atomic adds, in the order they land. A row with one entry in the batch rounds as in the
    deterministic update; a row with several gets the same sum in an order that varies from run
    to run (float rounding: not reproducible bit for bit). CPU tables are always deterministic
    and ignore it.
    """

    lr: float
    deterministic: bool = True

    code = U.SGD
    eps = 0.0

    def state(self, table: EmbeddingTable) -> np.ndarray:
        """SGD keeps no state (an empty array for the kernels)."""
        return _NO_STATE


@dataclass
class RowwiseAdagrad:
    """Row-wise Adagrad (as in DLRM/torchrec): one accumulator per row.

    ``state[r] += mean(g_r**2)``; ``row_r -= lr * g_r / (sqrt(state[r]) + eps)``, where ``g_r`` is
    the row's total gradient in this step.
    """

    lr: float
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    _states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    _device_states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)

    code = U.ADAGRAD

    def state(self, table: EmbeddingTable) -> np.ndarray:
        """The per-row accumulator of ``table`` (created on first use)."""
        st = self._states.get(table)
        if st is None:
            st = np.full(table.nvectors(), self.initial_accumulator_value, np.float32)
            self._states[table] = st
        return st

    def device_state(self, table: EmbeddingTable, full: Callable[[int, float], Any]) -> Any:
        """The accumulator of a table on a GPU, a device array made by ``full(n, value)`` on
        first use (kept apart from the host one: a table keeps its rows in one place)."""
        st = self._device_states.get(table)
        if st is None:
            st = full(table.nvectors(), self.initial_accumulator_value)
            self._device_states[table] = st
        return st


_NO_STATE = np.empty(0, np.float32)
Optimizer = SGD | RowwiseAdagrad
