"""The set-associative GPU cache (embeddings.gpu.lru): on a manager without a GPU its "device" is
numpy (the reference backend), which runs every line of its logic on CI; the same checks run
against CuPy on a GPU manager where a GPU exists.

The reference for every lookup and update is the uncached GPU path over a plain table on the
same backend: resolving indices to slots must not change a single bit.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import embeddings as E
from cachedarrays import readable, writable
from cachedarrays.devices import gpu as gpu_device
from cachedarrays.errors import InvariantError
from embeddings.gpu.cached import prefetch
from embeddings.gpu import lru_group as LG, prefetcher
from embeddings.gpu.lru import REPLACEMENTS, LRUCachedEmbeddings

from test_gpu_cached import (OPTIMIZERS, MirroredCache, Reference, _as_np, assert_gpu_same, base_rows as _base_rows,
                             gpu_manager, host_manager, train_and_compare, zipf_batch)

N, F = 400, 8

# Many tests here give a table a cache too small for its batches on purpose (to stage rows);
# the warning that says so is checked by its own test.
pytestmark = pytest.mark.filterwarnings("ignore:.*prefetched batches in a row did not fit:RuntimeWarning")


def _host(x) -> np.ndarray:
    return _as_np(x)


def contents(t: LRUCachedEmbeddings) -> np.ndarray:
    """The table as a reader sees it, without side effects: base rows, every cached row from its
    slot (staged rows are clean: their updates went home with the update), once the rows sent
    home have landed."""
    LG.drain([t])
    with readable(t.base_array) as v:
        out = np.array(v)
    W, tags = _host(t._W), _host(t._tags)
    live = np.flatnonzero(tags >= 0)
    out[tags[live]] = W[live]
    return out


def base_rows(t: LRUCachedEmbeddings) -> np.ndarray:
    """The base table once the rows sent home have landed (they go in the background)."""
    LG.drain([t])
    return _base_rows(t)


def make(W0, m, **kw) -> LRUCachedEmbeddings:
    return LRUCachedEmbeddings(W0.copy(), m, **kw)


def fresh(seed: int, **kw) -> tuple[np.ndarray, object, LRUCachedEmbeddings]:
    """(random rows, a host manager, an lru table over a copy of them)."""
    W0 = np.random.default_rng(seed).standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    return W0, m, make(W0, m, **kw)


@pytest.mark.parametrize("ways,rows,staging,reads", [(1, 40, 1, "mapped"), (4, 40, 2, "staged"),
                                                     (16, 64, 4096, "mapped"), (4, 400, 8, "mapped"),
                                                     (4, 400, 8, "staged"), (4, 40, 2, "split"),
                                                     (4, 400, 8, "split")])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_lookups_and_updates_equal_the_uncached_table_bit_for_bit(ways, rows, staging, reads, opt, replacement):
    rng = np.random.default_rng(ways * 7 + rows)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = make(W0, m, cache_rows=rows, ways=ways, staging_rows=staging, reads=reads, replacement=replacement)
    ref = Reference(W0)
    mk = OPTIMIZERS[opt]
    ours, theirs = mk(), mk()
    nxt = zipf_batch(rng, 16, 5)
    for step in range(15):
        idx, nxt = nxt, zipf_batch(rng, 16, 5)
        mode = ("sum", "mean")[step % 2]
        assert np.array_equal(_host(E.lookup(t, idx, mode=mode)), ref.lookup(idx, mode=mode)), step
        if step % 3:
            prefetch(t, nxt.ravel())
        g = rng.standard_normal((16, F)).astype(np.float32)
        E.pullback(t, g, idx, mode=mode, optimizer=ours)
        ref.pullback(g, idx, mode=mode, optimizer=theirs)
        t.check()
        assert np.array_equal(contents(t), ref.W)
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W)
    if opt == "adagrad":
        assert np.array_equal(ours.state(t), ref.state)
    t.close()
    m.check()


def test_staged_reads_gather_the_rows_on_the_host_and_a_bad_choice_is_refused(monkeypatch):
    """``reads="staged"``: the rows a placement brings in are gathered by CPU threads into one
    block (and put into their slots from it), not read through their mapped addresses; the
    choice may change between steps, and anything but the two choices is refused with the
    table's name, before anything is allocated or, later, changed."""
    rng = np.random.default_rng(18)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    with pytest.raises(ValueError, match=r"t: reads must be one of \('mapped', 'staged', 'split'\), got 'dma'"):
        make(W0, m, cache_rows=40, ways=4, reads="dma", name="t")
    m.check()
    gathered, reads = [], []
    gather, move = LG.gather_signalled, LG.move
    monkeypatch.setattr(LG, "gather_signalled", lambda tables, tabs, rows, *a, **kw: gathered.append(rows.size)
                        or gather(tables, tabs, rows, *a, **kw))
    monkeypatch.setattr(LG, "move", lambda g, *a, down, rows=True, state=True: reads.append((down, rows and a[0].size))
                        or move(g, *a, down=down, rows=rows, state=state))
    t, ref = make(W0, m, cache_rows=40, ways=4, reads="staged", name="t"), Reference(W0)
    for step in range(6):
        idx = zipf_batch(rng, 16, 5)
        gathered.clear(), reads.clear()
        admitted = int(t.counts[2])
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        assert gathered == [int(t.counts[2]) - admitted] and gathered[0] > 0  # every admitted row, gathered
        assert not any(down is False and bool(rows) for down, rows in reads)  # no row read through its mapped address
        g = rng.standard_normal((16, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=E.SGD(0.1))
        ref.pullback(g, idx, optimizer=E.SGD(0.1))
        t.check()
        assert np.array_equal(contents(t), ref.W)
    t.reads = "mapped"
    gathered.clear(), reads.clear()
    E.lookup(t, (zipf_batch(rng, 16, 5) + 200) % N)
    assert gathered == [] and any(down is False and bool(rows) for down, rows in reads)
    with pytest.raises(ValueError, match="t: reads must be one of"):
        t.reads = "staging"
    assert t.reads == "mapped"
    t.close()
    m.check()


def test_the_least_recently_used_way_of_a_set_goes_first_and_dirty_rows_go_back():
    W0 = np.arange(N * F, dtype=np.float32).reshape(N, F)
    m = host_manager()
    t = make(W0, m, cache_rows=2, ways=2)  # one set of two ways: every row competes
    opt = E.SGD(1.0)
    E.lookup(t, np.array([[5]]))
    E.lookup(t, np.array([[7]]))
    E.pullback(t, np.ones((1, F), np.float32), np.array([[5]]), optimizer=opt)  # 5 used last, and dirty
    assert sorted(_host(t._tags).tolist()) == [5, 7]
    E.lookup(t, np.array([[9]]))  # evicts 7 (least recently used, clean: nothing written)
    assert sorted(_host(t._tags).tolist()) == [5, 9]
    assert t.rows_written_back == 0
    E.lookup(t, np.array([[11]]))  # evicts 5, whose update goes back to the base table
    assert sorted(_host(t._tags).tolist()) == [9, 11]
    assert t.rows_written_back == 1
    assert np.array_equal(base_rows(t)[5], W0[5] - 1)
    hits, misses, admitted = t.counts
    assert (hits, misses, admitted) == (1, 4, 4)  # the update's resolution reused the lookup of 5
    t.check()
    t.close()


@pytest.mark.parametrize("replacement,kept", [("lru", {9, 11}), ("lfu", {5, 11})])
def test_lfu_keeps_a_row_used_in_many_batches_where_lru_keeps_the_latest_rows(replacement, kept):
    W0 = np.arange(N * F, dtype=np.float32).reshape(N, F)
    m = host_manager()
    t = make(W0, m, cache_rows=2, ways=2, replacement=replacement)  # one set of two ways
    for _ in range(3):
        E.lookup(t, np.array([[5, 5]]))  # three batches of use, however often each batch used it
    E.lookup(t, np.array([[7]]))  # the latest row: lru's last to go; lfu's first (one batch of use)
    if replacement == "lfu":
        assert sorted(zip(_host(t._tags).tolist(), _host(t._uses).tolist())) == [(5, 3), (7, 1)]
    E.lookup(t, np.array([[9]]))
    E.lookup(t, np.array([[11]]))
    assert set(_host(t._tags).tolist()) == kept
    assert t.telemetry()["policy"] == replacement and replacement in repr(t)
    assert t.counts[0] == 4  # both entries of the second and third batches (the first batch's both missed)
    t.check()
    t.close()
    m.check()


def test_a_replacement_that_does_not_exist_is_refused_naming_the_choices():
    W0 = np.zeros((N, F), np.float32)
    m = host_manager()
    with pytest.raises(ValueError, match=r"emb: replacement must be one of \('lru', 'lfu'\), got 'mru'"):
        make(W0, m, cache_rows=8, replacement="mru", name="emb")
    m.check()
    assert m.fast.used_bytes == 0


def test_a_set_whose_ways_the_batch_fills_stages_the_rest_and_writes_their_updates_back():
    W0, m, t = fresh(3, cache_rows=2, ways=2, staging_rows=1)  # one set, a one-row staging area
    ref = Reference(W0)
    idx = np.array([[1, 2, 3, 4, 5]])
    assert np.array_equal(_host(E.lookup(t, idx, mode="sum")), ref.lookup(idx, mode="sum"))
    assert _host(t._staged).size == 3 and t._W.shape[0] >= 2 + 3  # the staging area grew
    g = np.ones((1, F), np.float32)
    E.pullback(t, g, idx, mode="sum", optimizer=E.SGD(0.5))
    ref.pullback(g, idx, mode="sum", optimizer=E.SGD(0.5))
    assert _host(t._staged).size == 0  # the update wrote the staged rows home at once
    staged = [3, 4, 5]  # rows 1 and 2 took the ways
    assert np.array_equal(base_rows(t)[staged], ref.W[staged])
    assert np.array_equal(contents(t), ref.W)
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W)
    t.check()
    t.close()


def test_prefetch_never_moves_the_rows_of_the_batch_in_flight_and_counts_the_next_batch_once():
    W0, m, t = fresh(4, cache_rows=4, ways=4)  # one set of four ways: every row competes
    ref = Reference(W0)
    E.lookup(t, np.array([[5, 6]]))  # older rows in two ways
    cur = np.array([[1, 2]])
    E.lookup(t, cur)  # the batch in flight in the other two, used last
    slot = {r: s for s, r in enumerate(_host(t._tags)) if r >= 0}
    # three misses, two evictable ways: 5 and 6 go, 1 and 2 stay although they are the next oldest
    assert prefetch(t, np.array([10, 11, 12])) is False
    tags = _host(t._tags)
    assert tags[slot[1]] == 1 and tags[slot[2]] == 2  # the in-flight update lands where its lookup read
    assert sorted(tags.tolist()) == [1, 2, 10, 11]
    g = np.ones((1, F), np.float32)
    E.pullback(t, g, cur, optimizer=E.SGD(0.5))
    ref.pullback(g, cur, optimizer=E.SGD(0.5))
    nxt = np.array([[10, 11, 12]])
    assert np.array_equal(_host(E.lookup(t, nxt)), ref.lookup(nxt))  # 12 found a way at its own lookup
    assert np.array_equal(contents(t), ref.W)
    t.reset_counters()
    assert prefetch(t, np.array([20, 10])) is True  # one miss, one way left beside the in-flight 10, 11, 12
    E.lookup(t, np.array([[20, 10]]))
    hits, misses, _ = t.counts
    assert (hits, misses) == (1, 1)  # counted by the prefetch, not again by the lookup
    t.check()
    t.close()


