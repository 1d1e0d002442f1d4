"""CNN training under a fast-memory budget: kernels, gradients, modes, budgets, CLI and a real data set.

Tiny models of each family keep JAX compile time small; shapes are shared
across tests so the jitted kernels are reused.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachedarrays import DRAM, PM, CachedArray, CorrelationPrefetchPolicy, LRUPolicy, Manager, TwoLevelCachePolicy
from cnn import kernels as K
from cnn.annotate import Annotations
from cnn.execute import Executor
from cnn.graph import Tape
from cnn.layers import SoftmaxCrossEntropy
from cnn.models import build
from cnn.modes import MODES, BudgetTooSmallError, make_policy, parse_budget
from cnn.trainer import Config, measure_footprint, run_mode

TINY = {"vgg": Config("vgg", 5, 4, 4, 8), "resnet": Config("resnet", 11, 4, 4, 8),
        "densenet": Config("densenet", 9, 4, 4, 8)}
_FOOTPRINTS = {}


def footprint(family):
    if family not in _FOOTPRINTS:
        _FOOTPRINTS[family] = measure_footprint(TINY[family])
    return _FOOTPRINTS[family]


@pytest.fixture
def manager(tmp_path):
    m = Manager(DRAM("8MiB"), PM(tmp_path, "16MiB"), policy=LRUPolicy())
    yield m
    m.check()
    m.close()


# ---------------------------------------------------------------- the kernel programming model
def test_kernels_get_zero_copy_views_and_outputs_land_in_policy_regions(manager):
    ex = Executor(manager)
    x = CachedArray(np.arange(64, dtype=np.float32).reshape(4, 16), manager)
    seen = []

    def kernel(a):
        seen.append(a.unsafe_buffer_pointer())
        return a * 2

    (y,) = ex.call(kernel, (x,))
    assert seen == [manager.bytes(manager.primary(x.object)).ctypes.data]  # JAX read the region itself
    assert isinstance(y, CachedArray) and y.manager is manager
    np.testing.assert_array_equal(np.asarray(y), np.arange(64, dtype=np.float32).reshape(4, 16) * 2)
    assert not manager.pinned(x.object) and not manager.pinned(y.object)  # views released
    assert ex.stats.calls == 1 and ex.stats.read_fast == x.nbytes and ex.stats.written_fast == y.nbytes
    assert (ex.stats.copies, ex.stats.copied) == (1, y.nbytes)  # the output copied into its region


@jax.jit
def _double(a):
    return a * 2


def test_an_output_that_dies_unread_is_never_copied_into_its_region(manager):
    """The next two kernels read an output from the JAX value; freed then, unread, it is never copied."""
    from cachedarrays import unsafe_free
    from cnn.execute import FRESH_KERNELS
    assert FRESH_KERNELS == 2
    ex = Executor(manager)
    from_regions = []
    jax_input = ex._jax_input
    ex._jax_input = lambda v: from_regions.append(v.object.id) or jax_input(v)
    x = CachedArray(np.arange(64, dtype=np.float32), manager)
    (y,) = ex.call(_double, (x,))
    (z,) = ex.call(_double, (y,))  # reads y from the JAX value
    (v,) = ex.call(_double, (y,))  # so does the kernel after it
    unsafe_free(y)  # y's last use was v's kernel (what annotations do)
    cancelled = manager.telemetry()["counters"].get("deferred_fills_cancelled", 0)
    assert cancelled == 1 and ex.stats.copies == 0  # nothing needed the bytes of y, z or v yet
    (w,) = ex.call(_double, (z,))  # from z's value too; older outputs are written now
    assert from_regions == [x.object.id]  # every other operand came from a JAX value
    ex.sync()  # and the rest
    np.testing.assert_array_equal(np.asarray(z), np.arange(64, dtype=np.float32) * 4)
    np.testing.assert_array_equal(np.asarray(v), np.arange(64, dtype=np.float32) * 4)
    np.testing.assert_array_equal(np.asarray(w), np.arange(64, dtype=np.float32) * 8)
    assert (ex.stats.elided, ex.stats.elided_bytes) == (1, y.nbytes)
    assert (ex.stats.copies, ex.stats.copied) == (3, z.nbytes + v.nbytes + w.nbytes)
    manager.check()


def test_a_stored_output_moved_or_read_before_its_write_keeps_its_contents(manager):
    """The policy evicting an output whose copy is deferred, or anything reading it, writes it first."""
    from cachedarrays import evict, readable
    ex = Executor(manager)
    x = CachedArray(np.arange(4096, dtype=np.float32), manager)
    (y,) = ex.call(_double, (x,))
    assert ex.stats.copies == 0  # deferred
    evict(y)  # the move copies the region: the output is written into it first
    assert y.device == manager.slow.name and ex.stats.copies == 1
    (z,) = ex.call(_double, (x,))
    with readable(z) as a:
        np.testing.assert_array_equal(a, np.arange(4096, dtype=np.float32) * 2)
    assert ex.stats.copies == 2
    ex.sync()
    np.testing.assert_array_equal(np.asarray(y), np.arange(4096, dtype=np.float32) * 2)
    assert ex.stats.copies == 2 and ex.stats.elided == 0
    manager.check()


def test_a_value_replaced_before_its_copy_is_never_copied(manager):
    """`Executor.copy_into` over a value whose copy is still deferred replaces it: one copy, not two."""
    ex = Executor(manager)
    x = CachedArray(np.arange(64, dtype=np.float32), manager)
    (y,) = ex.call(_double, (x,))
    ex.call_into(jax.jit(lambda a: a * 3), (x,), (y,))
    ex.sync()
    np.testing.assert_array_equal(np.asarray(y), np.arange(64, dtype=np.float32) * 3)
    assert (ex.stats.copies, ex.stats.elided) == (1, 1)
    assert manager.telemetry()["counters"]["deferred_fills_cancelled"] == 1
    manager.check()


def test_saved_activations_are_cachedarrays_of_the_manager(manager):
    model = build("resnet", manager, depth=11, width=4, image=8, classes=10)
    ex = Executor(manager)
    tape = Tape(ex, Annotations(manager))
    x = CachedArray(np.random.default_rng(0).standard_normal((4, 8, 8, 3), dtype=np.float32), manager)
    model.forward(tape, x)
    assert len(tape.nodes) > 8  # stem, three blocks (chain, shortcut, add), head
    for node in tape.nodes:
        assert isinstance(node.output, CachedArray)
        for s in node.saved:
            assert isinstance(s, (CachedArray, tuple)), (node.layer, s)
            if isinstance(s, CachedArray):
                assert s.manager is manager and s.object.alive


class _JaxExec:
    """Runs the same layer code on plain JAX values, with parameters substituted: a reference for jax.grad."""

    def __init__(self, subst):
        self.subst = subst

    def call(self, kernel, inputs, *args, **static):
        vals = [self.subst.get(x.object.id, None) if isinstance(x, CachedArray) else x for x in inputs]
        out = kernel(*vals, *args, **static)
        return out if isinstance(out, tuple) else (out,)


class _JaxTape:
    def __init__(self, ex):
        self.ex = ex

    def __call__(self, layer, *xs):
        return layer.forward(self.ex, *xs)[0]

    @contextmanager
    def scope(self):
        yield


@pytest.mark.parametrize("family", ["vgg", "resnet", "densenet"])
def test_backward_kernels_match_jax_autodiff(family, manager):
    cfg = TINY[family]
    model = build(family, manager, depth=cfg.depth, width=cfg.width, image=cfg.image, classes=10)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((4, 8, 8, 3), dtype=np.float32)
    ys = rng.integers(0, 10, 4, dtype=np.int32)
    x, y = CachedArray(xs, manager), CachedArray(ys, manager)
    ex = Executor(manager)
    tape = Tape(ex, Annotations(manager))
    loss = tape(SoftmaxCrossEntropy(), model.forward(tape, x), y)
    ours = {p.object.id: np.asarray(g) for p, g in tape.backward(loss)}
    assert set(ours) == {p.object.id for p in model.params}

    params = {p.object.id: jnp.asarray(np.asarray(p)) for p in model.params}

    def reference(values):
        subst = dict(values)
        subst[x.object.id], subst[y.object.id] = jnp.asarray(xs), jnp.asarray(ys)
        jt = _JaxTape(_JaxExec(subst))
        logits = model.forward(jt, x)
        return K.xent_fwd(logits, jnp.asarray(ys))

    ref = jax.jit(jax.grad(reference))(params)
    for pid, g in ours.items():
        np.testing.assert_allclose(g, np.asarray(ref[pid]), rtol=2e-3, atol=2e-5)


# ---------------------------------------------------------------- modes and budgets
def test_modes_map_to_the_policies_of_table_4_7():
    assert isinstance(make_policy("2lm"), TwoLevelCachePolicy)
    assert isinstance(make_policy("cap"), CorrelationPrefetchPolicy)
    flags = {m: (p.local_alloc, p.honor_frees, p.prefetch_hints) for m in MODES if m != "2lm"
             for p in [make_policy(m)]}
    assert flags == {"dram": (True, True, True), "ca0": (False, False, False), "caL": (True, False, False),
                     "caLM": (True, True, False), "caLMP": (True, True, True), "cap": (True, True, False)}
    assert make_policy("ca0").insert_on_use and make_policy("2lm").collect_at == 0.8
    with pytest.raises(ValueError, match="unknown mode"):
        make_policy("fast")


def test_parse_budget():
    assert parse_budget("25%", 1000) == 250
    assert parse_budget(0.5, 1000) == 500
    assert parse_budget("1MiB", 1000) == 1 << 20
    assert parse_budget("123456", 1000) == 123456


@pytest.mark.parametrize("family", ["vgg", "resnet", "densenet"])
def test_every_mode_matches_dram_loss_at_the_smallest_budget(family):
    cfg, fp = TINY[family], footprint(family)
    assert 0 < fp.min_budget < fp.footprint
    base = [r.loss for r in run_mode(cfg, "dram", None, 2, fp).records]
    assert np.isfinite(base).all()
    for mode in MODES[1:]:
        run = run_mode(cfg, mode, fp.min_budget, 2, fp)   # run_mode also runs m.check() at the end
        assert [r.loss for r in run.records] == base, mode  # bit for bit: movement never changes a byte
        for r in run.records:
            assert r.fast_capacity <= fp.min_budget and r.peak_fast_bytes <= r.fast_capacity
            assert r.dram_to_pm_bytes > 0, f"{mode} at the smallest budget must evict something"


def test_backward_prefetches_the_next_layer_while_the_current_one_runs(monkeypatch):
    """`Tape.backward` hands `Annotations.ahead` the layer whose backward kernel comes next, once
    the current one is dispatched; under caLMP at half the footprint it brings saved tensors up
    early, and it only moves bytes: the losses are those of a run without it."""
    cfg, fp = TINY["densenet"], footprint("densenet")
    calls, early = [], []
    ahead, backward = Annotations.ahead, Annotations.backward

    def logged_ahead(self, layer, saved):
        arrays = [x for x in (*saved, *layer.params) if isinstance(x, CachedArray)]
        before = [x.policy.in_fast(x.object) for x in arrays]
        ahead(self, layer, saved)
        early.extend(not b and x.policy.in_fast(x.object) for x, b in zip(arrays, before))
        calls.append(("ahead", layer))

    def logged_backward(self, ex, layer, *args, **kwargs):
        calls.append(("backward", layer))
        return backward(self, ex, layer, *args, **kwargs)

    monkeypatch.setattr(Annotations, "ahead", logged_ahead)
    monkeypatch.setattr(Annotations, "backward", logged_backward)
    on = [r.loss for r in run_mode(cfg, "caLMP", "50%", 2, fp).records]
    for (kind, layer), following in zip(calls, calls[1:]):
        if kind == "ahead":
            assert following == ("backward", layer)
    kinds = [kind for kind, _ in calls]
    passes = sum(kind == "backward" and isinstance(layer, SoftmaxCrossEntropy) for kind, layer in calls)
    assert passes >= 2 and kinds.count("ahead") == kinds.count("backward") - passes  # none before the loss's
    assert any(early)
    monkeypatch.setattr(Annotations, "ahead", lambda self, layer, saved: None)
    assert [r.loss for r in run_mode(cfg, "caLMP", "50%", 2, fp).records] == on


def test_learned_prefetch_learns_the_training_step_and_reports_coverage_and_accuracy():
    """Step 0 is learned (nothing predicted: every miss is fetched on use); from step 1 on, the
    look-ahead prefetches at least each next use's object, and the report says how well."""
    cfg, fp = TINY["resnet"], footprint("resnet")
    run = run_mode(cfg, "cap", "35%", 3, fp)
    first, later = run.records[0], run.records[1:]
    assert first.counters.get("learned_prefetches", 0) == 0 and first.counters["demand_fetches"] > 0
    assert first.prefetch_accuracy is None and 0 < first.coverage < 1
    for r in later:
        assert r.counters["learned_prefetches"] > 0 and r.counters["learned_prefetches_useful"] > 0
        assert r.counters["iterations_marked"] == 1
    report = run.policy_report
    assert report["iterations"] == 3 and report["learned_uses"] > 50
    assert report["uses"] > sum(r.counters["uses"] for r in run.records)  # and the model's construction
    assert 0 < report["accuracy"] <= 1 and 0 < report["coverage"] <= 1
    assert run.as_dict()["policy_report"] == report


