"""Policies: Table 4.5 semantics, the L/M/P switches, the 2LM model, and a stateful mirror test for each."""

import gc
import itertools
import math
import pathlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cachedarrays as ca
from cachedarrays import (DRAM, PM, CachedArray, CorrelationPrefetchPolicy, InvariantError, LRUPolicy, Manager,
                          OutOfMemoryError, PinnedError, TwoLevelCachePolicy, UseAfterFreeError, readable, writable)

pytestmark = pytest.mark.usefixtures("young_gc")  # gc.collect() in these tests scans only their objects


def readme_policy():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = text.split("<!-- policy-example -->")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(block, namespace)
    return namespace["LargeStaysSlowFIFO"]


def make(policy, fast="1MiB", slow="16MiB"):
    return Manager(DRAM(fast, bandwidth=(20, 20)), PM(None, slow, bandwidth="optane"), policy=policy)


def where(m, x):
    assert x.device == m.primary(x.object).device.name
    return x.device


def counters(m):
    return m.telemetry()["counters"]


def test_clean_eviction_is_elided_and_counted():
    m = make(LRUPolicy())
    x = CachedArray(np.arange(10_000, dtype=np.float32), m)
    ca.evict(x)  # dirty (just written): written back
    assert where(m, x) == "PM" and counters(m)["evictions_written_back"] == 1
    ca.prefetch(x)
    before = m.telemetry()["bytes_moved"]["DRAM->PM"]
    ca.evict(x)  # clean since the prefetch: no copy
    assert m.telemetry()["bytes_moved"]["DRAM->PM"] == before
    assert counters(m)["evictions_clean_elided"] == 1 and counters(m)["bytes_elided"] == x.nbytes
    m.reset_telemetry()
    assert counters(m) == {} and m.telemetry()["bytes_moved"] == {}
    ca.prefetch(x)
    x[0] = 42.0  # a write use dirties the fast copy
    ca.evict(x)
    assert m.telemetry()["bytes_moved"] == {"DRAM->PM": x.nbytes, "PM->DRAM": x.nbytes}
    assert x[0] == 42.0 and x[1] == 1.0
    m.check()


def test_lru_evicts_least_recent_and_softevict_goes_first():
    m = make(LRUPolicy(), fast="1MiB")
    xs = [CachedArray(np.full(60_000, i, np.float32), m) for i in range(4)]  # 240 KB each, 4 fit
    assert all(where(m, x) == "DRAM" for x in xs)
    _ = xs[0][0]  # use 0: now 1 is least recent
    y = CachedArray(np.zeros(60_000, np.float32), m)
    assert where(m, xs[1]) == "PM" and where(m, xs[0]) == "DRAM"
    ca.softevict(xs[3])  # most recent, but hinted
    z = CachedArray(np.zeros(60_000, np.float32), m)
    assert where(m, xs[3]) == "PM" and where(m, xs[0]) == "DRAM"
    assert counters(m)["softevictions"] == 1
    for i, x in enumerate(xs):
        assert np.all(np.asarray(x) == i)
    del y, z
    m.check()


def test_pinned_objects_are_never_evicted():
    m = make(LRUPolicy(), fast="1MiB")
    xs = [CachedArray(np.full(60_000, i, np.float32), m) for i in range(4)]
    views = [readable(x) for x in xs]
    with pytest.raises(OutOfMemoryError, match="pinned"):
        m.policy.alloc_fast(600_000)
    y = CachedArray(np.zeros(60_000, np.float32), m)  # placement falls back to slow
    assert where(m, y) == "PM" and all(where(m, x) == "DRAM" for x in xs)
    with pytest.raises(PinnedError):
        ca.evict(xs[0])
    for v in views:
        v.release()
    ca.evict(xs[0])
    assert where(m, xs[0]) == "PM"
    m.check()


