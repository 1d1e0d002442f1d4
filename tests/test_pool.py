"""Persistent pools: named objects across reopens and crashes, the metadata format's faults, the lock,
a stateful mirror test with crash steps (process and power failure), and kill -9 of a real process."""

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachedarrays import DRAM, PM, LRUPolicy, Manager, OutOfMemoryError, PMFormatError, evict, prefetch, readable, writable
from cachedarrays.devices import pmmeta
from cachedarrays.errors import (InvariantError, ObjectNotFoundError, PMCorruptError, PMMetadataFullError,
                                 PersistentObjectError, PoolLockedError, PoolMismatchError)
from cachedarrays.pool import Pool, persistent

ROOT = Path(__file__).resolve().parent.parent


def open_pool(path, capacity=None, dram="256KiB", **pm):
    m = Manager(DRAM(dram, bandwidth=(10, 10)), PM(path, capacity, **pm), policy=LRUPolicy())
    return m, Pool.open(m)


def contents(x) -> np.ndarray:
    with readable(x) as a:
        return np.array(a)


def fill(x, values) -> None:
    with writable(x) as a:
        a[...] = values


def test_named_objects_survive_a_reopen_with_shape_dtype_and_attrs(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "2MiB")
    rec = np.zeros(5, dtype=[("id", "<i8"), ("w", "<f4", (3,))])
    rec["id"] = np.arange(5)
    a = persistent(m, "tables/0", shape=(100, 16), dtype=np.float32)
    b = persistent(m, "records", shape=5, dtype=rec.dtype)
    fill(a, np.arange(1600, dtype=np.float32).reshape(100, 16))
    fill(b, rec)
    assert persistent(m, "tables/0").object is a.object  # the same object, not a copy
    assert m.persist() == [1] and pool.durable_point == 1
    pool.persist({"step": 7})
    m.check()
    m.close()

    m, pool = open_pool(path)
    assert pool.names() == ["records", "tables/0"] and pool.attrs == {"step": 7}
    assert not pool.recovery.unclean and pool.durable_point == 2
    a = persistent(m, "tables/0")
    assert a.shape == (100, 16) and a.dtype == np.float32 and a.device == "PM"
    assert np.array_equal(contents(a), np.arange(1600, dtype=np.float32).reshape(100, 16))
    assert contents(persistent(m, "records")).tobytes() == rec.tobytes()
    assert m.telemetry()["bytes_moved"] == {}  # opened in place: nothing was copied
    m.check()
    m.close()


def test_changes_after_the_last_durable_point_are_lost_on_close_and_crash(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "2MiB")
    x = persistent(m, "x", shape=1000, dtype=np.int32)
    fill(x, 1)
    m.persist()
    fill(x, 2)                                   # in place in PM: the home moves away first
    y = persistent(m, "y", shape=10, dtype=np.int32)  # created after the durable point
    m.check()
    m.close()                                    # no durable point: like a crash, but clean
    m, pool = open_pool(path)
    assert pool.names() == ["x"] and (contents(persistent(m, "x")) == 1).all()
    fill(persistent(m, "x"), 3)
    del m, pool, x, y                            # dropped without closing: the writer "died"
    import gc
    gc.collect()
    m, pool = open_pool(path)
    assert pool.recovery.unclean and "ended without closing" in str(pool.recovery)
    assert "durable point 1" in str(pool.recovery)
    assert (contents(persistent(m, "x")) == 1).all()
    m.check()
    m.close()


def test_cached_copies_write_back_only_at_durable_points_and_never_into_the_home(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "2MiB", dram="64KiB")
    xs = [persistent(m, f"o{i}", shape=8000, dtype=np.uint8) for i in range(4)]
    for i, x in enumerate(xs):
        fill(x, i)
    m.persist()
    homes = {x.object.id: m.primary(x.object) for x in xs}
    for x in xs:
        prefetch(x, force=True)                  # the home stays linked while the copy is clean
    assert all(m.getlinked(m.primary(x.object), m.slow) is homes[x.object.id] for x in xs)
    for i, x in enumerate(xs):
        fill(x, 10 + i)                          # dirty in DRAM: the home is unlinked first
        evict(x)                                 # the write-back goes to a fresh PM region
        assert m.primary(x.object) is not homes[x.object.id]
        assert (m.bytes(homes[x.object.id]) == i).all()  # the durable copy is untouched
    m.check()
    before = m.slow.used_bytes
    m.persist()
    assert m.slow.used_bytes < before            # the old homes were freed after the commit
    m.close()
    m, pool = open_pool(path)
    assert [int(contents(persistent(m, f"o{i}"))[0]) for i in range(4)] == [10, 11, 12, 13]
    m.close()


