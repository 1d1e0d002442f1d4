"""CachedArray: construction rules, statuses, NumPy protocols, JAX zero-copy, and the Listing 6.1 race."""

import threading

import jax
import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import (DRAM, PM, CachedArray, LRUPolicy, Manager, Status, StatusError, UseAfterFreeError,
                          readable, release, similar, writable)


@pytest.fixture
def m():
    manager = Manager(DRAM("2MiB"), PM(None, "16MiB"), policy=LRUPolicy())
    yield manager
    manager.check()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint64, np.bool_, np.complex64,
                                   np.dtype([("id", np.int64), ("w", np.float32, (3,))])])
def test_roundtrip_plain_bits_dtypes(m, dtype):
    src = np.zeros((5, 7), dtype=dtype)
    src.view(np.uint8)[...] = np.arange(src.nbytes, dtype=np.uint8).reshape(src.view(np.uint8).shape)
    x = CachedArray(src, m)
    assert x.shape == (5, 7) and x.dtype == np.dtype(dtype) and x.nbytes == src.nbytes
    assert np.asarray(x).tobytes() == src.tobytes()


def test_object_dtype_is_refused(m):
    with pytest.raises(TypeError, match="plain bits"):
        CachedArray(np.array([object(), 1], dtype=object), m)
    with pytest.raises(TypeError, match="plain bits"):
        CachedArray((3,), m, dtype=object)


def test_noncontiguous_and_fortran_sources_are_copied_in_c_order(m):
    base = np.arange(100, dtype=np.int32).reshape(10, 10)
    for src in (base[::2, 1::3], np.asfortranarray(base), base.T):
        x = CachedArray(src, m)
        with readable(x) as a:
            assert a.flags.c_contiguous and np.array_equal(a, src)


def test_shape_similar_and_empty(m):
    x = CachedArray((3, 4), m, np.int16)
    y = similar(x)
    assert y.shape == (3, 4) and y.dtype == np.int16 and y.object is not x.object
    z = CachedArray((0, 5), m, np.float32)
    assert z.nbytes == 0 and np.asarray(z).shape == (0, 5)
    with pytest.raises(ValueError, match="negative"):
        CachedArray((-1,), m)


def test_status_rules(m):
    x = CachedArray(np.arange(10.0), m)
    assert x.status is Status.NotBusy
    with pytest.raises(StatusError, match="NotBusy"):
        x.array
    r = readable(x)
    assert r.status is Status.ReadOnly and r.object is x.object
    assert not r.array.flags.writeable
    with pytest.raises(StatusError, match="ReadOnly"):
        r[0] = 5
    with pytest.raises(ValueError):
        r.array[0] = 5  # numpy refuses too
    r.release()
    with pytest.raises(StatusError, match="released"):
        r.array
    w = writable(x)
    w[0] = 5
    assert w.status is Status.ReadWrite and m.isdirty(m.primary(x.object))
    n = release(w)
    assert n.status is Status.NotBusy and not m.pinned(x.object)
    assert x[0] == 5


def test_views_pin_until_released_or_collected(m):
    x = CachedArray(np.arange(10.0), m)
    with readable(x) as a:
        assert m.pinned(x.object) and isinstance(a, np.ndarray)
    assert not m.pinned(x.object)
    v = writable(x)
    assert m.pinned(x.object)
    del v
    import gc
    gc.collect()
    m.check()  # the finalizer's unpin is applied at the next manager call
    assert not m.pinned(x.object)


def test_array_protocol_numpy2_semantics(m):
    x = CachedArray(np.arange(6, dtype=np.float32), m)
    with pytest.raises(ValueError, match="without a copy"):
        np.asarray(x, copy=False)
    c = np.asarray(x)
    c[0] = 100
    assert x[0] == 0  # a NotBusy array hands out copies
    r = readable(x)
    view = np.asarray(r, copy=False)
    assert np.shares_memory(view, r.array)
    assert np.asarray(r, dtype=np.float64).dtype == np.float64
    with pytest.raises(ValueError):
        np.asarray(r, dtype=np.float64, copy=False)


def test_ufuncs_operators_and_array_functions_return_cachedarrays(m):
    a = CachedArray(np.arange(12, dtype=np.float32).reshape(3, 4), m)
    b = CachedArray(np.ones((3, 4), np.float32), m)
    c = a * 2 + b
    assert isinstance(c, CachedArray) and np.array_equal(np.asarray(c), np.arange(12).reshape(3, 4) * 2 + 1)
    d = a @ np.transpose(b)  # an array function, then a ufunc
    assert isinstance(d, CachedArray) and d.shape == (3, 3)
    s = np.sum(a)
    assert not isinstance(s, CachedArray) and s == 66
    cat = np.concatenate([a, b])
    assert isinstance(cat, CachedArray) and cat.shape == (6, 4)
    a += 1  # in place through out=
    assert np.array_equal(np.asarray(a), np.arange(1, 13).reshape(3, 4))
    out = similar(a)
    result = np.add(a, b, out=out)
    assert result is out and out[0, 0] == 2
    assert (a > 5).dtype == np.bool_
    mx, idx = np.max(a), np.argmax(a)
    assert mx == 12 and idx == 11


