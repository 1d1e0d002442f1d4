"""``gather_signalled``: CPU threads gather rows of several tables into one block and publish
each piece through flags, which a device stream (here the reference backend, which waits on the
host) waits for before it copies the piece."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embeddings.gpu.backend import ReferenceBackend
from embeddings.kernels.signalled import DONE, FAILED, gather_signalled


def _tables(rng, F, dtype=np.float32, n=3):
    return [rng.standard_normal((50 + 13 * i, F)).astype(dtype) for i in range(n)]


def _rows(rng, tables, m):
    tabs = rng.integers(0, len(tables), m)
    return tabs, np.array([rng.integers(0, tables[t].shape[0]) for t in tabs], np.int64)


@settings(max_examples=30, deadline=None)
@given(F=st.sampled_from([1, 5, 8, 64, 72]), m=st.integers(0, 300), pieces=st.integers(1, 6),
       threads=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_every_row_lands_in_its_place_and_every_flag_says_done(F, m, pieces, threads, seed):
    rng = np.random.default_rng(seed)
    tables = _tables(rng, F)
    tabs, rows = _rows(rng, tables, m)
    block = np.full((m, F), np.nan, np.float32)
    cuts = np.linspace(0, m, pieces + 1).astype(np.int64)
    flags = np.full(pieces * threads, 7, np.int64)
    done = []
    gathering = gather_signalled(tables, tabs, rows, block, cuts, flags, done=lambda: done.append(1))
    assert gathering.running(timeout_s=10)  # every thread inside its share (or done): no GIL needed to finish
    assert gathering.result() >= 0
    want = np.stack([tables[t][r] for t, r in zip(tabs, rows)]) if m else block
    assert np.array_equal(block, want)
    assert np.all(flags == DONE) and done == [1]


def test_a_waiter_takes_each_piece_once_its_flags_are_set_and_finds_it_gathered():
    """The reference backend's ``wait_flags`` stands for a device stream: after it returns for
    piece ``p``, that piece of the block holds its rows, while later pieces may still be coming."""
    rng = np.random.default_rng(1)
    tables = _tables(rng, 64)
    m, pieces, threads = 40000, 8, 2
    tabs, rows = _rows(rng, tables, m)
    block = np.zeros((m, 64), np.float32)
    cuts = np.linspace(0, m, pieces + 1).astype(np.int64)
    flags = np.empty(pieces * threads, np.int64)
    be, err = ReferenceBackend(), np.zeros(1, np.int32)
    want = np.stack([t[r] for t, r in zip([tables[i] for i in tabs], rows)])
    gathering = gather_signalled(tables, tabs, rows, block, cuts, flags)
    for p in range(pieces):
        be.wait_flags(flags[p * threads:(p + 1) * threads], err)
        a, b = cuts[p], cuts[p + 1]
        assert np.array_equal(block[a:b], want[a:b]), p
    gathering.result()
    assert err[0] == 0


def test_a_row_out_of_range_fails_its_threads_pieces_and_raises_naming_it():
    rng = np.random.default_rng(2)
    tables = _tables(rng, 8)
    m, pieces, threads = 400, 4, 2
    tabs, rows = _rows(rng, tables, m)
    rows[230] = tables[tabs[230]].shape[0]  # piece 2 (200..300), thread 0's share (200..250)
    block = np.zeros((m, 8), np.float32)
    flags = np.empty(pieces * threads, np.int64)
    be, err = ReferenceBackend(), np.zeros(1, np.int32)
    gathering = gather_signalled(tables, tabs, rows, block, np.linspace(0, m, pieces + 1).astype(np.int64), flags)
    be.wait_flags(flags, err, timeout_s=10)  # every flag is set, failed ones too: nothing waits for ever
    with pytest.raises(IndexError, match=rf"position 230 names row {rows[230]} of table {tabs[230]}, outside it"):
        gathering.result()
    assert flags.reshape(pieces, threads).tolist() == [[DONE, DONE], [DONE, DONE], [FAILED, DONE], [FAILED, DONE]]
    assert err[0] == 1


def test_join_waits_for_every_thread_and_raises_nothing_the_result_then_raises():
    rng = np.random.default_rng(6)
    tables = _tables(rng, 8)
    tabs, rows = _rows(rng, tables, 300)
    rows[10] = -1
    block, flags = np.zeros((300, 8), np.float32), np.empty(3 * 2, np.int64)
    gathering = gather_signalled(tables, tabs, rows, block, np.array([0, 100, 200, 300]), flags)
    gathering.join()
    assert np.all(flags != 0) and flags[0] == FAILED  # every thread has ended: each flag is set
    with pytest.raises(IndexError, match="position 10"):
        gathering.result()


def test_running_says_whether_every_thread_has_begun_its_share():
    """A share still queued (its pool busy) needs the GIL to begin: ``running`` says False until
    it has begun, so a caller never queues a device wait that such a share could block."""
    from embeddings.kernels.scatter import THREADS, thread_pool
    rng = np.random.default_rng(5)
    tables = _tables(rng, 8)
    tabs, rows = _rows(rng, tables, 200)
    release = threading.Event()
    busy = [thread_pool("gather", THREADS).submit(release.wait, 10) for _ in range(THREADS)]
    block, flags = np.zeros((200, 8), np.float32), np.empty(2, np.int64)
    gathering = gather_signalled(tables, tabs, rows, block, np.array([0, 100, 200]), flags)
    assert not gathering.running(timeout_s=0.05) and np.all(flags == 0)
    release.set()
    assert gathering.running(timeout_s=10)
    gathering.result()
    assert all(f.result() for f in busy) and np.all(flags == DONE)
    assert np.array_equal(block, np.stack([tables[t][r] for t, r in zip(tabs, rows)]))


def test_a_waiter_gives_up_after_its_timeout_with_an_error():
    be, err = ReferenceBackend(), np.zeros(1, np.int32)
    flags = np.array([DONE, 0], np.int64)
    be.wait_flags(flags, err, timeout_s=0.05)
    assert err[0] == 2


def test_an_error_in_a_thread_still_sets_its_flags_and_calls_done(monkeypatch):
    import embeddings.kernels.signalled as S
    rng = np.random.default_rng(3)
    tables = _tables(rng, 8)
    tabs, rows = _rows(rng, tables, 100)
    monkeypatch.setattr(S, "_share", lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
    flags = np.empty(3 * 2, np.int64)
    done = threading.Event()
    gathering = gather_signalled(tables, tabs, rows, np.zeros((100, 8), np.float32), np.array([0, 30, 60, 100]),
                                 flags, done=done.set)
    assert gathering.running(timeout_s=10)  # the threads ended before their shares began
    with pytest.raises(MemoryError, match="out of memory"):
        gathering.result()
    assert np.all(flags == FAILED) and done.is_set()


def test_bad_arguments_are_refused_before_any_thread_starts():
    rng = np.random.default_rng(4)
    tables = _tables(rng, 8)
    tabs, rows = _rows(rng, tables, 10)
    block, cuts, flags = np.zeros((10, 8), np.float32), np.array([0, 10]), np.full(2, 5, np.int64)
    with pytest.raises(ValueError, match=r"10 rows in the block, but \(9,\) tables"):
        gather_signalled(tables, tabs[:9], rows, block, cuts, flags)
    with pytest.raises(ValueError, match="table 1 is"):
        gather_signalled([tables[0], tables[1][:, :4]], tabs % 2, rows % 50, block, cuts, flags)
    with pytest.raises(ValueError, match="pieces must cut 0..10"):
        gather_signalled(tables, tabs, rows, block, np.array([0, 6, 5, 10]), flags)
    with pytest.raises(ValueError, match="flags must be int64, one per piece"):
        gather_signalled(tables, tabs, rows, block, np.array([0, 3, 10]), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="the block must be 2-d with contiguous rows"):
        gather_signalled(tables, tabs, rows, np.zeros((10, 16), np.float32)[:, ::2], cuts, flags)
    assert np.all(flags == 5) and np.all(block == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("cachedarrays.devices.gpu", fromlist=["available"]).available(),
                    reason="needs a CUDA GPU and CuPy")
def test_a_device_stream_waits_for_the_flags_and_reports_a_failed_writer_or_its_timeout():
    """``CudaBackend.wait_flags``: work queued after it runs once every flag is set by a host
    thread; a failed flag and a wait past its timeout each set the device's error word."""
    import time
    from embeddings.gpu.backend import cuda_backend
    be = cuda_backend()
    cp = be.xp
    flags = be.pinned((4,), np.int64)
    for final, want in (([DONE] * 4, 0), ([DONE, FAILED, DONE, DONE], 1)):
        flags[:] = 0
        err, out = cp.zeros(1, np.int32), cp.zeros(1, np.int32)
        out += 0  # the kernel loaded now: its first launch behind a waiting kernel would wait for that kernel
        be.sync()
        with be.stream():
            be.wait_flags(flags, err)
            out += 1  # queued behind the wait
            done = be.fence()
        time.sleep(0.05)
        assert not done.done and int(out.get()[0]) == 0  # still waiting: no flag yet (get reads another stream)
        for i, f in enumerate(final):
            flags[i] = f
        be.wait(done)
        assert int(out.get()[0]) == 1 and int(err.get()[0]) == want
    flags[:] = [DONE, 0, DONE, DONE]
    err = cp.zeros(1, np.int32)
    start = time.perf_counter()
    with be.stream():
        be.wait_flags(flags, err, timeout_s=0.2)
        be.wait(be.fence())
    assert int(err.get()[0]) == 2 and 0.15 < time.perf_counter() - start < 5
