"""Lookups against numpy references: every form, feature sizes 1..300, batches from 0, 1-2 threads."""

import ml_dtypes

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embeddings as E
from helpers import numba_threads

FEATURES = st.one_of(st.integers(1, 300), st.sampled_from([8, 16, 32, 64, 128, 256]))


def ref_pooled(table, idx, offsets, weights=None, mean=False):
    """float64 numpy reference for a CSR pooled lookup."""
    t = table.astype(np.float64)
    out = np.zeros((len(offsets) - 1, t.shape[1]))
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        rows = t[idx[s:e]]
        if weights is not None:
            rows = rows * np.asarray(weights[s:e], np.float64)[:, None]
        out[b] = rows.sum(0)
        if mean and e > s:
            out[b] /= e - s
    return out


@st.composite
def batches(draw):
    """A table and a duplicate-heavy CSR batch (bag sizes 0..7, few distinct rows)."""
    F = draw(FEATURES)
    N = draw(st.integers(1, 40))
    B = draw(st.integers(0, 24))
    sizes = draw(st.lists(st.integers(0, 7), min_size=B, max_size=B))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    hot = draw(st.integers(1, N))  # indices drawn from only `hot` rows -> many duplicates
    # int32 indices with odd (run-time) sizes only: numba compiles a kernel per index type and
    # feature-size specialisation, and the index loads are the same code at every size
    idx = rng.integers(0, hot, offsets[-1]).astype(np.int32 if F % 2 else np.int64)
    table = rng.standard_normal((N, F)).astype(np.float32)
    weights = rng.standard_normal(offsets[-1]).astype(np.float32)
    threads = draw(st.sampled_from([1, 2]))
    return table, idx, offsets, weights, threads


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["sum", "mean"]), st.booleans())
def test_pooled_csr_matches_numpy(batch, mode, weighted):
    table, idx, offsets, weights, threads = batch
    with numba_threads(threads):
        w = weights if weighted else None
        got = E.lookup(E.SimpleEmbedding(table), idx, offsets, mode=mode, weights=w)
        want = ref_pooled(table, idx, offsets, w, mode == "mean")
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_non_reducing_is_exact_gather(batch):
    table, idx, _, _, threads = batch
    with numba_threads(threads):
        got = E.lookup(E.SimpleEmbedding(table), idx)
        assert np.array_equal(got, table[idx])


@settings(max_examples=30, deadline=None)
@given(FEATURES, st.integers(0, 20), st.integers(0, 6), st.sampled_from([1, 2]), st.sampled_from(["sum", "mean"]))
def test_fixed_width_equals_csr(F, B, k, threads, mode):
    with numba_threads(threads):
        rng = np.random.default_rng(F * 1000 + B * 10 + k)
        table = rng.standard_normal((30, F)).astype(np.float32)
        idx = rng.integers(0, 30, (B, k))
        w = rng.random((B, k)).astype(np.float32)
        t = E.SimpleEmbedding(table)
        got = E.lookup(t, idx, mode=mode, weights=w)
        offsets = np.arange(0, B * k + 1, k) if k else np.zeros(B + 1, np.int64)
        want = ref_pooled(table, idx.reshape(-1), offsets, w.reshape(-1), mode == "mean")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_lookup_into_strided_slice_touches_only_its_columns():
    rng = np.random.default_rng(1)
    T, F, B = 3, 16, 50
    big = np.full((B, (T + 1) * F), -7.0, np.float32)
    tables = [rng.standard_normal((100, F)).astype(np.float32) for _ in range(T)]
    idx = [rng.integers(0, 100, (B, 4)) for _ in range(T)]
    for t in range(T):
        view = big[:, (t + 1) * F:(t + 2) * F]
        assert E.lookup_into(view, E.SimpleEmbedding(tables[t]), idx[t]) is view
        np.testing.assert_allclose(view, tables[t][idx[t]].sum(1), rtol=1e-5, atol=1e-5)
    assert (big[:, :F] == -7.0).all()


