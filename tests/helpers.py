"""Helpers shared by several test modules."""

from contextlib import contextmanager

import numba

from embeddings import config


@contextmanager
def numba_threads(n):
    """Run with ``n`` numba threads; with more than one, force the parallel kernels even for
    the tiny inputs of these tests (normally they run serially below a work threshold)."""
    saved = (config.SERIAL_WORK, config.SERIAL_CHECK, config.PARALLEL_REINDEX_MIN)
    numba.set_num_threads(n)
    if n > 1:
        config.SERIAL_WORK = config.SERIAL_CHECK = config.PARALLEL_REINDEX_MIN = 0
    try:
        yield
    finally:
        config.SERIAL_WORK, config.SERIAL_CHECK, config.PARALLEL_REINDEX_MIN = saved


@contextmanager
def sgd_path(path):
    """Route SGD pullbacks through ``"owner"`` (owner-computes, no plan: the default),
    ``"segments"`` (owner-computes a few indices at a time, as for very large batches) or
    ``"plan"`` (the radix plan and fused kernel that Adagrad and huge batches use)."""
    saved = config.OWNER_MAX, config.OWNER_SEGMENT
    if path == "plan":
        config.OWNER_MAX = -1
    elif path == "segments":
        config.OWNER_SEGMENT = 5
    try:
        yield
    finally:
        config.OWNER_MAX, config.OWNER_SEGMENT = saved
