"""DLRM training on CachedArrays embedding tables (dissertation sections 5.5 and 5.6).

Public API:

* :class:`DLRMConfig` (architecture), :class:`DLRM` (model and training step),
  :mod:`dlrm.dense` (jitted JAX dense part);
* :func:`make_tables` (``dram`` / ``simple`` / ``static`` / ``dynamic`` placement),
  :class:`ManagedEmbedding`;
* :mod:`dlrm.data`: :class:`~dlrm.data.Batch`, :class:`~dlrm.data.SyntheticData`,
  :func:`~dlrm.data.preprocess` / :class:`~dlrm.data.CriteoDataset` (Criteo Kaggle format),
  :class:`~dlrm.data.Prefetcher`;
* :mod:`dlrm.metrics` (``roc_auc``, ``accuracy``, ``bce``, ``PhaseTimer``),
  :mod:`dlrm.checkpoint` (``save`` / ``load``);
* ``python -m dlrm.train`` (the training script) and ``python -m dlrm.demo``.
"""

import os

# numba's OpenMP workers spin-then-sleep by default; next to XLA's thread pool on 2 cores this made
# every parallel-region launch cost 10-16 ms (median; 2 us with PASSIVE): a tiny DLRM step went
# from 120 ms to 5 ms. Must be set before the OpenMP runtime starts (first parallel kernel call).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .dense import DLRMConfig  # noqa: E402
from .model import DLRM, StepResult  # noqa: E402
from .placement import POLICIES, ManagedEmbedding, make_tables  # noqa: E402

__all__ = ["DLRM", "DLRMConfig", "ManagedEmbedding", "POLICIES", "StepResult", "make_tables"]
