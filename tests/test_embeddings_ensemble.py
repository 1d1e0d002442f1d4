"""Ensembles agree with per-table calls, write in place, and validate every table first."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embeddings as E
from helpers import numba_threads


def make(T, N, F, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((N, F)).astype(np.float32) for _ in range(T)], rng


# T is part of the ensemble kernels' numba types (tuples of T arrays): one table, and several
# (2 and 3 would compile the same kernels twice more for no other difference). F: one run-time
# and one specialised size (the single-table tests cover every specialisation of the shared code)
@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 3]), st.sampled_from([3, 64]), st.integers(0, 30), st.integers(0, 5),
       st.sampled_from([1, 2]), st.sampled_from(["sum", "mean"]), st.booleans())
def test_ensemble_lookup_and_update_match_per_table(T, F, B, k, threads, mode, weighted):
    with numba_threads(threads):
        datas, rng = make(T, 25, F, T * 100 + B)
        idx = [rng.integers(0, rng.integers(1, 26), (B, k)) for _ in range(T)]
        w = [rng.random((B, k)).astype(np.float32) for _ in range(T)] if weighted else None
        tabs = [E.SimpleEmbedding(d.copy(), f"t{i}") for i, d in enumerate(datas)]
        refs = [E.SimpleEmbedding(d.copy()) for d in datas]
        ens = E.Ensemble(tabs)
        out = ens.lookup(idx, mode=mode, weights=w)
        assert out.shape == (B, T, F)
        for t in range(T):
            want = E.lookup(refs[t], idx[t], mode=mode, weights=None if w is None else w[t])
            np.testing.assert_allclose(out[:, t], want, rtol=1e-6, atol=1e-6)
        g = rng.standard_normal((B, T, F)).astype(np.float32)
        opt_e, opt_r = E.RowwiseAdagrad(0.1), E.RowwiseAdagrad(0.1)
        ens.pullback(g, idx, mode=mode, weights=w, optimizer=opt_e)
        for t in range(T):
            E.pullback(refs[t], g[:, t], idx[t], mode=mode, weights=None if w is None else w[t], optimizer=opt_r)
            np.testing.assert_allclose(tabs[t].data, refs[t].data, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(opt_e.state(tabs[t]), opt_r.state(refs[t]), rtol=1e-6)


def test_ensemble_csr_and_non_reducing():
    datas, rng = make(3, 40, 8, 0)
    ens = E.Ensemble([E.SimpleEmbedding(d) for d in datas])
    offs = [np.array([0, 2, 2, 5]), np.array([0, 0, 1, 1]), np.array([0, 3, 4, 6])]
    idx = [rng.integers(0, 40, o[-1]) for o in offs]
    out = ens.lookup(idx, offs)
    for t in range(3):
        np.testing.assert_allclose(out[:, t], E.lookup(ens.tables[t], idx[t], offs[t]), rtol=1e-6)
    flat = [rng.integers(0, 40, 7) for _ in range(3)]
    out = ens.lookup(flat)
    for t in range(3):
        assert np.array_equal(out[:, t], datas[t][flat[t]])


def test_ensemble_writes_into_dlrm_concatenation():
    T, F, B = 4, 16, 33
    datas, rng = make(T, 50, F, 1)
    ens = E.Ensemble([E.SimpleEmbedding(d) for d in datas])
    big = np.full((B, (T + 1) * F), 3.0, np.float32)
    view = big[:, F:].reshape(B, T, F)
    assert np.shares_memory(view, big)
    idx = [rng.integers(0, 50, (B, 6)) for _ in range(T)]
    ens.lookup_into(view, idx)
    assert (big[:, :F] == 3.0).all()
    for t in range(T):
        np.testing.assert_allclose(big[:, (t + 1) * F:(t + 2) * F], datas[t][idx[t]].sum(1), rtol=1e-5, atol=1e-5)


def test_ensemble_validates_all_tables_before_writing():
    datas, rng = make(3, 10, 4, 2)
    tabs = [E.SimpleEmbedding(d.copy(), f"t{i}") for i, d in enumerate(datas)]
    ens = E.Ensemble(tabs)
    idx = [np.array([[1, 2]]), np.array([[3, 4]]), np.array([[5, 10]])]
    out = np.full((1, 3, 4), 9.0, np.float32)
    with pytest.raises(IndexError, match="t2"):
        ens.lookup_into(out, idx)
    assert (out == 9.0).all()
    g = np.ones((1, 3, 4), np.float32)
    g[0, 1, 0] = np.nan
    with pytest.raises(FloatingPointError, match="t1"):
        ens.pullback(g, [np.array([[1, 2]])] * 3, optimizer=E.SGD(1.0))
    for t, d in zip(tabs, datas):
        assert np.array_equal(t.data, d)


def test_ensemble_requires_matching_tables():
    with pytest.raises(ValueError):
        E.Ensemble([E.SimpleEmbedding(np.zeros((3, 4), np.float32)), E.SimpleEmbedding(np.zeros((3, 5), np.float32))])
    with pytest.raises(TypeError):
        E.Ensemble([E.SimpleEmbedding(np.zeros((3, 4), np.float32)), E.SimpleEmbedding(np.zeros((3, 4), np.float64))])


@pytest.mark.parametrize("path", ["ascending", "dense map"])
def test_ensemble_update_plans_match_per_table(monkeypatch, path):
    """The ensemble's parallel reindexing (radix sort per table, in ascending row order above
    FIRST_USE_MAX; the dense maps for tables too large to sort) with weights on some tables only
    and mean pooling gives each table the same update as its own pullback."""
    from embeddings import config
    from embeddings import ensemble as ENS

    if path == "ascending":
        monkeypatch.setattr(config, "FIRST_USE_MAX", 0)
    else:
        monkeypatch.setattr(ENS, "sortable", lambda nvec, n: False)
    datas, rng = make(3, 60, 16, 7)
    tabs = [E.SimpleEmbedding(d.copy(), f"t{i}") for i, d in enumerate(datas)]
    refs = [E.SimpleEmbedding(d.copy()) for d in datas]
    offs = [np.array([0, 4, 4, 9, 30]), np.array([0, 1, 2, 3, 4]), np.array([0, 10, 20, 25, 26])]
    idx = [rng.integers(0, 60, o[-1]) for o in offs]
    w = [rng.random(offs[0][-1]).astype(np.float32), None, rng.random(offs[2][-1]).astype(np.float32)]
    g = rng.standard_normal((4, 3, 16)).astype(np.float32)
    with numba_threads(2):
        E.Ensemble(tabs).pullback(g, idx, offs, mode="mean", weights=w, optimizer=E.SGD(0.5))
    for t in range(3):
        E.pullback(refs[t], g[:, t], idx[t], offs[t], mode="mean", weights=w[t], optimizer=E.SGD(0.5))
        np.testing.assert_allclose(tabs[t].data, refs[t].data, rtol=1e-6, atol=1e-6)
        assert not np.array_equal(tabs[t].data, datas[t])