def test_forced_eviction_walks_each_run_between_pinned_objects_once():
    m = make(LRUPolicy(), fast="64KiB")
    xs = [CachedArray(np.full(1024, i, np.float32), m) for i in range(16)]  # 4 KiB each: DRAM is full
    assert all(where(m, x) == "DRAM" for x in xs)
    views = [readable(xs[i]) for i in (3, 7, 11)]  # walls: runs of 12, 12, 12 and 16 KiB
    m.reset_telemetry()
    y = CachedArray(np.full(4096, -1, np.float32), m)  # 16 KiB: only the last run holds it
    assert where(m, y) == "DRAM"
    c = counters(m)
    # least recent first: 0 walks [0, 3) and fails, 1 and 2 are skipped; so for 4 and 8; 12 succeeds
    assert c["forced_evictfrom"] == 4 and c["forced_evictfrom_skipped"] == 6 and c["evictfrom_failures"] == 3
    assert [where(m, x) for x in xs] == ["DRAM"] * 12 + ["PM"] * 4
    for v in views:
        v.release()
    for i, x in enumerate(xs):
        assert np.all(np.asarray(x) == i)
    assert np.all(np.asarray(y) == -1)
    m.check()


def test_lru_looks_up_only_the_victims_it_tries_and_a_live_order_is_listed_first(monkeypatch):
    """Making room under LRU takes its candidates one at a time from a copy of the order, so a
    forced eviction that the least recent object satisfies looks up that object only; a policy
    that declares no snapshot (``victims_snapshot`` False, the default, for ``victims_on`` that
    yield from live structures) has every candidate listed before the first eviction."""
    m = make(LRUPolicy(), fast="64KiB")
    xs = [CachedArray(np.full(1024, i, np.float32), m) for i in range(16)]  # 4 KiB each: DRAM is full
    looked = []
    real = m.getobject
    monkeypatch.setattr(m, "getobject", lambda i: looked.append(i) or real(i))
    y = CachedArray(np.full(1024, -1, np.float32), m)
    assert where(m, y) == "DRAM" and where(m, xs[0]) == "PM"
    assert looked == [xs[0].object.id]  # not the 15 others
    monkeypatch.undo()

    class Listed(LRUPolicy):  # as a policy that yields from live structures declares itself
        victims_snapshot = False

    m2 = make(Listed(), fast="64KiB")
    zs = [CachedArray(np.full(1024, i, np.float32), m2) for i in range(16)]
    looked.clear()
    real2 = m2.getobject
    monkeypatch.setattr(m2, "getobject", lambda i: looked.append(i) or real2(i))
    w = CachedArray(np.full(1024, -2, np.float32), m2)
    assert where(m2, w) == "DRAM" and where(m2, zs[0]) == "PM"
    assert looked == [z.object.id for z in zs]  # all listed before the eviction
    for i, z in enumerate(zs):
        assert np.all(np.asarray(z) == i)
    m.check()
    m2.check()


def test_out_of_memory_names_sizes():
    m = make(LRUPolicy(), fast="256KiB", slow="1MiB")
    with pytest.raises(OutOfMemoryError, match=r"requested 2000000 bytes .*larger than every level \(DRAM 256.0 KiB, PM 1.0 MiB\)"):
        CachedArray((500_000,), m, np.float32)
    keep = [CachedArray((200_000,), m, np.float32) for _ in range(1)]
    with pytest.raises(OutOfMemoryError, match=r"requested 400000 bytes but only \d+ bytes are free \(largest free region \d+"):
        keep += [CachedArray((100_000,), m, np.float32) for _ in range(3)]
    m.check()


def test_switches_of_table_4_7():
    m = make(LRUPolicy(local_alloc=False, honor_frees=False, prefetch=False))
    x = CachedArray(np.ones(1000, np.float32), m)
    assert where(m, x) == "DRAM"  # created slow, then the initial write moved it in (insert on use)
    y = CachedArray((1000,), m, np.float32)
    assert where(m, y) == "PM"  # never used yet: still slow
    ca.unsafe_free(y)
    assert y.object.alive and counters(m)["frees_ignored"] == 1
    ca.evict(x)
    assert not ca.prefetch(x) and where(m, x) == "PM" and counters(m)["prefetches_ignored"] == 1
    m2 = make(LRUPolicy(local_alloc=True, honor_frees=True, prefetch=True))
    z = CachedArray((1000,), m2, np.float32)
    assert where(m2, z) == "DRAM"
    ca.unsafe_free(z)
    assert not z.object.alive
    with pytest.raises(UseAfterFreeError):
        z[0]
    m.check()
    m2.check()


