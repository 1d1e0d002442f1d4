"""Tuning thresholds, read at call time (tests lower them to exercise the parallel kernels).

A numba parallel region costs tens of microseconds to start on an idle machine and can cost
milliseconds when the cores are shared, so small batches run on the calling thread.
"""

SERIAL_WORK = 1 << 16  # floats touched by a lookup/update: below this, run serially
SERIAL_CHECK = 1 << 16  # elements validated: below this, check serially
PARALLEL_REINDEX_MIN = 1 << 14  # indices: below this one thread reindexes