def test_a_lookup_that_places_its_own_batch_keeps_the_rows_of_a_batch_prefetched_after_it():
    """One set of four ways. A is prefetched but leaves rows out (the ways of the batch in
    flight are locked); B is prefetched after it and takes the way of an older row. A's lookup
    then places A itself: it may take older ways but not B's, whose lookup still takes its
    prefetched slot."""
    rng = np.random.default_rng(12)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=4, ways=4, staging_rows=4), Reference(W0)

    def step(idx):
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        g = rng.standard_normal((1, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=E.SGD(0.1))
        ref.pullback(g, idx, optimizer=E.SGD(0.1))

    step(np.array([[1, 2]]))
    A, B = np.array([[3, 4, 5, 6, 7]]), np.array([[8]])
    assert prefetch(t, A.ravel()) is False  # two free ways for five rows; rows 1 and 2 are locked
    assert prefetch(t, B.ravel()) is True  # row 8 takes the way of row 1 or 2
    b = t._ahead[1]
    step(A)
    assert 8 in _host(t._tags) and t._staged.size == 0  # A's extra rows were staged, and went home after the update
    step(B)
    assert t._inflight_stamp == b.stamp  # B took its prefetched slot
    t.check()
    assert np.array_equal(contents(t), ref.W)
    t.close()
    m.check()


@pytest.mark.parametrize("between", [None, "counts"])
def test_a_prefetch_that_does_not_wait_for_the_last_update_keeps_that_batchs_ways(monkeypatch, between):
    """The DLRM order: X and A are prefetched, X is looked up and updated, then B is prefetched
    while X's update may still run on the device. With nothing but that update queued since
    X's lookup, B's placement waits only for the work before it (``work.after``: the fence
    taken at X's lookup) and the lock keeps X's ways, though A, prefetched after X, is queued.
    Any other operation in between (``counts`` joins the table) makes B wait for everything, and
    X's ways are free to go."""
    import embeddings.gpu.lru as LRU
    rng = np.random.default_rng(24)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=4, ways=4, staging_rows=4), Reference(W0)
    fences = iter(range(1, 10_000))
    monkeypatch.setattr(t.backend, "fence", lambda: ("fence", next(fences)))  # the device's events
    X, A, B = np.array([[1, 2]]), np.array([[3]]), np.array([[5, 6]])
    assert prefetch(t, X.ravel()) and prefetch(t, A.ravel())
    assert np.array_equal(_host(E.lookup(t, X)), ref.lookup(X))
    at_lookup = t._before_update
    g = rng.standard_normal((1, F)).astype(np.float32)
    E.pullback(t, g, X, optimizer=E.SGD(0.1))
    ref.pullback(g, X, optimizer=E.SGD(0.1))
    if between:
        getattr(t, between)
    (work,) = LRU.LRUCachedEmbeddings.prefetch_works([t], [B.ravel()])
    assert work.after == ([at_lookup] if between is None else None)
    placed = work()
    tags = set(_host(t._tags).tolist())
    if between is None:
        assert not placed and {1, 2, 3, 5} == tags  # one free way: 6 is left out, X keeps its ways
    else:
        assert placed and {3, 5, 6} <= tags and len({1, 2} & tags) == 1  # X's update is known done
    E.lookup(t, A)
    t.check()
    assert np.array_equal(contents(t), ref.W)
    t.close()
    m.check()


def test_prefetch_waits_while_the_current_batch_has_staged_rows():
    W0, m, t = fresh(5, cache_rows=1, ways=1)
    E.lookup(t, np.array([[1, 2]]))  # one way: row 2 is staged
    assert _host(t._staged).size == 1
    assert prefetch(t, np.array([3])) is False
    assert 3 not in _host(t._tags)
    t.close()


def test_bad_input_raises_the_cpu_error_and_changes_nothing():
    W0, m, t = fresh(6, cache_rows=16, ways=4)
    E.lookup(t, np.array([[1, 2, 3]]))
    before, tags = contents(t), _host(t._tags).copy()
    with pytest.raises(IndexError, match=r"table: index 400 at position \(0, 1\) is out of range"):
        E.lookup(t, np.array([[5, 400]]))
    with pytest.raises(IndexError):
        prefetch(t, np.array([-1]))
    with pytest.raises(ValueError, match="gradient shape"):
        E.pullback(t, np.ones((2, F), np.float32), np.array([[1, 2]]), optimizer=E.SGD(0.1))
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        E.pullback(t, np.full((1, F), np.nan, np.float32), np.array([[1, 2]]), optimizer=E.SGD(0.1))
    assert np.array_equal(contents(t), before) and np.array_equal(_host(t._tags), tags)
    t.check()
    with pytest.raises(ValueError, match="cache of 0 rows"):
        make(W0, m, cache_rows=0)
    with pytest.raises(ValueError, match="ways must be at least 1"):
        make(W0, m, ways=0)
    with pytest.raises(TypeError, match="float32"):
        make(W0.astype(np.float64), m)
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        E.lookup(t, np.array([[1]]))
    m.check()


def test_a_batch_whose_staging_rows_do_not_fit_is_refused_naming_the_budget_and_the_table_stays_usable():
    from cachedarrays import DRAM, LRUPolicy, Manager
    W0 = np.random.default_rng(13).standard_normal((N, F)).astype(np.float32)
    m = Manager(DRAM("4KiB", name="fast"), DRAM("1MiB", name="host"), policy=LRUPolicy())
    t, ref = make(W0, m, cache_rows=4, ways=4, staging_rows=1, name="emb"), Reference(W0)
    big = np.arange(200).reshape(1, 200)  # 196 rows to stage: 6 KiB beside the cache
    with pytest.raises(MemoryError, match=r"emb: a batch needs 196 staging rows beside the 4-slot cache, more "
                                          r"than fast has room for; raise its capacity \(--fast-budget\)"):
        E.lookup(t, big)
    t.check()
    assert np.array_equal(contents(t), W0)
    idx = np.array([[1, 2, 3]])
    assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
    t.close()
    m.check()


def test_check_finds_a_row_outside_its_set_and_a_row_cached_twice():
    W0, m, t = fresh(7, cache_rows=32, ways=4)
    E.lookup(t, np.array([[1, 2, 3]]))
    t.check()
    live = np.flatnonzero(t._tags >= 0)
    row = int(t._tags[live[0]])
    other = (live[0] // 4 + 1) % t.sets * 4 + 3  # a way of another set
    saved = t._tags[other]
    t._tags[other] = row
    with pytest.raises(InvariantError, match="more than one slot|outside"):
        t.check()
    t._tags[other] = saved
    t.check()
    t.close()


def test_an_ensemble_and_the_flushes_and_invalidate():
    rng = np.random.default_rng(8)
    Ws = [rng.standard_normal((N, F)).astype(np.float32) for _ in range(2)]
    m = host_manager()
    ts = [make(W, m, cache_rows=20, ways=4, name=f"t{i}") for i, W in enumerate(Ws)]
    refs = [Reference(W) for W in Ws]
    ens = E.Ensemble(ts)
    idx = [zipf_batch(rng, 8, 3) for _ in ts]
    got = _host(ens.lookup(idx))
    for i, r in enumerate(refs):
        assert np.array_equal(got[:, i], r.lookup(idx[i]))
    g = rng.standard_normal(got.shape).astype(np.float32)
    ens.pullback(g, idx, optimizer=E.SGD(0.1))
    for i, r in enumerate(refs):
        r.pullback(g[:, i], idx[i], optimizer=E.SGD(0.1))
    ts[0].flush_dirty()
    assert ts[0].cached_rows == 0 and np.array_equal(base_rows(ts[0]), refs[0].W)
    ts[1].writeback()
    ts[1].flush_clean()
    assert ts[1].cached_rows == 0 and np.array_equal(base_rows(ts[1]), refs[1].W)
    E.lookup(ts[0], idx[0])
    with writable(ts[0].base_array) as v:
        v[...] = 0
    ts[0].invalidate()
    assert ts[0].cached_rows == 0
    assert np.all(_host(E.lookup(ts[0], idx[0])) == 0)
    for t in ts:
        t.check()
        t.close()
    m.check()


def test_an_ensemble_update_plans_every_table_with_one_wait_and_a_table_given_twice_updates_twice(monkeypatch):
    """The ensemble's update plans all its tables' batches together (one call for their long-row
    counts), each on the slots its lookup resolved. A cached table given twice
    resolves and plans each of its batches just before its update (resolving the second batch
    may move the first's rows), so both updates land as two separate updates would."""
    from embeddings.gpu.backend import ReferenceBackend
    rng = np.random.default_rng(17)
    Ws = [rng.standard_normal((N, F)).astype(np.float32) for _ in range(3)]
    m = host_manager()
    ts = [make(W, m, cache_rows=24, ways=4, name=f"t{i}") for i, W in enumerate(Ws)]
    refs = [Reference(W) for W in Ws]
    counted = []
    long_rows = ReferenceBackend.long_rows
    monkeypatch.setattr(ReferenceBackend, "long_rows", lambda self, srows, *a: counted.append(len(srows))
                        or long_rows(self, srows, *a))
    for members, expect in (([0, 1, 2], [3]), ([0, 1, 0], [1, 1, 1])):
        ens = E.Ensemble([ts[i] for i in members])
        for _ in range(4):
            idx = [zipf_batch(rng, 8, 3) for _ in members]
            got = _host(ens.lookup(idx))
            for n, i in enumerate(members):
                assert np.array_equal(got[:, n], refs[i].lookup(idx[n]))
            g = rng.standard_normal(got.shape).astype(np.float32)
            counted.clear()
            ens.pullback(g, idx, optimizer=E.SGD(0.1))
            assert counted == expect
            for n, i in enumerate(members):
                refs[i].pullback(g[:, n], idx[n], optimizer=E.SGD(0.1))
            for t, r in zip(ts, refs):
                t.check()
                assert np.array_equal(contents(t), r.W)
    for t in ts:
        t.close()
    m.check()


def test_the_adagrad_accumulator_is_registered_exactly_while_the_table_uses_it():
    """Freed memory that stays page-locked breaks later host copies from whatever reuses it: the
    accumulator's registration ends when it is replaced, dropped, the table closed or collected."""
    rng = np.random.default_rng(9)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = make(W0, m, cache_rows=40, ways=4)
    reg = t.backend.registered
    idx = zipf_batch(rng, 8, 3)
    g = rng.standard_normal((8, F)).astype(np.float32)
    assert reg == {}  # the base table is never registered by the cache
    first, second = E.RowwiseAdagrad(0.1), E.RowwiseAdagrad(0.1)
    E.pullback(t, g, idx, optimizer=first)
    assert reg == {first.state(t).ctypes.data: N * 4}
    E.pullback(t, g, idx, optimizer=second)
    assert reg == {second.state(t).ctypes.data: N * 4}
    t.invalidate()
    assert reg == {}
    E.pullback(t, g, idx, optimizer=second)
    assert len(reg) == 1
    t.close()
    assert reg == {}
    t = make(W0, m, cache_rows=40, ways=4)
    reg = t.backend.registered
    E.pullback(t, g, idx, optimizer=E.RowwiseAdagrad(0.1))
    assert len(reg) == 1
    del t
    import gc
    gc.collect()
    assert reg == {}


def test_split_reads_share_the_rows_and_rebalance_on_the_measured_rates(monkeypatch):
    """``reads="split"``: of the rows a placement brings in, the first ``read_share`` are read
    through their mapped addresses and the rest gathered by CPU threads, each row once, and the
    two parts' measured rates set the next share."""
    rng = np.random.default_rng(19)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    gathered, mapped, rates = [], [], []
    gather, move, balance = LG.gather_signalled, LG.move, LG.balance
    monkeypatch.setattr(LG, "gather_signalled", lambda tables, tabs, rows, *a, **kw: gathered.append(rows.size)
                        or gather(tables, tabs, rows, *a, **kw))
    monkeypatch.setattr(LG, "balance", lambda tables, a, b: rates.append((a, b)) or balance(tables, a, b))

    def spy(g, slot, *a, down, rows=True, state=True):
        if not down and rows:
            mapped.append(int(slot.size))
        return move(g, slot, *a, down=down, rows=rows, state=state)
    monkeypatch.setattr(LG, "move", spy)
    t, ref = make(W0, m, cache_rows=40, ways=4, reads="split", name="t"), Reference(W0)
    assert t.read_share == 0.5
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="t: read_share must be between 0 and 1"):
            t.read_share = bad
    assert t.read_share == 0.5
    opt, theirs = E.RowwiseAdagrad(0.1), E.RowwiseAdagrad(0.1)
    rebalanced = 0
    for step in range(6):
        idx = zipf_batch(rng, 16, 5)
        gathered.clear(), mapped.clear(), rates.clear()
        if step:  # each placement from an even share: where the measured rates drove it near 0 or 1,
            t.read_share = 0.5  # a placement of a few rows left one part empty, by the clock not the code
        admitted, share = int(t.counts[2]), t.read_share
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        n = int(t.counts[2]) - admitted
        k = round(share * n)
        assert n > 0 and sum(mapped) == k and gathered == [n - k]
        if 0 < k < n:
            (a, b), = rates
            assert a > 0 and b > 0 and t.read_share == pytest.approx((share + a / (a + b)) / 2)
            rebalanced += 1
        else:
            assert rates == [] and t.read_share == share  # one part empty: nothing measured
        g = rng.standard_normal((16, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=opt)
        ref.pullback(g, idx, optimizer=theirs)
        t.check()
        assert np.array_equal(contents(t), ref.W)
    assert rebalanced >= 3  # both parts ran, and their rates moved the share, in most placements
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W) and np.array_equal(opt.state(t), ref.state)
    t.close()
    m.check()


