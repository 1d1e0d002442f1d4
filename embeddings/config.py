"""Tuning thresholds, read at call time (tests lower them to exercise the parallel kernels).

A numba parallel region costs tens of microseconds to start when its worker sleeps and can cost
milliseconds when the cores are shared, so small batches run on the calling thread
(:func:`serial`), input validation (vectorised, at memory speed on one core) runs serially up to
16M elements, and a pullback builds its update plan on the calling thread: a call opens at most
one parallel region, two for owner-computes SGD (check and collect, then write; back to back,
so the second finds the worker still spinning).
"""

from numba import get_num_threads

# Floats touched by a lookup/update: below this, run serially. A parallel region after more than
# ~50 us idle wakes a sleeping OpenMP worker (see cachedarrays/__init__.py): 50-80 us on this VM,
# the time one core takes to gather ~2 MB of random rows. 16384 rows, cold, 2 threads
# vs 1: F=16 (2^18 floats) lookup 0.157 vs 0.091 ms, SGD update 0.58 vs 0.21 ms; F=64 (2^20)
# a tie; F=256 parallel 20-40% faster.
SERIAL_WORK = 1 << 19
SERIAL_CHECK = 1 << 24  # elements validated: below this, check serially (vectorised, one core reads at memory speed)
PARALLEL_REINDEX_MIN = 1 << 22  # indices: from here pullback reindexes per thread (row ranges) in one region
FIRST_USE_MAX = 1 << 16  # indices: up to this many, update plans list rows in order of first use
OWNER_MAX = 1 << 22  # indices: up to this many, SGD on float tables updates owner-computes (no plan; kernels.owner)
OWNER_SEGMENT = 1 << 20  # indices per owner-computes pass (bounds its per-thread scratch)
# Output bytes of a non-reducing lookup from which it uses streaming stores (kernels.simd.vcopy_stream):
# an output this large leaves the caches anyway, and a normal store would read each line first.
# Half this box's 32 MB L3: 16384 rows of F=256 (16 MB) 1.14-1.54 -> 0.85-1.10 ms; F=128 (8 MB) and
# F=64 (4 MB) ran slower streamed (0.09-0.16 -> 0.18-0.23 ms at F=64), as a reused output of that
# size stays in L3 and its write-back is deferred.
STREAM_MIN_BYTES = 16 << 20


def serial(work: int) -> bool:
    """Whether a kernel touching ``work`` floats runs on the calling thread: below
    ``SERIAL_WORK``, or when numba has one thread."""
    return work < SERIAL_WORK or get_num_threads() == 1
