"""Managers over more than two levels, asynchronous copies, and their faults (CPU: DRAM, DRAM, PM)."""

import math
import threading
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cachedarrays as ca
import cachedarrays.engine as engine
from cachedarrays import (DRAM, PM, CachedArray, CopyError, DeviceUnavailableError, LRUPolicy, Manager,
                          OutOfMemoryError, TwoLevelCachePolicy, readable, writable)
from cachedarrays.devices import gpu

from test_manager import ManagerMachine
from test_policies import LearnedOrderMachine, PolicyMachine, learned, readme_policy

pytestmark = pytest.mark.usefixtures("young_gc")


def three(policy="lru", top="512KiB", middle="256KiB", bottom="16MiB", workers=1):
    """DRAM over a second DRAM over PM; ``policy=None`` for a manager without one."""
    return Manager(DRAM(top, bandwidth=(20, 20)), DRAM(middle, name="DRAM2", bandwidth=(10, 10)),
                   PM(None, bottom, bandwidth="optane"), policy=LRUPolicy() if policy == "lru" else policy,
                   copy_workers=workers)


def where(x):
    return x.device


# ---------------------------------------------------------------------- construction
def test_levels_fastest_first_and_the_old_forms():
    with three() as m:
        assert [d.name for d in m.levels] == ["DRAM", "DRAM2", "PM"]
        assert m.fast.name == "DRAM" and m.slow.name == "PM"
        assert m.below(m.fast).name == "DRAM2" and m.above(m.slow).name == "DRAM2" and m.below(m.slow) is None
    with Manager(fast=DRAM("1MiB"), slow=PM(None, "4MiB")) as m:
        assert [d.name for d in m.levels] == ["DRAM", "PM"]


def test_bad_level_lists_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="ordered fastest first.*PM \\(pm\\) comes before the faster DRAM"):
        Manager(PM(None, "1MiB"), DRAM("1MiB"))
    with pytest.raises(ValueError, match="two devices are named 'DRAM'.*name='dram1'"):
        Manager(DRAM("1MiB"), DRAM("1MiB"), PM(None, "1MiB"))
    with pytest.raises(ValueError, match="two or more devices"):
        Manager(DRAM("1MiB"))


@pytest.mark.skipif(gpu.available(), reason="a GPU is present: tests/test_gpu.py covers the GPU device")
def test_gpu_without_cuda_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match="CuPy|CUDA"):
        ca.GPU("64MiB")


def test_an_object_larger_than_every_level_names_them_all():
    with three() as m:
        with pytest.raises(OutOfMemoryError, match=r"larger than every level \(DRAM 512.0 KiB, DRAM2 256.0 KiB, PM 16.0 MiB\)"):
            CachedArray((5_000_000,), m, np.float32)
        m.check()


# ---------------------------------------------------------------------- the cascade
def test_eviction_cascades_and_clean_evictions_move_no_bytes():
    with three(top="256KiB", middle="256KiB") as m:
        xs = [CachedArray(np.full(50_000, i, np.float32), m) for i in range(3)]  # 200 KB each: one per DRAM level
        assert [where(x) for x in xs] == ["PM", "DRAM2", "DRAM"]
        moved = m.telemetry()["bytes_moved"]
        assert moved["DRAM->DRAM2"] == 400_000 and moved["DRAM2->PM"] == 200_000
        m.reset_telemetry()
        ca.prefetch(xs[0], force=True)    # PM -> DRAM: evicts xs[2] to DRAM2, which evicts xs[1] to PM
        assert [where(x) for x in xs] == ["DRAM", "PM", "DRAM2"]
        for x in xs:
            _ = x[0]                          # reads only: everything stays clean
        m.check()
        m.reset_telemetry()
        ca.evict(xs[0], to="PM")              # clean: its PM home is reused
        tele = m.telemetry()
        assert tele["bytes_moved"] == {} and tele["counters"]["evictions_clean_elided"] == 1
        for i, x in enumerate(xs):
            assert np.all(np.asarray(x) == i)
        m.check()