def test_block_granularity_cleanup_gives_the_same_losses():
    cfg, fp = TINY["densenet"], footprint("densenet")
    base = [r.loss for r in run_mode(cfg, "caLM", "50%", 2, fp).records]
    block = Config(**{**cfg.__dict__, "granularity": "block"})
    run = run_mode(block, "caLM", "50%", 2, fp)
    np.testing.assert_allclose([r.loss for r in run.records], base, rtol=1e-6)


def test_too_small_budget_names_the_smallest_that_works():
    cfg, fp = TINY["resnet"], footprint("resnet")
    with pytest.raises(BudgetTooSmallError) as info:
        run_mode(cfg, "caLM", fp.min_budget - 1, 1, fp)
    assert f"{fp.min_budget} bytes" in str(info.value) and "smallest budget that works" in str(info.value)


def test_a_budget_below_the_wide_kernels_runs_narrow_kernels_where_those_fit():
    """A DenseNet's widest kernel (a concatenation and the whole layer reading it: `ConcatChain`)
    needs more fast memory at once than the narrow kernels (``Config.wide`` False: the concatenation
    with the batch norm alone).  A budget between the two runs the narrow model, whose losses are
    the wide one's within float rounding; a budget below both names the narrow model's smallest."""
    import dataclasses
    from cnn.trainer import Session
    cfg, fp = TINY["densenet"], footprint("densenet")
    narrow = measure_footprint(dataclasses.replace(cfg, wide=False))
    assert narrow.min_budget < fp.min_budget
    wide_session = Session(cfg, "dram", None, fp)
    session = Session(cfg, "caLM", (narrow.min_budget + fp.min_budget) // 2, fp)
    try:
        assert not session.cfg.wide and "narrow kernels" in session.cfg.label
        assert session.fp.min_budget == narrow.min_budget
        np.testing.assert_allclose([session.step(i).loss for i in range(2)],
                                   [wide_session.step(i).loss for i in range(2)], rtol=1e-6)
        session.m.check()
    finally:
        session.close()
        wide_session.close()
    with pytest.raises(BudgetTooSmallError, match=f"{narrow.min_budget} bytes"):
        Session(cfg, "caLM", narrow.min_budget - 1, fp)


def test_chains_refuse_what_they_cannot_run(manager):
    """A chain member must be a one-input layer, a join is a residual one or a concatenation, and
    a residual block's layer takes the projected shortcut exactly when it has one."""
    from cnn.layers import AddReLU, BatchNorm, Chain, Conv2D, MaxPool, ResidualChain
    sigs = (("conv", 1, 0), ("bn_relu",))
    with pytest.raises(ValueError, match="residual must be"):
        K.chain_kernels(sigs, residual="dense")
    with pytest.raises(ValueError, match="not both"):
        K.chain_kernels(sigs, residual="identity", concat=(2, 2))
    rng = np.random.default_rng(0)
    conv = Conv2D(manager, rng, 2, 2, 1)
    with pytest.raises(TypeError, match="cannot be a member of a chain"):
        Chain([conv, MaxPool(2)])
    block = ResidualChain(Chain([conv, BatchNorm(manager, 2)]), AddReLU(), identity=True)
    x = CachedArray(np.ones((1, 2, 2, 2), np.float32), manager)
    with pytest.raises(ValueError, match="x alone"):
        block.forward(Executor(manager), x, x)


@pytest.mark.parametrize("identity", [True, False])
def test_a_residual_block_in_one_kernel_computes_what_its_separate_layers_do(identity, manager):
    """`ResidualChain` against its main path (`Chain`) and join (`AddReLU`) run apart: the same
    output, and in backward the same weight gradients and shortcut gradient, with the block
    input's gradient (both paths' summed for an identity shortcut) and without it (the kernel that
    skips it, which no model reaches: a block's input is always made by an earlier layer)."""
    from cnn.layers import AddReLU, BatchNorm, BNReLU, Chain, Conv2D, ResidualChain
    rng = np.random.default_rng(1)
    c = 3
    chain = Chain([Conv2D(manager, rng, c, c, 1), BNReLU(BatchNorm(manager, c)), Conv2D(manager, rng, c, c, 3)])
    block = ResidualChain(chain, AddReLU(), identity=identity)
    ex = Executor(manager)
    x = CachedArray(rng.standard_normal((2, 4, 4, c), dtype=np.float32), manager)
    s = CachedArray(rng.standard_normal((2, 4, 4, c), dtype=np.float32), manager)
    dy = CachedArray(rng.standard_normal((2, 4, 4, c), dtype=np.float32), manager)
    shortcut = () if identity else (s,)
    host = lambda xs: [None if a is None else np.asarray(a) for a in xs]  # noqa: E731

    h, saved_chain = chain.forward(ex, x)
    y_ref, saved_join = AddReLU().forward(ex, h, x if identity else s)
    (dh, _), _ = AddReLU().backward(ex, dy, saved_join, [True, True])
    (dx_main,), dps_ref = chain.backward(ex, dh, saved_chain, [True])
    dx_ref = np.asarray(dx_main) + (np.asarray(dh) if identity else 0)

    y, saved = block.forward(ex, x, *shortcut)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    dxs, dps = block.backward(ex, dy, saved, [True] * (1 + len(shortcut)))
    np.testing.assert_allclose(np.asarray(dxs[0]), dx_ref, rtol=1e-4, atol=1e-5)
    if not identity:
        np.testing.assert_allclose(np.asarray(dxs[1]), np.asarray(dh), rtol=1e-5, atol=1e-6)
    for got, want in zip(host(dps), host(dps_ref), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    dxs_w, dps_w = block.backward(ex, dy, saved, [False] * (1 + len(shortcut)))
    assert dxs_w[0] is None
    if not identity:
        np.testing.assert_allclose(np.asarray(dxs_w[1]), np.asarray(dh), rtol=1e-5, atol=1e-6)
    for got, want in zip(host(dps_w), host(dps), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dram_mode_moves_nothing_and_cleanup_shrinks_traffic():
    cfg, fp = TINY["resnet"], footprint("resnet")
    assert all(r.dram_to_pm_bytes == 0 and r.pm_to_dram_bytes == 0 for r in run_mode(cfg, "dram", None, 1, fp).records)
    written = {m: run_mode(cfg, m, "35%", 2, fp).records[-1].dram_to_pm_bytes for m in ("2lm", "caL", "caLM")}
    # frees and cleanup (M) avoid writing dead data back; 2LM writes back even dead dirty data
    assert written["caLM"] < written["caL"] < written["2lm"], written
    lm = run_mode(cfg, "caLM", "35%", 1, fp).records[0]
    assert lm.counters.get("objects_freed", 0) > 50 and not lm.counters.get("frees_ignored")
    l0 = run_mode(cfg, "caL", "35%", 1, fp).records[0]
    assert l0.counters.get("frees_ignored", 0) > 50


def test_checkpoint_interval_and_resume_give_the_same_losses(tmp_path):
    from cachedarrays.checkpoint import CheckpointError, Interval
    cfg, fp = TINY["vgg"], footprint("vgg")
    straight = [r.loss for r in run_mode(cfg, "caLM", "50%", 4, fp).records]
    ck, saved = str(tmp_path / "ck.npz"), []
    first = run_mode(cfg, "caLM", "50%", 3, fp, save=ck, interval=Interval(steps=2),
                     on_save=lambda path, i: saved.append(i))
    assert saved == [2, 3] and [r.loss for r in first.records] == straight[:3]
    resumed = run_mode(cfg, "caLM", "50%", 4, fp, load=ck)
    assert [r.iteration for r in resumed.records] == [3] and [r.loss for r in resumed.records] == straight[3:]
    other = Config(**{**cfg.__dict__, "lr": 0.5})
    with pytest.raises(CheckpointError, match="for another model or training setup"):
        run_mode(other, "caLM", "50%", 4, fp, load=ck)


# ---------------------------------------------------------------- the script
def test_cli_prints_iterations_writes_report_and_plots(tmp_path, capsys):
    from cnn.train import main
    out = tmp_path / "r.json"
    rc = main(["--model", "vgg", "--depth", "5", "--width", "4", "--batch", "4", "--image", "8",
               "--iterations", "2", "--mode", "dram,caLM,cap", "--fast-budget", "50%", "--no-progress",
               "--report", str(out), "--plot", str(tmp_path / "fig")])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("iter ") == 6 and "DRAM->PM" in text and "peak fast" in text and "modeled movement" in text
    assert text.count("coverage") == 3 and "learned prefetch over the run: coverage" in text  # cap's lines only
    report = json.loads(out.read_text())
    assert report["modes"]["cap"]["policy_report"]["iterations"] == 2 and "policy_report" not in report["modes"]["caLM"]
    its = report["modes"]["caLM"]["iterations"]
    assert len(its) == 2 and all(i["peak_fast_bytes"] <= i["fast_capacity"] for i in its)
    assert report["modes"]["caLM"]["iterations"][0]["loss"] == pytest.approx(report["modes"]["dram"]["iterations"][0]["loss"])
    for name in ("fig-occupancy-dram.png", "fig-occupancy-caLM.png", "fig-bytes.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_cli_help_and_too_small_budget(capsys, tmp_path):
    from cnn.train import main
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--fast-budget" in out and "--checkpoint-every" in out
    for bad, message in ((["--mode", "dram,caLM", "--save", "x.npz"], "exactly one --mode"),
                         (["--checkpoint-every", "2"], "needs --save FILE"),
                         (["--save", str(tmp_path / "no" / "x.npz")], "does not exist")):
        with pytest.raises(SystemExit):
            main(bad)
        assert message in capsys.readouterr().err
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 truncated")
    rc = main(["--model", "vgg", "--depth", "5", "--width", "4", "--batch", "4", "--image", "8", "--iterations", "1",
               "--mode", "caLM", "--fast-budget", "50%", "--no-progress", "--load", str(tmp_path / "bad.npz")])
    assert rc == 2 and "bad.npz is not a checkpoint" in capsys.readouterr().err
    rc = main(["--model", "vgg", "--depth", "5", "--width", "4", "--batch", "4", "--image", "8",
               "--iterations", "1", "--mode", "caLM", "--fast-budget", "100", "--no-progress"])
    assert rc == 2 and "smallest budget that works" in capsys.readouterr().err


def test_digits_reach_90_percent_test_accuracy(tmp_path):
    from cnn.data import load_digits
    d = load_digits()
    assert d.x_train.shape[1:] == (8, 8, 1) and len(d.x_test) > 300
    cfg = Config("vgg", 6, 8, 32, 8, 10, 1, lr=0.05, momentum=0.9)
    fp = measure_footprint(cfg, lambda i: d.batch(i, 32))
    acc = {}
    run_mode(cfg, "caLM", "50%", 150, fp, lambda i: d.batch(i, 32),
             after=lambda tr: acc.setdefault("test", float((tr.predict(d.x_test) == d.y_test).mean())))
    assert acc["test"] >= 0.90, acc


def test_depth_counts_weighted_layers_like_the_model_names(manager):
    from cnn.layers import Conv2D, Dense

    def weighted(model, skip_proj=True):
        return sum(1 for layer in model.layers if isinstance(layer, (Conv2D, Dense))
                   and not (skip_proj and layer.name.endswith(".proj")))

    big = Manager(DRAM("64MiB"), PM(None, "16MiB"), policy=LRUPolicy())
    try:
        vgg416 = build("vgg", big, depth=416, width=1, image=32, classes=10)   # the dissertation's VGG 416
        assert weighted(vgg416) == 416 and sum(vgg416.info["convs_per_stage"]) == 413
        r50 = build("resnet", big, depth=50, width=1, image=32, classes=10)
        assert r50.info["blocks"] == [3, 4, 6, 3] and weighted(r50) == 50
        d121 = build("densenet", big, depth=121, width=1, image=32, classes=10)
        assert d121.info["blocks"] == [6, 12, 24, 16] and weighted(d121) == 121
        assert build("resnet", big, depth=26, width=1, image=32).info["blocks"] == [2, 2, 3, 1]
    finally:
        big.close()
    with pytest.raises(ValueError, match="ResNet depth"):
        build("resnet", manager, depth=12)


# ---------------------------------------------------------------- the GPU path's logic on the CPU
@pytest.mark.parametrize("family", ["resnet", "densenet"])
def test_block_remat_gives_the_layer_by_layer_losses(family):
    """`cnn.functional` (the benchmark's baselines) trains the same model: same losses to rounding.
    Rematerialised blocks keep only their last output, so nothing after a block may read inside it."""
    from cnn.data import synthetic_batch
    from cnn.functional import initial_state, train_step
    import dataclasses
    cfg = TINY[family] if family == "resnet" else dataclasses.replace(TINY[family], depth=13)  # blocks of 2+ layers
    ours = [r.loss for r in run_mode(cfg, "dram", None, 2, measure_footprint(cfg)).records]
    with Manager(DRAM("8MiB"), PM(None, "16MiB"), policy=LRUPolicy()) as m:
        model = build(family, m, depth=cfg.depth, width=cfg.width, image=cfg.image, classes=cfg.classes)
        for variant in ("remat",):  # block replay under jax.checkpoint; "whole" is its code without scopes
            params, momenta = initial_state(model)
            step, losses = train_step(model, cfg.lr, cfg.momentum, variant), []
            for i in range(2):
                params, momenta, loss = step(params, momenta, *synthetic_batch(i, cfg.batch, cfg.image, 3, 10))
                losses.append(float(loss))
            np.testing.assert_allclose(losses, ours, rtol=1e-5, err_msg=variant)


def test_release_together_unpins_every_view_and_makes_no_gpu_record_on_the_host(manager):
    from cachedarrays import readable, release_together
    xs = [CachedArray(np.ones(8, np.float32), manager) for _ in range(3)]
    views = [readable(x) for x in xs] + [readable(xs[0])]
    assert all(manager.pinned(x.object) for x in xs)
    assert release_together(views) == [] and release_together(views) == []  # twice: harmless
    assert not any(manager.pinned(x.object) for x in xs)


def test_make_manager_checks_device_and_capacity(monkeypatch, tmp_path):
    from cnn import modes
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        modes.make_manager("caLM", 1 << 20, 1 << 24, device="tpu")
    monkeypatch.setattr(modes, "_pm_free", lambda pm_dir: 1 << 20)
    with pytest.raises(modes.ModelTooLargeError, match="hold only"):
        modes.make_manager("caLM", 1 << 20, 1 << 30, str(tmp_path))


@pytest.mark.skipif(__import__("cachedarrays.devices.gpu", fromlist=["available"]).available(),
                    reason="checks the error given where no GPU is present")
def test_cli_device_gpu_without_a_gpu_is_a_clear_error(capsys):
    from cnn.train import main
    rc = main(["--device", "gpu", "--model", "vgg", "--depth", "5", "--width", "4", "--batch", "4", "--image", "8",
               "--iterations", "1", "--no-progress"])
    assert rc == 2 and "--device gpu needs a usable CUDA GPU" in capsys.readouterr().err


def test_recompute_keeps_less_and_moves_less_for_the_same_losses():
    """--recompute (BNReLUConv): DenseNet's BN-ReLU-conv layers keep only the batch norm's input, so the
    footprint and the bytes written to PM at one budget shrink; the losses stay those of the plain model."""
    import dataclasses
    cfg, fp = TINY["densenet"], footprint("densenet")
    rc = dataclasses.replace(cfg, recompute=True)
    fr = measure_footprint(rc)
    assert fr.footprint < 0.8 * fp.footprint and "recompute" in rc.label
    budget = max(fp.min_budget, fr.min_budget)
    plain, recomputed = run_mode(cfg, "caLM", budget, 2, fp), run_mode(rc, "caLM", budget, 2, fr)
    np.testing.assert_allclose([r.loss for r in recomputed.records], [r.loss for r in plain.records], rtol=1e-6)
    assert recomputed.records[-1].dram_to_pm_bytes < 0.8 * plain.records[-1].dram_to_pm_bytes


@pytest.mark.parametrize("table", ["MODELS", "QUICK_MODELS"])
def test_every_model_the_gpu_benchmark_names_builds(table):
    """``benchmarks/gpu_cnn.py`` runs on a GPU only: its model specs are checked here, on any
    machine (a DenseNet depth the builder refuses once kept the DenseNet rows from ever running)."""
    from benchmarks import gpu_cnn
    from cachedarrays import DRAM, PM, LRUPolicy, Manager
    from cnn.models import build
    for name, spec in getattr(gpu_cnn, table).items():
        with Manager(DRAM(256 << 20), PM(None, 64 << 20), policy=LRUPolicy()) as m:
            model = build(spec["family"], m, depth=spec["depth"], width=spec["width"], image=spec["image"],
                          classes=10)
            assert model.info["family"] == spec["family"] == name and model.param_bytes > 0


def test_the_gpu_benchmark_compares_with_deepum_on_paper():
    """DeepUM runs over CUDA managed memory, which the benchmark does not run: its published ResNet
    times (Figure 9(b)) give its speedups over naive unified memory and over LMS, which are set
    beside this run's analogues, cap over 2lm and cap over caLMP at the same ratio."""
    from benchmarks import gpu_cnn
    rows = {"2lm 2x": {"seconds": 0.8}, "cap 2x": {"seconds": 0.4}, "caLMP 2x": {"seconds": 0.2}}
    p = gpu_cnn.on_paper(rows, 2)
    assert p["deepum_over_um"] == pytest.approx((32420 / 4585, 49283 / 5965))
    assert p["deepum_over_lms"] == pytest.approx((5470 / 5835, 3926 / 3922))  # batch 1792: LMS ran out of memory
    assert (p["cap_over_2lm"], p["cap_over_caLMP"]) == (2.0, 0.5)
    assert gpu_cnn.on_paper(rows, 4)["cap_over_2lm"] is None  # no 4x rows
    line = gpu_cnn.on_paper_line(p)
    assert "7.1-8.3x naive unified memory" in line and "cap 2.00x 2lm, 0.50x caLMP" in line


def test_the_gpu_benchmark_names_the_traffic_no_policy_can_avoid():
    """At the high-water mark every live byte is read again, so all but the budget's worth must come
    up the link after it, and what of that the step made went down before it: that bound caps the
    speed any policy can reach, and a target above it says so instead of blaming the schedule's own
    copies."""
    from benchmarks import gpu_cnn
    GiB, link = 1 << 30, 50e9
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, link) == pytest.approx(6 * GiB / link)
    assert gpu_cnn.bound_seconds(3 * GiB, 4 * GiB, link) == 0.0  # it fits: nothing must move
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, float("nan")) == 0.0  # no link measured (CPU run)
    # what the step made went down before the mark and comes up after it: the two directions add;
    # what it did not make (weights, momenta, the batch) may have gone down before the step
    down = 40e9
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, link, down) == pytest.approx(6 * GiB / link + 6 * GiB / down)
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, link, down, carried=GiB) == pytest.approx(
        6 * GiB / link + 5 * GiB / down)
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, link, down, carried=8 * GiB) == pytest.approx(6 * GiB / link)
    assert gpu_cnn.bound_seconds(3 * GiB, 4 * GiB, link, down) == 0.0
    assert gpu_cnn.bound_seconds(10 * GiB, 4 * GiB, link, float("nan")) == pytest.approx(6 * GiB / link)
    base = 0.1  # a 100 ms whole-jit step
    assert gpu_cnn.bound_speed(base, 10 * GiB, 4 * GiB, link, down) == pytest.approx(
        base / (6 * GiB / link + 6 * GiB / down))
    assert gpu_cnn.bound_speed(base, 3 * GiB, 4 * GiB, link) == 1.0
    assert gpu_cnn.bound_speed(base, 10 * GiB, 4 * GiB, link) == pytest.approx(base * link / (6 * GiB))
    from types import SimpleNamespace
    from cnn.trainer import Config
    cfg = Config(family="densenet", depth=13, width=8, image=32, batch=5)  # 3 channels, float32 images
    assert gpu_cnn.carried_bytes(cfg, SimpleNamespace(persistent=1000)) == 1000 + 4 * 5 * (3 * 32 * 32 + 1)
    rows = {"cap": {"seconds": 0.5, "to_fast": 1 * GiB}, "caLMP": {"seconds": 0.25, "to_fast": 1 * GiB},
            "remat": {"seconds": 0.2}}
    capped = gpu_cnn.ratio_targets("m", 4, rows, base, link, bound=0.5)
    (line, ok), _ = capped.items()
    assert not ok and "best caLMP 0.40x" in line and "no policy" in line and "0.50x" in line
    (line, ok), _ = gpu_cnn.ratio_targets("m", 4, rows, base, link, bound=0.9).items()
    assert "no policy" not in line and "PCIe floor" not in line  # 1 GiB at 50 GB/s fits in 100 ms
    _, (line, ok) = capped.items()  # remat (0.50x) is out of reach too where the bound is no higher
    assert not ok and "remat" in line and "cap both at 0.50x" in line
    _, (line, ok) = gpu_cnn.ratio_targets("m", 4, rows, base, link, bound=0.6).items()
    assert "no policy" not in line


