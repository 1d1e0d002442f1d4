"""Embedding tables with numba kernels (dissertation section 5.2).

Public API: the table protocol (``eltype``, ``featuresize``, ``nvectors``, ``example``, contexts
``Forward``/``Update``), ``SimpleEmbedding``, ``lookup``/``lookup_into``.
"""

from .lookup import lookup, lookup_into
from .protocol import (FORWARD, UPDATE, Context, EmbeddingTable, Forward, RowSource, Update, eltype,
                       example, featuresize, nvectors)
from .simple import SimpleEmbedding

__all__ = [
    "FORWARD", "UPDATE", "Context", "EmbeddingTable", "Forward", "RowSource", "Update",
    "SimpleEmbedding", "eltype", "example", "featuresize", "lookup", "lookup_into", "nvectors",
]