def test_a_clean_object_moves_no_bytes_down_any_level():
    with three(top="256KiB", middle="256KiB") as m:
        x = CachedArray(np.zeros(50_000, np.float32), m, place="slow")
        ca.prefetch(x, to="DRAM2")
        ca.prefetch(x)
        _ = x[3]
        m.reset_telemetry()
        ca.evict(x)
        ca.evict(x)
        assert where(x) == "PM" and m.telemetry()["bytes_moved"] == {}
        m.check()


def test_dirty_bits_are_per_link():
    """A write on the top level must reach PM through DRAM2 even when DRAM2 was clean."""
    with three(top="256KiB", middle="256KiB") as m:
        x = CachedArray(np.zeros(50_000, np.float32), m, place="slow")
        ca.prefetch(x, to="DRAM2")
        ca.prefetch(x)                    # DRAM over DRAM2 over PM, all clean
        assert len(m.regions_of(x.object)) == 3
        x[7] = 5.0                        # dirties the DRAM copy only
        ca.evict(x)                       # DRAM -> DRAM2: written back, DRAM2 now newer than PM
        ca.evict(x)                       # DRAM2 -> PM: must write back too
        assert m.telemetry()["bytes_moved"]["DRAM2->PM"] == 200_000
        assert where(x) == "PM" and x[7] == 5.0
        m.check()


def test_prefetch_to_a_middle_level_and_evict_to_a_given_one():
    with three() as m:
        x = CachedArray(np.arange(1000, dtype=np.int64), m, place="slow")
        ca.prefetch(x, to="DRAM2")
        assert where(x) == "DRAM2"
        ca.prefetch(x, to=m.levels[1])        # already there
        ca.prefetch(x)
        assert where(x) == "DRAM"
        ca.evict(x, to=m.slow)
        assert where(x) == "PM" and np.array_equal(np.asarray(x), np.arange(1000))
        with pytest.raises(ValueError, match="not a device of this array's manager"):
            ca.prefetch(x, to="GPU")
        m.check()


def test_readme_policy_runs_unchanged_on_three_levels():
    with three(readme_policy()(threshold=100_000)) as m:
        small = CachedArray(np.ones(1000, np.float32), m)
        big = CachedArray(np.ones(100_000, np.float32), m)
        assert where(small) == "DRAM" and where(big) == "PM"
        ca.evict(small)
        _ = small[0]                          # on_use brings it back
        assert where(small) == "DRAM"
        m.check()


# ---------------------------------------------------------------------- asynchronous movement
@pytest.fixture
def gate(monkeypatch):
    """Host copies wait at this gate (for up to 5 s) until the test opens it."""
    gate = threading.Event()
    real = engine.host_copy

    def gated_copy(dst, src):
        gate.wait(5)
        real(dst, src)

    monkeypatch.setattr(engine, "host_copy", gated_copy)
    return gate


def test_prefetch_returns_before_the_copy_and_the_use_waits_for_it(gate):
    with three() as m:
        x = CachedArray(np.arange(10_000, dtype=np.float64), m, place="slow")
        ca.prefetch(x)                        # returns while the copy is held at the gate
        region = m.primary(x.object)
        assert where(x) == "DRAM" and not region.fill.done()
        threading.Timer(0.05, gate.set).start()
        with readable(x) as a:                # waits for exactly this copy
            assert np.array_equal(a, np.arange(10_000))
        tele = m.telemetry()["copies"]["PM->DRAM"]
        assert tele["exposed_seconds"] > 0.01
        m.check()


