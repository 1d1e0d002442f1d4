"""Policies: placement and movement decisions on top of the data management API."""

from .base import Policy
from .correlation import CorrelationPrefetchPolicy
from .lru import LRUPolicy
from .twolevel import TwoLevelCachePolicy

__all__ = ["CorrelationPrefetchPolicy", "LRUPolicy", "Policy", "TwoLevelCachePolicy"]