@pytest.mark.parametrize("reads", ["staged", "split"])
def test_rows_sent_home_are_scattered_after_the_placements_own_gather(monkeypatch, reads):
    """The CPU threads write a placement's evicted rows home only once they have gathered its
    incoming rows (the two compete for the same cores and memory), and a read that fails still
    lets them land, so nothing waits for them forever."""
    from embeddings.kernels import scatter as SC
    rng = np.random.default_rng(20)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    log = []
    gather, scatter = LG.gather_signalled, SC.scatter_rows

    def slow_gather(*a, done, **kw):
        def slow_done():
            time.sleep(0.05)  # a scatter that did not wait would start in the meantime
            log.append("gather ends")
            done()
        log.append("gather starts")
        return gather(*a, done=slow_done, **kw)
    monkeypatch.setattr(LG, "gather_signalled", slow_gather)
    monkeypatch.setattr(SC, "scatter_rows", lambda jobs: log.append("scatter") or scatter(jobs))
    monkeypatch.setattr(LG, "balance", lambda *a: None)  # the CPU threads keep half of every read (none: no gather)
    t, ref = make(W0, m, cache_rows=40, ways=4, reads=reads, name="t"), Reference(W0)
    t.read_share = 0.5
    sent = 0
    for step in range(6):
        idx = zipf_batch(rng, 16, 5)
        log.clear()
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        LG.drain([t])
        if "scatter" in log:
            sent += 1
            assert log.index("scatter") > log.index("gather ends"), log
        g = rng.standard_normal((16, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=E.SGD(0.1))
        ref.pullback(g, idx, optimizer=E.SGD(0.1))
    assert sent >= 2  # dirty rows went home after some placements
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W)

    for step in range(3):  # dirty cached rows again
        idx = zipf_batch(rng, 16, 5)
        E.lookup(t, idx)
        E.pullback(t, np.ones((16, F), np.float32), idx, optimizer=E.SGD(0.1))
        ref.pullback(np.ones((16, F), np.float32), idx, optimizer=E.SGD(0.1))

    def broken(*a, **kw):
        raise MemoryError("no memory for the gather")
    monkeypatch.setattr(LG, "gather_signalled", broken)
    with pytest.raises(MemoryError, match="no memory for the gather"):
        E.lookup(t, (zipf_batch(rng, 16, 5) + 200) % N)  # misses: dirty rows go home, new rows come in
    assert t._home is not None and t._home.result(timeout=10) is None  # landed: not waiting for that gather
    t.check()  # the ways the read was filling are empty, their rows home
    assert np.array_equal(contents(t), ref.W)


ON_GPU = pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not gpu_device.available(),
                                                                         reason="needs a CUDA GPU and CuPy")])


@pytest.mark.parametrize("where", ["host", ON_GPU])
@pytest.mark.parametrize("reads", ["staged", "split"])
def test_a_gather_that_fails_on_its_threads_empties_the_ways_it_was_filling_and_raises(monkeypatch, reads, where):
    """The device copies and puts a read's pieces as the CPU threads' flags say they are
    gathered; a thread that fails flags its pieces failed, the device then puts nothing and
    empties the ways the read was filling (their rows went home first), and the lookup raises
    the thread's error. The table stays consistent and usable."""
    rng = np.random.default_rng(23)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    with (host_manager() if where == "host" else gpu_manager()) as m:
        t, ref = make(W0, m, cache_rows=40, ways=4, reads=reads, name="t"), Reference(W0)
        t.read_share = 0.5
        for step in range(3):  # dirty cached rows
            idx = zipf_batch(rng, 16, 5)
            E.lookup(t, idx)
            E.pullback(t, np.ones((16, F), np.float32), idx, optimizer=E.SGD(0.1))
            ref.pullback(np.ones((16, F), np.float32), idx, optimizer=E.SGD(0.1))
        gather = LG.gather_signalled

        def bad_row(tables, tabs, rows, *a, **kw):
            rows = rows.copy()
            rows[-1] = tables[int(tabs[-1])].shape[0]
            return gather(tables, tabs, rows, *a, **kw)
        monkeypatch.setattr(LG, "gather_signalled", bad_row)
        with pytest.raises(IndexError, match="outside it"):
            E.lookup(t, (zipf_batch(rng, 16, 5) + 200) % N)  # misses: dirty rows go home, new rows come in
        t.check()
        assert np.array_equal(contents(t), ref.W)
        monkeypatch.setattr(LG, "gather_signalled", gather)
        idx = zipf_batch(rng, 16, 5)
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        t.check()
        t.close()
        m.check()


def test_a_read_whose_threads_do_not_begin_in_time_waits_for_them_before_the_device_waits(monkeypatch):
    """Should a gather's threads not all begin their shares without the GIL in time (their pool
    busy), the read waits on the host for them to end before it queues the device's waits for
    their flags (which a share still needing the GIL could otherwise block): every step ends as
    with threads that began at once."""
    from embeddings.gpu.backend import ReferenceBackend
    from embeddings.kernels.signalled import Gathering
    alone, _ = trace_tables(host_manager(), True, reads="split")
    events = []
    monkeypatch.setattr(Gathering, "running", lambda self, timeout_s=10.0: events.append("late") or False)
    join = Gathering.join
    monkeypatch.setattr(Gathering, "join", lambda self: (join(self), events.append(("joined", all(
        f.done() for f in self._futures))))[0])
    wait = ReferenceBackend.wait_flags
    monkeypatch.setattr(ReferenceBackend, "wait_flags", lambda self, flags, *a, **kw:
                        events.append(("wait", bool(np.all(flags)))) or wait(self, flags, *a, **kw))
    late, _ = trace_tables(host_manager(), True, reads="split")
    assert_same_traces(late, alone)
    reads = [i for i, e in enumerate(events) if e == "late"]
    assert reads and all(events[i + 1] == ("joined", True) for i in reads)
    assert all(e[1] for e in events if isinstance(e, tuple) and e[0] == "wait")  # every flag set before each wait


def test_a_prefetched_batch_is_range_checked_once_and_any_other_batch_at_its_lookup(monkeypatch):
    """The lookup of indices equal to a prefetched batch skips the range check the prefetch did
    (a read of every index); any other batch is checked, and a bad index raises naming it."""
    import embeddings.batch as EB
    rng = np.random.default_rng(21)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=120, ways=4, name="t"), Reference(W0)
    a, b = zipf_batch(rng, 16, 5), zipf_batch(rng, 16, 5)
    want_a, want_b = ref.lookup(a), ref.lookup(b)
    import embeddings.gpu.backend as BE
    checked = []
    check, copy = EB.out_of_range, BE.copy_checked_each
    monkeypatch.setattr(EB, "out_of_range", lambda flat, n: checked.append(flat.size) or check(flat, n))
    monkeypatch.setattr(BE, "copy_checked_each",
                        lambda flats, n, outs: checked.extend(f.size for f in flats) or copy(flats, n, outs))
    prefetch(t, a.ravel())
    assert checked == [80]  # as the prefetch copies the batch for the device
    checked.clear()
    assert np.array_equal(_host(E.lookup(t, a.copy())), want_a)  # equal to the prefetched batch
    assert checked == []
    assert np.array_equal(_host(E.lookup(t, b)), want_b)  # not prefetched: checked
    assert checked == [80]
    bad = b.copy()
    bad[3, 2] = N
    prefetch(t, a.ravel())
    with pytest.raises(IndexError, match=rf"t: index {N} at position \(3, 2\) is out of range"):
        E.lookup(t, bad)
    t.check()
    t.close()
    m.check()