def test_a_prefetch_overlaps_compute_on_the_cpu():
    """256 MiB from PM while the main thread computes: the later use waits less than the copy took."""
    n = 256 << 20
    with Manager(DRAM("300MiB"), PM(None, "600MiB"), policy=LRUPolicy()) as m:
        x = CachedArray((n // 8,), m, np.float64, place="slow")
        with writable(x) as w:
            w[:] = 1.5
        m.reset_telemetry()
        ca.prefetch(x)
        assert not m.primary(x.object).fill.done()    # prefetch returned while the copy runs
        acc = np.zeros(1 << 16)
        deadline = time.perf_counter() + 0.2
        while time.perf_counter() < deadline:         # compute while the copy runs
            acc = np.sqrt(acc + 1.0)
        with readable(x) as a:
            assert a[0] == 1.5 and a[-1] == 1.5
        copy = m.telemetry()["copies"]["PM->DRAM"]
        assert copy["bytes"] == n
        assert copy["hidden_seconds"] > 0 and copy["exposed_seconds"] < copy["measured_seconds"]


def test_a_freed_region_is_not_reused_before_its_copy_completes(gate):
    with Manager(DRAM("256KiB"), PM(None, "4MiB"), policy=LRUPolicy()) as m:
        x = CachedArray(np.full(50_000, 3.0, np.float32), m)       # 200 KB in DRAM, dirty
        ca.evict(x)                                               # write-back held at the gate
        y = CachedArray((50_000,), m, np.float32)                  # reuses x's old DRAM bytes
        region = m.primary(y.object)
        assert region.device is m.fast and any(not w.done() for w in region.drains)
        m.check()                                                 # busy bytes are accounted for
        threading.Timer(0.05, gate.set).start()
        with writable(y) as w:                                    # waits for the write-back
            w[:] = 7.0
        assert np.all(np.asarray(x) == 3.0) and np.all(np.asarray(y) == 7.0)
        m.check()


def test_close_waits_for_copies_in_flight(monkeypatch, tmp_path):
    real = engine.host_copy
    monkeypatch.setattr(engine, "host_copy", lambda d, s: (time.sleep(0.05), real(d, s)))
    pool = tmp_path / "pool"
    m = Manager(DRAM("1MiB"), PM(pool, "4MiB"), policy=LRUPolicy())
    x = CachedArray(np.full(1000, 9, np.int32), m)
    ca.evict(x)
    pm = m.primary(x.object)
    assert not pm.fill.done()
    m.close()
    assert pm.fill.done() and pm.fill.error is None


def test_an_exception_inside_a_view_with_copies_in_flight_leaves_everything_consistent():
    with three() as m:
        xs = [CachedArray(np.full(20_000, i, np.float32), m, place="slow") for i in range(4)]
        with pytest.raises(RuntimeError, match="user code"):
            with readable(xs[0]):
                ca.prefetch(xs[1], xs[2], xs[3])
                raise RuntimeError("user code failed")
        assert not m.pinned(xs[0].object)
        m.check()
        for i, x in enumerate(xs):
            assert np.all(np.asarray(x) == i)


# ---------------------------------------------------------------------- failed copies
def test_a_copy_that_fails_at_submission_moves_nothing():
    with three() as m:
        x = CachedArray(np.arange(5000, dtype=np.float32), m, place="slow")

        def fault(src, dst, nbytes):
            raise OSError("injected DMA error")

        m.engine.fault = fault
        with pytest.raises(CopyError, match="object 1 from PM to DRAM failed.*injected DMA error"):
            ca.prefetch(x)
        m.engine.fault = None
        assert where(x) == "PM" and np.array_equal(np.asarray(x), np.arange(5000))
        m.check()


def test_a_copy_that_fails_in_flight_is_reported_at_the_next_use_and_loses_nothing(monkeypatch):
    real = engine.host_copy

    def flaky(dst, src):
        if src.size == 20_000:
            raise OSError("injected read error")
        real(dst, src)

    monkeypatch.setattr(engine, "host_copy", flaky)
    with three() as m:
        x = CachedArray(np.arange(5000, dtype=np.float32), m, place="slow")
        ca.prefetch(x)                                            # fails in the worker thread
        with pytest.raises(CopyError, match=r"object \d+ from PM to DRAM failed.*injected read error.*kept on PM"):
            with readable(x):
                pass
        monkeypatch.setattr(engine, "host_copy", real)
        assert where(x) == "PM"
        m.check()
        with readable(x) as a:                                    # the next use works from PM
            assert np.array_equal(a, np.arange(5000))
        ca.prefetch(x)
        assert where(x) == "DRAM" and np.array_equal(np.asarray(x), np.arange(5000))
        m.check()


# ---------------------------------------------------------------------- stateful, three levels, async
class ThreeLevelMachine(PolicyMachine):
    """The policy machine on DRAM (small) over DRAM2 (smaller) over PM, copies asynchronous."""

    workers = 1

    def make_manager(self):
        return three(self.policy_factory(), top="384KiB", middle="192KiB", bottom="32MiB", workers=self.workers)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), level=st.integers(0, 2), force=st.booleans())
    def prefetch_to(self, data, level, force):
        _, (x, _) = self._pick(data)
        ca.prefetch(x, force=force, to=self.m.levels[level].name)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), level=st.integers(1, 2))
    def evict_to(self, data, level):
        _, (x, _) = self._pick(data)
        if not self.m.pinned(x.object):
            ca.evict(x, to=self.m.levels[level])

    @invariant()
    def no_region_above_the_primary(self):
        for x, _ in self.arrays.values():
            if x.object.alive:
                assert self.m.regions_of(x.object)[0] is self.m.primary(x.object)


