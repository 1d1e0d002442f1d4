"""`cachedarrays.jaxdlpack.from_dlpack`: JAX's DLPack import without its per-call wrapper, checked
against ``jax.dlpack.from_dlpack`` on first use and replaced by it for good where they differ."""

import jax
import numpy as np
import pytest

from cachedarrays import jaxdlpack
from embeddings.aligned import aligned_empty


@pytest.fixture
def fresh(monkeypatch):
    """The module as in a new process: the direct import not checked yet, no device looked up."""
    monkeypatch.setattr(jaxdlpack, "_direct", None)
    monkeypatch.setattr(jaxdlpack, "_unsure", 0)
    monkeypatch.setattr(jaxdlpack, "_devices", {})
    return jaxdlpack


def _host_array(shape=(4, 16), dtype=np.float32):
    a = aligned_empty(shape, dtype)  # 64-byte aligned, so that JAX aliases it rather than copying
    a[...] = np.arange(a.size, dtype=dtype).reshape(shape)
    return a


def test_the_direct_import_aliases_the_same_memory_as_jax_does_and_is_taken_once_checked(fresh):
    a = _host_array()
    x = fresh.from_dlpack(a)
    assert fresh._direct is True
    ref = jax.dlpack.from_dlpack(a)
    assert isinstance(x, jax.Array) and x.shape == a.shape and x.dtype == a.dtype
    assert x.unsafe_buffer_pointer() == ref.unsafe_buffer_pointer() == a.ctypes.data
    b = _host_array((3, 16))
    y = fresh.from_dlpack(b)  # checked already: the direct path alone
    assert y.unsafe_buffer_pointer() == b.ctypes.data and np.array_equal(np.asarray(y), b)
    assert len(fresh._devices) == 1  # the CPU device, looked up once


def _misaligned(shape=(4, 16)):
    a = _host_array((shape[0] * shape[1] + 1,))[1:].reshape(shape)  # 4 bytes past a line: JAX copies it
    assert a.ctypes.data % 64
    return a


def test_an_import_jax_copies_leaves_the_check_to_the_next_and_so_many_give_it_up(fresh):
    a = _misaligned()
    x = fresh.from_dlpack(a)
    assert fresh._direct is None and np.array_equal(np.asarray(x), a)  # undecided
    b = _host_array()
    assert fresh.from_dlpack(b).unsafe_buffer_pointer() == b.ctypes.data and fresh._direct is True
    fresh._direct, fresh._unsure = None, 0  # as in a process whose imports are all copies
    for k in range(fresh.TRIES):
        c = _misaligned()
        c[...] = a + k
        assert np.array_equal(np.asarray(fresh.from_dlpack(c)), a + k)
        assert fresh._direct is (None if k + 1 < fresh.TRIES else False)


def test_a_type_jax_does_not_hold_is_canonicalised_as_jax_does(fresh):
    fresh.from_dlpack(_host_array())  # checked on float32: the int64 import below takes the direct path
    assert fresh._direct is True
    a = _host_array(dtype=np.int64)
    x, ref = fresh.from_dlpack(a), jax.dlpack.from_dlpack(a)
    assert fresh._direct is True and x.dtype == ref.dtype and np.array_equal(np.asarray(x), a)


@pytest.mark.parametrize("how", ["raises", "differs"])
def test_a_direct_import_unlike_jaxs_falls_back_to_jax_for_good(fresh, monkeypatch, how):
    calls = []

    def direct(x, *_):
        calls.append(x)
        if how == "raises":
            raise TypeError("internals changed")
        return jax.numpy.zeros(3)  # another array: not JAX's import of x

    monkeypatch.setattr(fresh, "_import", direct)
    a = _host_array()
    for k in range(3):
        x = fresh.from_dlpack(a + k)
        assert np.array_equal(np.asarray(x), a + k)
    assert fresh._direct is False and len(calls) == 1  # tried once only


def test_the_lookup_handoff_imports_where_jax_has_a_gpu_and_hands_the_array_back_where_not(fresh, monkeypatch):
    from embeddings.gpu import handoff
    a = _host_array()  # stands in for a lookup's CuPy output
    monkeypatch.setattr(handoff, "_jax_gpu", False)
    assert handoff.to_jax(a) is a
    monkeypatch.setattr(handoff, "_jax_gpu", True)
    x = handoff.to_jax(a)
    assert isinstance(x, jax.Array) and x.unsafe_buffer_pointer() == a.ctypes.data


def test_an_unordered_import_asks_the_exporter_for_no_synchronisation_and_jax_for_no_stream(fresh, monkeypatch):
    from jax._src import dlpack as jdl
    a = _host_array()
    fresh.from_dlpack(a)  # checked on a real import; the CPU device looked up
    asked, given = [], []

    class Exporter:  # ``a`` as a device array whose importer has a stream, as a GPU's has
        def __dlpack_device__(self):
            return a.__dlpack_device__()

        def __dlpack__(self, stream=None):
            asked.append(stream)
            return a.__dlpack__()

    (key, (device, _)), = fresh._devices.items()
    fresh._devices[key] = (device, 7)
    real = jdl._jax.dlpack_managed_tensor_to_buffer

    def import_(capsule, dev, stream, *rest):
        given.append(stream)
        return real(capsule, dev, None, *rest)  # the CPU has no streams

    monkeypatch.setattr(jdl._jax, "dlpack_managed_tensor_to_buffer", import_)
    x = fresh.from_dlpack(Exporter(), ordered=False)
    assert (asked, given) == ([-1], [None]) and x.unsafe_buffer_pointer() == a.ctypes.data
    y = fresh.from_dlpack(Exporter())
    assert (asked, given) == ([-1, 7], [None, 7]) and np.array_equal(np.asarray(y), a)
