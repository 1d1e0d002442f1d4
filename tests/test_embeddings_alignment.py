"""Tables from arrays whose rows are off their cache lines: SimpleEmbedding copies them onto
lines (``align=True``, the default) or keeps the caller's memory (``align=False``, updates write
through); Ensemble and CachedEmbeddings end up with rows on lines too; results are the same."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
import embeddings as E
from embeddings.aligned import aligned_copy, rows_aligned
from helpers import numba_threads


def shifted(shape, dtype, shift):
    """A C-contiguous array of ``shape`` whose data starts ``shift`` bytes past a cache line."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = E.aligned_empty((n + 64,), np.uint8)
    return raw[shift:shift + n].view(dt).reshape(shape)


def filled(shape, dtype, shift, seed):
    a = shifted(shape, dtype, shift)
    a[...] = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return a


@settings(max_examples=60, deadline=None)
@given(F=st.integers(1, 80), itemsize=st.sampled_from([2, 4, 8]), shift=st.integers(0, 63), nrows=st.integers(1, 40))
def test_rows_aligned_means_row_offsets_of_a_table_on_a_line(F, itemsize, shift, nrows):
    """The gcd rule against its definition: every row starts at the same offset within its line
    as the same row of a table that starts on a line (``shift`` rounded to the element size)."""
    dtype = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    shift -= shift % itemsize
    a = shifted((nrows, F), dtype, shift)
    stride = F * itemsize
    # the rows' offsets within their lines, as a set over all residues (rows beyond nrows included:
    # the property is of the placement, not of how many rows happen to exist)
    period = 64 // math.gcd(stride, 64)
    here = {(shift + r * stride) % 64 for r in range(period)}
    on_line = {(r * stride) % 64 for r in range(period)}
    assert rows_aligned(a) == (here == on_line)
    assert rows_aligned(aligned_copy(a))


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
SIZES = [1, 4, 8, 16, 24, 33, 64, 256]
# The kernels are compiled per dtype, per specialised size (8 .. 256; the others share one kernel)
# and serial or parallel, 1-15 s each. float32 runs them at every size, the thread count
# alternating; the other dtypes serially at two sizes sharing one kernel (rows copied or not) and
# at 16, the specialised size their other tests use, and bfloat16 (the usual reduced-precision
# storage) in parallel too.
KERNEL_CASES = ([(F, np.float32, 1 + i % 2) for i, F in enumerate(SIZES)]
                + [(F, dt, 1) for dt in (np.float64, np.float16, ml_dtypes.bfloat16) for F in (33, 48, 16)]
                + [(33, ml_dtypes.bfloat16, 2), (48, ml_dtypes.bfloat16, 2)])


def unaligned_and_kept(F, dtype):
    """A table from an array 16 bytes off a line, the same table on the caller's memory
    (``align=False``), the array and a copy of its first contents."""
    mine = filled((60, F), dtype, 16, F)
    original = mine.copy()
    return E.SimpleEmbedding(mine), E.SimpleEmbedding(mine, align=False), mine, original


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F", SIZES)
def test_unaligned_table_gets_aligned_rows(F, dtype):
    """16 bytes off a line (where numpy puts large arrays): the table copies the rows onto lines
    unless they are placed as well already (16-byte rows); ``align=False`` keeps the caller's
    memory; the copy leaves the caller's array alone."""
    t, kept, mine, original = unaligned_and_kept(F, dtype)
    # 16 bytes in, rows of a multiple of 32 bytes sit worse than on a line; other rows sit as well
    assert t.copied == (np.dtype(dtype).itemsize * F % 32 == 0)
    assert rows_aligned(t.data) and t.data.dtype == mine.dtype and np.array_equal(t.data, original)
    if np.dtype(dtype).itemsize * F % 64 == 0:
        assert t.data.ctypes.data % 64 == 0
    assert kept.data is mine and not kept.copied
    assert (t.data is mine) != t.copied


