"""CNN training on the GPU under an HBM budget (needs a GPU): every mode's losses equal all-in-HBM's
bit for bit, outputs stay on the GPU, the whole-jit baseline trains the same model, cap learns
device time."""

import numpy as np
import pytest

from cachedarrays import CachedArray
from cachedarrays.devices import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and CuPy")]

TINY = {"vgg": dict(family="vgg", depth=5, width=4, batch=4, image=8),
        "resnet": dict(family="resnet", depth=11, width=4, batch=4, image=8),
        "densenet": dict(family="densenet", depth=9, width=4, batch=4, image=8)}
_FP = {}


def cfg_fp(family, device="gpu"):
    from cnn.trainer import Config, measure_footprint
    cfg = Config(**TINY[family], device=device)
    if (family, device) not in _FP:
        _FP[family, device] = measure_footprint(cfg)
    return cfg, _FP[family, device]


@pytest.mark.parametrize("family", ["vgg", "resnet", "densenet"])
def test_every_mode_matches_all_in_hbm_loss_bit_for_bit_at_the_smallest_budget(family):
    from cnn.modes import MODES
    from cnn.trainer import run_mode
    cfg, fp = cfg_fp(family)
    base = run_mode(cfg, "dram", None, 2, fp)
    losses = [r.loss for r in base.records]
    assert np.isfinite(losses).all() and base.records[0].fast_device == "GPU"
    assert all(r.dram_to_pm_bytes == 0 and r.pm_to_dram_bytes == 0 for r in base.records)
    for mode in MODES[1:]:
        run = run_mode(cfg, mode, fp.min_budget, 2, fp)  # run_mode runs m.check() at the end
        assert [r.loss for r in run.records] == losses, mode
        for r in run.records:
            assert (r.fast_device, r.slow_device) == ("GPU", "DRAM")
            assert r.peak_fast_bytes <= r.fast_capacity <= fp.min_budget
            assert r.dram_to_pm_bytes > 0, f"{mode} at the smallest budget must evict something"


def test_gpu_losses_match_the_cpu_trainer():
    from cnn.trainer import run_mode
    cfg, fp = cfg_fp("resnet")
    cpu_cfg, cpu_fp = cfg_fp("resnet", "cpu")
    on_gpu = [r.loss for r in run_mode(cfg, "caLMP", "40%", 3, fp).records]
    on_cpu = [r.loss for r in run_mode(cpu_cfg, "caLMP", "40%", 3, cpu_fp).records]
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=2e-4)


def test_kernels_read_gpu_regions_zero_copy_and_outputs_stay_on_the_gpu():
    import jax
    from cnn.execute import Executor
    from cnn.modes import make_manager
    with make_manager("caLM", 64 << 20, 64 << 20, device="gpu") as m:
        ex = Executor(m)
        x = CachedArray(np.arange(4096, dtype=np.float32), m)
        seen = []

        def kernel(a):
            seen.append((a.unsafe_buffer_pointer(), a.devices()))
            return a * 2, a + 1

        y, z = ex.call(kernel, (x,))  # run eagerly: the pointer JAX got is visible
        region = m.primary(x.object)
        assert seen[0][0] == region.device.address(region.offset)  # JAX read the region itself
        assert y.device == "GPU" and z.device == "GPU"
        assert m.telemetry()["bytes_moved"] == {}  # nothing went through the host
        np.testing.assert_array_equal(np.asarray(y), np.arange(4096, dtype=np.float32) * 2)
        np.testing.assert_array_equal(np.asarray(z), np.arange(4096, dtype=np.float32) + 1)
        for _ in range(50):  # outputs whose JAX values die at once are still copied intact
            (w,) = ex.call(jax.jit(lambda a: a * 3), (y,))
        ex.sync()
        np.testing.assert_array_equal(np.asarray(w), np.arange(4096, dtype=np.float32) * 6)
        m.check()


def test_outputs_that_die_unread_are_not_copied_and_moved_ones_are_written_first():
    """`Executor.store` defers each output's copy: freed after the next kernel read it from its
    JAX value, it is never made; evicted before it is made, the copy down carries it."""
    import jax
    from cachedarrays import evict, unsafe_free
    from cnn.execute import Executor
    from cnn.modes import make_manager
    double = jax.jit(lambda a: a * 2)
    with make_manager("caLM", 64 << 20, 64 << 20, device="gpu") as m:
        ex = Executor(m)
        x_np = np.arange(1 << 16, dtype=np.float32)
        x = CachedArray(x_np, m)
        (y,) = ex.call(double, (x,))
        (z,) = ex.call(double, (y,))  # y from its JAX value
        unsafe_free(y)
        (w,) = ex.call(double, (z,))
        evict(w)  # into page-locked host memory: written into its GPU region first, then copied down
        assert w.device == m.slow.name and z.device == "GPU"
        ex.sync()
        np.testing.assert_array_equal(np.asarray(z), x_np * 4)
        np.testing.assert_array_equal(np.asarray(w), x_np * 8)
        assert (ex.stats.elided, ex.stats.copies) == (1, 2)
        m.check()


