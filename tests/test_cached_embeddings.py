"""CachedEmbeddings: equivalence with a plain table under lookups, updates and flushes, the
pointer-table invariants, concurrency of caching, policies, bad input and telemetry."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from embeddings import SGD, CachedEmbeddings, Ensemble, RowwiseAdagrad, SimpleEmbedding, lookup, pullback
from embeddings import distributions as D
from helpers import numba_threads, sgd_path


def manager():
    return ca.Manager(ca.DRAM("32MiB"), ca.PM(None, "64MiB"), policy=ca.LRUPolicy())


def base_of(t):
    with ca.readable(t.base_array) as b:
        return b.copy()


# F: rows of one float, a run-time size and a specialised one (the kernels compile per size)
@settings(max_examples=12, deadline=None)
@given(policy=st.sampled_from(["simple", "static", "dynamic"]), F=st.sampled_from([1, 5, 64]),
       seed=st.integers(0, 2**31), second_chance=st.booleans(), adagrad=st.booleans(), admit=st.integers(1, 3),
       threads=st.sampled_from([1, 2]))
def test_hundred_iterations_match_a_simple_table(policy, F, seed, second_chance, adagrad, admit, threads):
    with numba_threads(threads):  # 2: the parallel caching, counting and update kernels, however small the batch
        _hundred_iterations(policy, F, seed, second_chance, adagrad, admit)


def _hundred_iterations(policy, F, seed, second_chance, adagrad, admit):
    rng = np.random.default_rng(seed)
    N = 257
    data = rng.standard_normal((N, F)).astype(np.float32)
    m = manager()
    t = CachedEmbeddings(data.copy(), m, policy=policy, cache_rows=int(rng.integers(8, 64)), page_rows=4,
                         cacheslack=int(rng.integers(1, 8)), second_chance=second_chance, seed=seed, admit=admit,
                         age_window=float(rng.choice([0.5, 10.0])))
    ref = SimpleEmbedding(data.copy())
    make = (lambda: RowwiseAdagrad(lr=0.05)) if adagrad else (lambda: SGD(lr=0.1))
    opt_t, opt_r = make(), make()
    for it in range(100):
        batch = int(rng.integers(0, 12))
        k = int(rng.integers(1, 5))
        idx = D.zipf(N, (batch, k), 1.2, seed=seed + it) if rng.random() < 0.7 else rng.integers(0, N, (batch, k))
        op = rng.random()
        if op < 0.45:
            mode = ["sum", "mean", None][int(rng.integers(0, 3))]
            a = lookup(t, idx.ravel()) if mode is None else lookup(t, idx, mode=mode)
            b = lookup(ref, idx.ravel()) if mode is None else lookup(ref, idx, mode=mode)
            np.testing.assert_array_equal(a, b)
        elif op < 0.85:
            g = rng.standard_normal((batch, F)).astype(np.float32)
            pullback(t, g, idx, mode="sum", optimizer=opt_t)
            pullback(ref, g, idx, mode="sum", optimizer=opt_r)
        else:
            t.flush_dirty(int(rng.integers(0, 40)))
        t.check()
    t.flush_dirty(0)
    t.check()
    np.testing.assert_array_equal(base_of(t), ref.data)
    t.close()
    m.check()


def test_ensemble_of_cached_and_plain_tables_matches_per_table_calls():
    rng = np.random.default_rng(3)
    m = manager()
    datas = [rng.standard_normal((500, 16)).astype(np.float32) for _ in range(3)]
    tables = [CachedEmbeddings(datas[0].copy(), m, cache_rows=50), SimpleEmbedding(datas[1].copy()),
              CachedEmbeddings(datas[2].copy(), m, policy="static", cache_rows=100)]
    refs = [SimpleEmbedding(d.copy()) for d in datas]
    ens, ens_ref = Ensemble(tables), Ensemble(refs)
    opt, opt_ref = SGD(lr=0.1), SGD(lr=0.1)
    for it in range(20):
        idx = [D.zipf(500, (64, 3), 1.0, seed=it, table=j) for j in range(3)]
        np.testing.assert_array_equal(ens.lookup(idx, mode="sum"), ens_ref.lookup(idx, mode="sum"))
        g = rng.standard_normal((64, 3, 16)).astype(np.float32)
        ens.pullback(g, idx, mode="sum", optimizer=opt)
        ens_ref.pullback(g, idx, mode="sum", optimizer=opt_ref)
        for t in tables:
            if isinstance(t, CachedEmbeddings):
                t.check()
    for t, r in zip(tables, refs):
        if isinstance(t, CachedEmbeddings):
            t.flush_dirty(0)
            np.testing.assert_array_equal(base_of(t), r.data)
        else:
            np.testing.assert_array_equal(t.data, r.data)


CONCURRENT = r"""
import numba, numpy as np, cachedarrays as ca
from embeddings import CachedEmbeddings, SimpleEmbedding, SGD, config, lookup, pullback
assert numba.get_num_threads() == {threads}, numba.get_num_threads()
config.SERIAL_WORK = 0  # every pass in parallel chunks, however small
rng = np.random.default_rng(0)
m = ca.Manager(ca.DRAM("32MiB"), ca.PM(None, "64MiB"), policy=ca.LRUPolicy())
data = rng.standard_normal((4000, 32)).astype(np.float32)
t = CachedEmbeddings(data.copy(), m, cache_rows=600, page_rows=16)
ref = SimpleEmbedding(data.copy())
opt, opt_ref = SGD(lr=0.01), SGD(lr=0.01)
for it in range(30):
    idx = rng.integers(0, 40, size=(2000, 8))  # every thread fights over the same 40 hot rows
    idx[::7] = rng.integers(0, 4000, size=(idx[::7].shape))
    assert np.array_equal(lookup(t, idx, mode="sum"), lookup(ref, idx, mode="sum"))
    t.check()
    ptr = t._ptr
    cached = np.flatnonzero(ptr & 1)
    assert len(set((ptr[cached] >> 2).tolist())) == cached.size  # one copy per row, one row per slot
    g = rng.standard_normal((2000, 32)).astype(np.float32)
    pullback(t, g, idx, mode="sum", optimizer=opt)
    pullback(ref, g, idx, mode="sum", optimizer=opt_ref)