def test_the_copy_queue_follows_the_memory_free_outside_the_heap():
    """`queue_limit`: half the device memory free outside the heap, at most the heap's capacity, at
    least `MIN_QUEUE` (the kernel outputs queued for copying live in JAX's memory)."""
    import types
    from cnn.execute import MIN_QUEUE, queue_limit
    gpu = lambda capacity, free: types.SimpleNamespace(capacity=capacity, free_memory=lambda: free)  # noqa: E731
    assert queue_limit(gpu(18 << 30, 100 << 30)) == 18 << 30
    assert queue_limit(gpu(18 << 30, 10 << 30)) == 5 << 30
    assert queue_limit(gpu(18 << 30, 0)) == MIN_QUEUE


def test_importing_the_trainer_asks_xla_for_command_buffers_unless_the_user_chose(tmp_path):
    """`import cnn` adds XLA's command-buffer flags (one CUDA graph a program: cheaper launches)
    to ``XLA_FLAGS``, keeps the user's other flags, and leaves a user's own command-buffer choice."""
    import os
    import subprocess
    import sys
    code = "import os, cnn; print(os.environ['XLA_FLAGS'])"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(__file__))

    def run(extra: dict) -> str:
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True, cwd=root).stdout.strip()
    assert "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN" in run({})
    kept = run({"XLA_FLAGS": "--xla_dump_to=" + str(tmp_path)})
    assert kept.startswith("--xla_dump_to=") and "--xla_gpu_graph_min_graph_size=1" in kept
    assert run({"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}) == "--xla_gpu_enable_command_buffer="


def test_a_step_split_at_the_uploaded_batch_trains_as_one_step():
    """`Trainer.begin` brings the batch to the device and `Trainer.run` does the rest (a session starts
    its clock between the two, with the batch where whole-jit's is); together they are `Trainer.step`.
    `begin` leaves the policy alone (no object placed, no iteration marked), so a session's clock
    covers all of the policy's work; `run` without a batch is a clear error that leaves the trainer
    usable."""
    from cnn.data import synthetic_batch
    from cnn.trainer import Session
    cfg = Config(family="resnet", depth=8, width=4, batch=2, image=8)
    fp = measure_footprint(cfg)
    a, b = Session(cfg, "dram", None, fp), Session(cfg, "dram", None, fp)
    marks, mark = [], b.m.policy.mark_iteration
    b.m.policy.mark_iteration = lambda: (marks.append(1), mark())[1]
    try:
        for i in range(3):
            batch = synthetic_batch(i, cfg.batch, cfg.image, cfg.channels, cfg.classes, cfg.seed)
            objects = len(b.m.objects())
            b.trainer.begin(*batch)
            assert (len(b.m.objects()), len(marks)) == (objects, i)
            assert a.trainer.step(*batch) == b.trainer.run()
            assert len(marks) == i + 1
            with pytest.raises(RuntimeError, match="Trainer.begin"):
                b.trainer.run()
        assert [a.step(i).loss for i in range(3, 5)] == [b.step(i).loss for i in range(3, 5)]
        b.m.check()
    finally:
        a.close()
        b.close()


def test_a_recorded_step_replays_the_same_kernels_in_order_on_bare_arrays():
    """``Executor.tape`` records every kernel of a step; ``replay`` dispatches those kernels again,
    in order, on plain arrays of the recorded shapes and dtypes (the per-layer floor the GPU
    benchmark reports), and a tape of None records nothing."""
    from cnn.execute import replay
    from cnn.trainer import Session
    cfg = Config(family="resnet", depth=8, width=4, batch=2, image=8)
    s = Session(cfg, "dram", None, measure_footprint(cfg))
    try:
        s.step(0)
        ex = s.trainer.ex
        ex.tape = []
        s.step(1)
        tape, ex.tape = ex.tape, None
        assert len(tape) == ex.stats.calls > 10  # the step's kernels (the stats are the last step's)
        s.step(2)  # not recorded
        assert len(tape) == ex.stats.calls
        seen = []

        def spy(kernel):
            def call(*xs, **static):
                seen.append((kernel, [(x.shape, x.dtype) for x in xs if hasattr(x, "shape")]))
                return kernel(*xs, **static)
            return call
        replay([(spy(k), inputs, args, static) for k, inputs, args, static in tape])()
        assert [k for k, _ in seen] == [k for k, *_ in tape]
        for (_, got), (_, inputs, args, _) in zip(seen, tape):
            assert got[:len(inputs)] == [(shape, np.dtype(dt)) for shape, dt in inputs]
    finally:
        s.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=5), st.booleans(), st.floats(1e-4, 1.0), st.integers(0, 2**31))