def test_outputs_of_one_program_are_copied_after_the_whole_program():
    """CuPy's stream waits for one output of a jitted kernel (`Executor._kernel_done`, the DLPack
    stream handshake without an import): the copy of an output that finishes late, or that is an
    input handed back, must still see its final bytes."""
    import jax
    import jax.numpy as jnp
    from cnn.execute import Executor
    from cnn.modes import make_manager

    @jax.jit
    def slow_second(a, b):
        c = b
        for _ in range(30):  # tens of milliseconds of GPU work behind the second output only
            c = jnp.tanh(c @ c) * 0.5 + b
        return a + 1, c, b

    with make_manager("dram", 256 << 20, 64 << 20, device="gpu") as m:
        ex = Executor(m)
        rng = np.random.default_rng(0)
        a_np = np.arange(1024, dtype=np.float32)
        b_np = rng.standard_normal((1024, 1024)).astype(np.float32) / 32
        a, b = CachedArray(a_np, m), CachedArray(b_np, m)
        want = jax.device_get(slow_second(a_np, b_np))
        for _ in range(3):
            outs = ex.call(slow_second, (a, b))
            ex.sync()
            for got, expect in zip(outs, want):
                np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-6, atol=1e-6)
        m.check()


def test_operands_in_page_locked_host_memory_are_copied_on_the_gpu(monkeypatch):
    """An input a policy leaves in host memory is copied up into a CuPy buffer JAX imports, and an
    output placed there is copied down on CuPy's stream (`Executor._jax_input`, `store`), never
    through the host: every input read from a region is staged, every output is copied by
    `_copy_on`, the chain reads every value intact and the manager's invariants hold."""
    import jax
    from cnn.execute import Executor
    from cnn.modes import make_manager
    staged, copied = [], []
    keep, copy = Executor._keep_staged, Executor._copy_on
    monkeypatch.setattr(Executor, "_keep_staged", lambda ex, done: staged.append(len(ex._staged)) or keep(ex, done))
    monkeypatch.setattr(Executor, "_copy_on", lambda ex, *a: copied.append(a[3]) or copy(ex, *a))
    with make_manager("caLM", 4096, 64 << 20, device="gpu") as m:
        assert m.slow.page_locked
        ex = Executor(m)
        base_np = (np.arange(1 << 14) % 1024).astype(np.float32)  # 64 KiB each: no room in 4 KiB of HBM
        base, x = CachedArray(base_np, m), CachedArray(np.zeros(1 << 14, np.float32), m)
        assert base.device == x.device == m.slow.name
        step, inc = jax.jit(lambda b, a: (a * 2 + b, a.sum())), jax.jit(lambda a: a + 1)
        want = np.zeros(1 << 14, np.float32)
        for _ in range(10):
            y, total = ex.call(step, (base, x))  # base from its region; x from inc's value after the first
            (x,) = ex.call(inc, (y,))  # y from step's value: nothing staged
            assert y.device == x.device == m.slow.name
            np.testing.assert_allclose(np.asarray(total), want.sum(dtype=np.float64), rtol=1e-6)
            want = want * 2 + base_np + 1
        ex.sync()
        np.testing.assert_array_equal(np.asarray(x), want)
        assert staged == [2] + [1] * 9 and len(copied) == 30
        m.check()