def test_the_lookup_of_a_prefetched_batch_in_the_same_memory_reads_no_index_again(monkeypatch):
    """A lookup given the prefetched batch's memory again (another view: a trainer prefetches the
    flat indices and looks up the 2-d array they view) takes its placement without comparing the
    indices, which a full comparison of a trainer's batches did for 3 ms a step; a copy of the
    batch is compared in full, and a different batch of the same shape is told apart."""
    import embeddings.gpu.lru as LRU
    rng = np.random.default_rng(23)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=120, ways=4, name="t"), Reference(W0)
    a = zipf_batch(rng, 16, 5)
    compared = []
    equal = np.array_equal
    monkeypatch.setattr(LRU.np, "array_equal", lambda x, y: compared.append(x.size) or equal(x, y))
    prefetch(t, a.reshape(-1))
    assert t.telemetry()["prefetch_fallbacks"] == 0
    compared.clear()
    got = _host(E.lookup(t, a))
    assert compared == [] and not t._ahead  # taken, without reading an index
    assert equal(got, ref.lookup(a))
    prefetch(t, a.reshape(-1))
    compared.clear()
    got = _host(E.lookup(t, a.copy()))
    assert 80 in compared and not t._ahead  # other memory: compared in full, and taken
    assert equal(got, ref.lookup(a))
    b = (a + 1) % N
    prefetch(t, b.reshape(-1))
    assert np.array_equal(_host(E.lookup(t, a)), ref.lookup(a))  # not b's placement
    t.check()
    t.close()
    m.check()


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_a_split_read_with_an_empty_part_brings_every_row_and_keeps_its_share(monkeypatch, share):
    """A share of 0 (CPU threads gather every row) or 1 (the GPU reads them all): every row still
    comes in, and with one part empty no rate is measured, so the share stays. The placement's
    stream follows the end of the GPU's part in either case (the work after it, and the lookup,
    must not run before the rows are in)."""
    from embeddings.gpu.backend import ReferenceBackend
    clocks, followed = [], []
    follow = ReferenceBackend.follow
    monkeypatch.setattr(ReferenceBackend, "clock", lambda self: clocks.append(object()) or clocks[-1])
    monkeypatch.setattr(ReferenceBackend, "follow", lambda self, fence: followed.append(fence) or follow(self, fence))
    rng = np.random.default_rng(22)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=40, ways=4, reads="split", name="t"), Reference(W0)
    t.read_share = share
    for step in range(4):
        idx = zipf_batch(rng, 16, 5)
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        g = rng.standard_normal((16, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=E.SGD(0.1))
        ref.pullback(g, idx, optimizer=E.SGD(0.1))
        t.check()
    assert t.read_share == share
    assert clocks and all(end in followed for end in clocks[1::2])
    t.writeback()
    assert np.array_equal(base_rows(t), ref.W)
    t.close()
    m.check()


def test_the_split_share_moves_halfway_to_the_balance_of_the_two_rates_within_bounds():
    tables = [types.SimpleNamespace(read_share=0.5) for _ in range(3)]
    LG.balance(tables, 3e6, 1e6)  # the GPU reads three times as fast: it should take 3/4
    assert [t.read_share for t in tables] == [0.625] * 3
    for _ in range(20):
        LG.balance(tables, 1.0, 0.0)
    assert tables[2].read_share == 0.98
    for _ in range(20):
        LG.balance(tables, 0.0, 1.0)
    assert tables[0].read_share == 0.02


class LRUMachine(MirroredCache):
    """The set-associative cache: the shared rules, and flushes, over every size, associativity
    and staging area."""

    contents = staticmethod(contents)

    @initialize(rows=st.integers(1, 60), ways=st.integers(1, 8), staging=st.integers(1, 6), adagrad=st.booleans(),
                reads=st.sampled_from(["mapped", "staged", "split"]), replacement=st.sampled_from(REPLACEMENTS))
    def setup(self, rows, ways, staging, adagrad, reads, replacement):
        self.rng = np.random.default_rng(rows * 31 + ways)
        W0 = self.rng.standard_normal((120, 4)).astype(np.float32)
        self.start(rows, W0, adagrad)
        self.t = LRUCachedEmbeddings(W0.copy(), self.m, cache_rows=rows, ways=ways, staging_rows=staging,
                                     reads=reads, replacement=replacement)
        self.planned: list[np.ndarray] = []

    @rule(n=st.integers(0, 12), k=st.integers(1, 2))
    def plan(self, n, k):
        """Prefetch a batch to be looked up later; several may wait (the queue of placements).
        Small, so that most find a way for every row and their lookups take the prefetched slots."""
        idx = ((self.rng.zipf(1.2, (n, k)) - 1) % 120).astype(np.int64)
        prefetch(self.t, idx.ravel())
        self.planned.append(idx)

    @precondition(lambda self: self.planned)
    @rule(update=st.booleans())
    def take(self, update):
        """Look up (and update) the oldest planned batch: through its prefetched slots where they
        serve, else placed then."""
        self.step(self.planned.pop(0), update)

    @invariant()
    def queued_placements_keep_their_rows(self):
        """A prefetched placement waiting for its lookup still finds every row in its slots
        (later placements lock its ways)."""
        if not hasattr(self, "t"):
            return
        for a in list(self.t._ahead):
            if a.placed:
                assert np.array_equal(_host(self.t._tags)[_host(a.slots)], a.flat)

    @rule(dirty=st.booleans())
    def flush(self, dirty):
        if dirty:
            self.t.flush_dirty()
        else:
            self.t.writeback()
            self.t.flush_clean()
        assert self.t.cached_rows == 0


TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("opt,reads", [("sgd", "mapped"), ("adagrad", "mapped"), ("sgd", "staged"),
                                       ("adagrad", "staged"), ("sgd", "split"), ("adagrad", "split"),
                                       ("sgd_any", "staged")])
def test_gpu_lru_table_equals_the_uncached_gpu_table_bit_for_bit(opt, reads):
    rng = np.random.default_rng(12)
    W0 = rng.standard_normal((20000, 64)).astype(np.float32)
    with gpu_manager() as m:
        t = LRUCachedEmbeddings(W0, m, cache_fraction=0.05, staging_rows=64, reads=reads, name="emb")
        train_and_compare(m, t, contents, W0, rng, opt, 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_on_the_gpu_a_replaced_accumulator_is_no_longer_page_locked_and_host_copies_still_work():
    import cupy as cp
    from cachedarrays.devices.gpu import page_locked_at
    rng = np.random.default_rng(13)
    W0 = rng.standard_normal((20000, 64)).astype(np.float32)
    idx = zipf_batch(rng, 64, 5)
    g = rng.standard_normal((64, 64)).astype(np.float32)
    with gpu_manager() as m:
        t = LRUCachedEmbeddings(W0, m, cache_fraction=0.05, staging_rows=64, name="emb")
        first, second = E.RowwiseAdagrad(0.1), E.RowwiseAdagrad(0.1)
        E.pullback(t, g, idx, optimizer=first)
        p1 = first.state(t).ctypes.data
        assert page_locked_at(p1)
        E.pullback(t, g, idx, optimizer=second)
        p2 = second.state(t).ctypes.data
        assert not page_locked_at(p1) and page_locked_at(p2)
        del first
        for _ in range(20):  # fresh host arrays over the freed range copy to the device as usual
            a = np.full(20000, 3, np.int32)
            assert int(cp.asarray(a).sum()) == 60000
        t.close()
        assert not page_locked_at(p2)


SPECS = [(3000, 600, 4), (5000, 512, 8), (800, 200, 4)]  # rows, cache rows, ways


def trace_tables(m, together: bool, seed: int = 15, reads: str = "mapped",
                 replacement: str | list[str] = "lru", own_stream: bool = False) -> tuple[list, int]:
    """Three tables (``reads``, ``replacement``: one for all or one each) trained for 9 steps with Adagrad (lookup, prefetch of the next
    batch, update), prefetched ``together`` (one table-batched placement) or one table at a time:
    the state of every table after every step (tags, stamps, dirty bits, counts, contents, the
    accumulator, lfu's counts of use), and for each prefetch how many functions did it and whether each placed every row.
    ``own_stream``: the prefetches run on a stream of their own, as the prefetcher's thread runs them."""
    rng = np.random.default_rng(seed)
    reps = [replacement] * len(SPECS) if isinstance(replacement, str) else replacement
    ts = [LRUCachedEmbeddings(rng.standard_normal((r, 16)).astype(np.float32), m, cache_rows=c, ways=w,
                              staging_rows=2, reads=reads, replacement=rep, name=f"t{i}")
          for i, ((r, c, w), rep) in enumerate(zip(SPECS, reps))]
    batches = [[zipf_batch(rng, 64, 4, r) for r, _, _ in SPECS] for _ in range(10)]
    opt = E.RowwiseAdagrad(0.1)
    states, runs = [], []
    for step in range(9):
        for t, b in zip(ts, batches[step]):
            E.lookup(t, b)
        nxt = [b.ravel() for b in batches[step + 1]]
        works = (LRUCachedEmbeddings.prefetch_works(ts, nxt) if together
                 else [w for t, b in zip(ts, nxt) for w in LRUCachedEmbeddings.prefetch_works([t], [b])])
        if own_stream:  # as the prefetcher runs them: after the work queued so far, then joined
            be = ts[0].backend
            fence = be.fence()
            placed = []
            for w in works:
                be.follow(prefetcher._run(be, lambda: placed.append(w()), getattr(w, "after", None) or [fence]))
            runs.append((len(works), placed))
        else:
            runs.append((len(works), [w() for w in works]))
        for t, b in zip(ts, batches[step]):
            E.pullback(t, rng.standard_normal((64, 16)).astype(np.float32), b, optimizer=opt)
        states.append([tuple(np.array(a) for a in (_host(t._tags), _host(t._stamp), _host(t._dirty), t.counts,
                                                    contents(t), opt.state(t), _uses(t))) for t in ts])  # copies
    for t in ts:
        t.check()
        t.close()
    return states, runs


def _uses(t: LRUCachedEmbeddings) -> np.ndarray:
    return np.zeros(0, np.int32) if t._uses is None else _host(t._uses)


def assert_same_traces(a: list, b: list) -> None:
    for step, (x, y) in enumerate(zip(a, b)):
        for i, (u, v) in enumerate(zip(x, y)):
            for name, p, q in zip(("tags", "stamps", "dirty", "counts", "contents", "accumulator", "uses"), u, v):
                np.testing.assert_array_equal(p, q, err_msg=f"step {step}, table {i}: {name}")


def test_lfu_places_the_traced_batches_otherwise_than_lru_and_alone_as_together():
    lfu, runs = trace_tables(host_manager(), True, replacement="lfu")
    alone, _ = trace_tables(host_manager(), False, replacement="lfu")
    assert_same_traces(lfu, alone)
    lru, _ = trace_tables(host_manager(), True)
    assert any(not np.array_equal(p[0][0], q[0][0]) for p, q in zip(lfu, lru))  # other rows cached
    mixed, _ = trace_tables(host_manager(), True, replacement=["lfu", "lru", "lfu"])  # one group, both kinds
    assert_same_traces([[x[0], y[1], x[2]] for x, y in zip(lfu, lru)], mixed)
    assert all(u[-1].min() >= 0 and u[-1].max() > 1 for u in lfu[-1])  # rows used in several batches counted


def test_a_table_batched_prefetch_makes_each_tables_own_decisions(monkeypatch):
    together, runs = trace_tables(host_manager(), True)
    alone, _ = trace_tables(host_manager(), False)
    # all three placed at once (a row left out), and other placements where every row found a way
    assert (1, [False]) in runs and any(True in r for _, r in runs)
    assert_same_traces(together, alone)
    for reads in ("staged", "split"):
        other, _ = trace_tables(host_manager(), True, reads=reads)
        assert_same_traces(other, alone)
    import embeddings.gpu.backend as BE
    calls = []  # staged reads gathered piece by piece, each piece copied up on its own
    gather, upload = LG.gather_signalled, BE.ReferenceBackend.upload
    monkeypatch.setattr(LG, "gather_signalled", lambda tables, tabs, rows, block, cuts, *a, **kw:
                        calls.append(np.diff(cuts).tolist()) or gather(tables, tabs, rows, block, cuts, *a, **kw))
    ups = []
    monkeypatch.setattr(BE.ReferenceBackend, "upload", lambda self, dst, src: ups.append(len(src)) or upload(self, dst, src))
    monkeypatch.setattr(LG, "READ_PIECE_ROWS", 1)
    counted = []
    for pieces in (1, 4):
        calls.clear()
        monkeypatch.setattr(LG, "READ_PIECES", pieces)
        ups.clear()
        other, _ = trace_tables(host_manager(), True, reads="staged")
        assert_same_traces(other, alone)
        counted.append(sum(len(c) for c in calls))
        assert ups == [n for c in calls for n in c]  # each piece up on its own, in order, as the read cut it
    assert counted[1] > 3 * counted[0]  # reads of four rows or more, in four pieces


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_the_table_batched_cuda_kernels_make_the_numpy_forms_decisions():
    """Probe, count, distinct, victims, moves, both copies (rows and accumulators), settle and
    slots on the GPU against their numpy forms: same state after every step."""
    with gpu_manager() as gm:
        on_gpu, runs = trace_tables(gm, True)
        staged, _ = trace_tables(gm, True, reads="staged")
        split, _ = trace_tables(gm, True, reads="split")
        lfu_gpu, lfu_runs = trace_tables(gm, True, replacement="lfu")
        mixed_gpu, _ = trace_tables(gm, True, replacement=["lru", "lfu", "lru"])
    on_cpu, runs_cpu = trace_tables(host_manager(), True)
    assert runs == runs_cpu and (1, [False]) in runs
    assert_same_traces(on_gpu, on_cpu)
    assert_same_traces(staged, on_cpu)  # the rows gathered on the host and put into their slots
    assert_same_traces(split, on_cpu)  # some rows read by the GPU, the others gathered on the host
    lfu_cpu, lfu_runs_cpu = trace_tables(host_manager(), True, replacement="lfu")
    assert lfu_runs == lfu_runs_cpu
    assert_same_traces(lfu_gpu, lfu_cpu)  # counts of use once a batch, the order of eviction
    mixed_cpu, _ = trace_tables(host_manager(), True, replacement=["lru", "lfu", "lru"])
    assert_same_traces(mixed_gpu, mixed_cpu)  # lru tables in an lfu group: no counts, their own order


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_the_gpu_cache_makes_the_decisions_of_its_numpy_form(replacement):
    """Same batches, same sizes: the CUDA path and the numpy path hold the same rows in the same
    slots, with the same stamps and dirty bits, after every step (prefetch and staging included)."""
    rng = np.random.default_rng(14)
    W0 = rng.standard_normal((3000, 16)).astype(np.float32)
    with gpu_manager() as gm:
        hm = host_manager()
        ts = [LRUCachedEmbeddings(W0.copy(), mm, cache_rows=96, ways=4, staging_rows=2, replacement=replacement,
                                  name="t") for mm in (hm, gm)]
        opts = [E.RowwiseAdagrad(0.1), E.RowwiseAdagrad(0.1)]
        nxt = zipf_batch(rng, 64, 4, 3000)
        for step in range(12):
            idx, nxt = nxt, zipf_batch(rng, 64, 4, 3000)
            g = rng.standard_normal((64, 16)).astype(np.float32)
            for t, o in zip(ts, opts):
                E.lookup(t, idx)
                if step % 4:
                    prefetch(t, nxt.ravel())
                E.pullback(t, g, idx, optimizer=o)
            for name in ("_tags", "_stamp", "_dirty") + (("_uses",) if replacement == "lfu" else ()):
                np.testing.assert_array_equal(_host(getattr(ts[0], name)), _host(getattr(ts[1], name)), err_msg=name)
            assert np.array_equal(ts[0].counts, ts[1].counts)
        for t in ts:
            t.check()
            t.close()


def two_tables(seed: int, **kw) -> tuple:
    """(rng, manager, two lru tables over random rows, their references, 10 batches of 8 bags
    of 4 for each table)."""
    rng = np.random.default_rng(seed)
    Ws = [rng.standard_normal((N, F)).astype(np.float32) for _ in range(2)]
    m = host_manager()
    ts = [make(W, m, name=f"t{i}", **kw) for i, W in enumerate(Ws)]
    return rng, m, ts, [Reference(W) for W in Ws], [[zipf_batch(rng, 8, 4) for _ in ts] for _ in range(10)]


def test_a_background_prefetch_overlapping_the_update_changes_no_result():
    """The DLRM step's order: lookup, prefetch of the next batch started (validated now, device
    work on the worker thread), update of the current batch, then the prefetch joined."""
    rng, m, ts, refs, batches = two_tables(9, cache_rows=24, ways=4)
    synchronous = []
    for j, b in enumerate(batches):
        for t, r, idx in zip(ts, refs, b):
            assert np.array_equal(_host(E.lookup(t, idx)), r.lookup(idx))
        pending = None
        if j + 1 < len(batches):
            pending = prefetcher.start(ts, [i.ravel() for i in batches[j + 1]], synchronous.append)
        for t, r, idx in zip(ts, refs, b):
            g = rng.standard_normal((8, F)).astype(np.float32)
            E.pullback(t, g, idx, optimizer=E.SGD(0.1))
            r.pullback(g, idx, optimizer=E.SGD(0.1))
        prefetcher.finish(pending)
        for t, r in zip(ts, refs):
            t.check()
            assert np.array_equal(contents(t), r.W)
    assert synchronous == []  # every table prefetched in the background
    with pytest.raises(IndexError, match="t1: index 400"):
        prefetcher.start(ts, [np.array([1]), np.array([400])], synchronous.append)
    hits, misses, _ = ts[0].counts
    assert hits + misses == 10 * 8 * 4  # each batch counted once
    for t in ts:
        t.close()
    m.check()


def test_rows_sent_home_in_the_background_land_before_anything_reads_them(monkeypatch):
    """Evicted rows reach the host table through a CPU scatter in the background (held back
    here until the step is over): the next placement's reads and closing wait for it, so every
    lookup and the base table after closing equal the uncached table's."""
    import time
    from embeddings.kernels import scatter
    real, scattered = scatter.scatter_rows, []

    def late(jobs):
        time.sleep(0.05)
        scattered.append(sum(int(r.size) for _, r, _ in jobs))
        real(jobs)
    monkeypatch.setattr(scatter, "scatter_rows", late)
    rng, m, ts, refs, batches = two_tables(11, cache_rows=24, ways=4)
    prefetcher.finish(prefetcher.start(ts, [i.ravel() for i in batches[0]], None))
    for j, b in enumerate(batches):
        pending = prefetcher.start(ts, [i.ravel() for i in batches[j + 1]], None) if j + 1 < len(batches) else None
        for t, r, idx in zip(ts, refs, b):
            assert np.array_equal(_host(E.lookup(t, idx)), r.lookup(idx)), j
            g = rng.standard_normal((8, F)).astype(np.float32)
            E.pullback(t, g, idx, optimizer=E.SGD(0.1))
            r.pullback(g, idx, optimizer=E.SGD(0.1))
        prefetcher.finish(pending)
    assert sum(scattered) > 50  # many rows went home through the background scatter
    cpu = [t.telemetry()["prefetch_cpu_s"] for t in ts]
    assert all(c > 0 for c in cpu) and cpu[0] == cpu[1]  # one placement of both tables, its CPU shared
    ts[0].reset_counters()
    assert ts[0].telemetry()["prefetch_cpu_s"] == 0 and ts[1].telemetry()["prefetch_cpu_s"] == cpu[1]
    for t, r in zip(ts, refs):
        t.close()
        assert np.array_equal(base_rows(t), r.W)
    m.check()


@pytest.mark.parametrize("where", ["host", ON_GPU])
def test_tables_dropped_while_their_rows_go_home_are_freed_at_once(where):
    """Tables dropped unclosed while a placement's rows are on their way home go with their last
    reference (once the scatter that holds them ends), not at some later collection of cycles,
    which would release their memory at a moment no caller chose (under a new manager's tables,
    on the GPU)."""
    import gc
    import weakref
    rng = np.random.default_rng(8)
    m = host_manager() if where == "host" else gpu_manager()
    ts = [make(rng.standard_normal((N, F)).astype(np.float32), m, cache_rows=16, ways=4, name=f"t{i}")
          for i in range(2)]
    ens = E.Ensemble(ts)
    batch = [zipf_batch(rng, 8, 4) for _ in ts]
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(4):
            nxt = [zipf_batch(rng, 8, 4) for _ in ts]
            ens.lookup(batch)
            for work in LRUCachedEmbeddings.prefetch_works(ts, [b.ravel() for b in nxt]):
                work()
            ens.pullback(np.ones((8, 2, F), np.float32), batch, optimizer=E.SGD(0.1))
            batch = nxt
        assert any(t.rows_written_back for t in ts)  # rows went home
        refs = [weakref.ref(t) for t in ts]
        del ts, ens, work
        deadline = time.monotonic() + 10  # a scatter still running holds its tables until it ends
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r() for r in refs] == [None, None]
    finally:
        if enabled:
            gc.enable()
        m.close()


@pytest.mark.parametrize("cache_rows,fits", [(16, False), (N, True)])
def test_prefetched_batches_that_do_not_fit_the_cache_are_counted_and_warned_about_once(cache_rows, fits):
    """Batches of ~32 distinct rows: a 16-row cache cannot hold them, so every prefetched batch's
    lookup places it again (results unchanged), the table counts each one and warns once, naming
    itself and the remedy; a cache of every row counts none and stays silent."""
    import warnings
    rng = np.random.default_rng(12)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=cache_rows, ways=4, name="small"), Reference(W0)
    batches = [rng.integers(0, N, (8, 4)) for _ in range(8)]
    prefetch(t, batches[0].ravel())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for j, b in enumerate(batches):
            assert np.array_equal(_host(E.lookup(t, b)), ref.lookup(b))
            if j + 1 < len(batches):
                prefetch(t, batches[j + 1].ravel())
            g = rng.standard_normal((8, F)).astype(np.float32)
            E.pullback(t, g, b, optimizer=E.SGD(0.1))
            ref.pullback(g, b, optimizer=E.SGD(0.1))
            t.check()
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    if fits:
        assert said == [] and t.telemetry()["prefetch_fallbacks"] == 0
    else:
        assert len(said) == 1 and said[0].startswith("small: three prefetched batches in a row did not fit")
        assert "--cache-fraction" in said[0] and "smaller batches" in said[0]
        assert t.telemetry()["prefetch_fallbacks"] == len(batches)
        t.reset_counters()
        assert t.telemetry()["prefetch_fallbacks"] == 0
    assert np.array_equal(contents(t), ref.W)
    t.close()
    m.check()


