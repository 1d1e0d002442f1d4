"""Embedding tables whose rows are in GPU memory (issue #19).

Without a GPU (CI): the GPU path's driver (validation, update plan, dispatch) runs on the
reference backend, whose lookup is the Pallas kernel in interpret mode and whose update is a
numpy transcription of the CUDA kernel; both are checked against the numba CPU kernels, the
lookups bit for bit (same summation order), the updates to float32 rounding. The CUDA source is
compile-checked with nvcc where one is installed. ``gpu``-marked tests run the real thing.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embeddings as E
from cachedarrays.devices import gpu as gpu_device
from embeddings.gpu import cuda, ops, reference
from embeddings.gpu.backend import ReferenceBackend

F_SIZES = (8, 12, 64, 256)


def batch(rng, nvec: int, nbags: int, most: int, dup: bool = False):
    """CSR bags of 0..most indices (some empty); ``dup``: indices from 3 rows only."""
    sizes = rng.integers(0, most + 1, nbags)
    sizes[: max(1, nbags // 5)] = 0
    off = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    idx = rng.integers(0, 3 if dup else nvec, int(off[-1])).astype(np.int32)
    return idx, off


def table(rng, nvec: int, F: int) -> np.ndarray:
    return rng.standard_normal((nvec, F)).astype(np.float32)


def update_case(rng, nvec: int, nbags: int, most: int, F: int, dup: bool, weighted: bool):
    """A table of ``nvec`` rows of ``F``, CSR bags (:func:`batch`), weights (or None) and a gradient."""
    W = table(rng, nvec, F)
    idx, off = batch(rng, nvec, nbags, most, dup)
    w = rng.random(idx.size).astype(np.float32) if weighted else None
    return W, idx, off, w, rng.standard_normal((nbags, F)).astype(np.float32)


@pytest.mark.parametrize("F", F_SIZES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pallas_lookup_equals_the_numba_kernels_bit_for_bit(F, mode):
    rng = np.random.default_rng(F)
    W = table(rng, 97, F)
    t = E.SimpleEmbedding(W, "t")
    for dup, most in ((False, 1), (False, 40), (True, 40)):
        idx, off = batch(rng, 97, 23, most, dup)
        expect = E.lookup(t, idx, off, mode=mode)
        for be in (ReferenceBackend(), ReferenceBackend(device_indices=True)):
            got = ops.lookup(be, "t", W, idx, off, mode=mode)
            if mode == "sum":
                assert np.array_equal(got, expect), (F, mode, dup, most, np.abs(got - expect).max())
            else:  # XLA on the H100 host's CPU scaled some means up to 2 ulp apart (its codegen follows
                np.testing.assert_array_max_ulp(got, expect, maxulp=2)  # the ISA); the CUDA kernel is exact


def test_pallas_lookup_fixed_width_nonreducing_and_weighted():
    rng = np.random.default_rng(1)
    W = table(rng, 50, 64)
    t = E.SimpleEmbedding(W, "t")
    be = ReferenceBackend()
    idx2 = rng.integers(0, 50, (9, 40))
    assert np.array_equal(ops.lookup(be, "t", W, idx2), E.lookup(t, idx2))
    assert np.array_equal(ops.lookup(be, "t", W, idx2[:, :1], mode="mean"), W[idx2[:, 0]])
    flat = rng.integers(0, 50, 31)
    assert np.array_equal(ops.lookup(be, "t", W, flat), W[flat])
    idx, off = batch(rng, 50, 17, 12)
    w = rng.random(idx.size).astype(np.float32)
    for mode in ("sum", "mean"):
        np.testing.assert_allclose(ops.lookup(be, "t", W, idx, off, mode=mode, weights=w),
                                   E.lookup(t, idx, off, mode=mode, weights=w), rtol=1e-6, atol=1e-6)
    out = np.full((9, 3 * 64), 7.0, np.float32)  # lookup_into a column slice
    ops.lookup(be, "t", W, idx2, out=out[:, 64:128])
    assert np.array_equal(out[:, 64:128], E.lookup(t, idx2)) and (out[:, :64] == 7).all()
    assert ops.lookup(be, "t", W, np.zeros((0, 4), np.int64)).shape == (0, 64)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 24))
def test_reference_shapes_round_up_to_few_buckets(n):
    """The Pallas reference is compiled per argument shape, so it pads them to buckets: never
    below the length, a power of two up to 65536 and within an eighth of the length past it."""
    b = reference.bucket(n)
    assert b >= max(n, 8) and b == reference.bucket(b)
    if n > 65536:
        assert b <= n * 9 / 8 and b % (1 << (n.bit_length() - 4)) == 0
    else:
        assert b & (b - 1) == 0
    a = np.arange(n % 50 * 3).reshape(-1, 3)
    p = reference.padded(a, reference.bucket(len(a)), -1)
    assert np.array_equal(p[:len(a)], a) and (p[len(a):] == -1).all() and len(p) == reference.bucket(len(a))


@pytest.mark.parametrize("opt", [E.SGD, E.RowwiseAdagrad])
@pytest.mark.parametrize("device_indices", [False, True])
def test_reference_update_matches_the_cpu_pullback(opt, device_indices):
    rng = np.random.default_rng(2)
    be = ReferenceBackend(device_indices)
    for F, dup, mode, weighted in ((64, False, "sum", False), (12, True, "mean", False), (8, True, "sum", True)):
        W, idx, off, w, g = update_case(rng, 40, 11, 9, F, dup, weighted)
        cpu = W.copy()
        E.pullback(E.SimpleEmbedding(cpu, "t", align=False), g, idx, off, mode=mode, weights=w, optimizer=opt(0.1))
        dev, state = W.copy(), np.zeros(40, np.float32)
        ops.pullback(be, "t", dev, state, g, idx, off, mode=mode, weights=w, optimizer=opt(0.1))
        np.testing.assert_allclose(dev, cpu, rtol=2e-6, atol=2e-6)
        touched = np.zeros(40, bool)
        touched[idx] = True
        assert np.array_equal(dev[~touched], W[~touched]) and not np.array_equal(dev[touched], W[touched])


@pytest.mark.parametrize("device_indices", [False, True])
def test_any_order_sgd_makes_no_plan_matches_the_cpu_and_rounds_rows_of_one_entry_exactly(device_indices,
                                                                                          monkeypatch):
    rng = np.random.default_rng(21)
    be = ReferenceBackend(device_indices)
    monkeypatch.setattr(be, "argsorts", lambda idxs: pytest.fail("an any-order SGD update made a plan"))
    for F, dup, mode, weighted in ((64, False, "sum", False), (12, True, "mean", False), (8, True, "sum", True),
                                   (8, False, "mean", True)):
        W, idx, off, w, g = update_case(rng, 40, 11, 9, F, dup, weighted)
        cpu, exact, dev = W.copy(), W.copy(), W.copy()
        E.pullback(E.SimpleEmbedding(cpu, "t", align=False), g, idx, off, mode=mode, weights=w,
                   optimizer=E.SGD(0.1, deterministic=False))
        ops.pullback(ReferenceBackend(device_indices), "t", exact, None, g, idx, off, mode=mode, weights=w,
                     optimizer=E.SGD(0.1))
        ops.pullback(be, "t", dev, None, g, idx, off, mode=mode, weights=w, optimizer=E.SGD(0.1, deterministic=False))
        np.testing.assert_allclose(dev, cpu, rtol=2e-6, atol=2e-6)
        uses = np.bincount(idx, minlength=40)
        assert np.array_equal(dev[uses == 1], exact[uses == 1]) and np.array_equal(dev[uses == 0], W[uses == 0])
        assert not np.array_equal(dev[uses > 0], W[uses > 0])
        if dup:
            assert (uses > 1).any()


def test_update_plan_groups_each_rows_entries_in_batch_order():
    be = ReferenceBackend()
    idx = np.array([5, 2, 5, 9, 2, 5], np.int64)
    p = ops.plan(be, idx)
    assert p.srow.tolist() == [2, 2, 5, 5, 5, 9] and p.perm.tolist() == [1, 4, 0, 2, 5, 3]
    assert p.NL == 0 and p.NC == 0
    hot = np.concatenate([np.full(40, 7), np.arange(5), np.full(1100, 3)])  # rows 7 and 3 are long
    p = ops.plan(be, hot)
    # sorted: rows 0, 1, 2 (one entry each), 3 (1101), 4 (one), 7 (40)
    assert p.NL == 2 and p.lstart.tolist() == [3, 1105] and p.lend.tolist() == [1104, 1145]
    assert reference.chunk_len(40) == 32 and reference.chunk_len(1101) == 34 and reference.chunk_len(1156) == 34
    assert p.lbase.tolist() == [0, -(-1101 // 34)] and p.NC == -(-1101 // 34) + 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=60), st.integers(1, 40))
def test_the_long_row_bounds_hold_every_batch(runs, C):
    """The bounds an update allocates for when the long rows' counts stay on the device are never
    below the counts (runs of any lengths, each of a different row) and are reached: runs of
    ``C + 1`` entries fill the first."""
    from embeddings.gpu.backend import long_row_bounds
    srow = np.repeat(np.arange(len(runs)), runs)
    lstart, lend, lbase, NL, NC = ReferenceBackend._long_rows(srow, C)
    most, chunks = long_row_bounds(srow.size, C)
    assert NL <= most and NC <= chunks
    tight = np.repeat(np.arange(len(runs)), C + 1)
    assert ReferenceBackend._long_rows(tight, C)[3] == long_row_bounds(tight.size, C)[0] == len(runs)


def test_long_rows_sum_in_chunks_whose_sums_add_in_chunk_order():
    """A row of more than CHUNK entries: chunk_len(n) entries per chunk, each summed in batch order,
    the chunk sums added in order; shorter rows in batch order. Exact, on the reference backend."""
    rng = np.random.default_rng(11)
    F, n = 8, 1100
    W = table(rng, 6, F)
    idx = np.concatenate([np.full(n, 4), [1, 2, 1]])[rng.permutation(n + 3)].reshape(-1, 1)
    g = (rng.standard_normal((n + 3, F)) * 10.0 ** rng.integers(-3, 3, (n + 3, 1))).astype(np.float32)
    got = W.copy()
    ops.pullback(ReferenceBackend(), "t", got, None, g, idx, optimizer=E.SGD(0.5))
    pos = np.flatnonzero(idx[:, 0] == 4)
    cl = reference.chunk_len(n)
    acc = np.zeros(F, np.float32)
    for a in range(0, n, cl):
        part = np.zeros(F, np.float32)
        for p in pos[a:a + cl]:
            part = part + g[p]
        acc = acc + part
    assert cl == 34 and np.array_equal(got[4], W[4] - np.float32(0.5) * acc)
    one = np.flatnonzero(idx[:, 0] == 1)
    assert np.array_equal(got[1], W[1] - np.float32(0.5) * (np.zeros(F, np.float32) + g[one[0]] + g[one[1]]))
    serial = np.zeros(F, np.float32)
    for p in pos:
        serial = serial + g[p]
    assert not np.array_equal(acc, serial)  # the chunk order is a different order (this batch tells them apart)
    np.testing.assert_allclose(acc, g[pos].astype(np.float64).sum(0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device_indices", [False, True])
def test_bad_input_raises_the_cpu_error_before_anything_is_written(device_indices):
    rng = np.random.default_rng(3)
    W = table(rng, 20, 8)
    be = ReferenceBackend(device_indices)
    g = np.ones((3, 8), np.float32)
    cases = [
        (IndexError, dict(indices=np.array([[1, 2], [3, 20], [0, 0]]))),
        (IndexError, dict(indices=np.array([1, -1, 2, 3]), offsets=np.array([0, 1, 3, 4]))),
        (ValueError, dict(indices=np.array([1, 2, 3, 4]), offsets=np.array([0, 3, 1, 4]))),
        (ValueError, dict(indices=np.array([1, 2, 3, 4]), offsets=np.array([0, 1, 3, 5]))),
        (TypeError, dict(indices=np.array([[1.0, 2.0]] * 3))),
        (ValueError, dict(indices=np.array([1, 2, 3]), mode="sum")),
    ]
    for exc, kw in cases:
        with pytest.raises(exc) as cpu_err:
            E.lookup(E.SimpleEmbedding(W.copy(), "emb"), **kw)
        with pytest.raises(exc) as dev_err:
            ops.lookup(be, "emb", W, **kw)
        assert str(dev_err.value) == str(cpu_err.value)
        before = W.copy()
        for opt in (E.SGD(0.1), E.SGD(0.1, deterministic=False)):
            with pytest.raises(exc, match="emb"):
                ops.pullback(be, "emb", W, None, g, **kw, optimizer=opt)
            assert np.array_equal(W, before)
    bad = g.copy()
    bad[2, 5] = np.nan
    for opt in (E.SGD(0.1), E.SGD(0.1, deterministic=False)):
        with pytest.raises(FloatingPointError, match="emb: non-finite gradient in output row 2"):
            ops.pullback(be, "emb", W, None, bad, np.array([[1, 2], [3, 4], [5, 6]]), optimizer=opt)
        assert np.array_equal(W, before)
    with pytest.raises(TypeError, match="SGD's deterministic must be True or False, got 'no'"):
        ops.pullback(be, "emb", W, None, g, np.array([[1, 2], [3, 4], [5, 6]]), optimizer=E.SGD(0.1, "no"))
    assert np.array_equal(W, before)
    with pytest.raises(ValueError, match=r"gradient shape \(2, 8\)"):
        ops.pullback(be, "emb", W, None, g[:2], np.array([[1, 2], [3, 4], [5, 6]]), optimizer=E.SGD(0.1))
    with pytest.raises(TypeError, match="float32"):
        ops.lookup(be, "emb", W.astype(np.float64), np.array([1]))


class _Recording(ReferenceBackend):
    """The reference backend, recording its waits for the device among ``events``."""

    def __init__(self, device_indices: bool, events: list) -> None:
        super().__init__(device_indices)
        self.events = events

    def sync(self) -> None:
        self.events.append("sync")


@pytest.mark.parametrize("device_indices", [False, True])
def test_a_new_lookups_output_is_wrapped_while_its_kernel_runs_only_where_the_call_waits_for_it(device_indices):
    rng = np.random.default_rng(3)
    W = table(rng, 50, 8)
    idx = rng.integers(0, 50, (6, 3)).astype(np.int32)
    events = []
    be = _Recording(device_indices, events)

    def wrap(out, ordered):
        events.append(("wrap", ordered))
        return ("wrapped", out)

    tag, out = ops.lookup(be, "t", W, idx, wrap=wrap)
    assert tag == "wrapped" and np.array_equal(out, E.lookup(E.SimpleEmbedding(W, "t"), idx))
    # a device batch: the call waits to confirm the kernel's checks, so the output is wrapped
    # before that wait and needs no ordering; a host batch was checked before, nothing waits
    assert events == ([("wrap", False), "sync"] if device_indices else [("wrap", True)])
    events.clear()
    bad = idx.copy()
    bad[4, 1] = 50
    with pytest.raises(IndexError, match=r"t: index 50 at position \(4, 1\)"):
        ops.lookup(be, "t", W, bad, wrap=wrap)
    assert events == ([("wrap", False), "sync"] if device_indices else [])
    events.clear()
    into = np.zeros((6, 8), np.float32)
    assert ops.lookup(be, "t", W, idx, out=into, wrap=wrap) is into and ("wrap", False) not in events
    assert np.array_equal(into, out)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to compile-check the CUDA source")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    src = tmp_path / "kernels.cu"
    src.write_text(cuda.SOURCE)
    r = subprocess.run(["nvcc", "-arch=sm_90", "--std=c++14", "--ptx", "-o", str(tmp_path / "k.ptx"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for name in ("pooled_v4_i32", "pooled_v1_i64", "update_short_v4_i32", "update_long_v1_i64", "chunk_sums_v4",
                 "sorted_rows_i64", "long_rows_i32", "check_i32", "sgd_any_7_v4_i32", "sgd_any_9_v1_i64"):
        assert f".entry {name}(" in ptx


def test_numpy_tables_never_take_the_gpu_path():
    from embeddings.gpu import table_on_gpu
    assert not table_on_gpu(E.SimpleEmbedding(np.zeros((4, 8), np.float32)))


def test_bounce_blocks_come_in_few_sizes_each_at_most_a_quarter_larger_than_asked():
    from embeddings.gpu.backend import size_class
    sizes = np.unique(np.r_[np.arange(1, 70000, 7), np.linspace(1e5, 3e8, 5000).astype(np.int64)])
    classes = np.array([size_class(int(n)) for n in sizes])
    assert np.all(classes >= sizes) and np.all(np.diff(classes) >= 0)
    assert np.all(classes[sizes > 4096] <= 1.25 * sizes[sizes > 4096]) and np.all(classes[sizes <= 4096] == 4096)
    band = (sizes >= 100e6) & (sizes <= 125e6)  # a placement's rows from one step to the next
    assert len(np.unique(classes[band])) <= 3
    assert all(size_class(int(c)) == c for c in classes)  # a class asked for again is itself


# ---------------------------------------------------------------------------------------- on a GPU
def _gpu_tables(W: np.ndarray):
    """The same rows as a CuPy array, a JAX GPU array and a GPU-resident CachedArray (with its manager)."""
    import cupy as cp
    import jax
    from cachedarrays import DRAM, GPU, PM, CachedArray, LRUPolicy, Manager
    m = Manager(GPU("64MiB"), DRAM("64MiB"), PM(None, "128MiB"), policy=LRUPolicy())
    x = CachedArray(W, m)
    assert x.device == "GPU", x
    return m, {"cupy": cp.asarray(W), "jax": jax.device_put(W, jax.devices("gpu")[0]), "cached": x}


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_bounce_blocks_of_changing_sizes_reuse_the_page_locked_pool():
    """A block freed goes back to CuPy's pool and serves the next request of another size in its
    class: 200 transfers of different sizes page-lock memory a few times, not 200; host arrays
    uploaded by the backend likewise."""
    import cupy as cp
    from embeddings.gpu.backend import cuda_backend
    be, pool = cuda_backend(), cp.get_default_pinned_memory_pool()
    rng = np.random.default_rng(3)
    before = pool.n_free_blocks()
    for n in rng.integers(400_000, 480_000, 200):
        block = be.bounce((int(n), 64), np.float32)
        assert block.shape == (n, 64) and block.dtype == np.float32
        block[-1] = 1.0
        del block
    assert pool.n_free_blocks() - before <= 2
    before = pool.n_free_blocks()
    for n in rng.integers(400_000, 480_000, 100):  # host arrays made device arrays
        x = rng.integers(0, 1 << 40, int(n))
        assert np.array_equal(be.asarray(x).get(), x)
        assert np.array_equal(be.asarray(x[::3], np.int32).get(), x[::3].astype(np.int32))
    be.sync()
    assert pool.n_free_blocks() - before <= 4


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_device_arrays_come_to_the_host_exactly_whatever_their_size_layout_or_stream():
    """Small arrays come through a page-locked block after the work queued before them on the
    current stream (a kernel's result, read at once), large ones as CuPy copies them; strided
    views and JAX arrays too."""
    import cupy as cp
    import jax
    from embeddings.gpu.backend import SMALL, cuda_backend
    be = cuda_backend()
    rng = np.random.default_rng(4)
    with cp.cuda.Stream(non_blocking=True):
        for n in (1, 5, 1000, SMALL // 8, SMALL // 8 + 1, 300_000):
            x = cp.asarray(rng.integers(-1 << 40, 1 << 40, n))
            y = x * 3 + 1  # queued on this stream just before
            got = be.to_host(y)
            assert isinstance(got, np.ndarray) and got.shape == (n,) and np.array_equal(got, x.get() * 3 + 1)
        m = cp.arange(60, dtype=cp.float32).reshape(6, 10)
        assert np.array_equal(be.to_host(m[:, ::3]), m.get()[:, ::3])
        assert np.array_equal(be.to_host(cp.zeros((0, 4), cp.int32)), np.zeros((0, 4), np.int32))
    j = jax.device_put(np.arange(7, dtype=np.int32), jax.devices("gpu")[0])
    assert np.array_equal(be.to_host(j), np.arange(7))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_the_update_plans_of_several_batches_come_from_one_sort_equal_to_each_batchs_own():
    """``argsorts`` (one sort keyed by batch and entry) gives each batch the stable argsort it
    would get alone, for int32 and int64 indices, empty batches and duplicates; an invalid
    (negative) index still gets a permutation of its own batch, so nothing reads out of range
    before the checks refuse it."""
    import cupy as cp
    from embeddings.gpu.backend import cuda_backend
    be, ref = cuda_backend(), ReferenceBackend()
    rng = np.random.default_rng(5)
    host = [rng.integers(0, 50, 3000).astype(np.int32), np.zeros(0, np.int64),
            rng.integers(0, 1 << 35, 5000), np.full(700, 3, np.int32), rng.integers(0, 4, 1).astype(np.int32)]
    host[2][::7] = host[2][0]  # duplicates of a large row
    got = be.argsorts([cp.asarray(h) for h in host])
    for h, p, want in zip(host, got, ref.argsorts(host)):
        assert np.array_equal(cp.asnumpy(p), want)
    bad = [np.array([4, -1, 2, 0], np.int64), np.array([1, 0, 1], np.int64)]
    got = be.argsorts([cp.asarray(h) for h in bad])
    assert sorted(cp.asnumpy(got[0]).tolist()) == [0, 1, 2, 3] and cp.asnumpy(got[1]).tolist() == [1, 0, 2]
    assert [cp.asnumpy(p).tolist() for p in be.argsorts([cp.asarray(host[0])])] == [ref.argsort(host[0]).tolist()]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("F", [8, 12, 64, 256])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_gpu_lookup_equals_the_cpu_bit_for_bit(F, mode):
    import jax
    rng = np.random.default_rng(F)
    W = table(rng, 1000, F)
    cpu = E.SimpleEmbedding(W, "t")
    m, datas = _gpu_tables(W)
    with m:
        for kind, data in datas.items():
            t = E.SimpleEmbedding(data, "t")
            for dup, most in ((False, 1), (False, 40), (True, 40)):
                idx, off = batch(rng, 1000, 300, most, dup)
                expect = E.lookup(cpu, idx, off, mode=mode)
                got = E.lookup(t, idx, off, mode=mode)
                assert isinstance(got, jax.Array) and got.devices().pop().platform == "gpu", (kind, type(got))
                diff = np.abs(np.asarray(got) - expect).max() if expect.size else 0.0
                assert np.array_equal(np.asarray(got), expect), f"{kind} F={F} {mode} dup={dup} most={most}: {diff}"
                import cupy as cp
                got_dev = E.lookup(t, cp.asarray(idx), cp.asarray(off), mode=mode)  # device indices
                assert np.array_equal(np.asarray(got_dev), expect), kind
            idx2 = rng.integers(0, 1000, (64, 40))
            assert np.array_equal(np.asarray(E.lookup(t, idx2)), E.lookup(cpu, idx2)), kind
            flat = rng.integers(0, 1000, 77)
            assert np.array_equal(np.asarray(E.lookup(t, flat)), W[flat]), kind
            w = rng.random(idx2.shape).astype(np.float32)
            np.testing.assert_allclose(np.asarray(E.lookup(t, idx2, weights=w, mode=mode)),
                                       E.lookup(cpu, idx2, weights=w, mode=mode), rtol=1e-5, atol=1e-5)
        m.check()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_gpu_lookup_into_cupy_column_slices():
    import cupy as cp
    rng = np.random.default_rng(5)
    W = table(rng, 500, 64)
    t = E.SimpleEmbedding(cp.asarray(W), "t")
    idx = rng.integers(0, 500, (128, 40))
    out = cp.full((128, 3 * 64), 7.0, cp.float32)
    r = E.lookup_into(out[:, 64:128], t, idx)
    assert isinstance(r, cp.ndarray)
    host = out.get()
    assert np.array_equal(host[:, 64:128], E.lookup(E.SimpleEmbedding(W), idx)) and (host[:, :64] == 7).all()
    with pytest.raises(TypeError, match="immutable"):
        import jax.numpy as jnp
        E.lookup_into(jnp.zeros((128, 64), jnp.float32), t, idx)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("opt", [E.SGD, E.RowwiseAdagrad])
def test_gpu_pullback_matches_the_cpu(opt):
    import cupy as cp
    rng = np.random.default_rng(6)
    for F, dup, mode, weighted in ((64, False, "sum", False), (256, True, "mean", False), (12, True, "sum", True),
                                   (64, True, "sum", False)):
        W, idx, off, w, g = update_case(rng, 1000, 300, 40, F, dup, weighted)
        cpu = W.copy()
        E.pullback(E.SimpleEmbedding(cpu, "t", align=False), g, idx, off, mode=mode, weights=w, optimizer=opt(0.05))
        m, datas = _gpu_tables(W)
        with m:
            for kind, data in datas.items():
                if kind == "jax":
                    continue  # JAX arrays are immutable: updates go to CuPy arrays and CachedArrays
                t = E.SimpleEmbedding(data, "t")
                gd = cp.asarray(g) if kind == "cupy" else g
                E.pullback(t, gd, idx, off, mode=mode, weights=w, optimizer=opt(0.05))
                got = _host(data) if kind == "cupy" else np.asarray(data)
                err = np.abs(got - cpu).max()
                np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5 * (40 if dup else 1),
                                           err_msg=f"{kind} F={F} dup={dup} {mode} weighted={weighted}: {err}")
            m.check()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_gpu_bad_input_raises_before_anything_is_written():
    import cupy as cp
    rng = np.random.default_rng(7)
    W = table(rng, 100, 64)
    d = cp.asarray(W)
    t = E.SimpleEmbedding(d, "emb")
    g = cp.ones((3, 64), cp.float32)
    for indices in (np.array([[1, 2], [3, 100], [0, 0]]), cp.asarray(np.array([[1, 2], [3, 100], [0, 0]]))):
        with pytest.raises(IndexError, match=r"emb: index 100 at position \(1, 1\) is out of range"):
            E.lookup(t, indices)
        with pytest.raises(IndexError, match=r"emb: index 100 at position \(1, 1\)"):
            E.pullback(t, g, indices, optimizer=E.SGD(0.1))
    bad = g.copy()
    bad[1, 3] = cp.inf
    for indices in (np.array([[1, 2], [3, 4], [0, 0]]), cp.asarray(np.array([[1, 2], [3, 4], [0, 0]]))):
        with pytest.raises(FloatingPointError, match="emb: non-finite gradient in output row 1"):
            E.pullback(t, bad, indices, optimizer=E.RowwiseAdagrad(0.1))
    with pytest.raises(ValueError, match="offsets not monotone at bag 1"):
        E.lookup(t, cp.asarray([1, 2, 3]), cp.asarray([0, 2, 1, 3]))
    assert np.array_equal(d.get(), W)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_gpu_ensemble_matches_the_cpu():
    import cupy as cp
    rng = np.random.default_rng(8)
    Ws = [table(rng, 300 + 100 * i, 64) for i in range(3)]
    cpu = E.Ensemble([E.SimpleEmbedding(W.copy(), f"t{i}") for i, W in enumerate(Ws)])
    dev = [cp.asarray(W) for W in Ws]
    ens = E.Ensemble([E.SimpleEmbedding(d, f"t{i}") for i, d in enumerate(dev)])
    idx = [rng.integers(0, W.shape[0], (128, 20)) for W in Ws]
    assert np.array_equal(np.asarray(ens.lookup(idx)), cpu.lookup(idx))
    g = rng.standard_normal((128, 3, 64)).astype(np.float32)
    for opt in (E.RowwiseAdagrad(0.1), E.SGD(0.1, deterministic=False)):
        cpu.pullback(g, idx, optimizer=opt)
        ens.pullback(cp.asarray(g), idx, optimizer=opt)
        for i, d in enumerate(dev):
            np.testing.assert_allclose(d.get(), cpu.tables[i].data, rtol=1e-5, atol=1e-5)
    before = [d.get() for d in dev]
    bad = [i.copy() for i in idx]
    bad[2][5, 3] = 10 ** 6
    with pytest.raises(IndexError, match=r"t2: index 1000000 at position \(5, 3\)"):
        ens.pullback(cp.asarray(g), bad, optimizer=E.SGD(0.1))
    assert all(np.array_equal(d.get(), b) for d, b in zip(dev, before))


def _skewed_batch(rng, nvec: int, L: int):
    """Indices with one row of about half the entries, a few of ~40 and many singles (long and short rows)."""
    idx = rng.integers(0, nvec, L)
    idx[rng.random(L) < 0.5] = 3
    idx[rng.random(L) < 0.1] = rng.integers(0, 5, 1)[0] + 10
    return idx


def _skewed_updates(rng):
    """Per case (float4 and float rows, int32/int64 indices, sum/mean/weighted): F, mode, weighted,
    a table of 5000 rows, 512 skewed bags of 8 (:func:`_skewed_batch`), weights or None, a gradient."""
    for F, mode, weighted, dtype in ((64, "sum", False, np.int32), (256, "mean", False, np.int64),
                                     (10, "sum", True, np.int64), (12, "mean", True, np.int32)):
        W = table(rng, 5000, F)
        idx = _skewed_batch(rng, 5000, 512 * 8).astype(dtype).reshape(512, 8)
        w = rng.random(idx.shape).astype(np.float32) if weighted else None
        yield F, mode, weighted, W, idx, w, rng.standard_normal((512, F)).astype(np.float32)


def _gpu_pullback(W, state, g, idx, mode, w, optimizer, device_idx: bool) -> np.ndarray:
    """``ops.pullback`` on the CUDA backend into a device copy of ``W``, with the batch (indices,
    weights) on the device or the host: the updated rows."""
    import cupy as cp
    from embeddings.gpu.backend import cuda_backend
    dev = cp.asarray(W)
    on = cp.asarray if device_idx else (lambda x: x)
    ops.pullback(cuda_backend(), "t", dev, state, cp.asarray(g), on(idx), mode=mode,
                 weights=None if w is None else on(w), optimizer=optimizer)
    return dev.get()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("opt", [E.SGD, E.RowwiseAdagrad])
@pytest.mark.parametrize("counted_on", ["device", "host"])
def test_gpu_update_equals_the_reference_bit_for_bit(opt, counted_on, monkeypatch):
    """The CUDA update kernels (short rows, chunked long rows, both optimizers, float4 and float
    rows, int32/int64 and host/device indices, sum/mean/weighted) against the numpy reference,
    with the long rows' counts left on the device (the kernels read them) and, when the chunk
    sums of their bound would not fit the scratch allowed, counted on the host."""
    import cupy as cp
    from embeddings.gpu import backend as B_
    from embeddings.gpu.backend import cuda_backend
    if counted_on == "host":
        monkeypatch.setattr(B_, "SCRATCH", 0)
    rng = np.random.default_rng(12)
    for F, mode, weighted, W, idx, w, g in _skewed_updates(rng):
        ref, ref_state = W.copy(), np.full(W.shape[0], 0.25, np.float32)
        ops.pullback(ReferenceBackend(), "t", ref, ref_state, g, idx, mode=mode, weights=w, optimizer=opt(0.05))
        for device_idx in (False, True):
            state = cp.full(W.shape[0], 0.25, cp.float32)
            got = _gpu_pullback(W, state, g, idx, mode, w, opt(0.05), device_idx)
            assert np.array_equal(got, ref), (F, mode, weighted, device_idx, np.abs(got - ref).max())
            if opt is E.RowwiseAdagrad:
                assert np.array_equal(state.get(), ref_state)
        plan = ops.plan(ReferenceBackend(), idx.reshape(-1))
        assert plan.NL >= 2 and plan.perm.size - plan.NL > 100  # long and short rows both ran
        on_gpu = ops.plan(cuda_backend(), cp.asarray(idx.reshape(-1)), F)
        assert (on_gpu.counts is not None) == (counted_on == "device")
        assert on_gpu.sizes() == (plan.NL, plan.NC) and on_gpu.NL >= plan.NL and on_gpu.NC >= plan.NC


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_gpu_any_order_sgd_equals_its_reference_on_rows_of_one_entry_and_within_rounding_elsewhere():
    """The any-order SGD kernel (float4 and float rows, tiles of 128 and 512 entries, int32/int64
    and host/device indices, sum/mean/weighted, CSR bags) against its numpy reference: rows with
    one entry bit for bit, rows with many (one row takes half the batch) within float rounding of
    the reference's batch order; a bad device index leaves the table unwritten."""
    import cupy as cp
    from embeddings.gpu.backend import cuda_backend
    rng = np.random.default_rng(22)
    opt = E.SGD(0.05, deterministic=False)
    for F, mode, weighted, W, idx, w, g in _skewed_updates(rng):
        ref = W.copy()
        ops.pullback(ReferenceBackend(), "t", ref, None, g, idx, mode=mode, weights=w, optimizer=opt)
        uses = np.bincount(idx.ravel(), minlength=W.shape[0])
        assert uses.max() > 1000 and (uses == 1).sum() > 100
        for device_idx in (False, True):
            got = _gpu_pullback(W, None, g, idx, mode, w, opt, device_idx)
            assert np.array_equal(got[uses <= 1], ref[uses <= 1]), (F, mode, weighted, device_idx)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=f"{F} {mode} {weighted} {device_idx}")
    cidx, coff = batch(rng, 1000, 700, 12, dup=True)  # CSR bags, some empty, of 3 rows
    cw = rng.random(cidx.size).astype(np.float32)
    cg = rng.standard_normal((700, 16)).astype(np.float32)
    W16 = table(rng, 1000, 16)
    ref, dev = W16.copy(), cp.asarray(W16)
    ops.pullback(ReferenceBackend(), "t", ref, None, cg, cidx, coff, mode="mean", weights=cw, optimizer=opt)
    ops.pullback(cuda_backend(), "t", dev, None, cp.asarray(cg), cp.asarray(cidx), cp.asarray(coff), mode="mean",
                 weights=cp.asarray(cw), optimizer=opt)
    np.testing.assert_allclose(dev.get(), ref, rtol=1e-5, atol=1e-4)
    assert np.array_equal(dev.get()[3:], W16[3:]) and not np.array_equal(ref[:3], W16[:3])
    d = cp.asarray(W)
    bad = cp.asarray(idx)
    bad[7, 2] = W.shape[0]
    with pytest.raises(IndexError, match=rf"emb: index {W.shape[0]} at position \(7, 2\)"):
        E.pullback(E.SimpleEmbedding(d, "emb"), cp.asarray(g), bad, mode="mean", optimizer=opt)
    assert np.array_equal(d.get(), W)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_gpu_device_batch_errors_leave_outputs_and_tables_unwritten():
    import cupy as cp
    rng = np.random.default_rng(13)
    W = table(rng, 100, 64)
    t = E.SimpleEmbedding(cp.asarray(W), "emb")
    bad = cp.asarray(np.array([[1, 2], [3, 4], [0, -5]], np.int32))
    out = cp.full((3, 64), 7.0, cp.float32)
    with pytest.raises(IndexError, match=r"emb: index -5 at position \(2, 1\)"):
        E.lookup_into(out, t, bad)
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match="offsets"):
        E.lookup(t, cp.asarray([1, 2, 3]), cp.asarray([0, 2, 4]), mode="sum")
    with pytest.raises(IndexError, match="emb: index -5"):
        E.pullback(t, cp.ones((3, 64), cp.float32), bad, optimizer=E.SGD(0.1))
    assert np.array_equal(t.data.get(), W)
    ok = cp.asarray(np.array([[1, 2], [3, 4], [0, 5]], np.int32))
    assert np.array_equal(np.asarray(E.lookup(t, ok)), E.lookup(E.SimpleEmbedding(W), ok.get()))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")
