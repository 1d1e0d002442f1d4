"""The per-kernel host path: kept JAX views of regions (`jax_array`, `Manager.settled`), the executor
handing the previous kernel's outputs on as JAX values, and grouped SGD updates."""

import jax.numpy as jnp
import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import DRAM, PM, CachedArray, LRUPolicy, Manager, StatusError, jax_array, readable, writable


@pytest.fixture
def m():
    manager = Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy())
    yield manager
    manager.check()
    manager.close()


def test_jax_array_is_kept_while_the_region_stays_and_renewed_when_it_moves(m):
    x = CachedArray(np.arange(64, dtype=np.float32), m)
    with readable(x) as _:
        pass
    v = readable(x)
    a = jax_array(v)
    v.release()
    region = m.primary(x.object)
    assert a.unsafe_buffer_pointer() == region.device.address(region.offset)  # the region itself
    v = readable(x)
    assert jax_array(v) is a  # kept: no second import
    v.release()
    with writable(x) as w:  # writes land in the bytes the kept array aliases
        w[:] = -1
    v = readable(x)
    b = jax_array(v)
    assert b is a and np.asarray(b).tolist() == [-1.0] * 64
    v.release()
    ca.evict(x)
    ca.prefetch(x, force=True)  # back in DRAM, in a new region
    assert m.primary(x.object) is not region and region.freed
    v = readable(x)
    c = jax_array(v)
    moved = m.primary(x.object)
    assert c.unsafe_buffer_pointer() == moved.device.address(moved.offset)  # the new region's bytes
    assert np.asarray(c).tolist() == [-1.0] * 64
    v.release()
    with pytest.raises(StatusError, match="held readable"):
        jax_array(x)
    with pytest.raises(StatusError, match="held readable"):
        jax_array(v)


def test_an_object_placed_where_a_freed_one_was_reuses_its_import(m, monkeypatch):
    from cachedarrays import jaxdlpack
    imports = []
    real = jaxdlpack.from_dlpack
    monkeypatch.setattr(jaxdlpack, "from_dlpack", lambda v: imports.append(v) or real(v))

    def read(x):
        with readable(x) as _:
            pass  # the first use may move the object (LRU inserts on use); read its JAX array after
        v = readable(x)
        region = m.primary(x.object)
        arr = jax_array(v)
        v.release()
        return arr, (region.device, region.offset)

    x = CachedArray(np.arange(64, dtype=np.float32), m)
    a, where = read(x)
    assert len(imports) == 1
    ca.cleanup(x)
    y = CachedArray(np.arange(64, dtype=np.float32)[::-1].copy(), m)  # same size: the allocator reuses the spot
    b, where_y = read(y)
    assert where_y == where and b is a and len(imports) == 1  # no second import
    np.testing.assert_array_equal(np.asarray(b), np.arange(64)[::-1])  # y's bytes, read through the kept array
    ca.cleanup(y)
    z = CachedArray(np.arange(64, dtype=np.int32), m)  # same bytes, another dtype: imported anew
    c, where_z = read(z)
    assert where_z == where and c is not a and len(imports) == 2
    np.testing.assert_array_equal(np.asarray(c), np.arange(64))


def test_kept_imports_are_bounded(m, monkeypatch):
    monkeypatch.setattr(ca.array, "JAX_VIEWS_KEPT", 3)
    xs = [CachedArray(np.full(16, i, np.float32), m) for i in range(5)]
    for x in xs:
        with readable(x) as _:
            pass
        v = readable(x)
        jax_array(v)
        v.release()
    kept = ca.array._JAX_VIEWS[m]
    assert len(kept) == 3  # the two oldest went
    assert {offset for _, offset, _, _ in kept} == {m.primary(x.object).offset for x in xs[2:]}