def test_the_too_small_cache_warning_needs_three_fallbacks_in_a_row():
    """Fallback, fallback, a batch that fit, fallback: three counted, no warning (the batch that
    fit starts the run again); two more in a row make three and warn."""
    import warnings
    _, m, t = fresh(13, cache_rows=40, name="t9")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for placed in (False, False, True, False):
            t._prefetch_outcome(placed)
        assert t.prefetch_fallbacks == 3 and not seen
        t._prefetch_outcome(False)
        assert not seen
        t._prefetch_outcome(False)
    assert t.prefetch_fallbacks == 5 and [str(w.message)[:20] for w in seen] == ["t9: three prefetched"]
    t.close()
    m.check()


def test_a_prefetch_started_before_the_lookup_runs_beside_the_whole_step(monkeypatch):
    """The DLRM step's order for lru tables: the next batch's prefetch starts before the current
    batch's lookup and is joined after its update. The lookup and the update of a batch whose
    prefetch placed every row do not wait for it (its placement is held back until they are
    done: had they waited, the gate below would time out), and results equal the uncached
    table's."""
    import threading
    from embeddings.gpu import lru_group as LG
    rng, m, ts, refs, batches = two_tables(10, cache_rows=160, ways=8)
    place, gate, timed_out = LG.place, threading.Event(), []

    def held_back(*a, **k):
        if threading.current_thread() is not threading.main_thread() and not gate.wait(5):
            timed_out.append(True)
        return place(*a, **k)
    monkeypatch.setattr(LG, "place", held_back)
    gate.set()
    prefetcher.finish(prefetcher.start(ts, [i.ravel() for i in batches[0]], None))
    fast = 0
    for j, b in enumerate(batches):
        gate.clear()
        pending = prefetcher.start(ts, [i.ravel() for i in batches[j + 1]], None) if j + 1 < len(batches) else None
        taken = [t._ahead[0].stamp if t._ahead else None for t in ts]
        for t, r, idx in zip(ts, refs, b):
            assert np.array_equal(_host(E.lookup(t, idx)), r.lookup(idx))
            g = rng.standard_normal((8, F)).astype(np.float32)
            E.pullback(t, g, idx, optimizer=E.SGD(0.1))
            r.pullback(g, idx, optimizer=E.SGD(0.1))
        fast += sum(s is not None and t._inflight_stamp == s for t, s in zip(ts, taken))
        gate.set()
        prefetcher.finish(pending)
        for t, r in zip(ts, refs):
            t.check()
            assert np.array_equal(contents(t), r.W)
    assert not timed_out
    assert fast == 2 * 10  # every lookup took its prefetched slots without waiting
    for t in ts:
        t.close()
    m.check()