def test_delete_is_durable_at_the_next_durable_point(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "1MiB")
    x = persistent(m, "gone", shape=100, dtype=np.uint8)
    fill(x, 9)
    m.persist()
    used = m.slow.used_bytes
    pool.delete("gone")
    assert "gone" not in pool and pool.names() == []
    with pytest.raises(PersistentObjectError, match="deletion becomes durable at the next durable point"):
        m.free(x.object)
    assert (contents(x) == 9).all()              # still usable here, as a volatile array
    m.close()
    m, pool = open_pool(path)
    assert pool.names() == ["gone"]              # the deletion was not durable yet
    pool.delete("gone")
    m.persist()
    assert m.slow.used_bytes < used and pool.names() == []
    m.check()
    m.close()
    m, pool = open_pool(path)
    assert pool.names() == [] and m.slow.used_bytes == 0
    m.close()


def test_bad_names_shapes_and_dtypes_are_clear_errors(tmp_path):
    m, pool = open_pool(tmp_path / "p.pool", "1MiB")
    x = persistent(m, "t", shape=(10, 4), dtype=np.float32)
    m.persist()
    with pytest.raises(ObjectNotFoundError, match=r"holds no object named 'nope' \(it holds 1: 't'\)"):
        persistent(m, "nope")
    with pytest.raises(ObjectNotFoundError, match="nope"):
        persistent(m, "nope", shape=3, create=False)
    with pytest.raises(PoolMismatchError, match=r"'t' has shape \(10, 4\), not \(4, 10\)"):
        persistent(m, "t", shape=(4, 10), dtype=np.float32)
    with pytest.raises(PoolMismatchError, match="'t' has dtype float32, not float64"):
        persistent(m, "t", shape=(10, 4), dtype=np.float64)
    with pytest.raises(ValueError, match="already holds an object named 't'"):
        pool.create("t", 3)
    with pytest.raises(ValueError, match="non-empty string"):
        persistent(m, "", shape=3)
    with pytest.raises(TypeError, match="Python objects"):
        persistent(m, "o", shape=3, dtype=object)
    with pytest.raises(PersistentObjectError, match="persistent object 't'.*Pool.delete"):
        m.free(x.object)
    with pytest.raises(RuntimeError, match="durable objects|committed blocks"):
        m.defragment(m.slow)
    m.check()
    assert pool.names() == ["t"]
    m.close()


def test_a_full_pool_refuses_creation_write_back_and_in_place_writes_keeping_the_durable_point(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "64KiB", dram="64KiB")
    a = persistent(m, "a", shape=24 * 1024, dtype=np.uint8)
    fill(a, 1)
    m.persist()
    with pytest.raises(OutOfMemoryError, match="cannot create 'b'"):
        persistent(m, "b", shape=48 * 1024, dtype=np.uint8)
    b = persistent(m, "b", shape=24 * 1024, dtype=np.uint8)
    fill(b, 2)
    m.persist()                                  # 48 KiB of 64 used: a second copy of either no longer fits
    with pytest.raises(OutOfMemoryError, match="write to 'a' in place: its durable copy .* must move"):
        fill(a, 3)
    prefetch(a, force=True)
    fill(a, 4)                                   # cached in DRAM: the home is unlinked, no copy needed
    with pytest.raises(OutOfMemoryError, match="cannot write back 'a'.*pool stays at durable point 2"):
        m.persist()                              # but its write-back needs 24 KiB beside the home
    m.check()
    assert (contents(a) == 4).all()
    m.close()
    m, pool = open_pool(path)
    assert pool.durable_point == 2
    assert (contents(persistent(m, "a")) == 1).all() and (contents(persistent(m, "b")) == 2).all()
    m.close()