def test_in_place_sgd_is_the_sgd_kernels_bit_for_bit(sizes, momentum, lr, seed):
    from cnn import inplace
    rng = np.random.default_rng(seed)
    groups = 3 if momentum else 2
    arrays = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
              for _ in range(groups) for n in sizes]
    lr, mu = np.float32(lr), np.float32(0.9)
    want = K.sgd_momentum_steps(*arrays, lr, mu) if momentum else K.sgd_steps(*arrays, lr)
    got = [a.copy() for a in arrays]
    inplace.sgd_host(got, lr, mu if momentum else None)
    n = len(sizes)
    written = got[:n] + (got[2 * n:] if momentum else [])
    for w, g in zip(want, written):
        np.testing.assert_array_equal(np.asarray(w), g)
    for a, b in zip(got[n:2 * n], arrays[n:2 * n]):  # the gradients are only read
        np.testing.assert_array_equal(a, b)


def test_an_in_place_update_writes_its_targets_where_they_are_and_records_the_kernel(manager):
    from cnn import inplace
    ran = []  # the in-place form, not the kernel and a copy (which would give the same values)
    spy = inplace.InPlace(lambda arrays, *a: ran.append(len(arrays)) or inplace.sgd_host(arrays, *a),
                          inplace.sgd_cuda, np.float32)
    ex = Executor(manager, tape=[])
    w = CachedArray(np.arange(1000, dtype=np.float32), manager)
    g = CachedArray(np.ones(1000, np.float32), manager)
    v = CachedArray(np.full(1000, 2, np.float32), manager)
    before = manager.primary(w.object)
    ex.call_into(K.sgd_momentum_steps, (w, g, v), (w, v), np.float32(0.5), np.float32(0.9), in_place=spy)
    assert ran == [3] and manager.primary(w.object) is before  # the same bytes, written where they are
    np.testing.assert_array_equal(np.asarray(v), np.full(1000, 2.8, np.float32))
    np.testing.assert_array_equal(np.asarray(w), np.arange(1000, dtype=np.float32) - np.float32(0.5) * np.float32(2.8))
    assert ex.stats.calls == 1 and ex.stats.written_fast == 8000 and ex.stats.read_fast == 12000
    assert ex.stats.copies == 0  # written where they are: no output copied
    assert [k for k, *_ in ex.tape] == [K.sgd_momentum_steps]  # replayed as the kernel it stands for
    with pytest.raises(ValueError, match="writes only objects among its inputs"):
        ex.call_into(K.sgd_steps, (w, g), (v,), np.float32(0.5), in_place=spy)
    np.testing.assert_array_equal(np.asarray(v), np.full(1000, 2.8, np.float32))  # nothing written
    w16, g16 = CachedArray(np.ones(10, np.float16), manager), CachedArray(np.full(10, 4, np.float16), manager)
    ex.call_into(K.sgd_steps, (w16, g16), (w16,), np.float16(0.5), in_place=spy)  # float16: by the kernel
    np.testing.assert_array_equal(np.asarray(w16), np.full(10, -1, np.float16))
    assert ex.stats.calls == 2 and ran == [3] and (ex.stats.copies, ex.stats.copied) == (1, w16.nbytes)
    manager.check()