@pytest.mark.parametrize("hbm", [64 << 20, 4096])
def test_in_place_sgd_on_the_gpu_is_the_jax_kernel_bit_for_bit(hbm):
    """`cnn.inplace.SGD` through the executor on operands in HBM (a 64 MiB budget) and in
    page-locked host memory (4 KiB of HBM: nothing fits), with and without momentum: the same
    bits as the JAX kernels, the targets written where they are, the gradients untouched."""
    from cnn import inplace
    from cnn import kernels as K
    from cnn.execute import Executor
    from cnn.modes import make_manager
    rng = np.random.default_rng(5)
    sizes = [1000, 1, 70000, 0, 513]
    n, lr, mu = len(sizes), np.float32(0.05), np.float32(0.9)
    ran = []  # the CUDA form, not the kernel and a copy (which would give the same bits)
    spy = inplace.InPlace(inplace.sgd_host, lambda ptrs, *a: ran.append(len(ptrs)) or inplace.sgd_cuda(ptrs, *a),
                          np.float32)
    with make_manager("caLM", hbm, 64 << 20, device="gpu") as m:
        ex = Executor(m)
        for momentum in (False, True):
            host = [(rng.standard_normal(k) * 100).astype(np.float32) for _ in range(3 if momentum else 2) for k in sizes]
            xs = [CachedArray(a, m) for a in host]
            kernel, args = (K.sgd_momentum_steps, (lr, mu)) if momentum else (K.sgd_steps, (lr,))
            want = [np.asarray(w) for w in kernel(*host, *args)]
            targets = xs[:n] + (xs[2 * n:] if momentum else [])
            regions = [m.primary(t.object) for t in targets]
            ex.call_into(kernel, xs, targets, *args, in_place=spy)
            ex.sync()
            assert ran[-1] == len(xs)
            assert [m.primary(t.object) for t in targets] == regions
            if hbm > 4096:
                assert all(t.device == m.fast.name for t in targets)
            else:  # 280 KB cannot be in 4 KiB of HBM
                assert targets[2].device == m.slow.name and m.slow.page_locked
            for w, t in zip(want, targets):
                np.testing.assert_array_equal(np.asarray(t), w)
            for g, a in zip(xs[n:2 * n], host[n:2 * n]):
                np.testing.assert_array_equal(np.asarray(g), a)
        m.check()


def test_whole_jit_baseline_trains_the_same_model():
    import jax
    from cachedarrays import DRAM, PM, LRUPolicy, Manager
    from cnn.data import synthetic_batch
    from cnn.functional import initial_state, train_step
    from cnn.models import build
    from cnn.trainer import run_mode
    cfg, fp = cfg_fp("densenet")
    ours = [r.loss for r in run_mode(cfg, "dram", None, 2, fp).records]
    with Manager(DRAM("16MiB"), PM(None, "16MiB"), policy=LRUPolicy()) as m:
        model = build("densenet", m, depth=cfg.depth, width=cfg.width, image=cfg.image, classes=cfg.classes)
        for variant in ("whole", "remat"):
            params, momenta = initial_state(model, jax.devices()[0])
            step, losses = train_step(model, cfg.lr, cfg.momentum, variant), []
            for i in range(2):
                params, momenta, loss = step(params, momenta, *synthetic_batch(i, cfg.batch, cfg.image, 3, 10))
                losses.append(float(loss))
            np.testing.assert_allclose(losses, ours, rtol=2e-4, err_msg=variant)


def test_cap_learns_device_time_and_prefetches_on_the_gpu():
    from cnn.trainer import Session
    cfg, fp = cfg_fp("resnet")
    s = Session(cfg, "cap", "40%", fp)
    try:
        recs = [s.step(i) for i in range(3)]
        pol = s.m.policy
        times = pol.learned.times
        assert isinstance(pol.stamps, gpu.DeviceClock)
        assert len(times) > 50 and times == sorted(times) and times[-1] > 0
        assert times[-1] <= pol.learned.period
        assert recs[-1].counters["learned_prefetches"] > 0 and recs[-1].coverage > 0.5
    finally:
        s.close()


def test_cli_on_the_gpu_prints_gpu_traffic(capsys):
    from cnn.train import main
    rc = main(["--device", "gpu", "--model", "vgg", "--depth", "5", "--width", "4", "--batch", "4", "--image", "8",
               "--iterations", "2", "--mode", "dram,caLMP,cap", "--fast-budget", "50%", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("iter ") == 6 and "GPU->DRAM" in out and "on the GPU" in out


def test_recompute_trains_on_the_gpu_with_the_losses_of_kept_activations():
    """--recompute on the GPU: DenseNet keeps less; under a budget the losses equal its own all-in-HBM
    run bit for bit, and those of the plain model within rtol 2e-4: the recomputing layer is one XLA
    program (batch norm, ReLU, convolution) for which the GPU may pick another convolution algorithm
    than for the convolution alone, so float32 sums run in another order (two separately compiled
    steps differed by 3.1e-5 relative on the H100), and SGD carries the difference on."""
    import dataclasses
    from cnn.trainer import measure_footprint, run_mode
    cfg, fp = cfg_fp("densenet")
    rc = dataclasses.replace(cfg, recompute=True)
    fr = measure_footprint(rc)
    assert fr.footprint < 0.8 * fp.footprint
    kept = [r.loss for r in run_mode(cfg, "dram", None, 3, fp).records]
    alone = [r.loss for r in run_mode(rc, "dram", None, 3, fr).records]
    budgeted = run_mode(rc, "caLMP", fr.min_budget, 3, fr)
    assert [r.loss for r in budgeted.records] == alone
    assert all(r.dram_to_pm_bytes > 0 and r.fast_device == "GPU" for r in budgeted.records)
    assert np.isfinite(alone).all() and len(set(alone)) == 3  # the weights moved every step
    np.testing.assert_allclose(alone, kept, rtol=2e-4)
