"""``scatter_rows`` / ``gather_rows``: the CPU side of the lru cache's write-back (rows into host
tables) and of its staged reads (rows out of them into one block)."""

import contextlib

import numpy as np
import pytest

from embeddings.kernels import scatter
from embeddings.kernels.scatter import gather_rows, scatter_rows


@pytest.mark.parametrize("n", [0, 1, 5000, 3 * scatter.PIECE + 17])
def test_rows_land_where_they_belong_in_every_table(n, monkeypatch):
    monkeypatch.setattr(scatter, "THREADS", 4)  # jobs split into pieces on any machine
    rng = np.random.default_rng(n)
    tables = [rng.standard_normal((40_000, 8)).astype(np.float32) for _ in range(3)]
    want = [t.copy() for t in tables]
    jobs = []
    for t, w in zip(tables, want):
        rows = rng.choice(t.shape[0], n, replace=False).astype(np.int64)
        src = rng.standard_normal((n, 8)).astype(np.float32)
        w[rows] = src
        jobs.append((t, rows, src))
    scatter_rows(jobs)
    for t, w in zip(tables, want):
        assert np.array_equal(t, w)


@pytest.mark.parametrize("F,dtype,offset,kernel", [(64, np.float32, 0, "streamed"), (64, np.float32, 4, "vector"),
                                                    (8, np.float32, 0, "vector"), (5, np.float32, 0, "numba"),
                                                    (64, np.float64, 0, "numba")])