t.flush_dirty(0)
with ca.readable(t.base_array) as b:
    assert np.array_equal(b, ref.data)  # no update lost
print("ok", t.telemetry()["rows_cached"])
"""


@pytest.mark.parametrize("threads", [2, 8])
def test_many_threads_cache_and_update_the_same_hot_rows(threads):
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CONCURRENT.format(threads=threads)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_bad_indices_are_refused_before_anything_is_cached():
    m = manager()
    t = CachedEmbeddings(np.ones((100, 8), np.float32), m, cache_rows=10, name="users")
    before = t._ptr.copy()
    with pytest.raises(IndexError, match="users"):
        lookup(t, np.array([[1, 2], [3, 100]]), mode="sum")
    with pytest.raises(IndexError):
        lookup(t, np.array([-1]))
    with pytest.raises(TypeError):
        lookup(t, np.array([1.5, 2.0]))
    assert np.array_equal(t._ptr, before) and t.cached_rows == 0 and t.counts.sum() == 0
    t.check()


@pytest.mark.parametrize("path", ["owner", "segments", "plan"])
def test_non_finite_gradient_leaves_a_cached_table_untouched(path):
    m = manager()
    data = np.arange(100 * 8, dtype=np.float32).reshape(100, 8)
    t = CachedEmbeddings(data.copy(), m, cache_rows=40, page_rows=4, name="users")
    idx = np.array([3, 7, 7, 50, 99, 3])
    lookup(t, idx)  # caches these rows, clean
    ptr, counts = t._ptr.copy(), t.counts.copy()
    g = np.ones((6, 8), np.float32)
    g[4, 2] = np.inf
    with sgd_path(path), pytest.raises(FloatingPointError, match="users.*row 4"):
        pullback(t, g, idx, optimizer=SGD(0.5))
    # refused before the Update context: nothing counted, nothing dirty, every copy unchanged
    assert np.array_equal(t._ptr, ptr) and np.array_equal(t.counts, counts)
    t.check()
    t.flush_clean()  # raises if the refused update had marked the cache dirty
    assert np.array_equal(np.asarray(lookup(t, np.arange(100))), data)


def test_table_5_4_api_and_flush_rules():
    m = manager()
    t = CachedEmbeddings(np.arange(2000 * 4, dtype=np.float32).reshape(2000, 4), m, cache_rows=100, page_rows=10,
                         cacheslack=30, admit=1)  # the dissertation's rules: every miss is cached
    assert (t.cachelower, t.cacheslack) == (70, 30) and not t.isfull()
    lookup(t, np.arange(150))
    assert t.isfull() and t.cached_rows == 100
    tel = t.telemetry()
    assert tel["misses"] == 150 and tel["rows_cached"] == 100 and tel["bytes_slow_to_fast"] == 100 * 16
    cached = np.flatnonzero(t._ptr & 1)
    assert cached.size == 100 and cached.max() < 150
    t.access(cached)  # counts without caching
    assert t.telemetry()["hits"] == 100
    lookup(t, np.arange(150, 160))  # full: the oldest pages are flushed first, then these are cached
    assert 70 < t.cached_rows <= 80 and t.telemetry()["flushes"] == 1
    t.flush_clean()
    assert t.cached_rows <= 70
    pullback(t, np.ones((5, 4), np.float32), np.array([[95], [96], [97], [98], [99]]), mode="sum", optimizer=SGD(lr=1))
    with pytest.raises(ValueError, match="flush_dirty"):
        t.flush_clean()
    t.flush_dirty(0)
    assert t.cached_rows == 0 and t.telemetry()["rows_written_back"] > 0
    assert base_of(t)[99, 0] == 99 * 4 - 1  # the update reached the base table
    t.set_cachelower(50)
    t.set_cacheslack(10)
    assert t.state[2] == 60
    with pytest.raises(ValueError, match="cachelower"):
        t.set_cacheslack(1000)
    moved = m.telemetry()["bytes_moved"]
    assert moved["PM->DRAM"] >= 100 * 16 and moved["DRAM->PM"] > 0  # the manager saw the row copies
    t.check()
    t.close()
    m.check()


def test_admission_filter_caches_a_miss_only_once_the_row_is_frequent():
    m = manager()
    t = CachedEmbeddings(np.zeros((1000, 4), np.float32), m, cache_rows=100, page_rows=10, cacheslack=30,
                         admit=2, age_window=4)
    lookup(t, np.arange(100))  # filling: every miss is cached, whatever its count
    assert t.cached_rows == 100 and t.isfull()
    lookup(t, np.array([500]))  # full: flush to cachelower, then the filter applies; seen once: not cached
    assert t.cached_rows <= 70 and not t._ptr[500] & 1
    lookup(t, np.array([500, 501]))  # 500 now seen twice: cached; 501 once: not
    assert t._ptr[500] & 1 and not t._ptr[501] & 1
    np.testing.assert_array_equal(t._freq[[500, 501, 502]], [2, 1, 0])
    lookup(t, np.full(400 - 103, 7))  # 400 accesses in all = age_window * (cachelower + cacheslack): halved
    assert t._freq[500] == 1 and t._freq[7] == 255 // 2  # counts saturate at 255
    lookup(t, np.array([501]))  # its second access, but the halving forgot the first
    assert not t._ptr[501] & 1
    t.flush_clean(0)  # an empty cache fills again without the filter
    lookup(t, np.array([900]))
    assert t._ptr[900] & 1
    t.check()
    t.close()


def test_dynamic_policy_with_admit_1_caches_every_miss_while_room_lasts():
    m = manager()
    t = CachedEmbeddings(np.zeros((1000, 4), np.float32), m, cache_rows=100, page_rows=10, cacheslack=30, admit=1)
    lookup(t, np.arange(100))
    lookup(t, np.array([500]))
    assert t._ptr[500] & 1
    t.check()
    with pytest.raises(ValueError, match="admit"):
        CachedEmbeddings(np.zeros((10, 4), np.float32), m, admit=0)


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_hit_and_miss_counts_are_exact_for_every_lookup_kernel(policy, monkeypatch):
    from embeddings import config
    monkeypatch.setattr(config, "SERIAL_WORK", 1 << 10)  # small batches serial, larger ones parallel
    m = ca.Manager(ca.DRAM("64MiB"), ca.PM(None, "64MiB"), policy=ca.LRUPolicy())
    rng = np.random.default_rng(3)
    N = 3000
    tables = [CachedEmbeddings(rng.standard_normal((N, F)).astype(np.float32), m, policy=policy, cache_rows=300,
                               page_rows=16, seed=i, name=f"t{i}") for i, F in enumerate([16, 16, 12])]
    ens = Ensemble(tables[:2])
    for it in range(12):
        batch, k = int(rng.integers(1, 300)), int(rng.integers(1, 6))
        idx = [D.zipf(N, (batch, k), 1.1, seed=it, table=t) for t in range(2)]
        cached = [t._ptr.copy() & 1 for t in tables]  # hits are rows cached before the lookup
        before = [t.counts[:2].copy() for t in tables]
        w = rng.random((batch, k)).astype(np.float32)
        if it % 3 == 0:
            ens.lookup(idx, mode="sum")
        elif it % 3 == 1:
            ens.lookup(idx, mode="mean", weights=[w, w])
        else:
            ens.lookup([i.ravel() for i in idx])  # non-reducing
        lookup(tables[2], idx[0], mode="sum")  # a feature size without a specialised kernel
        for t, c, b, i in zip(tables, cached, before, [idx[0], idx[1], idx[0]]):
            hits = int(c[i.ravel()].sum())
            got = t.counts[:2] - b
            if policy == "static":
                np.testing.assert_array_equal(got, [hits, i.size - hits])
            else:  # the access may flush first; a row cached by its first access hits on its later ones
                assert got.sum() == i.size and 0 <= got[0] <= hits + i.size - np.unique(i).size
    if policy == "static":  # one table serving two features: nested blocks, each lookup counted once
        t, idx = tables[0], [D.zipf(N, (500, 3), 1.1, seed=99, table=t) for t in range(2)]
        before, cached = t.counts[:2].copy(), t._ptr & 1
        Ensemble([t, t]).lookup(idx, mode="sum")
        hits = int(cached[idx[0]].sum() + cached[idx[1]].sum())
        np.testing.assert_array_equal(t.counts[:2] - before, [hits, 3000 - hits])
    for t in tables:
        t.check()
        t.close()


def test_cache_lives_in_the_fast_device_and_base_in_the_slow_one():
    m = manager()
    base = ca.CachedArray(np.zeros((1000, 16), np.float32), m)  # placed in DRAM by the policy
    t = CachedEmbeddings(base, cache_rows=100)
    assert m.primary(base.object).device is m.slow
    assert m.fast.used_bytes >= 100 * 64 + 1000 * 8  # cache pages and pointer table
    with pytest.raises(ca.PinnedError):
        ca.evict(t._pins[1])  # cache pages are pinned while the table is open
    t.close()
    assert not m.pinned(base.object)


def test_static_policy_fills_once_and_never_caches_again():
    m = manager()
    hot = np.arange(0, 200, 2)
    t = CachedEmbeddings(np.zeros((1000, 8), np.float32), m, policy="static", cache_rows=100, hot=hot)
    assert t.cached_rows == 100 and np.all(t._ptr[hot] & 1)
    lookup(t, np.arange(1, 200, 2))
    lookup(t, hot)
    tel = t.telemetry()
    assert t.cached_rows == 100 and tel["hits"] == 100 and tel["misses"] == 100
    t.check()


def test_simple_policy_has_no_indirection():
    m = manager()
    t = CachedEmbeddings(np.ones((100, 8), np.float32), m, policy="simple")
    with t.rows(None) as src:
        assert src.slots is None and src.cache is None
    lookup(t, np.arange(10))
    assert t.telemetry()["misses"] == 10 and t.hitrate() == 0.0


def test_dynamic_policy_keeps_the_hot_rows_of_a_zipf_stream():
    m = manager()
    N = 50_000
    t = CachedEmbeddings(np.zeros((N, 8), np.float32), m, cache_fraction=0.1)
    for it in range(30):
        if it == 15:
            t.reset_counters()
        lookup(t, D.zipf(N, 4096, 1.0, seed=it))
    p = 1 / np.arange(1, N + 1)
    oracle = p[: N // 10].sum() / p.sum()
    assert t.hitrate() > 0.85 * oracle
    t.check()


def test_simple_embedding_over_a_cachedarray_pins_it_per_kernel_and_keeps_updates():
    m = manager()
    x = ca.CachedArray(np.ones((100, 8), np.float32), m)
    t = SimpleEmbedding(x)
    pullback(t, np.ones((2, 8), np.float32), np.array([[3], [4]]), mode="sum", optimizer=SGD(lr=0.5))
    assert not m.pinned(x.object)  # pinned only while the kernel ran
    np.testing.assert_array_equal(lookup(t, np.array([3, 5]))[:, 0], [0.5, 1.0])
    ca.evict(x)  # the policy may move it between kernel calls
    np.testing.assert_array_equal(lookup(t, np.array([4]))[0], np.full(8, 0.5, np.float32))


def test_pointer_table_holds_row_addresses_and_check_finds_every_corruption():
    from cachedarrays.errors import InvariantError
    m = manager()
    t = CachedEmbeddings(np.arange(400, dtype=np.float32).reshape(100, 4), m, policy="static", cache_rows=10,
                         hot=np.arange(10, 20), name="emb")
    t.check()
    ptr, rowbytes = t._ptr, 16
    assert ptr[0] >> 2 == t._base.ctypes.data and not ptr[0] & 1  # uncached: its own base row
    assert ptr[15] & 1 and (ptr[15] >> 2) - t._cache.ctypes.data == 5 * rowbytes  # sixth row cached
    good = ptr.copy()
    corruptions = {
        "uncached row points at a neighbour": (3, good[4]),
        "cached row points between cache rows": (12, good[12] + (4 << 2)),
        "cached row points at a free slot": (12, ((t._cache.ctypes.data + 11 * rowbytes) << 2) | 1),
        "two rows share a slot (back-edge disagrees)": (13, good[14]),
        "row left locked": (7, good[7] | 2),
    }
    for what, (row, value) in corruptions.items():
        ptr[row] = value
        with pytest.raises(InvariantError, match="emb"):
            t.check()
        ptr[:] = good
        t.check()
    t.close()


def test_ensemble_of_plain_and_cached_tables_agrees_with_table_by_table_calls():
    m = manager()
    rng = np.random.default_rng(5)
    datas = [rng.standard_normal((500, 16)).astype(np.float32) for _ in range(3)]
    mixed = Ensemble([SimpleEmbedding(datas[0].copy()), CachedEmbeddings(datas[1].copy(), m, cache_rows=60),
                      SimpleEmbedding(datas[2].copy())])
    refs = [SimpleEmbedding(d.copy()) for d in datas]
    for it in range(4):
        idx = [rng.integers(0, 500, size=(64, 3)) for _ in range(3)]
        out = mixed.lookup(idx, mode="sum")
        for i, r in enumerate(refs):
            np.testing.assert_allclose(out[:, i, :], lookup(r, idx[i], mode="sum"), rtol=1e-6, atol=1e-6)
        g = rng.standard_normal(out.shape).astype(np.float32)
        mixed.pullback(g, idx, mode="sum", optimizer=SGD(0.1))
        for i, r in enumerate(refs):
            pullback(r, g[:, i, :], idx[i], mode="sum", optimizer=SGD(0.1))
    for t, r in zip(mixed.tables, refs):
        np.testing.assert_allclose(lookup(t, np.arange(500)), r.data, rtol=1e-5, atol=1e-6)
    cached = mixed.tables[1]
    cached.check()
    cached.flush_dirty(0)
    with ca.readable(cached.base_array) as have:
        np.testing.assert_allclose(np.asarray(have), refs[1].data, rtol=1e-5, atol=1e-6)