def test_metadata_that_does_not_fit_its_slot_is_refused(tmp_path):
    m, pool = open_pool(tmp_path / "p.pool", "1MiB", meta_size=4096)
    for i in range(5):
        persistent(m, f"name-{i}", shape=1, dtype=np.uint8)
    m.persist()
    for i in range(40):
        persistent(m, f"a-rather-long-name-{i:04d}-" + "x" * 40, shape=1, dtype=np.uint8)
    with pytest.raises(PMMetadataFullError, match="larger meta_size"):
        m.persist()
    m.check()
    assert pool.durable_point == 1
    m.close()


def _committed_slot(path):
    layout = pmmeta.read_layout(str(path))
    with open(path, "rb") as f:
        f.seek(pmmeta.RECORD_AT)
        (seq,) = struct.unpack("<Q", f.read(8))
    return layout.meta_start + (seq % 2) * layout.slot_size, seq


def test_a_corrupted_metadata_slot_or_header_is_reported_not_repaired(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "1MiB")
    fill(persistent(m, "t", shape=100, dtype=np.uint8), 5)
    m.persist()
    m.persist()
    m.close()
    good = path.read_bytes()
    slot, seq = _committed_slot(path)
    for where, what in [(slot + 70, "checksum mismatch"), (slot + 10, "holds commit|checksum"),
                        (slot, "no slot magic")]:
        bad = bytearray(good)
        bad[where] ^= 0xFF
        path.write_bytes(bytes(bad))
        with pytest.raises(PMCorruptError, match=f"slot [AB] should hold commit {seq}.*({what}).*nothing was changed"):
            PM(path)
        assert path.read_bytes() == bytes(bad)   # reported, not repaired
    bad = bytearray(good)
    bad[20] ^= 1                                 # the capacity field of the header
    path.write_bytes(bytes(bad))
    with pytest.raises(PMCorruptError, match="header fails its checksum"):
        PM(path)
    path.write_bytes(good)
    m, pool = open_pool(path)
    assert int(contents(persistent(m, "t"))[0]) == 5
    m.close()


def test_truncated_newer_and_version_1_pools(tmp_path):
    path = tmp_path / "p.pool"
    PM(path, "1MiB").close()
    full = path.read_bytes()
    path.write_bytes(full[:len(full) - 4096])
    with pytest.raises(PMFormatError, match="truncated or resized"):
        PM(path)
    path.write_bytes(full[:40])
    with pytest.raises(PMFormatError, match="truncated"):
        PM(path)
    newer = bytearray(full)
    newer[8:12] = struct.pack("<I", pmmeta.VERSION + 1)
    path.write_bytes(bytes(newer))
    with pytest.raises(PMFormatError, match="version 3; this library reads versions 1, 2 .*newer cachedarrays"):
        PM(path)
    # a version-1 file (no metadata area): opens as a plain heap, refuses to hold named objects
    v1 = tmp_path / "v1.pool"
    v1.write_bytes(struct.pack("<8sIIQQ", b"CAPMPOOL", 1, 0, 1 << 20, 4096).ljust(4096 + (1 << 20), b"\0"))
    dev = PM(v1)
    assert dev.capacity == 1 << 20 and not dev.persistent and dev.recovery is None
    m = Manager(DRAM("64KiB"), dev)
    with pytest.raises(PMFormatError, match="layout version 1: it has no metadata area"):
        persistent(m, "t", shape=3)
    with pytest.raises(RuntimeError, match="no persistent pool is open"):
        m.persist()
    m.check()
    m.close()