def test_a_lookup_that_must_place_its_batch_leaves_the_next_prefetched_batch_valid():
    """Prefetches started before the lookup, with a cache so small that some leave rows out:
    such a lookup places its batch itself (staging what finds no way) without evicting the next
    batch's prefetched rows (checked slot by slot: 48 rows in 6 sets leave it no other choice at
    times), so the next lookup still takes its slots; each batch is counted once and results
    equal the uncached table's."""
    rng = np.random.default_rng(11)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=48, ways=8, staging_rows=2), Reference(W0)
    batches = [zipf_batch(rng, 8, 4) for _ in range(30)]
    prefetcher.finish(prefetcher.start([t], [batches[0].ravel()], None))
    slow_then_fast, was_fast, kept = 0, True, 0
    for j, b in enumerate(batches):
        pending = prefetcher.start([t], [batches[j + 1].ravel()], None) if j + 1 < len(batches) else None
        head = t._ahead[0] if t._ahead else None
        assert np.array_equal(_host(E.lookup(t, b)), ref.lookup(b))
        fast = head is not None and head.placed and t._inflight_stamp == head.stamp
        g = rng.standard_normal((8, F)).astype(np.float32)
        E.pullback(t, g, b, optimizer=E.SGD(0.1))
        ref.pullback(g, b, optimizer=E.SGD(0.1))
        prefetcher.finish(pending)
        if t._ahead and t._ahead[0].placed:  # the next batch's rows are still where it put them
            kept += 1
            assert np.array_equal(_host(t._tags)[_host(t._ahead[0].slots)], t._ahead[0].flat), j
        if not was_fast and fast:
            slow_then_fast += 1
        was_fast = fast
        t.check()
        assert np.array_equal(contents(t), ref.W)
    assert slow_then_fast > 0 and kept > 0
    hits, misses, _ = t.counts
    assert hits + misses == 30 * 8 * 4
    t.close()
    m.check()


def test_the_dlrm_model_reads_and_restores_a_cached_gpu_tables_adagrad_state(monkeypatch):
    """``DLRM.table_state`` / ``set_table_state`` (checkpoints) reach the accumulator the cache
    really uses (its device copy written back to the optimizer's host array, and rebuilt from it)."""
    import dlrm.model as M
    from dlrm import DLRM, DLRMConfig
    monkeypatch.setattr(M.jax, "device_put", lambda x: x)
    rng = np.random.default_rng(10)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = make(W0, m, cache_rows=40, ways=4, name="t0")
    model = DLRM(DLRMConfig([N], F, (6, F), (4, 1)), [t], optimizer="adagrad", lr=0.1, device="gpu")
    assert model.ensembles and not model._per_table and model._prefetching  # one ensemble call, and prefetches
    ref = Reference(W0)
    theirs = E.RowwiseAdagrad(0.1)
    for _ in range(3):
        idx = zipf_batch(rng, 8, 3)
        g = rng.standard_normal((8, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=model.table_opt)
        ref.pullback(g, idx, optimizer=theirs)
    np.testing.assert_array_equal(model.table_state(0), ref.state)
    values = rng.random(N).astype(np.float32)
    model.set_table_state(0, values)
    ref.state[...] = values
    idx = zipf_batch(rng, 8, 3)
    g = rng.standard_normal((8, F)).astype(np.float32)
    E.pullback(t, g, idx, optimizer=model.table_opt)
    ref.pullback(g, idx, optimizer=theirs)
    np.testing.assert_array_equal(contents(t), ref.W)
    np.testing.assert_array_equal(model.table_state(0), ref.state)
    t.close()


def test_a_lookup_of_a_batch_nobody_prefetched_keeps_the_next_batchs_placement(monkeypatch):
    """The trainer's order (the next batch's prefetch started, then the current lookup), with the
    prefetch landed before the lookup. A lookup of a batch that was not prefetched (the first
    one, one after a skipped batch, evaluation lookups) must keep the placement of the batch
    prefetched just before it: dropping it made every later lookup place its own batch too.
    Placements prefetched before the previous lookup were skipped, and go."""
    rng = np.random.default_rng(16)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t, ref = make(W0, m, cache_rows=256, ways=8), Reference(W0)  # room for three batches: every row finds a way
    own = []
    place = LRUCachedEmbeddings._place
    monkeypatch.setattr(LRUCachedEmbeddings, "_place", lambda self, *a, **k: own.append(j) or place(self, *a, **k))
    batches = [zipf_batch(rng, 8, 4) for _ in range(40)]

    def lookup(b):
        assert np.array_equal(_host(E.lookup(t, b)), ref.lookup(b))

    def step(cur, nxt):
        prefetcher.finish(prefetcher.start([t], [batches[nxt].ravel()], None))
        lookup(batches[cur])
        g = rng.standard_normal((8, F)).astype(np.float32)
        E.pullback(t, g, batches[cur], optimizer=E.SGD(0.1))
        ref.pullback(g, batches[cur], optimizer=E.SGD(0.1))
        t.check()

    for j in [*range(10), *range(14, 24)]:  # batch 10 is prefetched, then skipped
        step(j, j + 1)
    for j in range(30, 33):  # evaluation: lookups only
        lookup(batches[j])
        assert len(t._ahead) == 0  # the skipped batch 24 went at the first of them
    for j in range(24, 29):
        step(j, j + 1)
    assert own == [0, 14, 30, 31, 32, 24]
    assert np.array_equal(contents(t), ref.W)
    t.close()
    m.check()


def test_a_lookup_waits_for_a_background_prefetch_that_nobody_joined():
    rng = np.random.default_rng(14)
    W0 = rng.standard_normal((N, F)).astype(np.float32)
    m = host_manager()
    t = make(W0, m, cache_rows=24, ways=4)
    ref = Reference(W0)
    for _ in range(20):
        idx, nxt = zipf_batch(rng, 8, 4), zipf_batch(rng, 8, 4)
        assert np.array_equal(_host(E.lookup(t, idx)), ref.lookup(idx))
        prefetcher.start([t], [nxt.ravel()], None)  # never finished: the next operation waits for it
        g = rng.standard_normal((8, F)).astype(np.float32)
        E.pullback(t, g, idx, optimizer=E.SGD(0.1))
        ref.pullback(g, idx, optimizer=E.SGD(0.1))
        t.check()
        assert np.array_equal(contents(t), ref.W)
    t.close()
    assert np.array_equal(base_rows(t), ref.W)


def test_the_prefetcher_joins_every_table_before_raising_a_workers_error():
    import threading
    from embeddings.gpu.backend import ReferenceBackend
    finished = threading.Event()

    class Failing:
        backend = ReferenceBackend()

        @classmethod
        def prefetch_works(cls, tables, idx):
            def work():
                raise RuntimeError("device work failed")
            return [work]

    class Slow:
        backend = ReferenceBackend()

        @classmethod
        def prefetch_works(cls, tables, idx):
            def work():
                finished.wait(0.2)
                finished.set()
            return [work]

    pending = prefetcher.start([Failing(), Slow()], [np.zeros(1), np.zeros(1)], None)
    with pytest.raises(RuntimeError, match="device work failed"):
        prefetcher.finish(pending)
    assert finished.is_set()  # the other table's work had ended when the error came
    assert prefetcher.start([], [], None) is None
    with pytest.raises(TypeError, match="plain: cannot prefetch in the background"):
        prefetcher.start([E.SimpleEmbedding(np.zeros((4, 2), np.float32), name="plain")], [np.zeros(1)], None)


def test_the_hit_rate_benchmark_runs_the_placements_decisions_and_lfu_keeps_more_hot_rows(tmp_path, capsys):
    """``benchmarks/cache_hitrate.py`` (no GPU): both replacements over one seeded Zipf stream,
    placed by the numpy forms; on it lfu hits more often than lru, below the static top-k bound."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import cache_hitrate as CH
    out = tmp_path / "h.json"
    assert CH.main(["--rows", "100000", "--batch", "512", "--batches", "60", "--warm", "20", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    lru, lfu = got["results"]["lru"], got["results"]["lfu"]
    assert 0.5 < lru["hit_rate"] < lfu["hit_rate"] < got["ideal_static_top_k"] < 1
    assert lru["misses_per_batch"] > lfu["misses_per_batch"] > 0
    assert "lfu" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        CH.main(["--batches", "10", "--warm", "10", "--out", str(out)])
    assert "leaves no batch to count" in capsys.readouterr().err


def test_the_host_memory_floor_times_a_steps_rows_and_leaves_the_tables_as_they_were(monkeypatch):
    """``gpu_dlrm.host_floor`` on the reference backend (numpy as the device): every way a
    placement moves rows is timed, the whole-step schedule scatters beside its gather (on
    another thread), the floor is the best schedule, the check of a read's rows passes, and the
    scatter of the rows going home writes their own values back."""
    import sys
    import threading
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_dlrm as GD
    from embeddings.gpu.backend import ReferenceBackend
    from embeddings.kernels import scatter as SC
    scattered_on = []
    real = SC.scatter_rows
    monkeypatch.setattr(SC, "scatter_rows", lambda jobs, threads=None: scattered_on.append(
        threading.current_thread()) or real(jobs, threads))
    rng = np.random.default_rng(5)
    hosts = [rng.standard_normal((20_000, 16)).astype(np.float32) for _ in range(3)]
    before = [h.copy() for h in hosts]
    got = GD.host_floor(hosts, 5001, 3000, repeats=1, backend=ReferenceBackend())
    assert all(np.array_equal(h, b) for h, b in zip(hosts, before))
    beside = [t for t in scattered_on if t is not threading.current_thread()]
    assert len(beside) == 2 * len(GD.FLOOR_SHARES)  # one untimed and one timed run of each share
    ms, rows = got["ms"], got["rows"]
    assert len(ms) == 7 and all(v > 0 for v in ms.values())
    at_once = next(k for k in ms if k.startswith("a step's reads and scatter at once"))
    best_read = next(v for k, v in ms.items() if k.startswith("GPU and"))
    all_core_scatter = next(v for k, v in ms.items() if k.startswith("CPU scatter") and "default" not in k)
    assert rows[at_once] == 8001 and got["rows_in"] == 5001 and got["row_bytes"] == 64
    assert got["floor_ms"] == pytest.approx(min(ms[at_once], best_read + all_core_scatter))


def test_the_gil_probe_runs_each_side_work_beside_every_step_and_stops_its_thread():
    """``gpu_dlrm.gil_probe``: every configuration is timed, the side thread does its work once
    per step it is asked to (and the work is as long in CPU time as asked), and the thread has
    ended when the probe returns."""
    import sys
    import threading
    import time
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_dlrm as GD
    steps = []
    got = GD.gil_probe(lambda j: steps.append(j), [0.5, 1.0], per=3, nrounds=2)
    assert got["steps"] == len(steps) == 2 * 5 * 3 and steps == list(range(len(steps)))
    assert got["side_runs"] == 2 * 4 * 3  # every step but the lone ones
    assert len(got["python"]) == len(got["gil_free"]) == 2 and got["alone"] > 0
    assert (got["per"], got["rounds"]) == (3, 2)
    assert not any(t.name == "gil-probe" for t in threading.enumerate())
    for work in (GD.python_work, GD.gil_free_work):
        c0 = time.thread_time()
        work(2.0)
        assert time.thread_time() - c0 >= 2e-3


def test_the_traffic_probe_moves_a_steps_rows_beside_each_step_as_a_placement_does():
    """``gpu_dlrm.traffic_probe`` on the reference backend: beside every step of the traffic
    configuration the side thread reads a step's rows (the GPU's share through mapped addresses,
    the rest gathered by CPU threads) after the last step's scatter has ended, and scatters the
    rows going home beside the next step; every read brings the right rows, the tables end as
    they were, and a step's time includes its rows' read."""
    import sys
    import threading
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_dlrm as GD
    from embeddings.gpu.backend import ReferenceBackend
    rng = np.random.default_rng(6)
    hosts = [rng.standard_normal((5_000, 16)).astype(np.float32) for _ in range(3)]
    before = [h.copy() for h in hosts]
    rows = GD.StepRows(hosts, 3001, 2000, ReferenceBackend())
    log, lock = [], threading.Lock()
    for name in ("gather", "scatter", "gpu_read"):
        real = getattr(rows, name)

        def logged(*a, real=real, name=name):
            with lock:
                log.append(name + " starts")
            real(*a)
            with lock:
                log.append(name + " ends")
        setattr(rows, name, logged)
    steps = []
    got = GD.traffic_probe(lambda j: steps.append(j), rows, 0.4, per=3, nrounds=2)
    rows.close()
    assert steps == list(range(2 * 2 * 3)) and got["alone"] > 0 and got["traffic"] > 0
    assert log.count("gpu_read starts") == log.count("gather ends") == log.count("scatter ends") == 2 * 3
    for i, e in enumerate(log):  # a read starts only once the last scatter has ended
        if e == "gpu_read starts":
            assert log[:i].count("scatter starts") == log[:i].count("scatter ends")
    assert all(np.array_equal(h, b) for h, b in zip(hosts, before))
    k = round(0.4 * 3001)
    assert np.array_equal(np.concatenate([rows.dev[:k], rows.block[k:]]),
                          np.concatenate([h[r] for h, r in zip(hosts, rows.rin)]))
    assert not any(t.name == "side-probe" for t in threading.enumerate())
    slow = GD.side_probe(lambda j: None, [("work", lambda: time.sleep(0.02))], per=2, nrounds=1, whole=True)
    assert slow["work"] >= 20 and slow["side_runs"] == 2

    def broken():
        raise MemoryError("no room for the side work")
    with pytest.raises(MemoryError, match="no room for the side work"):  # raised on the caller's thread
        GD.side_probe(lambda j: None, [("broken", broken)], per=2, nrounds=1)
    assert not any(t.name == "side-probe" for t in threading.enumerate())


def test_the_benchmarks_rounds_alternate_the_contenders_and_keep_every_rounds_rate():
    """``gpu_dlrm.rounds``: one untimed step of each contender (and its end), then ``warmed``;
    then each contender runs its steps per round in every round, the order reversed every other
    round, each step index once, then its end of round when it has one; the medians come back
    and, when asked, every round's samples/s (how much the host varied)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_dlrm as GD
    calls, each = [], {}
    got = GD.rounds({"a": (lambda j: calls.append(("a", j)), 2, 10),
                     "b": (lambda j: calls.append(("b", j)), 1, 10, lambda: calls.append("b ends"))}, 3, each,
                    lambda: calls.append("warmed"))
    assert calls == [("a", 0), ("b", 0), "b ends", "warmed",
                     ("a", 1), ("a", 2), ("b", 1), "b ends", ("b", 2), "b ends", ("a", 3), ("a", 4), ("a", 5), ("a", 6),
                     ("b", 3), "b ends"]
    assert set(each) == set(got) == {"a", "b"} and all(len(v) == 3 for v in each.values())
    assert all(got[n] == sorted(each[n])[1] for n in got)