# ---------------------------------------------------------------- sums and concatenations inside the kernels
def test_call_into_adds_outputs_into_their_targets_in_the_kernels_own_program(manager):
    """``Executor.call(into=...)``: output i is added to ``into[i]`` (``acc + out``, `add_fwd`'s
    sum) and written into that object, which is returned in its place; the others are new objects;
    the step records one accumulating kernel, not a kernel and a sum."""
    ex = Executor(manager, tape=[])
    x = CachedArray(np.arange(64, dtype=np.float32), manager)
    acc = CachedArray(np.full(64, 0.25, np.float32), manager)
    two = jax.jit(lambda a: (a * 2, a + 1))
    d, e = ex.call(two, (x,), into=(acc, None))
    assert d is acc and e is not acc and ex.stats.calls == 1 and len(ex.tape) == 1
    ex.sync()
    np.testing.assert_array_equal(np.asarray(acc), np.float32(0.25) + np.arange(64, dtype=np.float32) * 2)
    np.testing.assert_array_equal(np.asarray(e), np.arange(64, dtype=np.float32) + 1)
    assert ex.tape[0][0].__name__.endswith("+acc")
    ex.call(two, (x,), into=(acc, e))  # every output into a target
    ex.sync()
    np.testing.assert_array_equal(np.asarray(acc), np.float32(0.25) + np.arange(64, dtype=np.float32) * 4)
    np.testing.assert_array_equal(np.asarray(e), np.arange(64, dtype=np.float32) * 2 + 2)
    assert ex.call(two, (x,), into=(None, None))[0] is not acc  # no target: plain `call`
    manager.check()


