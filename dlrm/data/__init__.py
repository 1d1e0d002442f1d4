"""DLRM input data: the :class:`Batch` type, synthetic data with a hidden teacher
(:mod:`dlrm.data.synthetic`), the Criteo Kaggle format (:mod:`dlrm.data.criteo`) and a
background-thread batch loader (:mod:`dlrm.data.loader`)."""

from .batch import Batch
from .loader import Prefetcher
from .synthetic import SyntheticData, Teacher
from .criteo import CriteoDataset, ParseReport, preprocess, read_processed

__all__ = ["Batch", "CriteoDataset", "ParseReport", "Prefetcher", "SyntheticData", "Teacher", "preprocess",
           "read_processed"]