def test_every_kernel_writes_exactly_the_rows_it_is_given(F, dtype, offset, kernel, monkeypatch):
    """Streamed (rows on cache lines), vector-copied (a table 4 bytes off a line, or rows shorter
    than a line) and numba's row assignment (other feature sizes and element types) agree with
    numpy, each case through the kernel it is meant for."""
    from embeddings.aligned import aligned_empty
    used = []
    simd, plain = scatter._scatter_simd, scatter._scatter
    monkeypatch.setattr(scatter, "_scatter_simd",
                        lambda spec, d, r, s_, stream: used.append("streamed" if stream else "vector") or
                        simd(spec, d, r, s_, stream))
    monkeypatch.setattr(scatter, "_scatter", lambda d, r, s_: used.append("numba") or plain(d, r, s_))
    rng = np.random.default_rng(F + offset)
    n, R = 5000, 3 * scatter.PIECE + 5
    raw = aligned_empty(n * F + offset // np.dtype(dtype).itemsize + 1, dtype)
    dst = raw[offset // np.dtype(dtype).itemsize:][:n * F].reshape(n, F)
    dst[:] = rng.standard_normal((n, F))
    want = dst.copy()
    rows = rng.integers(0, n, R)
    rows = np.unique(rows)[rng.permutation(np.unique(rows).size)]
    src = rng.standard_normal((rows.size, F)).astype(dtype)
    want[rows] = src
    scatter_rows([(dst, rows, src)])
    assert np.array_equal(dst, want)
    assert used and set(used) == {kernel}


def test_bad_input_is_refused_before_anything_is_written():
    dst = np.zeros((10, 4), np.float32)
    ok = (dst, np.array([1, 2]), np.ones((2, 4), np.float32))
    for rows in ([3, 10], [-1, 3]):
        with pytest.raises(IndexError, match="outside 0..9"):
            scatter_rows([ok, (dst, np.array(rows), np.ones((2, 4), np.float32))])
    with pytest.raises(ValueError, match="scatter of"):
        scatter_rows([ok, (dst, np.array([1, 2]), np.ones((2, 3), np.float32))])
    with pytest.raises(TypeError, match="1-d integer array, got 1-d float64"):
        scatter_rows([ok, (dst, np.array([1.0, 2.0]), np.ones((2, 4), np.float32))])
    for rows in (np.array([9, 0], np.int32), np.array([9, 10], np.uint32),  # every integer type is range-checked
                 np.array([9, 12, 0, -1])[::2], np.array([9, 0, 10, 1])[::2]):  # and strided rows
        with pytest.raises(IndexError, match="outside 0..9") if rows.max() > 9 else contextlib.nullcontext():
            gather_rows([(dst, rows, np.empty((2, 4), np.float32))])
    assert not dst.any()


@pytest.mark.parametrize("F,dtype,offset,kernel", [(64, np.float32, 0, "streamed"), (64, np.float32, 4, "vector"),
                                                    (5, np.float32, 0, "numba"), (64, np.float64, 0, "numba")])
def test_a_gather_reads_exactly_the_rows_it_is_given_into_its_block(F, dtype, offset, kernel, monkeypatch):
    """Every table's rows land in its part of the block, in order, through the kernel meant for
    the case (streamed where the block's rows start cache lines), split into pieces."""
    from embeddings.aligned import aligned_empty
    monkeypatch.setattr(scatter, "THREADS", 4)
    used = []
    simd, plain = scatter._gather_simd, scatter._gather
    monkeypatch.setattr(scatter, "_gather_simd", lambda spec, b, r, t, stream: used.append(
        "streamed" if stream else "vector") or simd(spec, b, r, t, stream))
    monkeypatch.setattr(scatter, "_gather", lambda b, r, t: used.append("numba") or plain(b, r, t))
    rng = np.random.default_rng(F + offset)
    tables = [rng.standard_normal((30_000, F)).astype(dtype) for _ in range(2)]
    rows = [rng.integers(0, 30_000, n) for n in (3 * scatter.PIECE + 5, 7)]
    k = offset // np.dtype(dtype).itemsize
    raw = aligned_empty(sum(r.size for r in rows) * F + k, dtype)
    block = raw[k:].reshape(-1, F)
    cut = rows[0].size
    gather_rows([(tables[0], rows[0], block[:cut]), (tables[1], rows[1], block[cut:])])
    assert np.array_equal(block, np.concatenate([tables[0][rows[0]], tables[1][rows[1]]]))
    assert used and set(used) == {kernel}
    out = np.zeros((2, F), dtype)
    with pytest.raises(IndexError, match="gather rows outside 0..29999"):
        gather_rows([(tables[0], np.array([0, 1]), out), (tables[1], np.array([5, 30_000]), out)])
    with pytest.raises(ValueError, match="gather of"):
        gather_rows([(tables[0], np.array([0, 1, 2]), out)])
    assert not out.any()


def test_a_later_scatter_waits_for_its_rows_and_scatters_run_in_the_order_started():
    import threading
    dst = np.zeros((100, 2), np.float32)
    landed, asked = threading.Event(), threading.Event()

    def first_jobs():
        asked.set()
        return [(dst, np.array([7]), np.full((1, 2), 1, np.float32))]
    first = scatter.scatter_later(lambda: landed.wait(5), first_jobs)
    second = scatter.scatter_later(lambda: None, lambda: [(dst, np.array([7]), np.full((1, 2), 2, np.float32))])
    assert not asked.wait(0.2) and not first.done() and not dst.any()  # nothing before its rows have landed
    landed.set()
    second.result(5)
    assert first.done() and dst[7].tolist() == [2, 2]  # the later scatter's rows won
    bad = scatter.scatter_later(lambda: None, lambda: [(dst, np.array([100]), np.ones((1, 2), np.float32))])
    with pytest.raises(IndexError, match="outside 0..99"):
        bad.result(5)


@pytest.mark.parametrize("text,want", [("3", 3), ("", None)])
def test_the_thread_count_comes_from_the_environment(monkeypatch, text, want):
    import os
    monkeypatch.setenv("CACHEDARRAYS_SCATTER_THREADS", text)
    n = scatter._threads()
    if want:
        assert n == want
    else:  # the default: both pools (scatter and gather) together leave half the cores to the step
        assert n == 1 or 2 * n <= (os.cpu_count() or 1) // 2
    for bad in ("0", "many"):
        monkeypatch.setenv("CACHEDARRAYS_SCATTER_THREADS", bad)
        with pytest.raises(ValueError, match="CACHEDARRAYS_SCATTER_THREADS must be a positive integer"):
            scatter._threads()


def test_a_caller_may_name_the_threads_of_one_move():
    """``threads`` splits one move over a pool of that size (the benchmark's all-core rates),
    with the same rows moved as the default pool; fewer than one thread is refused, nothing moved."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((50_000, 16)).astype(np.float32)
    rows = rng.integers(0, table.shape[0], 4 * scatter.PIECE)
    block = np.empty((rows.size, 16), np.float32)
    gather_rows([(table, rows, block)], threads=3)
    assert np.array_equal(block, table[rows])
    assert ("gather", 3) in scatter._pools and scatter._pools["gather", 3]._max_workers == 3
    dst = np.zeros_like(table)
    uniq = np.unique(rows)
    scatter_rows([(dst, uniq, table[uniq])], threads=2)
    assert np.array_equal(dst[uniq], table[uniq]) and np.count_nonzero(dst.any(axis=1)) == uniq.size
    out = np.zeros((2, 16), np.float32)
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        gather_rows([(table, np.arange(2), out)], threads=0)
    assert not out.any()


@pytest.mark.parametrize("sizes,parts", [([0], 3), ([5], 1), ([100_000, 0, 3, 70_000], 4), ([20_000] * 8, 4),
                                         ([1, 1, 1], 7), ([], 2)])
def test_shares_cut_the_jobs_rows_in_order_into_nearly_equal_runs(sizes, parts):
    rng = np.random.default_rng(len(sizes))
    table = np.zeros((10, 2), np.float32)
    jobs = [(table, rng.integers(0, 10, n), np.empty((n, 2), np.float32)) for n in sizes]
    shares = scatter._shares(jobs, parts)
    pieces = [p for share in shares for p in share]
    assert len(shares) <= parts and all(share for share in shares)
    rows = np.concatenate([r for _, r, _ in pieces]) if pieces else np.zeros(0, np.int64)
    assert np.array_equal(rows, np.concatenate([r for _, r, _ in jobs]) if jobs else rows)
    for _, r, b in pieces:  # each slice of rows keeps its own slice of the block: the same job, the same offset
        (jr, jb), = [(jr, jb) for _, jr, jb in jobs if r.size and np.shares_memory(r, jr)] or [(r, b)]
        assert b.shape[0] == r.size and (not r.size or np.shares_memory(b, jb))
        assert (r.ctypes.data - jr.ctypes.data) // jr.itemsize == (b.ctypes.data - jb.ctypes.data) // jb.strides[0]
    lengths = [sum(r.size for _, r, _ in share) for share in shares]
    assert not lengths or max(lengths) - min(lengths) <= 1


def test_a_move_of_many_tables_is_one_task_per_thread(monkeypatch):
    """Each pool task costs the GIL that the training step's thread waits for: a gather of eight
    tables on four threads is four tasks, not one per table and thread."""
    rng = np.random.default_rng(8)
    tables = [rng.standard_normal((50_000, 8)).astype(np.float32) for _ in range(8)]
    jobs = [(t, rng.integers(0, t.shape[0], 3 * scatter.PIECE), np.empty((3 * scatter.PIECE, 8), np.float32))
            for t in tables]
    tasks = []
    real = scatter._pieces
    monkeypatch.setattr(scatter, "_pieces", lambda kind, share: (tasks.append(len(share)), real(kind, share)))
    gather_rows(jobs, threads=4)
    assert len(tasks) == 4 and sum(tasks) >= 8
    for t, r, b in jobs:
        assert np.array_equal(b, t[r])