@pytest.mark.parametrize(("F", "dtype", "threads"), KERNEL_CASES)
def test_unaligned_table_gives_the_results_of_an_aligned_one(F, dtype, threads):
    """Lookups and updates of the table (rows copied onto lines or not) and of the one kept on the
    caller's memory (``align=False``) equal those of the same rows on lines from the start; the
    updates reach the caller's array through the kept table (or through the table, if not copied)."""
    rng = np.random.default_rng(F)
    t, kept, mine, original = unaligned_and_kept(F, dtype)
    ref = E.SimpleEmbedding(aligned_copy(original))
    idx = rng.integers(0, len(mine), (7, 5))
    offsets = np.array([0, 3, 3, 12, 20], np.int64)
    g = rng.standard_normal((7, F)).astype(np.float32)
    with numba_threads(threads):
        for args, kw in (((idx,), {"mode": "sum"}), ((idx.ravel()[:20], offsets), {"mode": "mean"}),
                         ((idx.ravel(),), {})):
            want = E.lookup(ref, *args, **kw)
            np.testing.assert_array_equal(E.lookup(t, *args, **kw), want)
            np.testing.assert_array_equal(E.lookup(kept, *args, **kw), want)
        for table in (ref, t) + ((kept,) if t.copied else ()):
            E.pullback(table, g, idx, mode="sum", optimizer=E.SGD(0.5))
    assert not np.array_equal(ref.data, original)
    np.testing.assert_array_equal(t.data, ref.data)
    np.testing.assert_array_equal(mine, ref.data)


def test_aligned_arrays_cached_arrays_and_array_likes_are_used_as_they_are():
    a = E.aligned_empty((10, 16))
    a[...] = 1
    t = E.SimpleEmbedding(a)
    assert t.data is a and not t.copied
    E.pullback(t, np.ones((1, 16), np.float32), [3], optimizer=E.SGD(1.0))
    assert (a[3] == 0).all()  # no copy: updates reach the caller's array
    m = ca.Manager(ca.DRAM("8MiB"), ca.PM(None, "8MiB"), policy=ca.LRUPolicy())
    c = ca.CachedArray(np.ones((10, 24), np.float32), m)
    tc = E.SimpleEmbedding(c)
    assert tc.data is c and not tc.copied
    with ca.readable(c) as v:
        assert rows_aligned(v) and v.ctypes.data % 64 == 0  # regions start on a line


def test_read_only_unaligned_table_stays_read_only():
    a = filled((20, 16), np.float32, 16, 0)
    a.flags.writeable = False
    t = E.SimpleEmbedding(a)
    assert t.copied and not t.data.flags.writeable
    np.testing.assert_array_equal(E.lookup(t, [1, 2]), a[[1, 2]])
    with pytest.raises(ValueError, match="read-only"):
        E.pullback(t, np.ones((1, 16), np.float32), [3], optimizer=E.SGD(1.0))


@pytest.mark.parametrize("align", [None, 1, "no"])
def test_align_must_be_a_bool(align):
    with pytest.raises(TypeError, match="align"):
        E.SimpleEmbedding(np.zeros((4, 4), np.float32), align=align)


def test_ensemble_of_unaligned_tables():
    """An ensemble over tables built from arrays off their lines: every table's rows on lines,
    lookups and updates equal to the same ensemble over the caller's memory. Two tables of 16
    floats, as the gradient test below has them: the ensemble kernels compile for each count and
    size of tables (6-11 s each), and the copy onto lines is the same for every size (checked for
    all of them above)."""
    F = 16
    rng = np.random.default_rng(F)
    arrays = [filled((50, F), np.float32, 16, s) for s in range(2)]
    ens = E.Ensemble([E.SimpleEmbedding(a) for a in arrays])
    kept = E.Ensemble([E.SimpleEmbedding(a, align=False) for a in arrays])
    assert all(t.copied and rows_aligned(t.data) for t in ens.tables)
    idx = [rng.integers(0, 50, (9, 4)) for _ in arrays]
    with numba_threads(2):
        np.testing.assert_array_equal(ens.lookup(idx, mode="sum"), kept.lookup(idx, mode="sum"))
        g = rng.standard_normal((9, 2, F)).astype(np.float32)
        ens.pullback(g, idx, mode="sum", optimizer=E.SGD(0.1))
        kept.pullback(g, idx, mode="sum", optimizer=E.SGD(0.1))
    for t, a in zip(ens.tables, arrays):
        np.testing.assert_array_equal(t.data, a)


