"""Reindexing by radix sort (the update plan of the backward pass) against the dense-map
reference and numpy, on tables small and large (one to three sort passes), 1 and 2 threads."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
import embeddings as E
from embeddings import config
from embeddings.kernels.reindex import (owner, plan_arrays, reindex_into, reindex_part, reindex_sort_serial,
                                        row_bits, sort_params)
from helpers import numba_threads, sgd_path

NVECS = [1, 2, 30, 2048, 2049, (1 << 21) + 5, (1 << 23) + 1]


@st.composite
def batches(draw):
    """(nvectors, idx, offsets, weights or None, mean): rows from a hot range at a random base, so
    that big tables get rows spread over many digits."""
    N = draw(st.sampled_from(NVECS))
    B = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(0, 8), min_size=B, max_size=B))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    L = int(offsets[-1])
    if draw(st.booleans()):
        idx = rng.integers(0, N, L)
    else:
        hot = rng.integers(0, N, draw(st.integers(1, 6)))
        idx = hot[rng.integers(0, len(hot), L)] if L else np.zeros(0, np.int64)
    if draw(st.booleans()):
        idx = idx.astype(np.int32)
    weights = rng.random(L).astype(np.float32) if draw(st.booleans()) else None
    return N, idx, offsets, weights, draw(st.booleans())


def reference(N, idx, offsets, weights, mean):
    """Plan from the dense-map kernel: (U, uniq, starts, bag, coef)."""
    L = idx.size
    need = weights is not None or mean
    uniq, counts, starts, bag, coef = plan_arrays(L, need)
    w = np.empty(0, np.float32) if weights is None else weights
    U = reindex_into(idx, offsets, w, mean, np.full(N, -1, np.int32), uniq, counts, starts, bag, coef)
    return U, uniq[:U], starts[:U + 1], bag, coef


def entries(uniq, starts, bag, coef):
    """{row: [(bag, coef), ...]} in CSR order."""
    return {int(r): list(zip(bag[starts[u]:starts[u + 1]].tolist(),
                             (coef[starts[u]:starts[u + 1]] if coef.size else np.ones(starts[u + 1] - starts[u])).tolist()))
            for u, r in enumerate(uniq)}


def _case(batch):
    """The dense map's plan of ``batch`` and the sizes a radix plan of it needs:
    ``(reference plan, L, need_coef, npass, dbits)``."""
    N, idx, offsets, weights, mean = batch
    return (reference(N, idx, offsets, weights, mean), idx.size, weights is not None or mean) + sort_params(N)


def test_sort_params_cover_the_row_bits():
    assert sort_params(1) == (0, 0) and sort_params(2) == (1, 1)
    assert sort_params(1_000_000) == (2, 10) and sort_params(2048) == (1, 11) and sort_params(2049) == (2, 6)
    for n in NVECS:
        npass, dbits = sort_params(n)
        assert npass * dbits >= row_bits(n) and dbits <= 11


@settings(max_examples=80, deadline=None)
@given(batches(), st.booleans())
def test_serial_radix_plan_matches_dense_map(batch, first_use):
    N, idx, offsets, weights, mean = batch
    (U, uniq, starts, bag, coef), L, need, npass, dbits = _case(batch)
    head = np.full(L, -1, np.int64)
    o_uniq, _, o_starts, o_bag, o_coef = plan_arrays(L, need)
    by_pos = first_use or weights is not None
    n = reindex_sort_serial(idx, offsets, np.empty(0, np.float32) if weights is None else weights, mean, npass,
                            dbits, first_use, np.empty(L, np.int64), np.empty(L, np.int64),
                            np.empty((npass, 1 << dbits), np.int64), np.empty(L if by_pos else 0, np.int32),
                            np.empty(L if by_pos and need else 0, np.float32), head, o_uniq, o_starts, o_bag, o_coef)
    assert n == U == len(set(idx.tolist()))
    assert (head == -1).all()
    if first_use:  # exactly the dense map's plan
        assert np.array_equal(o_uniq[:n], uniq) and np.array_equal(o_starts[:n + 1], starts)
        assert np.array_equal(o_bag, bag) and np.array_equal(o_coef, coef)
    else:
        assert (np.diff(o_uniq[:n]) > 0).all()
        assert entries(o_uniq[:n], o_starts, o_bag, o_coef) == entries(uniq, starts, bag, coef)
    assert o_starts[n] == L


@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(1, 5))
def test_partitioned_plans_split_rows_by_owner(batch, P):
    N, idx, offsets, weights, mean = batch
    (U, uniq, starts, bag, coef), L, need, npass, dbits = _case(batch)
    rb = row_bits(N)
    w = np.empty(0, np.float32) if weights is None else weights
    bagpos, coefpos = np.full(L if weights is not None else 0, -7, np.int32), np.empty(L if weights is not None else 0, np.float32)
    got = {}
    total = 0
    for t in range(P):
        p_uniq, _, p_starts, p_bag, p_coef = plan_arrays(L, need)
        n = reindex_part(idx, offsets, w, mean, t, P, rb, dbits, np.empty(L, np.int64), np.empty(L, np.int64),
                         np.empty((npass, 1 << dbits), np.int64), bagpos, coefpos, p_uniq, p_starts, p_bag, p_coef)
        rows = p_uniq[:n]
        assert (np.diff(rows) > 0).all()
        assert all(owner(int(r), P, rb) == t for r in rows)
        part = entries(rows, p_starts, p_bag, p_coef)
        assert not set(part) & set(got)
        got.update(part)
        total += n
    assert total == U
    assert got == entries(uniq, starts, bag, coef)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([(1 << 21) + 5, 3000]), st.sampled_from([1, 16, 40]), st.integers(0, 2**31),
       st.sampled_from([1, 2]), st.booleans(), st.booleans())
def test_pullback_on_large_tables_matches_numpy(N, F, seed, threads, adagrad, weighted):
    """Multi-pass sorts through both pullback paths (one plan; per-thread row ranges)."""
    rng = np.random.default_rng(seed)
    B, k = 50, 7
    table = rng.standard_normal((N, F)).astype(np.float32)
    idx = rng.integers(0, N, (B, k))
    idx[::3, :3] = idx[0, 0]  # duplicates across bags
    g = rng.standard_normal((B, F)).astype(np.float32)
    w = rng.random((B, k)).astype(np.float32) if weighted else None
    t = E.SimpleEmbedding(table.copy())
    with numba_threads(threads):
        opt = E.RowwiseAdagrad(lr=0.1, eps=1e-6) if adagrad else E.SGD(0.5)
        E.pullback(t, g, idx, weights=w, optimizer=opt)
    flat, ww = idx.reshape(-1), (np.ones(B * k) if w is None else w.reshape(-1).astype(np.float64))
    touched, at = np.unique(flat, return_inverse=True)
    G = np.zeros((touched.size, F))  # the touched rows' gradients (a dense one would be N x F)
    np.add.at(G, at, ww[:, None] * np.repeat(g.astype(np.float64), k, axis=0))
    want = table[touched].astype(np.float64)
    if adagrad:
        st_ = (G ** 2).mean(1)
        want -= 0.1 * G / (np.sqrt(st_)[:, None] + 1e-6)
        np.testing.assert_allclose(opt.state(t)[touched], st_, rtol=1e-4, atol=1e-6)
    else:
        want -= 0.5 * G
    np.testing.assert_allclose(t.data[touched], want, rtol=1e-4, atol=1e-5)
    untouched = np.setdiff1d(np.arange(min(N, 5000)), touched)
    assert np.array_equal(t.data[untouched], table[untouched])


def test_parallel_path_is_taken_for_large_batches_and_matches_serial(monkeypatch):
    """Above PARALLEL_REINDEX_MIN with 2 threads pullback reindexes per row range in one region."""
    from embeddings.kernels import update as U
    calls = []
    real = U.pullback_parts
    monkeypatch.setattr(U, "pullback_parts", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(3)
    table = rng.standard_normal((5000, 16)).astype(np.float32)
    idx = rng.integers(0, 5000, (300, 5))
    g = rng.standard_normal((300, 16)).astype(np.float32)
    a, b = E.SimpleEmbedding(table.copy()), E.SimpleEmbedding(table.copy())
    with numba_threads(2), sgd_path("plan"):  # small SGD batches would go owner-computes
        E.pullback(a, g, idx, mode="mean", optimizer=E.SGD(0.1))
    with numba_threads(1), sgd_path("plan"):
        E.pullback(b, g, idx, mode="mean", optimizer=E.SGD(0.1))
    assert calls == [1]
    np.testing.assert_allclose(a.data, b.data, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads,path", [(1, "plan"), (2, "plan"), (1, "owner"), (2, "owner")])
def test_cached_table_updates_through_pointer_table_in_every_path(threads, path):
    """CachedEmbeddings rows resolved through ``slots`` by the partitioned, the plan and the
    owner-computes kernels."""
    rng = np.random.default_rng(5)
    N, F = 600, 16
    data = rng.standard_normal((N, F)).astype(np.float32)
    m = ca.Manager(ca.DRAM("32MiB"), ca.PM(None, "64MiB"), policy=ca.LRUPolicy())
    t = E.CachedEmbeddings(data.copy(), m, cache_rows=64, page_rows=4)
    ref = E.SimpleEmbedding(data.copy())
    with numba_threads(threads), sgd_path(path):
        for it in range(20):
            idx = rng.integers(0, 80, (40, 4))
            idx[::5] = rng.integers(0, N, idx[::5].shape)
            E.lookup(t, idx, mode="sum")  # caches rows
            g = rng.standard_normal((40, F)).astype(np.float32)
            E.pullback(t, g, idx, optimizer=E.SGD(0.05))
            E.pullback(ref, g, idx, optimizer=E.SGD(0.05))
            t.check()
    t.flush_dirty(0)
    with ca.readable(t.base_array) as b:
        np.testing.assert_allclose(b, ref.data, rtol=1e-6, atol=1e-6)
    t.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_tables_too_large_for_packed_keys_fall_back_to_the_dense_map(monkeypatch, threads):
    """Rows >= 2**31 (or 2**32 indices) do not fit the packed key: the dense map builds the plan."""
    import importlib
    PB = importlib.import_module("embeddings.pullback")
    monkeypatch.setattr(PB, "sortable", lambda nvectors, nindices: False)
    rng = np.random.default_rng(11)
    table = rng.standard_normal((40, 8)).astype(np.float32)
    idx = rng.integers(0, 40, (30, 4))
    g = rng.standard_normal((30, 8)).astype(np.float32)
    t = E.SimpleEmbedding(table.copy())
    with numba_threads(threads), sgd_path("plan"):
        E.pullback(t, g, idx, mode="mean", optimizer=E.SGD(0.5))
        rows, vals = E.sparse_gradient(E.SimpleEmbedding(table), g, idx, mode="mean")
    G = np.zeros((40, 8))
    np.add.at(G, idx.reshape(-1), np.repeat(g.astype(np.float64), 4, axis=0) / 4)
    np.testing.assert_allclose(t.data, table - 0.5 * G, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vals, G[rows], rtol=1e-5, atol=1e-6)
    assert (PB.scratch_for(t) == -1).all()