def test_call_into_with_targets_that_do_not_fit_is_a_clear_error_that_writes_nothing(manager):
    ex = Executor(manager)
    x = CachedArray(np.arange(64, dtype=np.float32), manager)
    acc = CachedArray(np.ones(64, np.float32), manager)
    small = CachedArray(np.ones(8, np.float32), manager)
    live = len(manager.objects())
    with pytest.raises(ValueError, match="into= has 2 entries for a kernel with 1 outputs"):
        ex.call(_double, (x,), into=(acc, None))
    with pytest.raises(ValueError, match=r"into\[0\] has shape \(8,\)"):
        ex.call(jax.jit(lambda a: a.reshape(8, 8)), (x,), into=(small,))
    with pytest.raises(ValueError, match="arrays and static keywords only"):
        ex.call(_double, (x,), 3, into=(acc,))
    ex.sync()
    np.testing.assert_array_equal(np.asarray(acc), np.ones(64, np.float32))
    np.testing.assert_array_equal(np.asarray(small), np.ones(8, np.float32))
    assert len(manager.objects()) == live  # no output stored
    manager.check()


@pytest.mark.parametrize("family,recompute", [("densenet", False), ("densenet", True), ("resnet", False),
                                              ("resnet", True)])
def test_sums_and_fused_layers_inside_kernels_give_the_separate_kernels_gradients(family, recompute, manager,
                                                                                 monkeypatch):
    """A step with gradients summed inside the backward kernels, each convolution fused with the
    batch norm after it (`ConvBN`) and each DenseNet concatenation with the layer reading it
    (`ConcatChain`, the whole chain reading it), runs of convolutions and
    batch norms as one kernel (`Chain`) and a residual block's join inside its chain
    (`ResidualChain`) runs no sum or concatenation kernel of its own, and gives the gradients of the
    same maths as separate kernels (within float rounding: XLA may fuse the arithmetic differently)."""
    from cnn import layers as L
    from cnn import models
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((4, 8, 8, 3), dtype=np.float32)
    ys = rng.integers(0, 10, 4, dtype=np.int32)
    cfg = TINY[family]

    def gradients():
        model = build(family, manager, depth=cfg.depth, width=cfg.width, image=8, classes=10, recompute=recompute)
        ex = Executor(manager, tape=[])
        tape = Tape(ex, Annotations(manager))
        loss = tape(SoftmaxCrossEntropy(), model.forward(tape, CachedArray(xs, manager)), CachedArray(ys, manager))
        index = {p.object.id: i for i, p in enumerate(model.params)}
        grads = {index[p.object.id]: np.asarray(g) for p, g in tape.backward(loss)}
        ex.sync()
        return grads, {getattr(k, "__name__", "") for k, *_ in ex.tape}

    fused, names = gradients()
    assert not {"add_fwd", "concat_fwd", "concat_bwd"} & names
    assert any(n.endswith("+acc") for n in names)
    assert ("concat_chain_fwd" in names) == (family == "densenet")
    assert ("residual_fwd" in names) == (family == "resnet") and not {"add_relu_fwd", "relu_bwd"} & names
    with monkeypatch.context() as mp:  # the same model with separate sums, concatenations and batch norms
        mp.setattr(models, "BNReLU", type("Unfused", (), {}))  # no layer for ConcatChain to wrap
        mp.setattr(models, "BNReLUConv", type("Unfused", (), {}))
        mp.setattr(models, "fuse_conv_bn", list)
        mp.setattr(models, "fuse_chains", list)
        for cls in (L.Conv2D, L.BNReLU, L.BNReLUConv, L.Concat, L.AvgPool, L.GlobalAvgPool, L.Dense,
                    L.SoftmaxCrossEntropy, L.BatchNorm, L.MaxPool, L.ReLU):
            mp.setattr(cls, "adds_into", False)
        separate, names = gradients()
    assert "add_fwd" in names and not {"conv_bn_fwd", "concat_chain_fwd", "chain_fwd"} & names
    assert set(fused) == set(separate) == set(range(len(fused)))
    for i, g in fused.items():
        np.testing.assert_allclose(g, separate[i], rtol=1e-5, atol=1e-6)


