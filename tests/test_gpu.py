"""The GPU level: a GPU over DRAM over PM, copies on CUDA streams, JAX and CuPy views (needs a GPU)."""

import warnings

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

import cachedarrays as ca
from cachedarrays import DRAM, GPU, PM, CachedArray, CopyError, LRUPolicy, Manager, OutOfMemoryError, readable, writable
from cachedarrays.devices import gpu

from test_levels import ThreeLevelMachine
from test_policies import same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and CuPy"),
              pytest.mark.usefixtures("young_gc")]


def gpu_manager(fast="64MiB", dram="128MiB", pm="512MiB", policy=None, workers=1):
    return Manager(GPU(fast), DRAM(dram), PM(None, pm), policy=LRUPolicy() if policy is None else policy,
                   copy_workers=workers)


def test_gpu_regions_are_cupy_views_that_jax_takes_without_a_copy():
    import cupy as cp
    import jax
    with gpu_manager() as m:
        assert m.levels[1].page_locked  # the DRAM heap is registered for DMA
        x = CachedArray(np.arange(4096, dtype=np.float32), m)
        assert x.device == "GPU"
        with writable(x) as w:
            assert isinstance(w, cp.ndarray)
            w *= 2
        with readable(x) as a:
            assert isinstance(a, jax.Array)
            assert a.unsafe_buffer_pointer() == m.primary(x.object).device.address(m.primary(x.object).offset)
            total = float(jax.jit(lambda v: (v * v).sum())(a))
        assert total == pytest.approx(float(np.sum((2 * np.arange(4096, dtype=np.float64)) ** 2)), rel=1e-5)
        m.check()


def test_the_issue_example_prefetch_use_write_evict():
    import jax
    with gpu_manager() as m:
        host = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
        x = CachedArray(host, m, place="slow")
        assert x.device == "PM"
        ca.prefetch(x)                                   # PM -> GPU, staged or direct, on a copy stream
        with readable(x) as a:
            y = jax.jit(lambda v: v @ v)(a)
        with writable(x) as w:                           # a CuPy view; JAX's result goes in on the GPU
            ca.assign(w, y)
        ca.evict(x)                                      # dirty: written back to DRAM
        assert x.device == "DRAM"
        np.testing.assert_allclose(np.asarray(x), host @ host, rtol=2e-3, atol=1e-2)
        tele = m.telemetry()
        assert tele["bytes_moved"]["GPU->DRAM"] == host.nbytes
        assert tele["bytes_moved"]["PM->GPU"] == host.nbytes
        m.reset_telemetry()
        ca.prefetch(x)
        _ = x[0, 0]
        ca.evict(x)                                      # clean: no bytes move
        assert m.telemetry()["bytes_moved"] == {"DRAM->GPU": host.nbytes}
        m.check()


def test_gpu_capacity_larger_than_free_memory_names_both_sizes():
    with pytest.raises(OutOfMemoryError, match=r"larger than the free memory of cuda:0 \(.* free of .*\)"):
        GPU("4096GiB")


def test_a_failed_gpu_copy_names_the_object_and_pair():
    with gpu_manager() as m:
        x = CachedArray(np.ones(1000, np.float32), m, place="slow")

        def fault(src, dst, nbytes):
            raise RuntimeError("cudaErrorIllegalAddress (injected)")

        m.engine.fault = fault
        with pytest.raises(CopyError, match=r"object \d+ from PM to GPU failed.*injected"):
            ca.prefetch(x)
        m.engine.fault = None
        assert x.device == "PM" and np.all(np.asarray(x) == 1)
        m.check()


def test_overlap_of_an_upload_with_jax_compute_is_recorded_as_hidden():
    import jax
    import jax.numpy as jnp
    with gpu_manager(fast="1GiB", dram="1GiB") as m:
        w = CachedArray((64 << 20) // 4, m, np.float32, place="slow")
        with writable(w) as a:
            a[:] = 1
        ca.prefetch(w, to="DRAM")
        _ = w[0]
        m.reset_telemetry()
        b = jnp.ones((4096, 4096), jnp.float32)
        f = jax.jit(lambda v: v @ v @ v @ v)
        ca.prefetch(w)
        f(b).block_until_ready()                        # compute while the copy runs
        with readable(w) as a:
            assert float(a[-1]) == 1.0
        copy = m.telemetry()["copies"]["DRAM->GPU"]
        assert copy["hidden_seconds"] > 0


class GPUMachine(ThreeLevelMachine):
    """The three-level policy machine with the GPU on top (numeric dtypes: CuPy has no structured ones)."""

    def make_manager(self):
        with warnings.catch_warnings():  # the PM file cannot be page-locked: its GPU copies are staged
            warnings.simplefilter("ignore", RuntimeWarning)
            return Manager(GPU("384KiB"), DRAM("192KiB"), PM(None, "32MiB"), policy=self.policy_factory(),
                           copy_workers=self.workers)

    @rule(shape=st.lists(st.integers(1, 90), min_size=1, max_size=3),
          dtype=st.sampled_from([np.float32, np.int16, np.uint8, np.float64]))
    def create(self, shape, dtype):
        super().create(shape, dtype)

    @staticmethod
    def address(view) -> int:
        a = view.array
        return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_gets_host_copies_of_an_array_that_its_own_pin_moves_to_the_gpu(dtype):
    """TwoLevelCachePolicy inserts an array into the GPU when it is used: an array on a host level
    that NumPy pins moves there as it is pinned. The call still gets host arrays, also when the
    same array is both operands (found by the GPU state machine below: a CuPy view beside a
    host copy)."""
    with gpu_manager(fast="1MiB", policy=ca.TwoLevelCachePolicy()) as m:
        want = np.arange(10, dtype=dtype)
        x = CachedArray(want.copy(), m)
        big = CachedArray(np.zeros(1 << 18, np.float32), m)  # the whole GPU level: x goes to a host level
        assert big.device == "GPU" and x.device != "GPU"
        y = x + x
        assert isinstance(y, CachedArray) and same(np.asarray(y), want + want)
        assert same(np.asarray(x * 3), want * 3)
        m.check()


def _gpu_machine(factory, workers):
    cls = type(f"GPU_{factory.__name__}_{workers}", (GPUMachine,),
               {"policy_factory": staticmethod(factory), "workers": workers})
    case = cls.TestCase
    # no "explain" phase: its line tracing next to the copy threads crashed CPython 3.12 once
    case.settings = settings(max_examples=8, stateful_step_count=30, deadline=None,
                             phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    return case


TestGPULRU = _gpu_machine(LRUPolicy, 1)
TestGPULRU2 = _gpu_machine(LRUPolicy, 2)
TestGPUTwoLevel = _gpu_machine(ca.TwoLevelCachePolicy, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and CuPy")
def test_a_page_locked_heap_dropped_unclosed_leaves_no_cuda_registration_behind():
    """A host heap registered with CUDA (:func:`~cachedarrays.devices.gpu.pagelock`) and dropped
    without being unlocked is unregistered by the time its memory goes, so a later heap mapped at
    the same addresses can be registered itself."""
    import gc
    dev = DRAM("8MiB", bandwidth=(10, 10))
    addr = dev.address(0)
    assert gpu.pagelock(dev) and gpu.page_locked_at(addr)
    del dev
    gc.collect()
    assert not gpu.page_locked_at(addr)
    again = DRAM("8MiB", bandwidth=(10, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused registration warns
        assert gpu.pagelock(again) and gpu.page_locked_at(again.address(0))
    gpu.pageunlock(again)
    assert not gpu.page_locked_at(again.address(0))
