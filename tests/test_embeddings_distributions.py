"""Index streams: LFSR permutations, Zipf rank-frequency slope, uniformity, reproducibility."""

import numpy as np
import pytest

from embeddings import distributions as D


@pytest.mark.parametrize("m", range(2, 21))
def test_lfsr_has_maximal_period(m):
    seq = D.lfsr_sequence(m, seed=m)
    assert len(seq) == 2**m - 1
    assert np.array_equal(np.sort(seq), np.arange(1, 2**m))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 1000, 4097, 100_000])
@pytest.mark.parametrize("seed", [0, 5])
def test_lfsr_permutation_visits_every_index_once(n, seed):
    p = D.lfsr_permutation(n, seed)
    assert np.array_equal(np.sort(p), np.arange(n))


def test_lfsr_permutations_differ_by_seed_and_scatter_neighbours():
    a, b = D.lfsr_permutation(100_000, 1), D.lfsr_permutation(100_000, 2)
    assert not np.array_equal(a, b)
    assert np.abs(np.diff(a[:100])).min() > 1  # consecutive ranks land on non-adjacent rows


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.2])
def test_zipf_rank_frequency_slope(alpha):
    ranks = D.zipf_ranks(50_000, 1_000_000, alpha, seed=3)
    counts = np.bincount(ranks, minlength=50_000)
    r = np.arange(1, 201)
    slope = np.polyfit(np.log(r), np.log(counts[:200]), 1)[0]
    assert abs(slope + alpha) < 0.05


def test_scrambled_zipf_has_same_frequencies_on_permuted_rows():
    n = 10_000
    ranks = D.zipf_ranks(n, 200_000, 1.0, seed=9, table=4)
    rows = D.zipf(n, 200_000, 1.0, seed=9, table=4)
    perm = D.lfsr_permutation(n, 9 * 1_000_003 + 4)
    assert np.array_equal(rows, perm[ranks])
    assert np.array_equal(np.sort(np.bincount(rows, minlength=n)), np.sort(np.bincount(ranks, minlength=n)))
    assert rows.min() >= 0 and rows.max() < n


def test_uniform_frequencies_and_range():
    x = D.uniform(100, 400_000, seed=1)
    counts = np.bincount(x, minlength=100)
    assert x.min() >= 0 and x.max() < 100
    chi2 = ((counts - 4000) ** 2 / 4000).sum()
    assert chi2 < 180  # 99 degrees of freedom; p ~ 1e-6


def test_streams_are_seeded_and_per_table():
    assert np.array_equal(D.zipf(1000, 50, seed=1, table=0), D.zipf(1000, 50, seed=1, table=0))
    assert not np.array_equal(D.zipf(1000, 50, seed=1, table=0), D.zipf(1000, 50, seed=1, table=1))
    assert np.array_equal(D.uniform(1000, (5, 3), seed=2), D.uniform(1000, (5, 3), seed=2))
    assert D.uniform(1000, (5, 3)).shape == (5, 3)