def test_the_benchmarks_steps_alone_place_then_step_each_batch_and_keep_the_models_timer():
    """``gpu_dlrm.steps_alone``: each batch placed (when asked) and synchronised, then stepped
    with no next batch and synchronised; the step's phases come from a timer of its own, per step,
    and the model's timer is put back, also when a step raises."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import gpu_dlrm as GD
    from dlrm.metrics import PhaseTimer
    calls = []

    class Model:
        timer = PhaseTimer()

        def train_step(self, b, nxt):
            calls.append(("step", b, nxt))
            if b == "bad":
                raise RuntimeError("step failed")
            with self.timer("lookup"):
                time.sleep(0.002)
    model, own = Model(), Model.timer
    placed, stepped, phases = GD.steps_alone(model, [1, 2], lambda b: calls.append(("place", b)),
                                             lambda: calls.append("sync"))
    assert calls == ["sync", ("place", 1), "sync", ("step", 1, None), "sync",
                     "sync", ("place", 2), "sync", ("step", 2, None), "sync"]
    assert len(placed) == len(stepped) == 2 and min(stepped) >= 0.002
    assert set(phases) == {"lookup"} and phases["lookup"] >= 2.0  # ms a step
    assert model.timer is own and not own.seconds
    calls.clear()
    _, stepped, _ = GD.steps_alone(model, [3], sync=lambda: None)
    assert calls == [("step", 3, None)] and len(stepped) == 1
    with pytest.raises(RuntimeError, match="step failed"):
        GD.steps_alone(model, ["bad"], sync=lambda: None)
    assert model.timer is own


def test_the_batches_of_a_prefetch_are_slices_of_one_block_in_table_order():
    """``prefetch_works`` copies each table's batch into the next slice of one page-locked block
    (of the type its rows fit), so a placement group's batches go up in one copy; the same pass
    finds each batch's first index out of range."""
    from embeddings.gpu.backend import checked_index_blocks
    rng, m, ts, refs, batches = two_tables(14, cache_rows=24, ways=4)
    flats = [np.arange(5), np.arange(7) + N - 6]
    blocks, bad = checked_index_blocks([t.backend for t in ts], flats, [t.nvectors() for t in ts])
    assert [b.size for b in blocks] == [5, 7] and all(b.dtype == np.int32 for b in blocks)
    assert blocks[1].ctypes.data == blocks[0].ctypes.data + blocks[0].nbytes  # adjacent: one copy
    assert all(np.array_equal(b, f) for b, f in zip(blocks, flats)) and bad.tolist() == [-1, 6]  # N is past the rows
    for t in ts:
        t.close()
    m.check()


def test_front_graph_entries_are_kept_per_group_and_size_bounded_and_dropped_with_their_tables(monkeypatch):
    """:mod:`.lru_front` keeps one entry per group of tables and batch size (at most
    ``MAX_FRONTS``, the least recently used dropped first), makes a new one when a group's
    tables are other objects, and drops those of a forgotten (closed) or collected table. Host
    tables never make one: their front runs as it is."""
    import gc
    import types
    from embeddings.gpu import lru_front as LF
    monkeypatch.setattr(LF, "_fronts", type(LF._fronts)())
    monkeypatch.setattr(LF, "MAX_FRONTS", 2)

    class Table:  # what an entry reads of a table
        backend = types.SimpleNamespace(xp=np)
        reads = "split"

    ts = [Table(), Table()]
    a = LF._entry(ts, [5, 7], np.int32, True)
    assert LF._entry(ts, [5, 7], np.int32, True) is a and a.raw.size == 12 and a.raw.dtype == np.int32
    assert a.table.size == LG.Group.words(2) and a.graph is None and not a.failed
    b = LF._entry(ts, [6, 7], np.int32, True)
    assert b is not a and LF._entry(ts[:1], [5], np.int32, True) is not b
    assert len(LF._fronts) == 2 and a not in LF._fronts.values()  # the least recently used went
    LF.forget(ts[1])
    assert [f.of(ts[:1]) for f in LF._fronts.values()] == [True]
    gone = Table()
    LF._entry([gone], [3], np.int32, True)
    del gone
    gc.collect()
    LF._entry(ts[:1], [5], np.int32, True)
    assert len(LF._fronts) == 1 and all(f.alive() for f in LF._fronts.values())
    LF._fronts.clear()
    monkeypatch.setattr(LF, "COUNTS", type(LF.COUNTS)())
    trace_tables(host_manager(), True, reads="split")
    assert not LF._fronts
    assert LF.COUNTS["step by step"] >= 9 and set(LF.COUNTS) == {"step by step"}  # every prefetch, one front each


def test_a_front_over_the_compacted_misses_decides_as_one_over_the_whole_batch_and_an_overflow_runs_again(monkeypatch):
    """After a group's first placement its fronts sort only its misses (compacted, at most a bound
    learned from the misses seen): every step ends as with fronts over the whole batch, for each
    kind of read and replacement. A bound below the misses (a tiny margin) makes a front that
    places and counts nothing, which runs again over the whole batch: the same end states, the
    hits and misses counted once, lfu's counts of use once a batch."""
    from embeddings.gpu import lru_front as LF
    fronts = []
    real = LG.front
    monkeypatch.setattr(LG, "front", lambda g, idx, xp, counted=True, hosts=None, cap=None:
                        fronts.append(real(g, idx, xp, counted, hosts, cap)) or fronts[-1])
    for reads, replacement in (("mapped", "lru"), ("split", "lfu"), ("staged", "lru")):
        fronts.clear()
        monkeypatch.setattr(LF, "COMPACT", False)
        whole, whole_runs = trace_tables(host_manager(), True, reads=reads, replacement=replacement)
        assert {f.cap for f in fronts} == {None} and fronts
        for margin in (1.25, 0.3):
            fronts.clear()
            monkeypatch.setattr(LF, "COMPACT", True)
            monkeypatch.setattr(LF, "CAP_MARGIN", margin)
            monkeypatch.setattr(LF, "COUNTS", type(LF.COUNTS)())
            compacted, runs = trace_tables(host_manager(), True, reads=reads, replacement=replacement)
            assert runs == whole_runs
            assert_same_traces(compacted, whole)
            assert fronts[0].cap is None and any(f.cap is not None for f in fronts)  # a bound once one has run
            over = [i for i, f in enumerate(fronts) if f.overflowed()]
            assert LF.COUNTS["run again"] == len(over)
            assert all(fronts[i + 1].cap is None and fronts[i + 1].idx is fronts[i].idx for i in over)
            assert (len(over) > 0) == (margin < 1)


def test_the_bound_of_a_groups_compacted_misses_follows_its_last_placements_and_goes_with_its_tables(monkeypatch):
    """:func:`.lru_front._cap`: no bound before a group's first front has run, then
    ``CAP_MARGIN`` times the most entries that missed in its last ``WINDOW`` fronts, rounded up
    to a 64th of the batch: raised at once, lowered only below ``SHRINK`` of it; None (the whole
    batch) where it reaches the batch; forgotten with a table of the group; none when off."""
    from embeddings.gpu import lru_front as LF
    monkeypatch.setattr(LF, "_misses", {})
    monkeypatch.setattr(LF, "COMPACT", True)
    monkeypatch.setattr(LF, "WINDOW", 3)
    monkeypatch.setattr(LF, "CAP_MARGIN", 1.25)
    monkeypatch.setattr(LF, "SHRINK", 0.75)
    ts = [object(), object()]
    sizes = [3200, 3200]  # steps of 100 entries

    def placed(misses):  # a front ran with these misses; the bound for the next
        rec, _ = LF._cap(ts, sizes)
        rec.host = types.SimpleNamespace(cnt=np.array([0, 0, misses]))
        return LF._cap(ts, sizes)[1]

    assert LF._cap(ts, sizes)[1] is None
    got = [placed(m) for m in (1000, 400, 2000, 1400, 1300, 900, 880, 5200, 10, 10, 10)]
    assert got == [1300, 1300, 2600, 2600, 2600, 1800, 1800, None, None, None, 100]
    assert LF._cap(ts[:1], sizes[:1])[1] is None  # another group
    LF.forget(ts[1])
    assert list(LF._misses) == [((id(ts[0]),), (3200,))]
    monkeypatch.setattr(LF, "COMPACT", False)
    assert placed(10) is None  # compaction off