def test_pull_and_small_to_host_bring_the_devices_bytes_through_the_mapped_address():
    """`CudaBackend.pull` (a kernel storing into page-locked memory: words where aligned, else
    bytes; the first elements only, as many as a device count says) and `to_host` of small
    arrays give the device's values, whatever the type, size and layout; a size mismatch, host
    memory that is not page-locked, or a count over elements that are not words is refused
    before anything is written."""
    import cupy as cp
    from embeddings.gpu.backend import cuda_backend
    be = cuda_backend()
    rng = np.random.default_rng(1)
    for x in (rng.integers(-2 ** 40, 2 ** 40, 300_001), rng.integers(0, 9, 7).astype(np.int32),
              rng.random(13) < 0.5, rng.standard_normal((5, 3)).astype(np.float32), np.zeros(0, np.int64)):
        d = cp.asarray(x)
        host = be.bounce(x.shape, x.dtype)
        be.pull(host, d)
        be.wait(be.fence())
        assert np.array_equal(host, x)
        assert np.array_equal(be.to_host(d[::2]), x[::2])  # small and not contiguous: made contiguous first
    odd = cp.arange(9, dtype=cp.int8)[1:]  # eight bytes, not on an 8-byte boundary: byte by byte
    host = be.bounce((8,), np.int8)
    be.pull(host, odd)
    be.wait(be.fence())
    assert host.tolist() == list(range(1, 9))
    short = be.bounce((3,), np.int64)
    short[:] = -1
    with pytest.raises(ValueError, match="pull: 32 contiguous device bytes need as many contiguous host bytes"):
        be.pull(short, cp.arange(4, dtype=cp.int64))
    assert short.tolist() == [-1, -1, -1]
    pageable = np.full(4, -1, np.int64)
    with pytest.raises(ValueError, match="pull: the host array must be page-locked"):
        be.pull(pageable, cp.arange(4, dtype=cp.int64))
    assert pageable.tolist() == [-1] * 4
    src = cp.arange(10, 16, dtype=cp.int64)
    for count, expect in ((3, [10, 11, 12, -1, -1, -1]), (0, [-1] * 6), (9, list(range(10, 16)))):
        bounded = be.bounce((6,), np.int64)  # only the first `count` (a device number) stored
        bounded[:] = -1
        be.pull(bounded, src, cp.asarray([count], cp.int64))
        be.wait(be.fence())
        assert bounded.tolist() == expect
    with pytest.raises(ValueError, match="pull: a device count bounds arrays of 8-byte elements, got int32"):
        be.pull(be.bounce((4,), np.int32), cp.arange(4, dtype=cp.int32), cp.asarray([2], cp.int64))
    assert be.to_host(cp.arange(3)).tolist() == [0, 1, 2]  # the device is still fine
