"""The host side of `CudaBackend` on CI, over a stand-in for CuPy whose device arrays are numpy
memory and whose copies are memmoves: `asarray` uploads host arrays of any shape, type and layout
through a page-locked block it holds until the copy's event is done."""

import ctypes
import threading
import types

import numpy as np
import pytest

from embeddings.gpu.backend import CudaBackend


class _Device(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.array(self).view(np.ndarray)


class _Event:
    def __init__(self, disable_timing=True):
        self.done = False

    def record(self):
        pass

    def synchronize(self):
        self.done = True


@pytest.fixture
def backend():
    events = []

    def event(**_):
        events.append(_Event())
        return events[-1]

    xp = types.SimpleNamespace(ndarray=_Device, empty=lambda shape, dtype: np.empty(shape, dtype).view(_Device),
                               asarray=lambda x, dtype=None: np.asarray(x, dtype).view(_Device))
    xp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(memcpyAsync=lambda d, s, n, kind, stream: ctypes.memmove(d, s, n),
                                      memcpyHostToDevice=1),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0), alloc_pinned_memory=bytearray, Event=event)
    be = CudaBackend.__new__(CudaBackend)  # no GPU: only the attributes these paths read
    be.xp, be._local = xp, threading.local()
    be.events = events
    return be


def test_asarray_uploads_host_arrays_of_any_shape_type_and_layout(backend):
    rng = np.random.default_rng(0)
    for shape in [(5,), (3, 4), (2, 3, 5), (0,), (7, 0)]:
        x = rng.integers(0, 1000, shape)
        for dtype in (None, np.int32, np.float32):
            y = backend.asarray(x, dtype)
            assert type(y) is _Device and y.shape == x.shape and y.dtype == (x.dtype if dtype is None else dtype)
            np.testing.assert_array_equal(y.get(), x.astype(y.dtype))
    x = rng.standard_normal((6, 8))[:, ::2]  # not contiguous
    np.testing.assert_array_equal(backend.asarray(x).get(), x)
    assert backend.asarray(np.float64(3.0)).shape == ()


def test_bounce_blocks_are_held_until_their_copy_is_done(backend):
    for n in (3, 4, 5):
        backend.asarray(np.arange(n))
    assert len(backend._local.held) == 3  # no copy has finished: every block is still the copy's
    for e in backend.events:
        e.done = True
    backend.asarray(np.arange(2))
    assert len(backend._local.held) == 1  # the finished ones went back to the pool


def test_upload_blocks_copies_adjacent_blocks_at_once_and_others_each(backend, monkeypatch):
    """Slices that follow each other in host memory go up in one copy, others one by one; the
    device array is the blocks one after the other either way."""
    copies = []
    real = backend.xp.cuda.runtime.memcpyAsync
    monkeypatch.setattr(backend.xp.cuda.runtime, "memcpyAsync",
                        lambda d, s, n, kind, stream: copies.append(n) or real(d, s, n, kind, stream))
    whole = np.arange(30, dtype=np.int32)
    other = np.arange(100, 107, dtype=np.int32)
    blocks = [whole[0:10], whole[10:10], whole[10:25], other, whole[25:30]]
    got = backend.upload_blocks(blocks)
    assert np.array_equal(got.get(), np.concatenate(blocks))
    assert copies == [100, 28, 20]  # 10 + 15 entries at once (the empty one between), then each apart


def test_upload_blocks_into_a_given_array_fills_it_and_refuses_one_of_another_size_or_type(backend):
    """A captured placement uploads its batch into a buffer that stays where it is."""
    from embeddings.gpu.backend import ReferenceBackend
    blocks = [np.arange(4, dtype=np.int32), np.arange(10, 13, dtype=np.int32)]
    for be, empty in ((backend, backend.xp.empty), (ReferenceBackend(), np.empty)):
        out = empty(7, np.int32)
        assert be.upload_blocks(blocks, out=out) is out
        assert np.array_equal(np.asarray(out), np.concatenate(blocks))
        for bad in (empty(6, np.int32), empty(7, np.int64)):
            before = np.array(bad)
            with pytest.raises(ValueError, match="7 elements of int32"):
                be.upload_blocks(blocks, out=bad)
            assert np.array_equal(np.asarray(bad), before)  # nothing written