THREE = settings(max_examples=12, stateful_step_count=30, deadline=None)


def _three_machine(factory, workers, learning=False):
    bases = (LearnedOrderMachine, ThreeLevelMachine) if learning else (ThreeLevelMachine,)
    cls = type(f"Three_{factory.__name__}_{workers}", bases,
               {"policy_factory": staticmethod(factory), "workers": workers})
    case = cls.TestCase
    case.settings = THREE
    return case


TestThreeLRU1 = _three_machine(LRUPolicy, 1)
TestThreeLRU2 = _three_machine(LRUPolicy, 2)
TestThreeTwoLevelCache = _three_machine(TwoLevelCachePolicy, 2)
TestThreeLRUInsertOnUse = _three_machine(lambda: LRUPolicy(local_alloc=False), 1)
TestThreeLearned = _three_machine(learned(), 2, learning=True)
TestThreeLearnedMemoryBoundOnly = _three_machine(learned(slack=math.inf), 1, learning=True)


class AsyncManagerMachine(ManagerMachine):
    """The manager machine by hand on three levels, copies asynchronous on two workers: a copy may
    be in flight under every later step, and contents must still match."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.m = three(policy=None, top="128KiB", middle="128KiB", bottom="1MiB", workers=2)
        self.objs: dict[int, tuple] = {}
        self.rng = np.random.default_rng(0)

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), level=st.integers(0, 2), switch=st.booleans())
    def copy_async(self, data, level, switch):
        obj, mirror = self._pick(data)
        x = self.m.primary(obj)
        dev = self.m.levels[level]
        if x.device is dev:
            return
        y = self.linked_or_new(x, dev)
        if y is None:
            return
        self.m.copyto_async(y, x)
        if switch:
            self.m.set_primary(obj, y)     # the next read of y waits for the copy


TestAsyncManagerMachine = AsyncManagerMachine.TestCase
TestAsyncManagerMachine.settings = settings(max_examples=20, stateful_step_count=35, deadline=None)


def test_assign_writes_a_jax_result_into_a_writable_view():
    import jax.numpy as jnp
    with three() as m:
        x = CachedArray((1000,), m, np.float32)
        with writable(x) as w:
            ca.assign(w, jnp.arange(1000, dtype=jnp.float32) * 2)
        assert np.array_equal(np.asarray(x), np.arange(1000, dtype=np.float32) * 2)
        with pytest.raises(ca.StatusError, match="writable"):
            ca.assign(readable(x), 1.0)
        with readable(x) as r, pytest.raises(ca.StatusError, match="read-only"):
            ca.assign(r, 1.0)
        m.check()


def test_telemetry_and_plot_cover_every_level(tmp_path):
    from cachedarrays.plot import plot_occupancy
    with three(top="256KiB", middle="256KiB") as m:
        xs = [CachedArray(np.full(50_000, i, np.float32), m) for i in range(3)]
        tele = m.telemetry()
        assert set(tele["occupancy"]) == {"DRAM", "DRAM2", "PM"}
        assert all(set(u) == {"DRAM", "DRAM2", "PM"} for _, u in tele["timeline"])
        assert tele["occupancy"]["DRAM2"]["high_water"] >= 200_000
        path = plot_occupancy(tele, str(tmp_path / "occ.png"))
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        del xs