def test_two_level_cache_model():
    m = make(TwoLevelCachePolicy())
    x = CachedArray((10_000,), m, np.float32)
    assert where(m, x) == "PM"  # every object lives in the slow device
    with writable(x) as a:  # insert on use
        a[:] = 3
    assert where(m, x) == "DRAM" and m.getlinked(m.primary(x.object), m.slow) is not None
    ca.unsafe_free(x)  # not semantic
    assert x.object.alive
    written = m.telemetry()["bytes_moved"].get("DRAM->PM", 0)
    del x, a
    gc.collect()
    m.check()  # drains the free queue: the dirty dead data is written back anyway
    assert m.telemetry()["bytes_moved"]["DRAM->PM"] == written + 40_000
    assert counters(m)["dead_writebacks"] == 1


def test_modeled_time_uses_device_bandwidths():
    m = Manager(DRAM("1MiB", bandwidth=(10, 10)), PM(None, "4MiB", bandwidth=(4, 2)), policy=LRUPolicy())
    x = CachedArray(np.ones(100_000, np.uint8), m)
    ca.evict(x)
    ca.prefetch(x)
    copies = m.telemetry()["copies"]
    assert copies["DRAM->PM"]["modeled_seconds"] == pytest.approx(100_000 / 2e9)
    assert copies["PM->DRAM"]["modeled_seconds"] == pytest.approx(100_000 / 4e9)
    assert copies["PM->DRAM"]["measured_seconds"] > 0


def test_check_catches_a_policy_that_breaks_the_fast_primary_invariant():
    class Broken(LRUPolicy):
        def prefetch(self, obj, force=False):
            x = self.m.primary(obj)
            y = self.m.allocate(self.fast, x.nbytes)
            self.m.copyto(y, x)
            self.m.link(x, y)  # forgot set_primary
            return True

    m = make(Broken(local_alloc=False))
    x = CachedArray((100,), m, np.float32)
    ca.prefetch(x)
    with pytest.raises(InvariantError, match="not its primary"):
        m.check()


def same(a, b) -> bool:
    """Bitwise equality (random bytes make NaNs, which == would call different). CuPy arrays, which
    GPU levels give, are brought to the host explicitly."""
    a, b = (x.get() if hasattr(x, "get") else np.asarray(x) for x in (a, b))
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


DTYPES = [np.float32, np.int16, np.uint8, np.float64, np.bool_, np.dtype([("a", np.int32), ("b", np.float32)])]


