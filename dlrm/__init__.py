"""DLRM training on CachedArrays embedding tables (dissertation sections 5.5 and 5.6).

Public API:

* :class:`DLRMConfig` (architecture), :class:`DLRM` (model and training step),
  :mod:`dlrm.dense` (jitted JAX dense part);
* :func:`make_tables` (``dram`` / ``simple`` / ``static`` / ``dynamic`` placement);
* :mod:`dlrm.data`: :class:`~dlrm.data.Batch`, :class:`~dlrm.data.SyntheticData`,
  :func:`~dlrm.data.preprocess` / :class:`~dlrm.data.CriteoDataset` (Criteo Kaggle format),
  :class:`~dlrm.data.Prefetcher`;
* :mod:`dlrm.metrics` (``roc_auc``, ``accuracy``, ``bce``, ``PhaseTimer``),
  :mod:`dlrm.checkpoint` (``save`` / ``load``);
* ``python -m dlrm.train`` (the training script) and ``python -m dlrm.demo``.
"""

from .dense import DLRMConfig
from .model import DLRM, StepResult
from .placement import POLICIES, make_tables

__all__ = ["DLRM", "DLRMConfig", "POLICIES", "StepResult", "make_tables"]
