"""The data manager: Table 4.4 semantics, bad input, the free queue, threads and a stateful mirror test."""

import gc
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachedarrays import DRAM, PM, Manager, OutOfMemoryError, PinnedError, UseAfterFreeError

pytestmark = pytest.mark.usefixtures("young_gc")  # gc.collect() in these tests scans only their objects


def new(m, device, data: bytes):
    r = m.allocate(m.devices[device.name], len(data))
    m.bytes(r)[:] = np.frombuffer(data, np.uint8)
    return m.new_object(r)


def test_prefetch_and_evict_by_hand(manager):
    m = manager
    obj = new(m, m.slow, b"a" * 1000)
    x = m.primary(obj)
    y = m.allocate(m.fast, m.sizeof(x))
    m.copyto(y, x)
    m.link(x, y)
    m.set_primary(obj, y)
    assert m.in_device(m.primary(obj), m.fast) and m.getlinked(y, m.slow) is x and m.parent(x) is obj
    m.bytes(y)[:3] = np.frombuffer(b"zzz", np.uint8)
    m.mark_dirty(y)
    assert m.isdirty(y)
    m.copyto(x, y)
    m.set_primary(obj, x)
    m.unlink(y, x)
    assert m.parent(y) is None
    m.free(y)
    assert bytes(m.bytes(m.primary(obj))[:4]) == b"zzza"
    tele = m.telemetry()
    assert tele["bytes_moved"] == {"DRAM->PM": 1000, "PM->DRAM": 1000}
    assert tele["copies"]["PM->DRAM"]["modeled_seconds"] > 0
    m.check()


def test_ids_increase_and_getobject(manager):
    a, b = new(manager, manager.fast, b"1" * 64), new(manager, manager.fast, b"2" * 64)
    assert b.id > a.id and manager.getobject(a.id) is a
    manager.free(a)
    assert manager.getobject(a.id) is None


def test_garbage_collected_objects_are_freed_at_next_call(manager):
    used = manager.fast.used_bytes
    obj = new(manager, manager.fast, b"x" * 4096)
    assert manager.fast.used_bytes > used
    del obj
    gc.collect()
    manager.check()  # any manager call drains the free queue
    assert manager.fast.used_bytes == used


def test_bad_input_is_refused_and_nothing_breaks(manager, tmp_path):
    m = manager
    a = new(m, m.fast, b"a" * 128)
    b = new(m, m.slow, b"b" * 128)
    with pytest.raises(ValueError, match="positive"):
        m.allocate(m.fast, 0)
    with pytest.raises(OutOfMemoryError, match="larger than the whole device"):
        m.allocate(m.fast, 2 << 20)
    with pytest.raises(OutOfMemoryError, match=r"requested 1000000 bytes but only \d+ bytes are free \(largest free region \d+"):
        for _ in range(3):
            m.allocate_or_raise(m.fast, 1_000_000)
    with pytest.raises(ValueError, match="different objects"):
        m.link(m.primary(a), m.primary(b))
    small = m.allocate(m.slow, 64)
    with pytest.raises(ValueError, match="copy 128 bytes"):
        m.copyto(small, m.primary(a))
    with pytest.raises(ValueError, match="is the primary"):
        m.free(m.primary(a))
    m.free(small)
    with pytest.raises(UseAfterFreeError):
        m.free(small)
    m.free(b)
    with pytest.raises(UseAfterFreeError, match="was freed"):
        m.primary(b)
    other = Manager(DRAM("64KiB"), PM(tmp_path, "64KiB"))
    with pytest.raises(ValueError, match="different manager|not a device of this manager"):
        m.allocate(other.fast, 64)
    with pytest.raises(ValueError, match="different manager"):
        other.primary(a)
    other.close()
    m.pin(a)
    with pytest.raises(PinnedError):
        m.free(a)
    m.unpin(a)
    m.check()


def _evict_callback(m):
    """Listing 4.1 as an evictfrom callback."""
    def evict(region):
        obj = m.parent(region)
        y = m.getlinked(region, m.slow)
        fresh = y is None
        if fresh:
            y = m.allocate(m.slow, m.sizeof(region))
        if fresh or m.isdirty(region):
            m.copyto(y, region)
        m.set_primary(obj, y)
        m.free(region)
        return True
    return evict


def test_evictfrom_evicts_and_skips_pinned(manager):
    m = manager
    objs = [new(m, m.fast, bytes([i]) * 200_000) for i in range(5)]
    assert m.allocate(m.fast, 300_000) is None
    m.pin(objs[1])
    ok = m.evictfrom(m.fast, m.primary(objs[0]), 300_000, _evict_callback(m))
    assert not ok and all(m.in_device(m.primary(o), m.fast) for o in objs)  # the walk would need object 1
    ok = m.evictfrom(m.fast, m.primary(objs[2]), 300_000, _evict_callback(m))
    assert ok and m.allocate(m.fast, 300_000) is not None
    for i, o in enumerate(objs):
        assert (m.bytes(m.primary(o)) == i).all()
    assert m.in_device(m.primary(objs[1]), m.fast)
    m.unpin(objs[1])
    m.check()