def test_strided_outputs_and_gradients_reach_the_kernels_as_row_major_views():
    """A column slice goes to the kernels as the C-contiguous rows it lies in (same row addresses
    and stride), so no kernel is compiled again for its layout; other arrays pass unchanged."""
    from embeddings.kernels import lookup as K
    from embeddings.kernels import owner as O
    from embeddings.kernels import update as U
    from embeddings.kernels.rowaccess import row_major
    big = np.arange(5 * 48, dtype=np.float32).reshape(5, 48)
    col = big[:, 16:32]
    v = row_major(col)
    assert v.flags.c_contiguous and v.shape == (5, 48) and v.strides == col.strides
    assert v.ctypes.data == col.ctypes.data and np.array_equal(v[:, :16], col)
    big.flags.writeable = False
    assert not row_major(big[:, 16:32]).flags.writeable
    for a in (big, big[:, ::2], big[:0, 16:32], np.zeros(4, np.float32)):
        assert row_major(a) is a
    rng = np.random.default_rng(5)
    t = E.SimpleEmbedding(rng.standard_normal((30, 16)).astype(np.float32))
    out = np.zeros((6, 48), np.float32)
    E.lookup_into(out[:, 16:32], t, rng.integers(0, 30, (6, 3)))
    E.lookup_into(out[:, 16:32], t, rng.integers(0, 30, 6))
    g = E.aligned_empty((6, 48))  # the slice's rows on lines, so the planned update reads them in place
    g[...] = rng.standard_normal((6, 48))
    idx = rng.integers(0, 30, (6, 3))
    for opt in (E.SGD, E.RowwiseAdagrad):  # owner-computes, and the planned update
        strided, dense = E.SimpleEmbedding(t.data.copy()), E.SimpleEmbedding(t.data.copy())
        E.pullback(strided, g[:, 16:32], idx, mode="sum", optimizer=opt(0.1))
        E.pullback(dense, np.ascontiguousarray(g[:, 16:32]), idx, mode="sum", optimizer=opt(0.1))
        assert not np.array_equal(strided.data, t.data)
        np.testing.assert_array_equal(strided.data, dense.data)
    for kernel in (K.pooled_serial, K.gather_serial, O.apply_owned_serial, U.apply_update_serial):
        assert kernel.signatures and all("'A'" not in str(sig) for sig in kernel.signatures)


def test_empty_bags_give_zero_rows_also_for_mean():
    table = np.ones((5, 4), np.float32)
    got = E.lookup(E.SimpleEmbedding(table), np.array([1, 2]), np.array([0, 0, 2, 2]), mode="mean")
    assert np.array_equal(got, np.array([[0] * 4, [1] * 4, [0] * 4], np.float32))
    assert not np.isnan(got).any()


def test_batch_zero_and_one():
    t = E.SimpleEmbedding(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert E.lookup(t, np.array([], np.int64)).shape == (0, 4)
    assert E.lookup(t, np.array([], np.int64), np.array([0])).shape == (0, 4)
    assert np.array_equal(E.lookup(t, np.array([[2]])), [[8, 9, 10, 11]])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float64])
def test_low_precision_storage_accumulates_in_float32(dtype):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((64, 16)).astype(dtype)  # 16: the size the other low-precision tests use
    idx = rng.integers(0, 64, (20, 9))
    t = E.SimpleEmbedding(table)
    assert t.eltype() == np.dtype(dtype)
    got = E.lookup(t, idx)
    assert got.dtype == np.float32
    want = table.astype(np.float32)[idx].astype(np.float64).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(E.lookup(t, idx[:, 0]), table[idx[:, 0]].astype(np.float32))


def test_protocol_functions():
    data = np.zeros((7, 3), np.float32)
    t = E.SimpleEmbedding(data, name="users")
    assert (E.eltype(t), E.featuresize(t), E.nvectors(t)) == (np.float32, 3, 7)
    assert E.example(t) is data
    with t.rows(E.FORWARD) as src:
        assert src.base is data and src.slots is None


def test_array_like_objects_go_through_the_hook():
    class Wrapped:  # stands in for a CachedArray: only __array__
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    a = np.arange(20, dtype=np.float32).reshape(5, 4)
    w = Wrapped(a)
    t = E.SimpleEmbedding(w)
    assert E.example(t) is w
    assert np.array_equal(E.lookup(t, [4, 0]), a[[4, 0]])
    E.pullback(t, np.ones((1, 4), np.float32), [3], optimizer=E.SGD(1.0))
    assert np.array_equal(a[3], np.arange(12, 16) - 1)


def test_array_like_that_only_copies_is_readable_but_refuses_updates():
    class CopyOnly:  # like a CachedArray outside a status view: __array__ must copy
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            if copy is False:
                raise ValueError("no view without a copy")
            return self.a.copy()

    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    t = E.SimpleEmbedding(CopyOnly(a))
    assert np.array_equal(E.lookup(t, [2, 2]), a[[2, 2]])
    with pytest.raises(TypeError, match="in place"):
        E.pullback(t, np.ones((1, 2), np.float32), [1], optimizer=E.SGD(1.0))
    assert np.array_equal(a, np.arange(8, dtype=np.float32).reshape(4, 2))