def test_an_interrupted_commit_is_discarded_and_reported(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "1MiB")
    fill(persistent(m, "t", shape=100, dtype=np.uint8), 1)
    m.persist()
    seq = m.slow.committed.seq
    store = m.slow._meta._store_u64

    def die_before_the_record(at, value):  # the slot of the next commit is written, the record is not
        raise KeyboardInterrupt("killed")
    m.slow._meta._store_u64 = die_before_the_record
    with pytest.raises(KeyboardInterrupt):
        fill(persistent(m, "t"), 2)              # the re-home copies first, then its commit dies
    m.slow._meta._store_u64 = store
    assert m.slow.committed.seq == seq
    m.check()
    del m, pool
    import gc
    gc.collect()
    m, pool = open_pool(path)
    assert pool.recovery.unclean and "interrupted commit" in str(pool.recovery)
    assert int(contents(persistent(m, "t"))[0]) == 1
    m.close()


def test_unclaimed_blocks_make_check_say_what_to_do(tmp_path):
    path = tmp_path / "p.pool"
    m, pool = open_pool(path, "1MiB")
    persistent(m, "t", shape=100, dtype=np.uint8)
    m.persist()
    m.close()
    m = Manager(DRAM("64KiB"), PM(path))
    r = m.allocate(m.slow, 4096)                 # volatile allocations never take a committed block
    assert r.offset not in m.slow.unclaimed
    with pytest.raises(InvariantError, match="1 committed blocks .* not claimed: open the pool"):
        m.check()
    Pool.open(m)
    m.check()
    m.close()


