"""Index streams for benchmarks and tests: uniform and Zipf(alpha), seeded and reproducible.

Zipf draws ranks (rank 0 most frequent, ``P(rank k) ~ (k + 1) ** -alpha``) over the table's
rows. So that hot rows are not neighbours in memory (which would give the Zipf stream spatial
locality it should not have), ranks are mapped to rows through a maximal-length linear feedback
shift register permutation with a per-table seed, as in dissertation section 5.4.1.1.

A Galois LFSR of ``m`` bits with a primitive feedback polynomial visits every non-zero ``m``-bit
state exactly once per period ``2**m - 1``; states above ``n`` are skipped (cycle walking), which
gives a permutation of ``range(n)`` in O(n).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

# Galois feedback masks of maximal-length LFSRs (primitive polynomials), by register width.
LFSR_TAPS = {
    2: 0x3, 3: 0x6, 4: 0xC, 5: 0x14, 6: 0x30, 7: 0x60, 8: 0xB8, 9: 0x110, 10: 0x240, 11: 0x500,
    12: 0x829, 13: 0x100D, 14: 0x2015, 15: 0x6000, 16: 0xD008, 17: 0x12000, 18: 0x20400,
    19: 0x40023, 20: 0x90000, 21: 0x140000, 22: 0x300000, 23: 0x420000, 24: 0xE10000,
    25: 0x1200000, 26: 0x2000023, 27: 0x4000013, 28: 0x9000000, 29: 0x14000000,
    30: 0x20000029, 31: 0x48000000, 32: 0x80200003,
}


def lfsr_width(n: int) -> int:
    """Smallest register width whose period covers ``n`` values (states 1..n)."""
    return max(2, int(n).bit_length())


@njit(cache=True)
def _lfsr_walk(n, taps, state, out):
    """Fill ``out`` (length n) with the LFSR states <= n, minus one, in visiting order."""
    filled = 0
    start = state
    while filled < n:
        if state <= n:
            out[filled] = state - 1
            filled += 1
        lsb = state & 1
        state >>= 1
        if lsb:
            state ^= taps
        if state == start and filled < n:
            return -1  # period too short: the taps are not maximal
    return filled


def _start_state(seed: int, period: int) -> int:
    """A well-mixed non-zero start state for a seed (splitmix64), so that nearby seeds give
    unrelated streams and the walk does not begin on the sparse states 1, 2, 4, ..."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % period + 1


def lfsr_sequence(m: int, seed: int = 1, length: int | None = None) -> np.ndarray:
    """The first ``length`` (default: one full period) states of the ``m``-bit LFSR from ``seed``."""
    period = (1 << m) - 1
    length = period if length is None else length
    state = _start_state(seed, period)
    taps = LFSR_TAPS[m]
    out = np.empty(length, np.int64)
    for i in range(length):
        out[i] = state
        lsb = state & 1
        state >>= 1
        if lsb:
            state ^= taps
    return out


@lru_cache(maxsize=64)
def _permutation(n: int, seed: int) -> np.ndarray:
    m = lfsr_width(n)
    period = (1 << m) - 1
    out = np.empty(n, np.int64)
    got = _lfsr_walk(n, LFSR_TAPS[m], _start_state(seed, period), out)
    if got != n:
        raise RuntimeError(f"LFSR of width {m} is not maximal-length")
    out.setflags(write=False)
    return out


def lfsr_permutation(n: int, seed: int = 0) -> np.ndarray:
    """A permutation of ``range(n)`` given by a maximal-length LFSR started from ``seed``."""
    if n <= 0:
        return np.empty(0, np.int64)
    return _permutation(int(n), int(seed))


def _rng(seed: int, table: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(table)]))


def uniform(nvectors: int, size: int | tuple[int, ...], *, seed: int = 0, table: int = 0) -> np.ndarray:
    """Uniform int64 indices in ``[0, nvectors)``; ``(seed, table)`` selects the stream."""
    return _rng(seed, table).integers(0, nvectors, size=size, dtype=np.int64)


@lru_cache(maxsize=16)
def _zipf_cdf(n: int, alpha: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    c = np.cumsum(p)
    c /= c[-1]
    c.setflags(write=False)
    return c


def zipf_ranks(nvectors: int, size: int | tuple[int, ...], alpha: float = 1.0, *, seed: int = 0,
               table: int = 0) -> np.ndarray:
    """Zipf ranks in ``[0, nvectors)``, rank 0 the most frequent, without scrambling."""
    if alpha < 0:
        raise ValueError("alpha must be >= 0")
    u = _rng(seed, table).random(size)
    r = np.searchsorted(_zipf_cdf(int(nvectors), float(alpha)), u, side="right")
    return np.minimum(r, nvectors - 1).astype(np.int64)


def zipf(nvectors: int, size: int | tuple[int, ...], alpha: float = 1.0, *, seed: int = 0,
         table: int = 0, scramble: bool = True) -> np.ndarray:
    """Zipf(alpha)-distributed int64 row indices, hot rows scattered by a per-table LFSR."""
    ranks = zipf_ranks(nvectors, size, alpha, seed=seed, table=table)
    if not scramble:
        return ranks
    return lfsr_permutation(nvectors, seed * 1_000_003 + table)[ranks]