@pytest.mark.parametrize("F", [8, 16, 32, 64, 128, 256])
def test_every_specialised_size_matches_numpy_with_unaligned_output(F):
    """Each compile-time feature size (8- and 16-wide vector code) for every lookup form, writing
    into rows that start 4 bytes off a cache line, and the fused SGD update."""
    rng = np.random.default_rng(F)
    table = rng.standard_normal((50, F)).astype(np.float32)
    t = E.SimpleEmbedding(table.copy())
    offsets = np.array([0, 9, 9, 10, 17], np.int64)  # bags of 9 (4 + 4 + 1), 0, 1, 7
    idx = rng.integers(0, 50, offsets[-1])
    w = rng.random(offsets[-1]).astype(np.float32)
    wide = np.zeros((4, F + 1), np.float32)
    out = wide[:, 1:]  # rows 4 bytes into each row of `wide`
    for mode, weights in (("sum", None), ("mean", None), ("sum", w)):
        E.lookup_into(out, t, idx, offsets, mode=mode, weights=weights)
        np.testing.assert_allclose(out, ref_pooled(table, idx, offsets, weights, mode == "mean"), rtol=1e-5, atol=1e-5)
        assert (wide[:, 0] == 0).all()
    flat = np.zeros((idx.size, F + 1), np.float32)
    E.lookup_into(flat[:, 1:], t, idx)
    assert np.array_equal(flat[:, 1:], table[idx])
    g = rng.standard_normal((4, F)).astype(np.float32)
    E.pullback(t, g, idx, offsets, optimizer=E.SGD(0.5))
    want = table.copy()
    for b in range(4):
        for p in range(offsets[b], offsets[b + 1]):
            want[idx[p]] -= 0.5 * g[b]
    np.testing.assert_allclose(t.data, want, rtol=1e-5, atol=1e-5)


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8]))
def test_aligned_empty_starts_on_a_cache_line(shape, dtype):
    a = E.aligned_empty(tuple(shape), dtype)
    assert a.shape == tuple(shape) and a.dtype == dtype
    assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
    a[...] = 1  # the whole array is usable memory
    assert a.sum() == a.size


def test_allocating_lookups_return_aligned_arrays():
    # numpy's own buffers are 16-byte aligned, so one lookup could land on 64 bytes by chance
    # (1 in 4); twelve sizes in a row cannot
    rng = np.random.default_rng(0)
    data = rng.standard_normal((50, 16)).astype(np.float32)
    t = E.SimpleEmbedding(data)
    ens = E.Ensemble([t, E.SimpleEmbedding(data.copy())])
    for n in range(1, 13):
        idx = rng.integers(0, 50, 7 * n)
        out = E.lookup(t, idx)
        assert out.ctypes.data % 64 == 0 and np.array_equal(out, data[idx])
        both = ens.lookup([idx, idx])
        assert both.ctypes.data % 64 == 0 and np.array_equal(both[:, 1], data[idx])


@pytest.mark.parametrize("threads", [1, 2])
def test_streaming_gather_is_exact_and_only_for_aligned_rows(threads, monkeypatch):
    """Non-reducing lookups into large outputs use non-temporal stores (every row must start on
    a cache line): with the size threshold at 0, every specialised size gathers exactly into an
    aligned output, and outputs whose rows are not all on a cache line take the normal path."""
    from embeddings import config
    from embeddings.lookup import streams

    monkeypatch.setattr(config, "STREAM_MIN_BYTES", 0)
    rng = np.random.default_rng(threads)
    with numba_threads(threads):
        for F in (8, 16, 20, 24, 32, 48, 64, 128, 256):  # 20, 24, 48: generic kernel, which ignores the flag
            table = rng.standard_normal((300, F)).astype(np.float32)
            t = E.SimpleEmbedding(table)
            idx = rng.integers(0, 300, 1000)
            out = E.aligned_empty((idx.size, F))
            assert streams(out) == (F % 16 == 0)  # else every other row is off a cache line
            E.lookup_into(out, t, idx)
            assert np.array_equal(out, table[idx])
            pad = -F % 16
            wide = E.aligned_empty((idx.size, 16 + F + pad))
            for view in (wide[:, 16:16 + F], wide[:, :F]):  # strided, every row on a cache line
                assert streams(view)
                view[...] = 0
                E.lookup_into(view, t, idx)
                assert np.array_equal(view, table[idx])
            off = E.aligned_empty((idx.size * F + 4,))[4:].reshape(idx.size, F)  # 16 bytes off
            assert not streams(off)
            E.lookup_into(off, t, idx)
            assert np.array_equal(off, table[idx])
    monkeypatch.setattr(config, "STREAM_MIN_BYTES", 4 << 20)
    assert not streams(E.aligned_empty((100, 64))) and streams(E.aligned_empty((16384, 64)))
    big = E.aligned_empty((16384, 64))  # 4 MB at the threshold: streamed, and exact
    table = rng.standard_normal((1000, 64)).astype(np.float32)
    idx = rng.integers(0, 1000, 16384)
    E.lookup_into(big, E.SimpleEmbedding(table), idx)
    assert np.array_equal(big, table[idx])