def test_room_possible_counts_pinned_objects_as_walls(manager):
    """`room_possible` answers what victim after victim of `evictfrom` would: with object 1 of five
    pinned, 300,000 bytes fit only from object 2 on; with 1 and 3 pinned, nowhere. It moves nothing."""
    m = manager
    objs = [new(m, m.fast, bytes([i]) * 200_000) for i in range(5)]
    m.pin(objs[1])
    assert m.room_possible(m.fast, 300_000)
    m.pin(objs[3])
    assert not m.room_possible(m.fast, 300_000)
    assert not any(m.evictfrom(m.fast, m.primary(o), 300_000, _evict_callback(m)) for o in objs)
    assert m.room_possible(m.fast, 200_000)
    assert all(m.in_device(m.primary(o), m.fast) for o in objs)
    m.unpin(objs[1])
    m.unpin(objs[3])
    m.check()


def test_evictfrom_callback_that_lies_is_caught(manager):
    m = manager
    objs = [new(m, m.fast, b"q" * 500_000) for _ in range(2)]
    with pytest.raises(AssertionError, match="did not free it"):
        m.evictfrom(m.fast, m.primary(objs[0]), 600_000, lambda region: True)
    m.check()
    assert all(bytes(m.bytes(m.primary(o))[:1]) == b"q" for o in objs)


def test_defragment_keeps_contents(manager):
    m = manager
    objs = [new(m, m.fast, bytes([i]) * 3000) for i in range(10)]
    for o in objs[::2]:
        m.free(o)
    assert m.defragment(m.fast) == 5
    for i, o in list(enumerate(objs))[1::2]:
        assert (m.bytes(m.primary(o)) == i).all()
    m.check()


def test_threads_allocate_copy_free(tmp_path):
    m = Manager(DRAM("8MiB"), PM(tmp_path, "32MiB"))
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                n = int(rng.integers(1, 50_000))
                data = rng.integers(0, 256, n, dtype=np.uint8)
                r = m.allocate(m.slow, n)
                m.bytes(r)[:] = data
                obj = m.new_object(r)
                y = m.allocate(m.fast, n)
                if y is not None:
                    m.copyto(y, r)
                    m.link(r, y)
                    m.set_primary(obj, y)
                assert np.array_equal(m.bytes(m.primary(obj)), data)
                m.free(obj)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m.check()
    assert m.fast.used_bytes == 0 and m.slow.used_bytes == 0
    m.close()