def test_element_indexing(m):
    x = CachedArray(np.zeros((4, 4), np.int32), m)
    x[1, 2] = 7
    x[3] = np.arange(4)
    x[0, :] = CachedArray(np.full(4, 9, np.int32), m)
    assert x[1, 2] == 7 and list(x[3]) == [0, 1, 2, 3] and list(x[0]) == [9] * 4
    with pytest.raises(IndexError):
        x[5, 0]
    assert len(x) == 4 and [int(v[0]) for v in x] == [9, 0, 0, 0]


def test_two_managers_in_one_operation_are_refused(m):
    other = Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy())
    a = CachedArray(np.ones(4), m)
    b = CachedArray(np.ones(4), other)
    with pytest.raises(ValueError, match="two different managers"):
        a + b
    other.check()


def test_use_after_unsafe_free(m):
    x = CachedArray(np.ones(4), m)
    ca.unsafe_free(x)
    ca.unsafe_free(x)  # freeing twice is harmless
    uses = [lambda: x[0], lambda: np.asarray(x), lambda: readable(x), lambda: writable(x), lambda: x + 1,
            lambda: ca.prefetch(x), lambda: ca.evict(x), lambda: ca.softevict(x)]
    for use in uses:
        with pytest.raises(UseAfterFreeError, match="was freed"):
            use()


def test_jax_dlpack_is_zero_copy(m):
    x = CachedArray(np.arange(64, dtype=np.float32).reshape(8, 8), m)
    r = readable(x)
    j = jax.dlpack.from_dlpack(r)
    assert j.unsafe_buffer_pointer() == r.array.ctypes.data
    assert float(j.sum()) == float(np.arange(64).sum())
    with pytest.raises(StatusError):
        x.__dlpack__()


def test_listing_6_1_race_cannot_tear_a_write():
    """A writer holds writable(x) while another thread forces evictions; the write must land whole."""
    m = Manager(DRAM("1MiB"), PM(None, "16MiB"), policy=LRUPolicy())
    x = CachedArray(np.zeros(100_000, np.float32), m)  # 400 KB
    others = [CachedArray(np.zeros(50_000, np.float32), m) for _ in range(4)]
    stop = threading.Event()
    running = threading.Event()
    errors = []
    rounds = [0]

    def pressure():
        while not stop.is_set():
            try:
                ca.evict(x)
            except ca.PinnedError:
                pass
            except Exception as e:  # pragma: no cover
                errors.append(e)
            for o in others:
                ca.prefetch(o, force=True)
            ca.prefetch(x, force=True)
            rounds[0] += 1
            running.set()

    t = threading.Thread(target=pressure)
    t.start()
    assert running.wait(30)  # the writes below must overlap the eviction pressure
    try:
        for value in range(1, 40):
            with writable(x) as a:
                address = a.ctypes.data
                for chunk in range(0, a.size, 10_000):
                    a[chunk:chunk + 10_000] = value
                    assert a.ctypes.data == address
            assert np.all(np.asarray(x) == value)
    finally:
        stop.set()
        t.join()
    assert errors == [] and rounds[0] > 0
    assert m.telemetry()["counters"].get("prefetches", 0) > 0  # the other thread really moved data
    m.check()


def test_no_move_between_write_use_and_pin(monkeypatch):
    """Deterministic Listing 6.1 race: another thread tries to evict and re-fetch ``x`` right
    between writable's write use and its pin. It must wait for the pin (and then find ``x``
    pinned); were it to get in, the write would land in a clean copy and be dropped on eviction."""
    import cachedarrays.array as A

    m = Manager(DRAM("1MiB"), PM(None, "4MiB"), policy=LRUPolicy())
    x = CachedArray(np.zeros(1000, np.float32), m)
    real_wrap = A._wrap
    outcome = []

    def mover():
        try:
            ca.evict(x)
            ca.prefetch(x)
            outcome.append("moved")
        except ca.PinnedError:
            outcome.append("pinned")

    def racing_wrap(arr, status):
        t = threading.Thread(target=mover)
        t.start()
        t.join(0.5)  # the mover runs now unless writable holds the manager's lock
        view = real_wrap(arr, status)
        monkeypatch.setattr(A, "_wrap", real_wrap)
        racing_wrap.thread = t
        return view

    monkeypatch.setattr(A, "_wrap", racing_wrap)
    with writable(x) as a:
        a[:] = 7
        racing_wrap.thread.join()  # the mover gets the lock once writable returns: x is pinned then
    assert outcome == ["pinned"]
    ca.evict(x)
    assert np.all(np.asarray(x) == 7)
    m.check()