def test_large_aligned_lookups_reach_the_kernel_as_streaming(monkeypatch):
    """The exactness test above passes whether or not streaming happens; this one checks the
    wiring: ``run_lookup`` hands ``stream=True`` to the gather kernel exactly for outputs that
    ``streams`` accepts, and that kernel's compiled code holds non-temporal stores."""
    from embeddings import config
    from embeddings.kernels import lookup as K

    monkeypatch.setattr(config, "STREAM_MIN_BYTES", 1 << 12)
    seen = []
    real = K.gather_serial
    monkeypatch.setattr(K, "gather_serial", lambda *a: (seen.append(a[-1]), real(*a)))
    table = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    t = E.SimpleEmbedding(table)
    idx = np.arange(100) % 7
    big, small = E.aligned_empty((100, 64)), E.aligned_empty((10, 64))  # 25.6 KB and 2.5 KB
    shifted = E.aligned_empty((100 * 64 + 4,))[4:].reshape(100, 64)
    for out, want in ((big, True), (small, False), (shifted, False)):
        E.lookup_into(out, t, idx[:out.shape[0]])
        assert seen.pop() is want and np.array_equal(out, table[idx[:out.shape[0]]])

    # the stores themselves: compiled fresh (numba cannot show the code of cached kernels)
    from embeddings.kernels.intrinsics import address_as_pointer
    from embeddings.kernels.rowaccess import spec_for
    from embeddings.kernels.simd import vcopy_stream

    @numba.njit
    def copy_row(spec, dst, src):
        vcopy_stream(spec, address_as_pointer(dst.ctypes.data, dst), address_as_pointer(src.ctypes.data, src))

    for F in (8, 64):  # an odd 8-float tail, and 16-float vectors
        dst, src = E.aligned_empty((F,)), np.arange(F, dtype=np.float32)
        copy_row(spec_for(F), dst, src)
        assert np.array_equal(dst, src)
    ir = "".join(copy_row.inspect_llvm().values())
    assert ir.count("!nontemporal") >= 1 + 4  # every store of both: one 8-wide, four 16-wide


@pytest.mark.parametrize("threads", [1, 2])
def test_bags_of_one_run_as_a_gather(threads, monkeypatch):
    """Pooled lookups with exactly one index per bag and no weights ((batch, 1) indices, or CSR
    offsets 0..n) reach the gather kernel and equal the rows, for sum and mean, alone and in an
    ensemble; n indices in n bags with an empty bag, or weights, stay pooled."""
    from embeddings.batch import make_bags
    from embeddings.kernels import ensemble as KE
    from embeddings.kernels import lookup as K

    rng = np.random.default_rng(threads)
    table = rng.standard_normal((40, 64)).astype(np.float32)
    t = E.SimpleEmbedding(table)
    idx = rng.integers(0, 40, 30)
    calls = []
    for name in ("gather", "gather_serial", "pooled", "pooled_serial"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, real=real, name=name: (calls.append(name), real(*a)))
    real_eg = KE.ensemble_gather
    monkeypatch.setattr(KE, "ensemble_gather", lambda *a: (calls.append("ensemble_gather"), real_eg(*a)))
    with numba_threads(threads):
        for mode in ("sum", "mean"):
            for args in ((idx.reshape(-1, 1),), (idx, np.arange(31))):
                assert make_bags("t", 40, *args, mode=mode).singles()
                calls.clear()
                assert np.array_equal(E.lookup(t, *args, mode=mode), table[idx])
                assert calls and calls[0].startswith("gather")
        ens = E.Ensemble([t, E.SimpleEmbedding(table[::-1].copy())])
        calls.clear()
        both = ens.lookup([idx.reshape(-1, 1), idx.reshape(-1, 1)], mode="sum")
        assert np.array_equal(both[:, 0], table[idx]) and np.array_equal(both[:, 1], table[::-1][idx])
        assert calls == (["ensemble_gather"] if threads > 1 else ["gather_serial"] * 2)
        holes = np.array([0, 0, 2] + list(range(3, 31)))  # 30 indices in 30 bags, the first one empty
        w = np.ones(30, np.float32)
        for args, kw in (((idx, holes), {}), ((idx, np.arange(31)), {"weights": w})):
            assert not make_bags("t", 40, *args, weights=kw.get("weights"), mode="sum").singles()
            calls.clear()
            got = E.lookup(t, *args, mode="sum", **kw)
            assert calls and calls[0].startswith("pooled")
            np.testing.assert_allclose(got, ref_pooled(table, idx, args[1]), rtol=1e-6, atol=1e-6)