class PolicyMachine(RuleBasedStateMachine):
    """Arrays of random shapes and dtypes in a fast device smaller than their total, mirrored in numpy."""

    policy_factory = staticmethod(LRUPolicy)

    def __init__(self):
        super().__init__()
        self.m = self.make_manager()
        self.arrays: dict[int, tuple] = {}
        self.views: list = []
        self.rng = np.random.default_rng(0)
        self.next_key = 0

    def make_manager(self):
        return make(self.policy_factory(), fast="512KiB", slow="32MiB")

    def teardown(self):
        self.views.clear()
        self.m.close()

    def _pick(self, data):
        key = data.draw(st.sampled_from(sorted(self.arrays)))
        return key, self.arrays[key]

    @rule(shape=st.lists(st.integers(1, 90), min_size=1, max_size=3), dtype=st.sampled_from(DTYPES))
    def create(self, shape, dtype):
        dtype = np.dtype(dtype)
        mirror = np.frombuffer(self.rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
                               .tobytes(), dtype=dtype).reshape(shape)
        if dtype == np.bool_:
            mirror = mirror.astype(bool)
        x = CachedArray(mirror, self.m)
        self.arrays[self.next_key] = (x, mirror.copy())
        self.next_key += 1

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def write(self, data):
        _, (x, mirror) = self._pick(data)
        i = data.draw(st.integers(0, x.shape[0] - 1))
        with writable(x) as a:
            a[i] = a[(i + 1) % x.shape[0]]
        mirror[i] = mirror[(i + 1) % x.shape[0]]

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def read(self, data):
        _, (x, mirror) = self._pick(data)
        with readable(x) as a:
            assert same(a, mirror)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), force=st.booleans())
    def prefetch(self, data, force):
        _, (x, _) = self._pick(data)
        ca.prefetch(x, force=force)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def evict(self, data):
        _, (x, _) = self._pick(data)
        if not self.m.pinned(x.object):
            ca.evict(x)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def softevict(self, data):
        _, (x, _) = self._pick(data)
        ca.softevict(x)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def hold_view(self, data):
        _, (x, _) = self._pick(data)
        if len(self.views) < 3:
            v = readable(x)
            self.views.append((v, self.address(v)))

    @precondition(lambda self: self.views)
    @rule()
    def drop_view(self):
        v, address = self.views.pop(0)
        assert self.address(v) == address  # a pinned object never moved
        v.release()

    @staticmethod
    def address(view) -> int:
        return view.array.ctypes.data

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def free(self, data):
        key, (x, _) = self._pick(data)
        if self.m.pinned(x.object):
            return
        ca.unsafe_free(x)
        if not x.object.alive:
            del self.arrays[key]
            with pytest.raises(UseAfterFreeError):
                x[0]

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def drop_reference(self, data):
        key, _ = self._pick(data)
        if any(v.object is self.arrays[key][0].object for v, _ in self.views):
            return
        del self.arrays[key]
        gc.collect()

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def transparent_op(self, data):
        _, (x, mirror) = self._pick(data)
        if mirror.dtype.fields is not None or mirror.dtype == np.bool_:
            return
        with np.errstate(all="ignore"):
            y = x + x
            expected = mirror + mirror
        assert isinstance(y, CachedArray)
        self.arrays[self.next_key] = (y, expected)
        self.next_key += 1

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), then=st.sampled_from(["read", "evict", "prefetch", "free", "drop", "crowd", "twice", "none"]))
    def write_later(self, data, then):
        """New contents written later (`write_later`), then what must see them, move them or drop them."""
        key, (x, mirror) = self._pick(data)
        if self.m.pinned(x.object):
            return
        writes = []
        shape, dtype = x.shape, x.dtype
        plain = type(self.m.policy) is LRUPolicy  # frees without moving anything first

        def deferred(contents):
            def write(target, stream):
                writes.append(contents)
                if stream is None:  # host bytes
                    assert target.shape == shape and target.dtype == dtype
                    target[...] = contents
                    return None
                from cachedarrays.devices.gpu import CudaUse, cupy  # GPU or page-locked bytes, by address
                cp = cupy()
                source = np.ascontiguousarray(contents)
                cp.cuda.runtime.memcpyAsync(target, source.ctypes.data, source.nbytes, 4, stream.ptr)
                stream.synchronize()  # the source is this function's
                return CudaUse(stream)
            return write

        new = np.frombuffer(self.rng.integers(0, 256, mirror.nbytes, dtype=np.uint8).tobytes(),
                            dtype=mirror.dtype).reshape(mirror.shape)
        if new.dtype == np.bool_:
            new = new.astype(bool)
        ca.write_later(x, deferred(new))
        assert writes == []  # nothing needed the bytes yet
        mirror[...] = new
        if then == "read":
            with readable(x) as a:
                assert same(a, new)
            assert len(writes) == 1
        elif then == "evict":
            ca.evict(x)  # a move copies from the region: the write lands first
        elif then == "prefetch":
            ca.prefetch(x, force=True)
        elif then == "free":
            ca.unsafe_free(x)
            if not x.object.alive:  # a policy without M ignores it
                del self.arrays[key]
                assert writes == [] or not plain  # freed before anything read it: never written
        elif then == "drop":
            del self.arrays[key]
            del x
            gc.collect()
            self.m.collect()
            assert writes == [] or not plain
        elif then == "crowd":  # allocations that may evict it
            for _ in range(4):
                self.create([90, 90], np.float32)
        elif then == "twice":  # a second write before the first is made replaces it
            newer = mirror[::-1].copy()
            ca.write_later(x, deferred(newer))
            mirror[...] = newer
            assert all(w is new for w in writes)  # only a move the write use made could have made the first
        self.m.check()

    @invariant()
    def consistent(self):
        self.m.check()
        occupancy = self.m.telemetry()["occupancy"]["DRAM"]
        assert occupancy["high_water"] <= occupancy["capacity"]
        for x, mirror in self.arrays.values():
            assert same(x, mirror)


