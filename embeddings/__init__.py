"""Embedding tables with numba kernels (dissertation section 5.2).

Public API: the table protocol (``eltype``, ``featuresize``, ``nvectors``, ``example``, contexts
``Forward``/``Update``), ``SimpleEmbedding``, ``lookup``/``lookup_into``, ``pullback`` with ``SGD``/``RowwiseAdagrad``
(fused, no dense gradient), ``sparse_gradient``, ``Ensemble``; index streams in ``embeddings.distributions``.
"""

from .ensemble import Ensemble
from .lookup import lookup, lookup_into
from .optim import SGD, RowwiseAdagrad
from .pullback import UpdatePlan, pullback, sparse_gradient
from .protocol import (FORWARD, UPDATE, Context, EmbeddingTable, Forward, RowSource, Update, eltype,
                       example, featuresize, nvectors)
from .simple import SimpleEmbedding
from . import distributions

__all__ = [
    "FORWARD", "UPDATE", "Context", "Ensemble", "EmbeddingTable", "Forward", "RowSource", "Update",
    "RowwiseAdagrad", "SGD", "SimpleEmbedding", "UpdatePlan", "eltype", "example", "featuresize", "lookup", "lookup_into", "nvectors", "pullback",
    "sparse_gradient",
]
