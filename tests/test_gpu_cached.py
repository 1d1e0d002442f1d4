"""The GPU CachedEmbeddings (embeddings.gpu.cached): on a manager without a GPU its "device" is
numpy (the reference backend), which runs every line of the cache's logic on CI; the same tests
run against CuPy on a GPU manager where a GPU exists.

The reference for every lookup and update is the uncached GPU path (embeddings.gpu.ops over a
plain table on the same backend): resolving indices to cache slots must not change a single bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import embeddings as E
from cachedarrays import DRAM, PM, LRUPolicy, Manager, readable
from cachedarrays.devices import gpu as gpu_device
from embeddings.gpu import ops
from embeddings.gpu.backend import ReferenceBackend
from embeddings.gpu.cached import CachedEmbeddings, prefetch
from embeddings.kernels import cache as K

N, F = 400, 8


def host_manager(tmp_path=None) -> Manager:
    slow = PM(tmp_path, "8MiB") if tmp_path is not None else DRAM("8MiB", name="host")
    return Manager(DRAM("4MiB", name="fast"), slow, policy=LRUPolicy())


def zipf_batch(rng, nbags: int, k: int, n: int = N) -> np.ndarray:
    return ((rng.zipf(1.3, (nbags, k)) - 1) % n).astype(np.int64)


OPTIMIZERS = {"sgd": lambda: E.SGD(0.1), "sgd_any": lambda: E.SGD(0.1, deterministic=False),
              "adagrad": lambda: E.RowwiseAdagrad(0.1)}


def assert_gpu_same(got, want, opt: str, msg: object = None) -> None:
    """Bit for bit, except after any-order SGD on a GPU: there a row with several entries in a
    batch sums them in the order its atomic adds land (on the reference backend, in batch order)."""
    if opt == "sgd_any":  # rounding of sums of many entries: relative to the largest values
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-5 * float(np.abs(want).max()), err_msg=str(msg))
    else:
        assert np.array_equal(got, want), msg


def contents(t: CachedEmbeddings) -> np.ndarray:
    """The table as a reader sees it, without side effects: base rows, with every cached row taken
    from its device slot and updated staged rows from the staging area."""
    with readable(t.base_array) as v:
        out = np.array(v)
    W = t._W if isinstance(t._W, np.ndarray) else t._W.get()
    if t.policy != "simple":
        for p in range(int(t.state[K.TAIL]), int(t.state[K.HEAD])):
            s = p % t._ring
            out[t._backedge[s]] = W[s]
    if t._staged_dirty:
        out[t._staged] = W[t._ring:t._ring + t._staged.size]
    return out


def base_rows(t: CachedEmbeddings) -> np.ndarray:
    with readable(t.base_array) as v:
        return np.array(v)


class Reference:
    """The uncached GPU path on a plain table of the same backend."""

    def __init__(self, W: np.ndarray, be=None) -> None:
        self.be = be or ReferenceBackend()
        self.W = self.be.asarray(W.copy())
        self.state = self.be.asarray(np.zeros(W.shape[0], np.float32))

    def lookup(self, *args, **kw):
        return ops.lookup(self.be, "ref", self.W, *args, **kw)

    def pullback(self, grad, idx, offsets=None, *, optimizer, **kw):
        st_ = self.state if isinstance(optimizer, E.RowwiseAdagrad) else None
        ops.pullback(self.be, "ref", self.W, st_, grad, idx, offsets, optimizer=optimizer, **kw)


def _as_np(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


@pytest.mark.parametrize("policy", ["dynamic", "static", "simple"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_lookups_and_updates_equal_the_uncached_table_bit_for_bit(policy, opt):
    rng = np.random.default_rng(1)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = CachedEmbeddings(W0, m, policy=policy, cache_rows=60, page_rows=8, name="emb")
    ref = Reference(W0)
    make = OPTIMIZERS[opt]
    ours, theirs = make(), make()
    for step in range(40):
        if step % 3 == 0:  # CSR bags with weights, mean
            idx = zipf_batch(rng, 1, 90)[0]
            off = np.sort(np.concatenate(([0, idx.size], rng.integers(0, idx.size, 29))))
            w = rng.random(idx.size).astype(np.float32)
            kw = dict(offsets=off, weights=w, mode="mean")
        else:
            idx, kw = zipf_batch(rng, 30, 3), {}
        got = E.lookup(t, idx, **kw)
        want = ref.lookup(idx, **kw)
        assert np.array_equal(got, want), step
        if step % 4 == 1:
            prefetch(t, zipf_batch(rng, 30, 3).ravel())
        g = rng.standard_normal(got.shape).astype(np.float32)
        E.pullback(t, g, idx, optimizer=ours, **kw)
        ref.pullback(g, idx, optimizer=theirs, **kw)
        t.check()
        assert np.array_equal(contents(t), ref.W), step
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W)
    if opt == "adagrad":
        assert np.array_equal(ours.state(t), ref.state)
    tel = t.telemetry()
    assert tel["hits"] + tel["misses"] > 0
    if policy == "simple":
        assert tel["hits"] == 0
    else:
        assert tel["hits"] > 0
    t.close()
    m.check()


def random_table(seed: int, **kw) -> tuple[np.random.Generator, CachedEmbeddings, Reference]:
    """A cached table of random rows over a new host manager, and the reference over the same rows."""
    rng = np.random.default_rng(seed)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    return rng, CachedEmbeddings(W0, host_manager(), page_rows=8, **kw), Reference(W0)


def test_dynamic_admits_every_row_of_a_batch_so_no_row_is_staged_while_room_lasts():
    rng, t, _ = random_table(2, cache_rows=100)
    idx = rng.choice(N, 50, replace=False)
    E.lookup(t, idx)
    assert t._staged.size == 0 and t.cached_rows == 50
    assert t.counts.tolist() == [0, 50, 50]
    E.lookup(t, idx)
    assert t.counts.tolist() == [50, 50, 50]
    big = rng.choice(N, 200, replace=False)  # more distinct rows than the cache holds: the rest is staged
    out = E.lookup(t, big)
    assert np.array_equal(out, base_rows(t)[big])
    assert t._staged.size > 0 and t.cached_rows <= 100
    t.check()


def test_a_flush_moves_spared_rows_on_the_device_and_writes_evicted_updates_back():
    rng, t, ref = random_table(3, cache_rows=64, cacheslack=16)
    opt = E.SGD(0.5)
    hot = np.arange(10)
    for step in range(30):  # the hot rows are hit every step, so flushes spare them
        idx = np.concatenate((hot, rng.integers(10, N, 20)))
        assert np.array_equal(E.lookup(t, idx), ref.lookup(idx))
        g = rng.standard_normal((idx.size, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=opt)
        ref.pullback(g, idx, optimizer=opt)
        t.check()
    assert t.flushes > 3 and t.rows_written_back > 0
    assert all(t._ptr[r] & K.CACHED for r in hot)  # spared, never evicted
    assert np.array_equal(contents(t), ref.W)
    t.flush_dirty(0)
    assert t.cached_rows == 0 and np.array_equal(base_rows(t), ref.W)
    E.pullback(t, np.ones((1, F), np.float32), [3], optimizer=opt)
    with pytest.raises(ValueError, match="flush_clean would lose them"):
        t.flush_clean()
    t.check()


def test_prefetch_admits_into_free_slots_only_and_counts_the_batch_once():
    rng, t, _ = random_table(4, cache_rows=64)
    cur = rng.choice(N, 40, replace=False)
    E.lookup(t, cur)
    where = t._ptr[cur].copy()
    tail = int(t.state[K.TAIL])
    nxt = rng.choice(N, 40, replace=False)
    before = t.counts.copy()
    assert prefetch(t, nxt)  # room for 24 of them: admitted, nothing flushed
    assert int(t.state[K.TAIL]) == tail and np.array_equal(t._ptr[cur], where)
    assert t.isfull()
    counted = t.counts - before
    assert counted[0] + counted[1] == nxt.size
    assert not prefetch(t, rng.choice(N, 40, replace=False))  # full: a flush could move the current batch's rows
    assert np.array_equal(t._ptr[cur], where)
    E.lookup(t, nxt)  # flushes now (the current batch is done) and counts nothing again
    assert np.array_equal(t.counts, before + counted)
    t.check()


def test_prefetch_waits_while_the_current_batch_has_staged_rows():
    rng, t, ref = random_table(5, cache_rows=16, cacheslack=8)
    cur = rng.choice(N, 60, replace=False)  # more than the cache: some rows are staged
    E.lookup(t, cur)
    staged = t._staged.copy()
    assert staged.size > 0
    assert not prefetch(t, cur)  # admitting a staged row now would read it before its update lands
    g = rng.standard_normal((cur.size, F)).astype(np.float32)
    E.pullback(t, g, cur, optimizer=E.SGD(1.0))
    ref.pullback(g, cur, optimizer=E.SGD(1.0))
    assert np.array_equal(contents(t), ref.W)
    E.lookup(t, cur[:3])  # the next batch writes the staged rows back first
    assert np.array_equal(contents(t), ref.W)
    assert np.array_equal(base_rows(t)[staged], ref.W[staged]) and not t._staged_dirty
    t.check()


def test_bad_input_raises_the_cpu_error_and_changes_nothing():
    rng = np.random.default_rng(6)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = CachedEmbeddings(W0, m, cache_rows=64, page_rows=8, name="clicks")
    E.lookup(t, rng.integers(0, N, 30))
    state, ptr, seen = t.state.copy(), t._ptr.copy(), contents(t)
    with pytest.raises(IndexError, match=r"clicks.*position 2.*400"):
        E.lookup(t, [1, 2, 400])
    with pytest.raises(IndexError, match="clicks"):
        E.pullback(t, np.ones((2, F), np.float32), [5, -1], optimizer=E.SGD(1.0))
    with pytest.raises(ValueError, match="gradient shape"):
        E.pullback(t, np.ones((3, F), np.float32), [5, 6], optimizer=E.SGD(1.0))
    assert np.array_equal(t.state, state) and np.array_equal(t._ptr, ptr)
    g = np.ones((2, F), np.float32)
    g[1, 3] = np.nan
    with pytest.raises(FloatingPointError, match="clicks: non-finite gradient in output row 1"):
        E.pullback(t, g, [5, 6], optimizer=E.SGD(1.0))
    with pytest.raises(TypeError, match="unsupported optimizer"):
        E.pullback(t, np.ones((2, F), np.float32), [5, 6], optimizer="sgd")
    assert np.array_equal(contents(t), seen)
    t.check()
    with pytest.raises(ValueError, match="unknown policy"):
        CachedEmbeddings(W0, m, policy="lru")
    with pytest.raises(TypeError, match="float32"):
        CachedEmbeddings(W0.astype(np.float64), m)
    with pytest.raises(ValueError, match="between 1 and 400"):
        CachedEmbeddings(W0, m, cache_rows=401)
    with pytest.raises(TypeError, match="host row source"):
        t.rows(E.FORWARD, np.arange(3))
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        E.lookup(t, [1])
    m.check()


def test_an_ensemble_of_cached_tables_matches_the_reference():
    rng = np.random.default_rng(7)
    m = host_manager()
    Ws = [rng.standard_normal((N, F)).astype(np.float32) for _ in range(3)]
    tables = [CachedEmbeddings(W, m, cache_rows=50, page_rows=8, name=f"t{i}") for i, W in enumerate(Ws)]
    refs = [Reference(W) for W in Ws]
    ens = E.Ensemble(tables)
    opt = E.SGD(0.3)
    for _ in range(6):
        idx = [zipf_batch(rng, 20, 4) for _ in tables]
        got = ens.lookup(idx)
        want = np.stack([r.lookup(i) for r, i in zip(refs, idx)], axis=1)
        assert np.array_equal(got, want)
        g = rng.standard_normal(got.shape).astype(np.float32)
        ens.pullback(g, idx, optimizer=opt)
        for i, (r, ix) in enumerate(zip(refs, idx)):
            r.pullback(g[:, i, :], ix, optimizer=opt)
    idx = [zipf_batch(rng, 20, 4) for _ in tables]
    wide = np.full((20, 5, F), -1.0, np.float32)  # each table writes its column of a strided view
    ens.lookup_into(wide[:, 1:4, :], idx)
    assert np.array_equal(wide[:, 1:4, :], np.stack([r.lookup(i) for r, i in zip(refs, idx)], axis=1))
    assert np.all(wide[:, [0, 4], :] == -1.0)
    bad = [zipf_batch(rng, 20, 4) for _ in tables]
    bad[2][0, 0] = N
    g = np.zeros((20, 3, F), np.float32)
    before = [contents(t) for t in tables]
    with pytest.raises(IndexError, match="t2"):
        ens.pullback(g, bad, optimizer=opt)
    g = rng.standard_normal(g.shape).astype(np.float32)
    g[7, 1, 2] = np.inf  # the batch just looked up (its resolution reused), a bad gradient in table t1
    with pytest.raises(FloatingPointError, match="t1: non-finite gradient in output row 7"):
        ens.pullback(g, idx, optimizer=opt)
    assert all(np.array_equal(contents(t), b) for t, b in zip(tables, before))
    for t, r in zip(tables, refs):
        assert np.array_equal(contents(t), r.W)
        t.check()


def test_one_ensemble_update_takes_cached_and_plain_tables(monkeypatch):
    """The GPU ensemble update (one function for plain and cached tables), with the reference
    backend standing for CUDA: bit for bit with the reference, and a bad gradient in any
    table refused before any table changes."""
    from embeddings.gpu import tables as GT
    monkeypatch.setattr(GT, "cuda_backend", lambda be=ReferenceBackend(): be)
    rng = np.random.default_rng(11)
    m = host_manager()
    Ws = [rng.standard_normal((N, F)).astype(np.float32) for _ in range(2)]
    ts = [CachedEmbeddings(Ws[0], m, cache_rows=50, page_rows=8, name="c0"), E.SimpleEmbedding(Ws[1].copy(), "p1")]
    refs = [Reference(W) for W in Ws]
    opt = E.SGD(0.3)
    now = lambda: [contents(ts[0]), ts[1].data.copy()]  # noqa: E731
    for step in range(4):
        idx = [zipf_batch(rng, 20, 4) for _ in ts]
        if step % 2:
            E.lookup(ts[0], idx[0])  # the update then reuses this resolution
        g = rng.standard_normal((20, 2, F)).astype(np.float32)
        GT.ensemble_pullback(ts, g, idx, None, None, None, opt)
        for i, r in enumerate(refs):
            r.pullback(g[:, i, :], idx[i], optimizer=opt)
        assert all(np.array_equal(got, r.W) for got, r in zip(now(), refs))
    before = now()
    for bad_table in (0, 1):
        g = rng.standard_normal((20, 2, F)).astype(np.float32)
        g[3, bad_table, 1] = np.nan
        with pytest.raises(FloatingPointError, match=f"{ts[bad_table].name}: non-finite gradient in output row 3"):
            GT.ensemble_pullback(ts, g, idx, None, None, None, opt)
        assert all(np.array_equal(a, b) for a, b in zip(now(), before))
    with pytest.raises(ValueError, match="ensemble gradient shape"):
        GT.ensemble_pullback(ts, np.zeros((20, 3, F), np.float32), idx, None, None, None, opt)
    ts[0].check()
    ts[0].close()
    m.check()


def test_invalidate_drops_the_cache_after_the_base_table_was_replaced(tmp_path):
    rng = np.random.default_rng(8)
    m = host_manager(tmp_path)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    for policy in ("dynamic", "static"):
        t = CachedEmbeddings(W0, m, policy=policy, cache_rows=40, page_rows=8)
        E.pullback(t, np.ones((5, F), np.float32), np.arange(5), optimizer=E.SGD(1.0))
        from cachedarrays import writable
        with writable(t.base_array) as v:
            v[...] = 7.0  # e.g. a checkpoint loaded into the base table
        t.invalidate()
        assert np.array_equal(E.lookup(t, np.arange(N)), np.full((N, F), 7.0, np.float32))
        t.check()
        t.close()
    m.check()


class MirroredCache(RuleBasedStateMachine):
    """The rules every GPU cache's state machine shares: random lookups, updates, prefetches and
    write-backs on ``self.t``, each mirrored on the plain table ``self.ref`` (a subclass's
    ``setup`` makes them, with ``rng``, ``m``, ``opt`` and ``opt_ref``); ``check()`` and the
    contents (the subclass's ``contents``) after every step."""

    contents = staticmethod(lambda t: None)

    def start(self, seed: int, W0: np.ndarray, adagrad: bool) -> None:
        self.m = host_manager()
        self.ref = Reference(W0)
        self.opt = E.RowwiseAdagrad(0.2) if adagrad else E.SGD(0.2)
        self.opt_ref = E.RowwiseAdagrad(0.2) if adagrad else E.SGD(0.2)

    def step(self, idx: np.ndarray, update: bool) -> None:
        """Look ``idx`` up (and update its rows when ``update``) on both tables."""
        assert np.array_equal(_as_np(E.lookup(self.t, idx)), self.ref.lookup(idx))
        if update:
            g = self.rng.standard_normal((idx.shape[0], 4)).astype(np.float32)
            E.pullback(self.t, g, idx, optimizer=self.opt)
            self.ref.pullback(g, idx, optimizer=self.opt_ref)

    @rule(n=st.integers(0, 80), k=st.integers(1, 3), update=st.booleans())
    def batch(self, n, k, update):
        self.step(((self.rng.zipf(1.2, (n, k)) - 1) % 120).astype(np.int64), update)

    @rule(n=st.integers(0, 80))
    def prefetch_next(self, n):
        prefetch(self.t, self.rng.integers(0, 120, n))

    @rule()
    def writeback(self):
        self.t.writeback()
        assert np.array_equal(base_rows(self.t), self.ref.W)

    @invariant()
    def consistent(self):
        self.t.check()
        assert np.array_equal(self.contents(self.t), self.ref.W)

    def teardown(self):
        self.t.close()
        assert np.array_equal(base_rows(self.t), self.ref.W)
        self.m.check()


class CacheMachine(MirroredCache):
    """The host-bookkept cache under every policy, with flushes and bound changes too."""

    contents = staticmethod(contents)

    @initialize(policy=st.sampled_from(["dynamic", "dynamic", "static", "simple"]), rows=st.integers(1, 60),
                page=st.integers(1, 9), adagrad=st.booleans(), spare=st.booleans())
    def setup(self, policy, rows, page, adagrad, spare):
        self.rng = np.random.default_rng(rows * 31 + page)
        W0 = self.rng.standard_normal((120, 4)).astype(np.float32)
        self.start(rows, W0, adagrad)
        self.t = CachedEmbeddings(W0, self.m, policy=policy, cache_rows=rows, page_rows=page, second_chance=spare,
                                  staging_rows=4)

    @precondition(lambda self: self.t.policy != "simple")
    @rule(frac=st.floats(0, 1))
    def flush(self, frac):
        self.t.flush_dirty(int(frac * self.t.cached_rows))

    @precondition(lambda self: self.t.policy != "simple")
    @rule(frac=st.floats(0, 1))
    def bounds(self, frac):
        ring = int(self.t.state[K.RING])
        lower = int(frac * (ring - 1))
        self.t.set_cachelower(0)
        self.t.set_cacheslack(max(1, ring - lower))
        self.t.set_cachelower(min(lower, ring - 1))


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# ---------------------------------------------------------------------------------------- on a GPU
def gpu_manager() -> Manager:
    from cachedarrays import GPU
    return Manager(GPU("64MiB"), DRAM("64MiB"), policy=LRUPolicy())


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("policy,opt", [(p, o) for p in ("dynamic", "static", "simple") for o in ("sgd", "adagrad")]
                         + [("dynamic", "sgd_any")])
def test_gpu_cached_table_equals_the_uncached_gpu_table_bit_for_bit(policy, opt):
    rng = np.random.default_rng(11)
    n, F_ = 20000, 64
    W0 = rng.standard_normal((n, F_)).astype(np.float32)
    with gpu_manager() as m:
        t = CachedEmbeddings(W0, m, policy=policy, cache_fraction=0.05, name="emb")
        train_and_compare(m, t, contents, W0, rng, opt, 0.5 if policy == "dynamic" else None)


def train_and_compare(m, t, read, W0, rng, opt: str, hit_rate: float | None) -> None:
    """30 steps of lookups, next-batch prefetches and updates (``opt``) on the GPU cached table
    ``t`` over ``W0``, each checked against the uncached GPU path (:func:`assert_gpu_same`); then
    its contents (``read(t)``), its base table after ``close`` and, when given, its least hit rate."""
    import jax
    from embeddings.gpu.backend import cuda_backend
    n, F_ = W0.shape
    ref = Reference(W0, cuda_backend())
    make = OPTIMIZERS[opt]
    ours, theirs = make(), make()
    nxt = zipf_batch(rng, 512, 20, n)
    for step in range(30):
        idx, nxt = nxt, zipf_batch(rng, 512, 20, n)
        got = E.lookup(t, idx)
        assert isinstance(got, jax.Array) and got.devices().pop().platform == "gpu"
        assert_gpu_same(np.asarray(got), ref.lookup(idx).get(), opt, step)
        prefetch(t, nxt.ravel())
        g = rng.standard_normal((512, F_)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=ours)
        ref.pullback(g, idx, optimizer=theirs)
        t.check()
    assert_gpu_same(read(t), ref.W.get(), opt)
    t.close()
    assert_gpu_same(base_rows(t), ref.W.get(), opt)
    if hit_rate is not None:
        assert t.telemetry()["hit_rate"] > hit_rate
    m.check()