class LearnedOrderMachine(PolicyMachine):
    """The policy machine plus iterations: a mark, then reads of the oldest arrays in order (first
    evicted, in some), so that a policy that learns the order of uses has one to learn and prefetches
    ahead of it, while every other rule still runs in between."""

    @initialize()
    def learn_an_order(self):
        """Six arrays of 80 KB (more than fast memory holds) and two iterations over them: every
        example starts with a learned order."""
        for _ in range(6):
            self.create([20_000], np.float32)
        self._iteration(6, False)
        self._iteration(6, True)

    @precondition(lambda self: self.arrays)
    @rule(n=st.integers(1, 8), evict_first=st.booleans())
    def iteration(self, n, evict_first):
        self._iteration(n, evict_first)

    @precondition(lambda self: self.arrays)
    @rule(n=st.integers(2, 8))
    def iteration_after_eviction(self, n):  # a second rule: iterations come often enough to be learned
        self._iteration(n, True)

    def _iteration(self, n, evict_first):
        self.m.policy.mark_iteration()
        keys = sorted(self.arrays)[:n]
        if evict_first:
            for key in keys:
                x = self.arrays[key][0]
                if not self.m.pinned(x.object):
                    ca.evict(x, to=self.m.slow)
        for key in keys:
            x, mirror = self.arrays[key]
            with readable(x) as a:
                assert same(a, mirror)


def counting_clock():
    """A deterministic clock for the machines: each reading is 100 us after the previous one."""
    ticks = itertools.count()
    return lambda: next(ticks) * 1e-4


def learned(**kw):
    """A `CorrelationPrefetchPolicy` factory on a `counting_clock` (so that examples replay exactly)."""
    def factory():
        return CorrelationPrefetchPolicy(clock=counting_clock(), **kw)
    factory.__name__ = "learned_" + "_".join(f"{k}_{v}" for k, v in kw.items())
    return factory


STATEFUL = settings(max_examples=15, stateful_step_count=30, deadline=None)


def _machine(factory, base=PolicyMachine):
    cls = type(f"Machine_{factory.__name__}", (base,), {"policy_factory": staticmethod(factory)})
    case = cls.TestCase
    case.settings = STATEFUL
    return case


TestLRU = _machine(LRUPolicy)
TestLRUNothing = _machine(lambda: LRUPolicy(local_alloc=False, honor_frees=False, prefetch=False))
TestLRUOnlyM = _machine(lambda: LRUPolicy(local_alloc=False, honor_frees=True, prefetch=True))
TestTwoLevel = _machine(TwoLevelCachePolicy)
TestReadmePolicy = _machine(lambda: readme_policy()(threshold=100_000))
TestLearned = _machine(learned(), LearnedOrderMachine)
TestLearnedMemoryBoundOnlyWithHints = _machine(learned(slack=math.inf, hints=True), LearnedOrderMachine)


def test_plots_are_written(tmp_path):
    from cachedarrays.plot import plot_bytes_moved, plot_occupancy
    m = make(LRUPolicy())
    xs = [CachedArray(np.ones(100_000, np.float32), m) for _ in range(5)]
    ca.evict(xs[:2])
    tele = m.telemetry()
    assert len(tele["timeline"]) >= 5
    p1 = plot_occupancy(tele, str(tmp_path / "occ.png"))
    p2 = plot_bytes_moved({"run": tele, "twice": tele}, str(tmp_path / "moved.png"))
    for p in (p1, p2):
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