def test_host_memory_that_is_not_page_locked_has_no_cuda_address(m):
    x = CachedArray(np.arange(8, dtype=np.float32), m)
    assert not m.fast.page_locked and not ca.cuda_reachable(x)  # no GPU here: nothing is page-locked
    with readable(x) as _:
        pass
    v = readable(x)
    with pytest.raises(ValueError, match="not page-locked"):
        ca.device_pointer(v)
    v.release()
    m.fast.page_locked = True  # what pagelock() records once CUDA has registered the heap
    try:
        assert ca.cuda_reachable(x)
    finally:
        m.fast.page_locked = False


def test_settled_says_whether_a_reader_would_wait(m):
    x = CachedArray(np.ones(1024, np.float32), m)
    region = m.primary(x.object)
    assert m.settled(region) and m.settled(region, write=True)
    ca.evict(x)
    slow = m.primary(x.object)
    fast = m.allocate(m.fast, slow.nbytes)
    m.link(slow, fast)
    done = m.copyto_async(fast, slow)
    if not done.done():
        assert not m.settled(fast)
    m.ready(fast)
    assert m.settled(fast) and region.freed and not m.settled(region)


def test_the_next_kernel_reads_the_previous_outputs_jax_value():
    from cnn.execute import Executor
    with Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy()) as m:
        ex = Executor(m)
        x = CachedArray(np.arange(8, dtype=np.float32), m)
        made, seen = [], []

        def double(a):
            made.append(a * 2)
            return made[-1]

        def record(a, b):
            seen.append((a, b))
            return a + b

        (y,) = ex.call(double, (x,))
        (z,) = ex.call(record, (y, x))
        assert seen[0][0] is made[0] and seen[0][1] is not made[0]  # y from its value, x from its region
        ex.call_into(double, (x,), (y,))  # y rewritten: the next reader must not see the old value
        (w,) = ex.call(record, (z, y))
        assert seen[1][1] is made[1]  # the new value, which y's deferred write will store
        np.testing.assert_array_equal(np.asarray(w), np.arange(8) * 3 + np.arange(8) * 2)
        with pytest.raises(ValueError, match="cannot be stored"):
            ex.call_into(lambda a: jnp.zeros(3, jnp.float32), (x,), (y,))


def test_sgd_groups_stay_within_the_largest_parameter_and_match_single_updates():
    from cnn import kernels as K
    from cnn.execute import Executor
    from cnn.annotate import Annotations
    from cnn.optim import SGD
    with Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy()) as m:
        rng = np.random.default_rng(0)
        sizes = [40, 3, 5, 64, 2, 2, 30]
        ws = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        gs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        params = [CachedArray(w, m) for w in ws]
        opt = SGD(params, 0.1, 0.9)
        pgrads = [(p, CachedArray(g, m)) for p, g in zip(params, gs)]
        groups = opt.groups(pgrads)
        assert [pair for g in groups for pair in g] == pgrads
        assert [len(g) for g in groups] == [3, 1, 3]  # 48 bytes of 256 would not fit after 40+3+5 floats
        assert all(sum(p.nbytes for p, _ in g) <= 64 * 4 for g in groups)
        ex = Executor(m)
        singles = [ex.call(K.sgd_momentum_step, (CachedArray(w, m), CachedArray(g, m), CachedArray(0 * w, m)),
                           np.float32(0.1), np.float32(0.9)) for w, g in zip(ws, gs)]  # on the same device
        ex.stats.reset()
        opt.step(ex, Annotations(m), pgrads)
        for p, (want_w, want_v) in zip(params, singles):
            assert np.asarray(p).tobytes() == np.asarray(want_w).tobytes()
            assert np.asarray(opt.state[p.object.id]).tobytes() == np.asarray(want_v).tobytes()
        assert ex.stats.calls == 3
        assert [len(g) for g in opt.groups(pgrads, 30 * 4)] == [3, 1, 3]  # below the largest parameter: as before
        assert [len(g) for g in opt.groups(pgrads, 146 * 4)] == [7]  # a kernel's working set takes them all
        assert [len(g) for g in opt.groups(pgrads, 145 * 4)] == [6, 1]