class ManagerMachine(RuleBasedStateMachine):
    """Objects mirrored in numpy; random link, copy, set_primary, write, free, gc; contents always match."""

    def __init__(self):
        super().__init__()
        self.m = Manager(DRAM("256KiB", bandwidth=(10, 10)), PM(None, "1MiB"))
        self.objs: dict[int, tuple] = {}  # id -> (object, mirror)
        self.rng = np.random.default_rng(0)

    def teardown(self):
        self.m.close()

    def _pick(self, data):
        return self.objs[data.draw(st.sampled_from(sorted(self.objs)))]

    @rule(n=st.integers(1, 40_000), fast=st.booleans())
    def create(self, n, fast):
        r = self.m.allocate(self.m.fast if fast else self.m.slow, n)
        if r is None:
            return
        data = self.rng.integers(0, 256, n, dtype=np.uint8)
        self.m.bytes(r)[:] = data
        obj = self.m.new_object(r)
        self.objs[obj.id] = (obj, data.copy())

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def copy_to_other_device(self, data):
        obj, mirror = self._pick(data)
        x = self.m.primary(obj)
        y = self.linked_or_new(x, self.m.slow if x.device is self.m.fast else self.m.fast)
        if y is None:
            return
        self.m.copyto(y, x)
        self.m.mark_clean(x)

    def linked_or_new(self, x, device):
        """``x``'s linked region on ``device``, or a new one linked to it (None if it does not fit)."""
        y = self.m.getlinked(x, device)
        if y is None:
            y = self.m.allocate(device, x.nbytes)
            if y is not None:
                self.m.link(x, y)
        return y

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def switch_primary_to_valid_copy(self, data):
        obj, mirror = self._pick(data)
        x = self.m.primary(obj)
        for dev in self.m.devices.values():
            y = self.m.getlinked(x, dev)
            if y is not None and y is not x and np.array_equal(self.m.bytes(y), mirror):
                self.m.set_primary(obj, y)
                return

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), value=st.integers(0, 255))
    def write(self, data, value):
        obj, mirror = self._pick(data)
        x = self.m.primary(obj)
        i = data.draw(st.integers(0, x.nbytes - 1))
        self.m.bytes(x)[i] = value
        mirror[i] = value
        self.m.mark_dirty(x)

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def drop_linked(self, data):
        obj, _ = self._pick(data)
        x = self.m.primary(obj)
        for dev in self.m.devices.values():
            y = self.m.getlinked(x, dev)
            if y is not None and y is not x:
                self.m.unlink(x, y)
                self.m.free(y)

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), by_gc=st.booleans())
    def free(self, data, by_gc):
        key = data.draw(st.sampled_from(sorted(self.objs)))
        obj, _ = self.objs.pop(key)
        if not by_gc:
            self.m.free(obj)
        del obj
        gc.collect()

    @precondition(lambda self: self.objs)
    @rule(data=st.data(), then=st.sampled_from(["read", "copy", "copy_async", "free", "drop_linked", "twice", "none"]))
    def fill_later(self, data, then):
        """A deferred fill of the primary (`Manager.fill_later`), then what must see it, copy it or drop it."""
        key = data.draw(st.sampled_from(sorted(self.objs)))
        obj, mirror = self.objs[key]
        x = self.m.primary(obj)
        writes = []

        def write(contents):
            def fill():
                self.m.ready(x)  # after earlier readers of the region (the fill itself is not waited for)
                writes.append(1)
                self.m.bytes(x, wait=False)[:] = contents
            return fill

        new = self.rng.integers(0, 256, x.nbytes, dtype=np.uint8)
        self.m.fill_later(x, write(new))
        mirror[:] = new
        assert writes == [] and not self.m.settled(x)
        if then == "read":
            assert np.array_equal(self.m.bytes(x), new) and writes == [1]
        elif then in ("copy", "copy_async"):  # the copy carries the new bytes: the fill is issued first
            y = self.linked_or_new(x, self.m.slow if x.device is self.m.fast else self.m.fast)
            if y is not None:
                (self.m.copyto if then == "copy" else self.m.copyto_async)(y, x)
                assert writes == [1] and np.array_equal(self.m.bytes(y), new)
        elif then == "free":
            del self.objs[key]
            self.m.free(obj)
            assert writes == []  # never read: never written
        elif then == "drop_linked":
            self.drop_linked(data)
        elif then == "twice":  # a second fill over the pending one replaces it
            newer = new[::-1].copy()
            self.m.fill_later(x, write(newer))
            mirror[:] = newer
            assert np.array_equal(self.m.bytes(x), newer) and writes == [1]
        self.m.check()

    @invariant()
    def contents_match(self):
        self.m.check()
        assert len(self.m.objects()) == len(self.objs)
        for obj, mirror in self.objs.values():
            assert np.array_equal(self.m.bytes(self.m.primary(obj)), mirror)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)


def test_the_occupancy_timeline_keeps_the_latest_changes_on_top_of_the_folded_older_ones(monkeypatch):
    """Each allocation or free records one device's use (`Telemetry._sample`); past
    `TIMELINE_LENGTH` the oldest change folds into the timeline's start, so every entry still
    shows every device's use after that change, as sampled in full."""
    from cachedarrays import telemetry
    monkeypatch.setattr(telemetry, "TIMELINE_LENGTH", 5)
    m = Manager(DRAM("1MiB"), DRAM("1MiB", name="DRAM2"))
    want, regions = [], []
    for i in range(9):  # alternate the devices, so that the kept entries need folded values of the other
        device = m.levels[i % 2]
        if i in (4, 7):
            m.free(regions.pop(0))
        else:
            regions.append(m.allocate(device, 4096 * (i + 1)))
        want.append({d.name: d.used_bytes for d in m.levels})
    timeline = m.telemetry()["timeline"]
    assert [u for _, u in timeline] == want[-5:]
    assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)
    m.reset_telemetry()
    assert m.telemetry()["timeline"] == []
    m.free(regions.pop())
    assert [u for _, u in m.telemetry()["timeline"]] == [{d.name: d.used_bytes for d in m.levels}]
    for r in regions:
        m.free(r)
    m.check()


def test_an_object_that_dies_inside_a_locked_section_is_freed_only_after_it(manager):
    """A handle dying while this thread holds the lock only queues its object: the manager calls
    nested in the section (which take the plain lock or find it held) never free under it; the
    first call after the section does."""
    m = manager
    obj = m.new_object(m.allocate(m.fast, 4096))
    keep = m.new_object(m.allocate(m.fast, 4096))
    freed = lambda: m.telemetry_data.counters["objects_freed"]  # noqa: E731
    with m.lock():
        del obj
        gc.collect()
        region = m.allocate(m.fast, 4096)  # nested: the queue waits
        with m.lock():
            m.free(region)
        assert freed() == 0 and len(m.objects()) == 1
    m.primary(keep)  # no lock: nothing drained yet
    assert freed() == 0
    m.free(m.allocate(m.fast, 64))  # the first locked call after the section drains
    assert freed() == 1
    m.check()
