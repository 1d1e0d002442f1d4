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