@pytest.mark.parametrize("policy", ["simple", "dynamic"])
def test_cached_embeddings_from_an_unaligned_array_has_rows_on_lines(policy):
    """CachedEmbeddings copies a plain array into the slow device: base and cache rows start on
    lines, results match a plain table, and updates stay in the table, not the caller's array."""
    F = 16
    data = filled((200, F), np.float32, 16, 1)
    original = data.copy()
    m = ca.Manager(ca.DRAM("8MiB"), ca.PM(None, "8MiB"), policy=ca.LRUPolicy())
    t = E.CachedEmbeddings(data, m, policy=policy, cache_rows=50)
    ref = E.SimpleEmbedding(original.copy())
    idx = np.random.default_rng(0).integers(0, 200, (30, 3))
    np.testing.assert_array_equal(E.lookup(t, idx, mode="sum"), E.lookup(ref, idx, mode="sum"))
    src = t._base
    assert src.ctypes.data % 64 == 0
    if policy == "dynamic":
        assert t._cache.ctypes.data % 64 == 0 and t.cached_rows > 0
    g = np.ones((30, F), np.float32)
    E.pullback(t, g, idx, mode="sum", optimizer=E.SGD(0.1))
    E.pullback(ref, g, idx, mode="sum", optimizer=E.SGD(0.1))
    np.testing.assert_array_equal(E.lookup(t, np.arange(200)), ref.data)
    np.testing.assert_array_equal(data, original)
    t.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_gradient_off_its_lines_gives_the_same_update(threads, monkeypatch):
    """Plan-driven updates (Adagrad, and an ensemble's) read a gradient whose rows are off their
    lines through an aligned copy when they read each row more than once; results are identical
    to those from an aligned gradient, and a single-read or aligned gradient is used as is."""
    from embeddings.pullback import gathered_grad

    rng = np.random.default_rng(threads)
    F, B, k = 16, 12, 5
    g = rng.standard_normal((B, F)).astype(np.float32)
    off = shifted((B, F), np.float32, 16)
    off[...] = g
    on = E.aligned_empty((B, F))
    on[...] = g
    assert gathered_grad(off, B) is off and gathered_grad(on, B * k) is on
    copy = gathered_grad(off, B * k)
    assert copy is not off and rows_aligned(copy) and np.array_equal(copy, g)
    g3 = shifted((B, 2, F), np.float32, 16)
    g3[...] = rng.standard_normal((B, 2, F))
    c3 = gathered_grad(g3, 2 * B * k)
    assert rows_aligned(c3[:, 0, :]) and rows_aligned(c3[:, 1, :]) and np.array_equal(c3, g3)
    data = rng.standard_normal((30, F)).astype(np.float32)
    idx = rng.integers(0, 30, (B, k))
    import sys
    PB = sys.modules["embeddings.pullback"]
    seen = []
    for name in ("run_update", "run_parts"):  # one thread: a plan; two (thresholds at 0): per-thread row ranges
        real = getattr(PB, name)
        monkeypatch.setattr(PB, name, lambda t, g, *a, real=real: (seen.append(rows_aligned(g)), real(t, g, *a)))
    with numba_threads(threads):
        tables = []
        for grad in (on, off):
            t = E.SimpleEmbedding(data.copy())
            E.pullback(t, grad, idx, mode="sum", optimizer=E.RowwiseAdagrad(0.1))
            tables.append(t.data)
        np.testing.assert_array_equal(*tables)
        assert seen == [True, True]  # the update kernel read the off-line gradient through a copy on lines
        on3 = E.aligned_empty((B, 2, F))
        on3[...] = g3
        results = []
        for grad in (on3, g3):
            ens = E.Ensemble([E.SimpleEmbedding(data.copy()), E.SimpleEmbedding(data.copy())])
            ens.pullback(grad, [idx, idx], mode="sum", optimizer=E.RowwiseAdagrad(0.1))
            results.append(np.stack([t.data for t in ens.tables]))
        np.testing.assert_array_equal(*results)