def test_a_front_that_cannot_be_captured_stays_eager_and_warns_once(monkeypatch):
    """A capture that fails (or a stream that cannot be captured) marks the entry eager for good;
    the first failure warns, naming the error."""
    import types
    import warnings
    from embeddings.gpu import lru_front as LF
    monkeypatch.setattr(LF, "_warned", [False])

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def begin_capture(self, mode):
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")

    def xp(ptr):
        import contextlib
        return types.SimpleNamespace(cuda=types.SimpleNamespace(
            get_current_stream=lambda: Stream(ptr), MemoryPool=lambda: types.SimpleNamespace(malloc=None),
            using_allocator=lambda malloc: contextlib.nullcontext()))

    monkeypatch.setattr(LF, "COUNTS", type(LF.COUNTS)())
    entries = [types.SimpleNamespace(graph=None, failed=False) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LF._capture(entries[0], None, xp(0))  # the legacy default stream: not tried, no warning
        LF._capture(entries[1], None, xp(1))
        LF._capture(entries[2], None, xp(1))
    assert all(e.failed and e.graph is None for e in entries) and LF.COUNTS["capture failed"] == 3
    assert len(caught) == 1 and "cudaErrorStreamCaptureUnsupported" in str(caught[0].message)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_a_placements_front_replayed_as_a_cuda_graph_makes_the_same_decisions(monkeypatch):
    """The traced tables with their fronts captured and replayed (from the second placement of
    each group, on the prefetch's own stream: the default stream cannot be captured) end every
    step as with fronts run step by step, for each kind of read."""
    from embeddings.gpu import lru_front as LF
    captured = []
    real = LF._capture
    monkeypatch.setattr(LF, "_capture", lambda e, g, xp: (real(e, g, xp), captured.append(e.graph is not None)))
    with gpu_manager() as gm:
        for reads in ("split", "mapped"):
            captured.clear()
            monkeypatch.setattr(LF, "GRAPHS", True)
            monkeypatch.setattr(LF, "COUNTS", type(LF.COUNTS)())
            graphs, runs = trace_tables(gm, True, reads=reads, own_stream=True)
            assert captured and all(captured)  # each group (staged rows leave a table out of some) captured once
            assert LF.COUNTS["captured"] == len(captured) and LF.COUNTS["replayed"] > 0
            monkeypatch.setattr(LF, "GRAPHS", False)
            eager, eager_runs = trace_tables(gm, True, reads=reads, own_stream=True)
            assert runs == eager_runs
            assert_same_traces(graphs, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_on_the_gpu_compacted_fronts_and_fronts_run_again_decide_as_fronts_over_the_whole_batch(monkeypatch):
    """The CUDA probe's compaction (a warp's misses placed by one atomic), its padding and the
    count that skips an overflowed front: replayed as graphs, every step ends as with fronts over
    the whole batch; with a bound below the misses, the fronts that overflowed ran again."""
    from embeddings.gpu import lru_front as LF
    with gpu_manager() as gm:
        monkeypatch.setattr(LF, "GRAPHS", True)
        monkeypatch.setattr(LF, "COMPACT", False)
        whole, whole_runs = trace_tables(gm, True, reads="split", replacement="lfu", own_stream=True)
        for margin in (1.25, 0.3):
            monkeypatch.setattr(LF, "COMPACT", True)
            monkeypatch.setattr(LF, "CAP_MARGIN", margin)
            monkeypatch.setattr(LF, "COUNTS", type(LF.COUNTS)())
            got, runs = trace_tables(gm, True, reads="split", replacement="lfu", own_stream=True)
            assert runs == whole_runs
            assert_same_traces(got, whole)
            assert LF.COUNTS["replayed"] > 0 and (LF.COUNTS["run again"] > 0) == (margin < 1)


def test_update_graph_entries_are_kept_per_ensemble_and_arguments_and_only_plain_lru_updates_take_one(monkeypatch):
    """:mod:`.update_graph` keeps one entry per ensemble and everything its kernels take (a new
    learning rate is a new entry, so a rate that changes every step never captures), at most
    ``MAX_UPDATES`` (the least recently used dropped first), and drops those of a forgotten
    (closed) or collected table. Only an ensemble of ``lru`` tables, each given once, without
    staged rows, with fixed-size bags whose chunk sums fit the scratch, on a device, takes one."""
    import gc
    import types
    from embeddings.gpu import backend as BK, update_graph as UG
    monkeypatch.setattr(UG, "_entries", type(UG._entries)())
    monkeypatch.setattr(UG, "MAX_UPDATES", 2)

    class Table:  # what an entry reads of a table
        update_graphs = True

        def __init__(self, at):
            self._W = self._dirty = types.SimpleNamespace(data=types.SimpleNamespace(ptr=at))
            self._staged = np.zeros(0, np.int64)
            self._nslots = 64

    def prep(n, off=None, w=None):
        return types.SimpleNamespace(bags=types.SimpleNamespace(idx=np.zeros(n, np.int32), off=off, w=w, k=4,
                                                                  mean=False, nout=n // 4))

    grad = np.zeros((8, 2, 4), np.float32)
    ts, preps = [Table(1), Table(2)], [prep(32), prep(32)]
    a = UG._entry(ts, np, grad, preps, [None, None], E.SGD(0.1))
    assert UG._entry(ts, np, grad, preps, [None, None], E.SGD(0.1)) is a and a.grad.shape == (8, 2, 4)
    assert [i.size for i in a.idx] == [32, 32] and a.graph is None and not a.failed
    b = UG._entry(ts, np, grad, preps, [None, None], E.SGD(0.2))  # another learning rate
    assert b is not a and UG._entry(ts[:1], np, grad[:, :1], preps[:1], [None], E.SGD(0.2)) is not b
    assert len(UG._entries) == 2 and a not in UG._entries.values()  # the least recently used went
    UG.forget(ts[1])
    assert len(UG._entries) == 1 and not any(e.serves(ts[1]) for e in UG._entries.values())
    gone = Table(3)
    UG._entry([gone], np, grad[:, :1], preps[:1], [None], E.SGD(0.1))
    del gone
    gc.collect()
    kept = UG._entry(ts[:1], np, grad[:, :1], preps[:1], [None], E.SGD(0.2))
    assert list(UG._entries.values()) == [kept] and kept.alive()  # the collected table's entry went

    dev = types.SimpleNamespace(flags=types.SimpleNamespace(c_contiguous=True))  # a device gradient
    assert UG.eligible(ts, dev, preps, 4)
    assert not UG.eligible(ts, grad, preps, 4)  # host arrays: the numpy forms
    assert not UG.eligible([ts[0], ts[0]], dev, preps, 4)  # a table given twice
    assert not UG.eligible(ts, dev, [prep(32), prep(32, off=np.arange(9))], 4)
    assert not UG.eligible(ts, dev, [prep(32), prep(32, w=np.ones(32))], 4)
    assert not UG.eligible(ts, dev, [prep(32), prep(0)], 4)
    big = BK.SCRATCH // (4 * 4) * 40  # a batch whose chunk sums for the most long rows would not fit
    assert not UG.eligible(ts, dev, [prep(32), prep(big)], 4) and UG.eligible(ts, dev, [prep(32), prep(big)], 1)
    assert not UG.eligible(ts, dev, preps, 0)  # rows of nothing: nothing to update
    ts[1]._staged = np.arange(2)
    assert not UG.eligible(ts, dev, preps, 4)
    ts[1]._staged = np.zeros(0, np.int64)
    monkeypatch.setattr(UG, "GRAPHS", False)
    assert not UG.eligible(ts, dev, preps, 4)
    plain = types.SimpleNamespace(update_graphs=False, _staged=np.zeros(0))
    monkeypatch.setattr(UG, "GRAPHS", True)
    assert not UG.eligible([ts[0], plain], dev, preps, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_an_ensembles_update_replayed_as_a_cuda_graph_equals_the_uncached_tables_bit_for_bit(monkeypatch, opt):
    """An ensemble of lru tables in the DLRM step's order (lookup, the next batch's prefetch on its
    thread, update, join): with the update captured once and replayed every later step, and
    with it run kernel by kernel, every table equals the uncached GPU table
    (:func:`assert_gpu_same`)."""
    from embeddings.gpu import update_graph as UG
    from embeddings.gpu.backend import cuda_backend
    make = OPTIMIZERS[opt]
    for graphs in (True, False):
        monkeypatch.setattr(UG, "GRAPHS", graphs)
        monkeypatch.setattr(UG, "COUNTS", type(UG.COUNTS)())
        rng = np.random.default_rng(31)
        Ws = [rng.standard_normal((3000, 16)).astype(np.float32) for _ in range(3)]
        batches = [[zipf_batch(rng, 64, 4, 3000) for _ in Ws] for _ in range(9)]
        with gpu_manager() as m:
            ts = [LRUCachedEmbeddings(W, m, cache_rows=1024, ways=8, name=f"t{i}") for i, W in enumerate(Ws)]
            refs = [Reference(W, cuda_backend()) for W in Ws]
            ens, ours, theirs = E.Ensemble(ts), make(), make()
            for step in range(8):
                got = _host(ens.lookup(batches[step]))
                for n, r in enumerate(refs):
                    assert_gpu_same(got[:, n], r.lookup(batches[step][n]).get(), opt, (graphs, step))
                pending = prefetcher.start(ts, [b.ravel() for b in batches[step + 1]], None)
                g = rng.standard_normal(got.shape).astype(np.float32)
                ens.pullback(g, batches[step], optimizer=ours)
                prefetcher.finish(pending)
                for n, r in enumerate(refs):
                    r.pullback(g[:, n], batches[step][n], optimizer=theirs)
            for t, r in zip(ts, refs):
                t.check()
                assert_gpu_same(contents(t), r.W.get(), opt, graphs)
                t.close()
        if graphs:
            assert UG.COUNTS["captured"] == 1 and UG.COUNTS["replayed"] >= 5, dict(UG.COUNTS)
        else:
            assert not UG.COUNTS


def test_a_capture_runs_the_work_between_begin_and_end_with_its_own_allocator_and_returns_its_graph():
    """:func:`.graphs.capture`: the work runs inside the stream's capture (relaxed mode) with the
    new pool's allocator in force; the graph, the work's result and the pool come back, counted
    as captured. A failure inside the work still ends the capture."""
    import collections
    import contextlib
    import types
    from embeddings.gpu import graphs
    log, allocator = [], [None]

    class Pool:
        def malloc(self, n):
            return n

    @contextlib.contextmanager
    def using_allocator(malloc):
        allocator[0] = malloc
        yield
        allocator[0] = None

    class Stream:
        def begin_capture(self, mode):
            log.append(("begin", mode))

        def end_capture(self):
            log.append("end")
            return "graph"

    xp = types.SimpleNamespace(cuda=types.SimpleNamespace(MemoryPool=Pool, using_allocator=using_allocator))
    counts = collections.Counter()
    graph, out, pool = graphs.capture(xp, Stream(), lambda: log.append(("work", allocator[0].__self__)) or 7,
                                      counts, [False], "work")
    assert (graph, out, isinstance(pool, Pool)) == ("graph", 7, True) and counts == {"captured": 1}
    assert log == [("begin", graphs.CAPTURE_RELAXED), ("work", pool), "end"]
    log.clear()
    with pytest.warns(RuntimeWarning, match="the work could not be captured as a CUDA graph .ValueError: no."):
        assert graphs.capture(xp, Stream(), lambda: (_ for _ in ()).throw(ValueError("no")), counts, [False],
                              "the work") is None
    assert log == [("begin", graphs.CAPTURE_RELAXED), "end"] and counts["capture failed"] == 1

    class T:
        pass

    t, tries = T(), []
    entry = graphs.Entry([t])  # a capture that fails marks the entry failed: eager for good, never tried again

    def fails():
        tries.append("capture")
        entry.failed = True

    assert [entry.ready(fails) for _ in range(3)] == [False] * 3 and tries == ["capture"] and entry.runs == 3
    entry = graphs.Entry([t])  # the first run eager, the second captures, then replays
    assert not entry.ready(lambda: tries.append("again"))
    assert entry.ready(lambda: setattr(entry, "graph", "g")) and entry.ready(lambda: tries.append("never"))
    assert entry.runs == 1 and tries == ["capture"]  # no capture on the first run, none once there is a graph
