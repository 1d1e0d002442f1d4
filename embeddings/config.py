"""Tuning thresholds, read at call time (tests lower them to exercise the parallel kernels).

A numba parallel region costs tens of microseconds to start on an idle machine and can cost
milliseconds when the cores are shared, so small batches run on the calling thread, input
validation (vectorised, at memory speed on one core) runs serially up to 16M elements, and a
pullback builds its update plan on the calling thread: a call opens at most one parallel region.
"""

SERIAL_WORK = 1 << 16  # floats touched by a lookup/update: below this, run serially
SERIAL_CHECK = 1 << 24  # elements validated: below this, check serially (vectorised, one core reads at memory speed)
PARALLEL_REINDEX_MIN = 1 << 22  # indices: from here pullback reindexes per thread (row ranges) in one region
FIRST_USE_MAX = 1 << 16  # indices: up to this many, update plans list rows in order of first use
OWNER_MAX = 1 << 22  # indices: up to this many, SGD on float tables updates owner-computes (no plan; kernels.owner)
OWNER_SEGMENT = 1 << 20  # indices per owner-computes pass (bounds its per-thread scratch)
