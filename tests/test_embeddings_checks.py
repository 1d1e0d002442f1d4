"""Validation kernels: blockwise vectorised scans must report exactly the first bad position."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embeddings.kernels import checks as C


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3 * C.BLOCK + 7), st.integers(1, 1 << 40), st.sampled_from([np.int32, np.int64]),
       st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["neg", "big", "edge"])), max_size=4),
       st.integers(0, 2**31))
def test_first_out_of_range_is_exact(L, n, dtype, bad, seed):
    rng = np.random.default_rng(seed)
    hi = min(n, np.iinfo(dtype).max)
    idx = rng.integers(0, hi, L).astype(dtype)
    for frac, kind in bad:
        if L:
            p = int(frac * (L - 1))
            idx[p] = {"neg": -1 - int(rng.integers(0, 100)), "big": np.iinfo(dtype).max, "edge": min(n, np.iinfo(dtype).max)}[kind]
    bad_pos = np.flatnonzero((idx.astype(np.int64) < 0) | (idx.astype(np.int64) >= n))
    want = int(bad_pos[0]) if bad_pos.size else -1
    assert C.first_out_of_range_serial(idx, n) == want
    assert C.first_out_of_range(idx, n) == want
    assert C.out_of_range(idx, n) == want
    for out_type in (np.int32, np.int64):  # the check fused with a copy finds the same position
        out = np.full(L, -7, out_type)
        assert C.copy_checked_each([idx], [n], [out]).tolist() == [want]
        assert np.array_equal(out, idx.astype(out_type))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70000), st.integers(1, 2**40), st.sampled_from([np.int32, np.int64]),
                          st.sampled_from([np.int32, np.int64]), st.floats(0, 1), st.booleans()), max_size=5),
       st.integers(0, 2**31))
def test_copy_checked_each_copies_and_checks_every_array(arrays, seed):
    rng = np.random.default_rng(seed)
    srcs, bounds, outs, want = [], [], [], []
    for L, n, src_type, out_type, frac, bad in arrays:
        n = min(n, np.iinfo(src_type).max, np.iinfo(out_type).max)
        idx = rng.integers(0, n, L).astype(src_type)
        if bad and L:
            idx[int(frac * (L - 1))] = -1
        srcs.append(idx), bounds.append(n), outs.append(np.full(L, -7, out_type))
        bad_pos = np.flatnonzero((idx < 0) | (idx >= n))
        want.append(int(bad_pos[0]) if bad_pos.size else -1)
    got = C.copy_checked_each(srcs, bounds, outs)
    assert got.tolist() == want
    for idx, out in zip(srcs, outs):
        assert np.array_equal(out, idx.astype(out.dtype))


def test_copy_checked_each_refuses_arrays_it_cannot_copy():
    a = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="array 1 must be 1-d and contiguous, into one of its length"):
        C.copy_checked_each([a, a], [10, 10], [np.empty(10, np.int32), np.empty(9, np.int32)])
    with pytest.raises(ValueError, match="array 0 must be 1-d and contiguous"):
        C.copy_checked_each([a[::2]], [10], [np.empty(5, np.int32)])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.sampled_from([1, 3, 16, 64, 300]), st.booleans(),
       st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.sampled_from([np.nan, np.inf, -np.inf])), max_size=3),
       st.integers(0, 2**31))
def test_first_nonfinite_row_is_exact(n, F, strided, bad, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, F) if strided else (n, F)).astype(np.float32) * 1e30
    x = x[:, 1, :] if strided else x
    for fr, fk, v in bad:
        if n:
            x[int(fr * (n - 1)), int(fk * (F - 1))] = v
    rows = np.flatnonzero(~np.isfinite(x).all(1))
    want = int(rows[0]) if rows.size else -1
    assert C.first_nonfinite_row_serial(x) == want
    assert C.first_nonfinite_row(x) == want
    assert C.nonfinite_row(x) == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3 * C.BLOCK + 7), st.lists(st.floats(0, 1), max_size=3), st.integers(0, 2**31))
def test_first_bad_offset_is_exact(nbags, drops, seed):
    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(rng.integers(0, 3, nbags))]).astype(np.int64)
    for frac in drops:  # a decrease after bag b: offsets[b + 1] < offsets[b]
        if nbags:
            b = int(frac * (nbags - 1))
            off[b + 1] = off[b] - 1 - int(rng.integers(0, 5))
    bad = np.flatnonzero(off[1:] < off[:-1])
    assert C.first_bad_offset(off) == (int(bad[0]) if bad.size else -1)