def test_a_tensor_concatenated_with_itself_gets_both_gradients(manager):
    """`GradStore.targets` hands a layer a running sum once per node and never one that another
    tensor shares: a tensor read twice by one concatenation gets both slices' gradients."""
    from cnn.graph import GradStore
    from cnn.layers import BatchNorm, BNReLU, Chain, ConcatChain, Conv2D, Dense, GlobalAvgPool
    ex = Executor(manager)
    store = GradStore(ex)
    a, b = (CachedArray(np.ones(4, np.float32), manager) for _ in range(2))
    store.add(1, a)
    store.add(2, b)
    store.add(3, b)  # b serves keys 2 and 3
    assert [t is a if t is not None else None for t in store.targets([1, 1, None, 2, 5])] == [True] + [None] * 4

    rng = np.random.default_rng(0)
    conv = Conv2D(manager, rng, 3, 4)
    joined = [ConcatChain(Chain([BNReLU(BatchNorm(manager, c))])) for c in (8, 12)]  # concatenation + BN + ReLU
    layers = [conv, *joined, GlobalAvgPool(), Dense(manager, rng, 12, 10)]
    params = [p for layer in layers for p in layer.params]

    def forward(tape, x):
        h = tape(layers[0], x)
        u = tape(layers[1], h, h)  # h's gradient from the next layer is there when this one's comes
        u = tape(layers[2], u, h)
        return tape(layers[4], tape(layers[3], u))

    xs = rng.standard_normal((4, 8, 8, 3), dtype=np.float32)
    ys = rng.integers(0, 10, 4, dtype=np.int32)
    x, y = CachedArray(xs, manager), CachedArray(ys, manager)
    tape = Tape(ex, Annotations(manager))
    loss = tape(SoftmaxCrossEntropy(), forward(tape, x), y)
    ours = {p.object.id: np.asarray(g) for p, g in tape.backward(loss)}

    def reference(values):
        subst = dict(values)
        subst[x.object.id] = jnp.asarray(xs)
        return K.xent_fwd(forward(_JaxTape(_JaxExec(subst)), x), jnp.asarray(ys))

    ref = jax.jit(jax.grad(reference))({p.object.id: jnp.asarray(np.asarray(p)) for p in params})
    assert set(ours) == set(ref)
    for pid, g in ours.items():
        np.testing.assert_allclose(g, np.asarray(ref[pid]), rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("family", ["resnet", "densenet"])
def test_output_bytes_count_what_fused_layers_make_inside_as_the_separate_layers_would(family, manager,
                                                                                       monkeypatch):
    """The GPU benchmark sizes its batch from `output_bytes`: fusing layers must not change it."""
    from cnn import models
    from cnn.functional import output_bytes
    depth = {"resnet": 14, "densenet": 13}[family]
    fused = output_bytes(build(family, manager, depth=depth, width=4, image=16, classes=10), 3)
    monkeypatch.setattr(models, "BNReLU", type("Unfused", (), {}))
    monkeypatch.setattr(models, "BNReLUConv", type("Unfused", (), {}))
    monkeypatch.setattr(models, "fuse_conv_bn", list)
    monkeypatch.setattr(models, "fuse_chains", list)
    assert output_bytes(build(family, manager, depth=depth, width=4, image=16, classes=10), 3) == fused


@pytest.mark.parametrize("family", ["resnet", "densenet"])
def test_sgd_groups_as_large_as_the_largest_kernel_keep_the_smallest_budget(family, monkeypatch):
    """SGD groups parameters up to the step's largest kernel working set: fewer update kernels, and
    the smallest workable budget (that largest working set) stays what the model's kernels make it."""
    from cnn.optim import SGD
    from cnn.trainer import Session

    def kernels(fp):
        s = Session(TINY[family], "dram", None, fp)
        try:
            s.step(0)
            return s.trainer.ex.stats.calls
        finally:
            s.close()

    fp = footprint(family)
    grouped = kernels(fp)
    by_parameter = SGD.groups
    monkeypatch.setattr(SGD, "groups", lambda self, pgrads, limit=0: by_parameter(self, pgrads))
    small = measure_footprint(TINY[family])
    assert small.min_budget == fp.min_budget and small.footprint == fp.footprint
    assert kernels(small) > grouped


def test_batch_norm_kernels_save_the_batch_statistics_as_one_array_and_normalise_with_them():
    """`bn_fwd` against numpy (the other kernel tests compare our kernels with each other or with
    autodiff of them): rows 0 and 1 of the saved statistics are the mean and 1/std over N, H, W,
    and the backward kernels read the same rows."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32) * 3 + 1
    gamma, beta = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    y, stats = K.bn_fwd(x, gamma, beta)
    mean, var = x.astype(np.float64).mean(axis=(0, 1, 2)), x.astype(np.float64).var(axis=(0, 1, 2))
    np.testing.assert_allclose(np.asarray(stats), [mean, 1 / np.sqrt(var + K.EPS)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y), (x - mean) / np.sqrt(var + K.EPS) * gamma + beta, rtol=1e-4, atol=1e-5)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, pull = jax.vjp(lambda a, g, b: K.bn_fwd(a, g, b)[0], x, gamma, beta)
    for got, want in zip(K.bn_bwd(dy, x, gamma, stats), pull(dy)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    relu_y, relu_stats = K.bn_relu_fwd(x, gamma, beta)
    np.testing.assert_array_equal(np.asarray(relu_stats), np.asarray(stats))
    np.testing.assert_array_equal(np.asarray(relu_y), np.maximum(np.asarray(y), 0))