def test_only_one_process_may_open_a_pool(tmp_path):
    path = tmp_path / "p.pool"
    PM(path, "1MiB").close()
    first = PM(path)
    with pytest.raises(PoolLockedError, match=f"open for writing by this process .*flock"):
        PM(path)
    first.close()
    holder = subprocess.Popen([sys.executable, "-c", f"from cachedarrays import PM; p = PM({str(path)!r}); "
                               "print('open', flush=True); import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(PoolLockedError, match=f"by pid {holder.pid} "):
            PM(path)
    finally:
        holder.kill()
        holder.wait()
    PM(path).close()                             # the kernel released the dead holder's lock


# ---------------------------------------------------------------------------------------------------
# The stateful mirror test: random creates, writes (also through long-held views), moves, deletes,
# durable points, clean reopens and crashes, with a model of what a crash keeps.

class Crash(BaseException):
    """The simulated death of the process, raised at a chosen persist call."""


class Media:
    """What a crash leaves of the pool file.  ``persisted`` holds every byte range as of the last
    persist call that covered it (all a power failure is sure to keep); the live mapping is what a
    killed process leaves (the page cache survives it).  `arm` makes the n-th persist call from now
    capture the file as a crash there would leave it, and raise `Crash` instead of persisting."""

    SECTOR = 512

    def __init__(self, dev: PM):
        self.dev = dev
        self.persisted = np.array(dev._raw)
        self.countdown = 0
        raw_persist = dev._persist_raw

        def persist(offset, nbytes):
            if self.countdown:
                self.countdown -= 1
                if not self.countdown:
                    self.captured = self.image()
                    raise Crash
            raw_persist(offset, nbytes)
            self.persisted[offset:offset + nbytes] = dev._raw[offset:offset + nbytes]
        dev._persist_raw = persist

    def arm(self, calls: int, rng, how: str) -> None:
        self.countdown, self.rng, self.how, self.captured = calls, rng, how, None

    def image(self) -> bytes:
        """The file after a crash now: ``how`` is "kill" (the page cache survives), "lost" (a power
        failure keeps only what was persisted) or "torn" (and a random half of the other sectors)."""
        live = np.array(self.dev._raw)
        if self.how == "kill":
            return live.tobytes()
        out = self.persisted.copy()
        if self.how == "torn":
            diff = np.flatnonzero((live != out).reshape(-1, self.SECTOR).any(axis=1))
            for s in diff[self.rng.random(diff.size) < 0.5]:
                out[s * self.SECTOR:(s + 1) * self.SECTOR] = live[s * self.SECTOR:(s + 1) * self.SECTOR]
        return out.tobytes()


HOW = st.sampled_from(["kill", "lost", "torn"])
NAMES = ["a", "b", "c", "d"]
CRASH_AT = st.integers(1, 6)  # which persist call of the operation the crash precedes


class PoolMachine(RuleBasedStateMachine):
    """Named objects mirrored in numpy, now (``cur``) and at the last durable point (``durable``);
    crashes at random persist calls inside durable points and inside first writes, as a kill or
    as a power failure with torn sectors; contents and ``check()`` verified after every step."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="pool-machine-")
        self.files = 0
        self.rng = np.random.default_rng(0)
        self.point = 0                            # the durable point the mirror is at
        self.durable: dict[str, np.ndarray] = {}
        self.cur: dict[str, np.ndarray] = {}
        self.held: dict[str, object] = {}
        self._open(os.path.join(self.dir, "p0.pool"), "1MiB")

    def _open(self, path, capacity=None):
        self.path = path
        self.m, self.pool = open_pool(path, capacity, dram="64KiB")
        self.media = Media(self.m.slow)
        self.arrays = {name: self.pool.get(name) for name in self.pool.names()}

    def _abandon(self):
        for v in self.held.values():
            v.release()
        self.held.clear()
        self.arrays.clear()
        self.m.close()

    def _crashed(self, image: bytes, candidates: dict[int, dict]) -> None:
        """Continue from the crash ``image`` in a new file; it must be at one of the ``candidates``
        (durable point -> contents) exactly."""
        self._abandon()
        self.files += 1
        path = os.path.join(self.dir, f"p{self.files}.pool")
        with open(path, "wb") as f:
            f.write(image)
        os.unlink(self.path)
        self._open(path)
        assert self.pool.recovery.unclean
        self.point = self.pool.attrs.get("point", 0)
        assert self.point in candidates, (self.point, list(candidates))
        self.durable = candidates[self.point]
        self.cur = {k: v.copy() for k, v in self.durable.items()}

    def teardown(self):
        self._abandon()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(name=st.sampled_from(NAMES), n=st.integers(1, 40_000))
    def create(self, name, n):
        if name in self.cur:
            with pytest.raises(ValueError, match="already holds"):
                self.pool.create(name, n, np.uint8)
            return
        try:
            x = self.pool.create(name, n, np.uint8)
        except OutOfMemoryError:
            return
        data = self.rng.integers(0, 256, n, dtype=np.uint8)
        fill(x, data)
        self.arrays[name], self.cur[name] = x, data

    @precondition(lambda self: self.cur)
    @rule(data=st.data(), value=st.integers(0, 255))
    def write(self, data, value):
        name = data.draw(st.sampled_from(sorted(self.cur)))
        lo = data.draw(st.integers(0, self.cur[name].size - 1))
        hi = data.draw(st.integers(lo + 1, self.cur[name].size))
        try:
            if name in self.held:                # a long-held writable view: no new mark_dirty
                self.held[name].array[lo:hi] = value
            else:
                self.arrays[name][lo:hi] = value
        except OutOfMemoryError:
            return                               # no room to move the durable copy: refused
        self.cur[name][lo:hi] = value

    @precondition(lambda self: set(self.cur) - set(self.held))
    @rule(data=st.data(), crash_at=CRASH_AT, how=HOW, seed=st.integers(0, 2**32 - 1))
    def crash_during_a_write(self, data, crash_at, how, seed):
        """A first write after a durable point moves the home (copy, persist, commit): die inside it."""
        name = data.draw(st.sampled_from(sorted(set(self.cur) - set(self.held))))
        self.media.arm(crash_at, np.random.default_rng(seed), how)
        try:
            self.arrays[name][:] = 0xAB
        except (Crash, OutOfMemoryError):
            pass
        image = self.media.captured
        if image is None:                        # it needed fewer persist calls: die right after
            image = self.media.image()
        self.media.countdown = 0
        self._crashed(image, {self.point: self.durable})

    @precondition(lambda self: set(self.cur) - set(self.held))
    @rule(data=st.data())
    def hold_a_writable_view(self, data):
        name = data.draw(st.sampled_from(sorted(set(self.cur) - set(self.held))))
        try:
            self.held[name] = writable(self.arrays[name])
        except OutOfMemoryError:
            pass

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_a_view(self, data):
        self.held.pop(data.draw(st.sampled_from(sorted(self.held)))).release()

    @precondition(lambda self: self.cur)
    @rule(data=st.data(), into_dram=st.booleans())
    def move(self, data, into_dram):
        x = self.arrays[data.draw(st.sampled_from(sorted(self.cur)))]
        if self.m.pinned(x.object):
            return
        try:
            prefetch(x, force=True) if into_dram else evict(x)
        except OutOfMemoryError:
            pass

    @precondition(lambda self: self.cur)
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(sorted(self.cur)))
        self.pool.delete(name)
        del self.cur[name]
        view = self.held.pop(name, None)
        if view is not None:
            view.release()
        del self.arrays[name]

    @rule(crash_at=st.none() | CRASH_AT, how=HOW, seed=st.integers(0, 2**32 - 1))
    def durable_point(self, crash_at, how, seed):
        """``m.persist()``; with ``crash_at``, the process dies before that persist call inside it (or
        just after it): the pool must then be at the previous durable point or at this one."""
        new = {k: v.copy() for k, v in self.cur.items()}
        if crash_at is None:
            try:
                self.pool.persist({"point": self.point + 1})
            except OutOfMemoryError:
                return
            self.point, self.durable = self.point + 1, new
            return
        self.media.arm(crash_at, np.random.default_rng(seed), how)
        try:
            self.pool.persist({"point": self.point + 1})
        except (Crash, OutOfMemoryError):
            pass
        image = self.media.captured or self.media.image()
        self.media.countdown = 0
        self._crashed(image, {self.point: self.durable, self.point + 1: new})

    @rule()
    def close_and_reopen(self):
        self._abandon()
        self._open(self.path)
        assert not self.pool.recovery.unclean and self.pool.attrs.get("point", 0) == self.point
        self.cur = {k: v.copy() for k, v in self.durable.items()}

    @rule(how=HOW, seed=st.integers(0, 2**32 - 1))
    def crash_between_operations(self, how, seed):
        self.media.arm(0, np.random.default_rng(seed), how)
        self._crashed(self.media.image(), {self.point: self.durable})

    @precondition(lambda self: self.cur)
    @rule(data=st.data())
    def open_wrongly(self, data):
        name = data.draw(st.sampled_from(sorted(self.cur)))
        with pytest.raises(PoolMismatchError):
            persistent(self.m, name, shape=self.cur[name].size + 1, dtype=np.uint8)
        with pytest.raises(PoolMismatchError):
            persistent(self.m, name, shape=self.cur[name].size, dtype=np.int8)
        with pytest.raises(ObjectNotFoundError):
            persistent(self.m, "missing")

    @invariant()
    def contents_match(self):
        self.m.check()
        assert self.pool.names() == sorted(self.cur)
        for name, expect in self.cur.items():
            x = self.arrays[name]
            got = self.held[name].array if name in self.held else contents(x)
            assert np.array_equal(got, expect), name


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=20, stateful_step_count=35, deadline=None)


def _two_durable_points(path):
    """A pool at durable point 1, then every kind of change a durable point must write: an object
    written in place in PM (its home moved), one cached and dirty in DRAM, one written through a
    view held across the durable point, a new one and a deleted one.  Returns what point 2 holds."""
    m, pool = open_pool(path, "1MiB", dram="64KiB")
    media = Media(m.slow)
    v1 = {n: np.full(size, i + 1, np.uint8) for i, (n, size) in enumerate(
        [("in-place", 20_000), ("cached", 9_000), ("held", 5_000), ("deleted", 3_000)])}
    for n, v in v1.items():
        fill(persistent(m, n, shape=v.size, dtype=np.uint8), v)
    held = writable(pool.get("held"))
    pool.persist({"point": 1})
    v2 = {n: v.copy() for n, v in v1.items() if n != "deleted"}
    pool.get("in-place")[100:200] = v2["in-place"][100:200] = 42
    prefetch(pool.get("cached"), force=True)
    pool.get("cached")[:] = v2["cached"][:] = 43
    evict(pool.get("cached"))                    # a dirty write-back between durable points
    prefetch(pool.get("cached"), force=True)
    held.array[-10:] = v2["held"][-10:] = 44     # no mark_dirty: the view was taken before point 1
    v2["new"] = np.full(1000, 45, np.uint8)
    fill(persistent(m, "new", shape=1000, dtype=np.uint8), v2["new"])
    pool.delete("deleted")
    return m, pool, media, held, v1, v2


@pytest.mark.parametrize("how", ["kill", "lost", "torn"])
def test_a_crash_at_every_persist_call_of_a_durable_point_leaves_one_of_the_two_points(tmp_path, how):
    m, pool, media, held, v1, v2 = _two_durable_points(tmp_path / "count.pool")
    media.countdown = 10**9
    pool.persist({"point": 2})
    calls = 10**9 - media.countdown              # persist calls of one durable point
    media.countdown = 0
    held.release()
    m.close()
    assert calls >= 6
    seen = set()
    for crash_at in range(1, calls + 2):         # before each call, and after the last
        m, pool, media, held, v1, v2 = _two_durable_points(tmp_path / f"{crash_at}.pool")
        media.arm(crash_at, np.random.default_rng(crash_at), how)
        try:
            pool.persist({"point": 2})
        except Crash:
            pass
        image = media.captured or media.image()
        media.countdown = 0
        held.release()
        m.close()
        (tmp_path / "crashed.pool").write_bytes(image)
        m, pool = open_pool(tmp_path / "crashed.pool")
        point = pool.attrs["point"]
        seen.add(point)
        expect = {1: v1, 2: v2}[point]
        assert pool.names() == sorted(expect), (crash_at, point)
        for n, v in expect.items():
            assert np.array_equal(contents(pool.get(n)), v), (crash_at, point, n)
        m.check()
        m.close()
    assert seen == {1, 2}


@pytest.mark.parametrize("how", ["kill", "lost", "torn"])
def test_a_crash_at_every_persist_call_of_a_first_write_in_place_leaves_the_durable_point(tmp_path, how):
    for crash_at in range(1, 5):                 # the home's copy, the slot, the commit record, after
        m, pool = open_pool(tmp_path / f"{crash_at}.pool", "1MiB")
        media = Media(m.slow)
        fill(persistent(m, "t", shape=20_000, dtype=np.uint8), 1)
        pool.persist({"point": 1})
        media.arm(crash_at, np.random.default_rng(crash_at), how)
        try:
            pool.get("t")[:] = 2
        except Crash:
            pass
        image = media.captured or media.image()
        media.countdown = 0
        m.close()
        (tmp_path / "crashed.pool").write_bytes(image)
        m, pool = open_pool(tmp_path / "crashed.pool")
        assert pool.attrs["point"] == 1 and (contents(pool.get("t")) == 1).all(), crash_at
        m.check()
        m.close()


# ---------------------------------------------------------------------------------------------------
# kill -9 of a process working on a pool, at random moments, many times

def test_kill_9_at_random_moments_leaves_the_last_durable_point(tmp_path):
    import pool_crash_worker as W

    path = str(tmp_path / "kill.pool")
    zygote = subprocess.Popen([sys.executable, str(Path(__file__).parent / "pool_crash_worker.py"), "serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"})
    rng = np.random.default_rng(1)
    last, unclean = 0, 0
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for round_ in range(30):
            zygote.stdin.write(f"run {path} {round_} {rng.uniform(0.0, 0.25):.4f}\n")
            zygote.stdin.flush()
            status = zygote.stdout.readline().split()
            assert status[:2] == ["killed", str(signal.SIGKILL)], status
            if not os.path.exists(path):
                continue                         # killed before the pool file was linked into place
            m, pool = open_pool(path)
            k = pool.attrs.get("k", 0)
            unclean += pool.recovery.unclean
            assert k >= last
            expect = W.expected(k)
            assert pool.names() == sorted(expect)
            for name, data in expect.items():
                assert np.array_equal(contents(pool.get(name)), data), (k, name)
            m.check()
            m.close()
            last = k
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=10)
    assert last >= 10 and unclean >= 20          # it made progress, and was really killed mid-work
