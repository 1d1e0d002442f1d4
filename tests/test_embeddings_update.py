"""Pullback: fused SGD / row-wise Adagrad against numpy and jax.grad; refusal of bad gradients."""

import jax
import jax.numpy as jnp
import ml_dtypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embeddings as E
from helpers import numba_threads, sgd_path


def dense_grad(N, idx, offsets, grad, weights=None, mean=False):
    """float64 numpy reference of the table gradient (np.add.at handles duplicates)."""
    G = np.zeros((N, grad.shape[1]))
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        c = np.ones(e - s) if weights is None else np.asarray(weights[s:e], np.float64)
        if mean and e > s:
            c = c / (e - s)
        np.add.at(G, idx[s:e], c[:, None] * grad[b].astype(np.float64)[None, :])
    return G


@st.composite
def cases(draw):
    F = draw(st.one_of(st.integers(1, 300), st.sampled_from([16, 64, 256])))
    N = draw(st.integers(1, 30))
    B = draw(st.integers(0, 20))
    sizes = draw(st.lists(st.integers(0, 6), min_size=B, max_size=B))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    hot = draw(st.integers(1, N))
    idx = rng.integers(0, hot, offsets[-1])
    table = rng.standard_normal((N, F)).astype(np.float32)
    grad = rng.standard_normal((B, F)).astype(np.float32)
    weights = rng.random(offsets[-1]).astype(np.float32)
    return table, idx, offsets, grad, weights, draw(st.sampled_from([1, 2]))


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(["sum", "mean", "rows"]), st.booleans(), st.sampled_from(["owner", "segments", "plan"]))
def test_sgd_matches_numpy(case, mode, weighted, path):
    table, idx, offsets, grad, weights, threads = case
    with numba_threads(threads), sgd_path(path):
        w = weights if weighted else None
        t = E.SimpleEmbedding(table.copy())
        if mode == "rows":  # non-reducing lookup: one gradient row per index
            w, offsets = None, np.arange(idx.size + 1)
            grad = np.resize(grad, (idx.size, table.shape[1])).astype(np.float32)
            E.pullback(t, grad, idx, optimizer=E.SGD(0.25))
        else:
            E.pullback(t, grad, idx, offsets, mode=mode, weights=w, optimizer=E.SGD(0.25))
        want = table - 0.25 * dense_grad(len(table), idx, offsets, grad, w, mode == "mean")
        np.testing.assert_allclose(t.data, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_rowwise_adagrad_matches_numpy_over_two_steps(case):
    table, idx, offsets, grad, _, threads = case
    with numba_threads(threads):
        t = E.SimpleEmbedding(table.copy())
        opt = E.RowwiseAdagrad(lr=0.1, eps=1e-6, initial_accumulator_value=0.5)
        ref = table.astype(np.float64)
        state = np.full(len(table), 0.5)
        for step in range(2):
            g = grad * (step + 1)
            E.pullback(t, g, idx, offsets, optimizer=opt)
            G = dense_grad(len(table), idx, offsets, g)
            touched = np.zeros(len(table), bool)
            touched[idx] = True
            state[touched] += (G[touched] ** 2).mean(1)
            ref[touched] -= 0.1 * G[touched] / (np.sqrt(state[touched])[:, None] + 1e-6)
        np.testing.assert_allclose(opt.state(t), state, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(t.data, ref, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(cases(), st.booleans())
def test_sparse_gradient_rows_are_unique_and_correct(case, weighted):
    table, idx, offsets, grad, weights, threads = case
    with numba_threads(threads):
        w = weights if weighted else None
        rows, vals = E.sparse_gradient(E.SimpleEmbedding(table), grad, idx, offsets, weights=w)
        assert len(set(rows.tolist())) == len(rows) == len(set(idx.tolist()))
        G = dense_grad(len(table), idx, offsets, grad, w)
        # float32 sums of many terms that cancel err in proportion to the terms' magnitudes, not
        # to the sum's: the bound scales with the sum of absolute terms
        S = dense_grad(len(table), idx, offsets, np.abs(grad), None if w is None else np.abs(w))
        err = np.abs(vals - G[rows])
        assert (err <= 1e-5 + 1e-5 * S[rows]).all(), float((err / (1e-5 + 1e-5 * S[rows])).max())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_table_gradient_agrees_with_jax_grad(mode):
    rng = np.random.default_rng(7)
    N, F = 12, 5
    table = rng.standard_normal((N, F)).astype(np.float32)
    idx = np.array([3, 3, 0, 11, 3, 5, 0, 7, 7, 7])
    offsets = np.array([0, 2, 2, 6, 10])
    w = rng.random(len(idx)).astype(np.float32)
    probe = rng.standard_normal((4, F)).astype(np.float32)  # loss = sum(probe * lookup)
    seg = np.repeat(np.arange(4), np.diff(offsets))
    counts = np.maximum(np.diff(offsets), 1).astype(np.float32)

    def loss(M):
        rows = M[idx] * w[:, None]
        out = jax.ops.segment_sum(rows, seg, num_segments=4)
        if mode == "mean":
            out = out / counts[:, None]
        return jnp.sum(probe * out)

    with jax.default_device(jax.devices("cpu")[0]):  # the reference, on the CPU also where a GPU exists
        want = np.asarray(jax.grad(loss)(jnp.asarray(table)))
        at_table = float(loss(jnp.asarray(table)))
    t = E.SimpleEmbedding(table.copy())
    E.pullback(t, probe, idx, offsets, mode=mode, weights=w, optimizer=E.SGD(1.0))
    np.testing.assert_allclose(table - t.data, want, rtol=1e-5, atol=1e-6)
    out = E.lookup(E.SimpleEmbedding(table), idx, offsets, mode=mode, weights=w)
    np.testing.assert_allclose((probe * out).sum(), at_table, rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_refused_and_table_unchanged(bad):
    table = np.ones((10, 4), np.float32)
    t = E.SimpleEmbedding(table.copy(), name="items")
    g = np.ones((3, 4), np.float32)
    g[2, 1] = bad
    with pytest.raises(FloatingPointError, match="items.*row 2"):
        E.pullback(t, g, [1, 2, 3], optimizer=E.SGD(0.1))
    assert np.array_equal(t.data, table)


@pytest.mark.parametrize("path", ["owner", "segments", "plan"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("row", [0, 17, 38, 39])
def test_first_non_finite_row_is_reported_and_nothing_written(path, threads, row):
    # owner-computes checks the gradient inside its kernels, each thread a share of the rows, and
    # segments of 5 indices apply the first before collecting the next: the check must cover
    # every row before anything is written, and report the first bad one.
    rng = np.random.default_rng(row)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    t = E.SimpleEmbedding(table.copy(), name="items")
    idx = rng.integers(0, 50, 120)
    offsets = np.arange(0, 121, 3)
    g = rng.standard_normal((40, 8)).astype(np.float32)
    g[row, 5] = np.nan
    g[min(row + 1, 39), 0] = np.inf
    with numba_threads(threads), sgd_path(path):
        with pytest.raises(FloatingPointError, match=f"items.*row {row};"):
            E.pullback(t, g, idx, offsets, optimizer=E.SGD(0.1))
        assert np.array_equal(t.data, table)
        g[row, 5] = g[min(row + 1, 39), 0] = 0.5  # the same batch, made finite, goes through
        E.pullback(t, g, idx, offsets, optimizer=E.SGD(0.1))
    want = table.copy()
    np.add.at(want, idx, -0.1 * np.repeat(g, 3, axis=0))
    np.testing.assert_allclose(t.data, want, rtol=1e-5, atol=1e-6)


def test_gradient_shape_and_dtype_checked():
    t = E.SimpleEmbedding(np.ones((10, 4), np.float32))
    with pytest.raises(ValueError):
        E.pullback(t, np.ones((2, 4), np.float32), [1, 2, 3], optimizer=E.SGD(0.1))
    with pytest.raises(TypeError):
        E.pullback(t, np.ones((3, 4), np.int32), [1, 2, 3], optimizer=E.SGD(0.1))


@pytest.mark.parametrize("dtype,tol", [(ml_dtypes.bfloat16, 1e-2), (np.float16, 1e-3)])
def test_low_precision_update_rounds_float32_result(dtype, tol):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((40, 16)).astype(dtype)
    idx = rng.integers(0, 40, (8, 5))
    g = rng.standard_normal((8, 16)).astype(np.float32)
    t = E.SimpleEmbedding(table.copy())
    E.pullback(t, g, idx, optimizer=E.SGD(0.5))
    want = table.astype(np.float32) - 0.5 * dense_grad(40, idx.reshape(-1), np.arange(0, 41, 5), g)
    np.testing.assert_allclose(t.data.astype(np.float32), want, rtol=tol, atol=tol)
    assert not np.array_equal(t.data, table)


@pytest.mark.parametrize("path", ["owner", "plan"])
@pytest.mark.parametrize("F", [16, 13])
def test_float64_tables_update_in_float64(path, F):
    rng = np.random.default_rng(6)
    table = rng.standard_normal((40, F))
    idx = rng.integers(0, 40, (8, 5))
    g = rng.standard_normal((8, F)).astype(np.float32)
    t = E.SimpleEmbedding(table.copy())
    with sgd_path(path):
        E.pullback(t, g, idx, mode="mean", optimizer=E.SGD(0.5))
    want = table - 0.5 * dense_grad(40, idx.reshape(-1), np.arange(0, 41, 5), g, mean=True)
    assert t.data.dtype == np.float64
    np.testing.assert_allclose(t.data, want, rtol=1e-6, atol=1e-6)


def test_reindexing_leaves_no_state_behind():
    t = E.SimpleEmbedding(np.zeros((50, 2), np.float32))
    for _ in range(3):
        E.pullback(t, np.ones((4, 2), np.float32), [[1, 1], [2, 49], [49, 49], [0, 1]], optimizer=E.SGD(1.0))
    want = np.zeros(50)
    np.add.at(want, np.array([1, 1, 2, 49, 49, 49, 0, 1]), -3.0)
    assert np.array_equal(t.data[:, 0], want)
    from embeddings.pullback import scratch_for
    assert (scratch_for(t) == -1).all()


@given(st.lists(st.integers(0, 9), max_size=30), st.integers(1, 12))
def test_owner_segments_cover_every_bag_once_in_order(sizes, most):
    from embeddings.pullback import owner_segments
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    segments = owner_segments(offsets, most)
    assert [b for b0, b1 in segments for b in range(b0, b1)] == list(range(len(sizes)))
    for b0, b1 in segments:
        assert b1 > b0 and (offsets[b1] - offsets[b0] <= most or b1 == b0 + 1)
