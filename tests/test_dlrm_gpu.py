"""``python -m dlrm.train --device gpu``: the flags' parsing and errors (on any machine), and on a
GPU the same loss curve as the CPU run, checkpoint and resume, and the report."""

import numpy as np
import pytest

from cachedarrays.devices import gpu as gpu_device
from dlrm import gpu, train

TINY = ["--arch-embedding-size", "50-200-30-1000", "--arch-sparse-feature-size", "4",
        "--arch-mlp-bot", "6-16-4", "--arch-mlp-top", "16-1", "--mini-batch-size", "64",
        "--print-freq", "50", "--test-num-batches", "4", "--no-progress", "--test-freq", "0",
        "--num-indices-per-lookup", "3"]
TABLE_BYTES = (50 + 200 + 30 + 1000) * 4 * 4

requires_gpu = pytest.mark.skipif(not gpu_device.available(), reason="needs a CUDA GPU and CuPy")


# ------------------------------------------------------------------ any machine
@pytest.mark.parametrize("text", ["auto", "8GiB", "1000", "10%", "0.5%", "250%"])
def test_fast_budget_accepts_sizes_and_percentages(text):
    assert train.build_parser().parse_args(["--fast-budget", text]).fast_budget == text


@pytest.mark.parametrize("text", ["10x", "0%", "-5%", "%", "lots", "0"])
def test_fast_budget_rejects_anything_else_naming_the_flag(text, capsys):
    with pytest.raises(SystemExit):
        train.build_parser().parse_args([f"--fast-budget={text}"])
    assert "--fast-budget must be 'auto', a size" in capsys.readouterr().err


def test_hbm_need_counts_tables_or_cache_and_staging_rows():
    sizes, F, rows = [100, 1000], 8, [10, 100]
    per_row = F * 4 + gpu.STATE_BYTES
    assert gpu.hbm_need("dram", sizes, F, rows) == 1100 * F * 4
    assert gpu.hbm_need("static", sizes, F, rows) == (110 + 2 * gpu.STAGING_ROWS) * per_row
    assert gpu.hbm_need("dynamic", sizes, F, rows) == (110 + 2 * gpu.STAGING_ROWS) * per_row
    assert gpu.hbm_need("simple", sizes, F, rows) == 2 * gpu.STAGING_ROWS * per_row
    # lru: each cache rounded up to whole sets of WAYS slots, each slot with its tag, stamp and dirty bit
    slots = 16 + 112 if gpu.WAYS == 16 else None
    assert gpu.hbm_need("lru", sizes, F, rows) == (per_row + 8 + 4 + 1) * slots + 2 * gpu.STAGING_ROWS * per_row
    # lfu: and each slot's count of batches of use
    assert gpu.hbm_need("lfu", sizes, F, rows) == (per_row + 8 + 4 + 1 + 4) * slots + 2 * gpu.STAGING_ROWS * per_row


def test_resolve_budget_reads_percentages_of_the_tables_and_refuses_too_little():
    assert gpu.resolve_budget("10%", 10_000_000, 900_000, "dynamic") == 1_000_000
    assert gpu.resolve_budget("2MiB", 10_000_000, 900_000, "dynamic") == 2 << 20
    assert gpu.resolve_budget("auto", 10_000_000, 900_000, "dynamic") == 900_000 + gpu.SLACK
    with pytest.raises(SystemExit, match=r"--fast-budget 5% \(488.3 KiB\) cannot hold what --policy dynamic"):
        gpu.resolve_budget("5%", 10_000_000, 900_000, "dynamic")
    with pytest.raises(SystemExit, match="every table.*choose a cached --policy"):
        gpu.resolve_budget("1MiB", 10_000_000, 10_000_000, "dram")


def test_a_budget_too_small_for_the_tables_is_refused_before_any_device_is_touched():
    with pytest.raises(SystemExit, match=r"--fast-budget 50% .* cannot hold what --policy dram must keep in HBM"):
        train.main(TINY + ["--device", "gpu", "--fast-budget", "50%", "--num-batches", "2"])


@pytest.mark.skipif(gpu_device.available(), reason="checks the error where no GPU is usable")
def test_device_gpu_without_a_gpu_says_why():
    with pytest.raises(SystemExit, match="--device gpu: .*(CuPy|CUDA)"):
        train.main(TINY + ["--device", "gpu", "--num-batches", "2"])


@pytest.mark.parametrize("extra,message", [
    (["--fast-budget", "1GiB"], "--fast-budget caps the HBM of --device gpu"),
    (["--device", "gpu", "--pm-path", "somewhere"], "--pm-path and --resume-from-pool are CPU-only"),
    (["--policy", "lru"], "--policy lru is the GPU cache .* it needs --device gpu"),
    (["--policy", "lfu"], "--policy lfu is the GPU cache .* it needs --device gpu"),
])
def test_contradictory_device_flags_are_refused(extra, message):
    with pytest.raises(SystemExit, match=message):
        train.main(TINY + ["--num-batches", "2"] + extra)


def test_with_next_pairs_every_batch_with_the_one_after():
    assert list(train.with_next(iter([(3, "a"), (4, "b"), (5, "c")]))) == [(3, "a", "b"), (4, "b", "c"), (5, "c", None)]
    assert list(train.with_next(iter([]))) == []


# ------------------------------------------------------------------ on a GPU
CACHED = ("static", "dynamic", "simple", "lru", "lfu")


def _policies():
    return [("dram", "sgd"), ("dram", "adagrad"), ("lru", "adagrad"), ("lru", "sgd-any")] + [(p, "sgd") for p in CACHED]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("policy,optimizer", _policies())
@pytest.mark.usefixtures("young_gc")
def test_gpu_training_follows_the_cpu_loss_curve_for_200_steps(tmp_path, policy, optimizer):
    # Row-wise Adagrad at 0.05: its first step on a row is lr * g / |g| whatever |g|, so rounding
    # differences in small gradients turn into lr-sized steps; at 0.2 the curves part ten times faster.
    lr = "0.05" if optimizer == "adagrad" else "0.2"
    common = TINY + ["--num-batches", "200", "--optimizer", optimizer, "--learning-rate", lr]
    cpu = train.main(common + ["--pm-path", str(tmp_path), "--fast-capacity", "8MiB", "--slow-capacity", "8MiB"])
    on_gpu = train.main(common + ["--device", "gpu", "--policy", policy, "--cache-fraction", "0.2"])
    a = np.array([v for _, v in cpu["losses"]])
    b = np.array([v for _, v in on_gpu["losses"]])
    assert a.shape == b.shape == (200,)
    rel = np.abs(b - a) / np.abs(a)
    # The kernels sum in other orders (FMAs, reductions), so the curves start equal to rounding and
    # part geometrically from the first differing step: measured on the H100, the largest relative
    # difference over 200 steps was 6.9e-4 (SGD) and 2.0e-3 (Adagrad), the first above 1e-6 at steps
    # 108 and 34. The update kernels themselves are checked bit for bit in test_embeddings_gpu.py.
    # sgd-any (the CPU run is plain SGD) adds a row's entries in any order from the first step.
    assert rel[:10].max() <= 2e-6, f"the curves differ early: {rel[:10]}"
    rtol = 1e-2 if optimizer == "adagrad" else 5e-3
    assert rel.max() <= rtol, f"largest relative loss difference {rel.max():.2e} at step {int(rel.argmax()) + 1}"
    assert a[-50:].mean() < a[:50].mean()  # it learned: equal curves that go nowhere would prove little
    assert abs(on_gpu["evals"][-1]["auc"] - cpu["evals"][-1]["auc"]) < 1e-3
    s = on_gpu["summary"]
    assert "GPU" in s["peak_memory"]
    if policy == "dram":
        assert {t["device"] for t in s["tables"]} == {"GPU"} and s["peak_memory"]["GPU"] >= TABLE_BYTES
    else:
        assert all(t["hitrate"] is not None for t in s["tables"])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.usefixtures("young_gc")
def test_gpu_checkpoint_resume_and_a_budget_several_times_smaller_than_the_tables(tmp_path):
    common = TINY + ["--device", "gpu", "--optimizer", "adagrad"]
    straight = train.main(common + ["--num-batches", "12"])
    ck = str(tmp_path / "ck.npz")
    first = train.main(common + ["--num-batches", "6", "--save", ck])
    resumed = train.main(common + ["--num-batches", "12", "--load", ck, "--report", str(tmp_path / "r.json"),
                                   "--plot", str(tmp_path / "p")])
    np.testing.assert_allclose([v for _, v in first["losses"]], [v for _, v in straight["losses"][:6]], rtol=1e-6)
    assert resumed["start_step"] == 6
    np.testing.assert_allclose([v for _, v in resumed["losses"]], [v for _, v in straight["losses"][6:]],
                               rtol=1e-6, atol=1e-7)
    assert (tmp_path / "p_loss.png").stat().st_size > 1000 and (tmp_path / "r.json").stat().st_size > 100
    # tables four times the budget train under a cached policy
    big = ["--arch-embedding-size", "100000-50000", "--arch-sparse-feature-size", "16", "--arch-mlp-bot", "6-16"]
    small = train.main(TINY + big + ["--device", "gpu", "--policy", "dynamic", "--fast-budget", "25%",
                                     "--cache-fraction", "0.05", "--num-batches", "12"])
    assert small["summary"]["capacity"]["GPU"] == 150000 * 16 * 4 // 4
    assert small["summary"]["peak_memory"]["GPU"] <= 150000 * 16 * 4 // 4
    lru = train.main(TINY + big + ["--device", "gpu", "--policy", "lru", "--fast-budget", "25%",
                                   "--cache-fraction", "0.05", "--num-batches", "12"])
    assert lru["summary"]["peak_memory"]["GPU"] <= 150000 * 16 * 4 // 4
    np.testing.assert_allclose([v for _, v in lru["losses"]], [v for _, v in small["losses"]], rtol=1e-5)
    # cached tables resume with their Adagrad state (the accumulator the cache really uses)
    for policy in ("dynamic", "lru"):
        cached = common + ["--policy", policy, "--cache-fraction", "0.2"]
        ck2 = str(tmp_path / f"{policy}.npz")
        whole = train.main(cached + ["--num-batches", "12"])
        train.main(cached + ["--num-batches", "6", "--save", ck2])
        again = train.main(cached + ["--num-batches", "12", "--load", ck2])
        np.testing.assert_allclose([v for _, v in again["losses"]], [v for _, v in whole["losses"][6:]],
                                   rtol=1e-6, atol=1e-7, err_msg=policy)



@pytest.mark.parametrize("policy", ["dynamic", "lru", "lfu"])
def test_cache_fraction_for_a_budget_is_the_inverse_of_hbm_need(policy):
    sizes, F = [400_000, 200_000], 64
    budget = gpu.SLACK + 10_000_000
    f = gpu.cache_fraction_for(budget, policy, sizes, F)
    rows = [int(f * n) for n in sizes]
    assert gpu.hbm_need(policy, sizes, F, rows) <= budget - gpu.SLACK
    assert gpu.hbm_need(policy, sizes, F, [r + 100 for r in rows]) > budget - gpu.SLACK
    assert gpu.cache_fraction_for(gpu.SLACK, "static", sizes, F) == 0.0
    if policy == "lfu":  # its counts of use take room from the rows
        assert f < gpu.cache_fraction_for(budget, "lru", sizes, F)


def test_the_per_table_path_prefetches_the_next_batch_while_the_dense_work_runs(monkeypatch):
    """The GPU trainer's logic for cached tables, run on the CPU: tables the ensemble does not
    take get one lookup and one update each (same losses as the ensemble), and every step hands
    the next batch's flat indices to ``prefetch`` after the dense step was dispatched; tables
    that prefetch in the background (``lru``) get theirs started before the lookup."""
    import dlrm.model as M
    from dlrm import DLRM, DLRMConfig
    from dlrm.data import SyntheticData
    from embeddings import SimpleEmbedding

    sizes, F = [50, 200, 30, 1000], 4  # TINY's shapes: the kernels' compiled variants are shared
    cfg = DLRMConfig(sizes, F, (6, 16, F), (16, 1))
    data = SyntheticData(sizes, 6, 64, num_indices=3, seed=1)
    batches = [data.batch(i) for i in range(4)]

    def tables():
        rng = np.random.default_rng(0)
        return [SimpleEmbedding(rng.random((n, F), dtype=np.float32) - 0.5, name=f"t{i}") for i, n in enumerate(sizes)]

    plain = DLRM(cfg, tables(), lr=0.1)
    expected = [plain.train_step(b).loss for b in batches]

    events = []
    monkeypatch.setattr(gpu, "prefetch", lambda t, idx: events.append((t.name, idx)))
    started = object()  # what a background prefetch hands back, joined before the next step's lookup
    monkeypatch.setattr(gpu.prefetcher, "start", lambda ts, idx, fallback: events.append(
        ("background", [t.name for t in ts], idx)) or started)
    monkeypatch.setattr(gpu.prefetcher, "finish", lambda p: events.append("finish" if p is started else ("finish", p)))
    monkeypatch.setattr(M, "table_on_gpu", lambda t: False)  # host tables: per-table calls
    monkeypatch.setattr(M, "is_cached", lambda t: True)  # that prefetch as cached ones do
    monkeypatch.setattr(M.jax, "device_put", lambda x: x)
    ts = tables()
    for t in ts[1::2]:
        t.prefetch_works = None  # t1 and t3 prefetch in the background, as lru tables do
    cached = DLRM(cfg, ts, lr=0.1, device="gpu")
    cached._hold = lambda value: None  # host tables: no kernel reads the gradient later
    assert cached._per_table and not cached.ensembles
    grad, lookup = cached._grad, cached.lookup
    cached._grad = lambda *a: (events.append("dense"), grad(*a))[1]
    cached.lookup = lambda b: (events.append("lookup"), lookup(b))[1]
    pullback = cached._pullback
    cached._pullback = lambda *a: (events.append("update"), pullback(*a))[1]
    got = []
    for j, b in enumerate(batches):
        events.clear()
        nxt = batches[j + 1] if j + 1 < len(batches) else None
        got.append(cached.train_step(b, nxt).loss)
        joined = ["finish"] if j else []  # the previous step's background prefetch, before this lookup
        if nxt is None:
            assert events == joined + ["lookup", "dense", "update"]
        else:
            assert [e if isinstance(e, str) else e[:2] if e[0] == "background" else e[0] for e in events] == \
                [("background", ["t1", "t3"])] + joined + ["lookup", "dense", "t0", "t2", "update"]
            for idx, t in zip(events[0][2], (1, 3)):
                np.testing.assert_array_equal(idx, nxt.bags(t)[0])
            for (name, idx), t in zip(events[3 + len(joined):], (0, 2)):
                np.testing.assert_array_equal(idx, nxt.bags(t)[0])
    assert cached._pending is None  # the last step prefetched nothing and joined the one before
    # Where JAX runs on a GPU, the two models' separately compiled dense steps differ slightly
    # (TF32 matmuls, per-executable GEMM choices): measured 3.1e-5 relative on the H100.
    np.testing.assert_allclose(got, expected, rtol=1e-4)


@pytest.mark.gpu
@requires_gpu
def test_with_every_table_in_hbm_a_step_uploads_its_indices_once_and_bad_ones_raise_the_host_error(monkeypatch):
    """Tables in HBM take a step's indices as device copies made by the lookup and reused by the
    update: one upload per table and step, the CPU model's losses, and a bad index refused with
    the host path's error (table, position, value) before any table changes."""
    import dataclasses
    import cupy as cp
    from dlrm import DLRM, DLRMConfig
    from dlrm.data import SyntheticData
    from embeddings import SimpleEmbedding

    sizes, F = [50, 200, 30, 1000], 4  # TINY's shapes: the kernels' compiled variants are shared
    cfg = DLRMConfig(sizes, F, (6, 16, F), (16, 1))
    data = SyntheticData(sizes, 6, 64, num_indices=3, seed=1)
    batches = [data.batch(i) for i in range(4)]
    rng = np.random.default_rng(0)
    W = [rng.random((n, F), dtype=np.float32) - 0.5 for n in sizes]
    plain = DLRM(cfg, [SimpleEmbedding(w.copy(), name=f"t{i}") for i, w in enumerate(W)], lr=0.1)
    model = DLRM(cfg, [SimpleEmbedding(cp.asarray(w), name=f"t{i}") for i, w in enumerate(W)], lr=0.1, device="gpu")
    from embeddings.gpu.backend import CudaBackend
    uploads = []
    real, real_be = cp.asarray, CudaBackend.asarray
    monkeypatch.setattr(cp, "asarray", lambda a, *k, **kw: (uploads.append(id(a)), real(a, *k, **kw))[1])
    monkeypatch.setattr(CudaBackend, "asarray",  # host arrays go up through the backend's own blocks
                        lambda be, a, *k, **kw: (uploads.append(id(a)), real_be(be, a, *k, **kw))[1])
    for b in batches[:3]:
        uploads.clear()
        np.testing.assert_allclose(model.train_step(b).loss, plain.train_step(b).loss, rtol=1e-4)
        assert sorted(x for x in uploads if x in {id(i) for i in b.indices}) == sorted(id(i) for i in b.indices)
    bad = dataclasses.replace(batches[3], indices=[i.copy() for i in batches[3].indices])
    bad.indices[2][5, 1] = 30
    before = [t.data.get() for t in model.tables]
    with pytest.raises(IndexError, match=r"t2: index 30 at position \(5, 1\) is out of range for a table of 30 rows"):
        model.train_step(bad)
    assert all(np.array_equal(t.data.get(), w) for t, w in zip(model.tables, before))
    np.testing.assert_allclose(model.train_step(batches[3]).loss, plain.train_step(batches[3]).loss, rtol=1e-4)


@pytest.mark.gpu
@requires_gpu
def test_with_every_table_in_hbm_the_next_batchs_indices_go_up_a_step_ahead_and_a_bad_one_raises_at_its_own_step(
        monkeypatch):
    """Given the next batch, a step of tables in HBM uploads that batch's indices (checked and
    narrowed to int32 in one pass) beside itself, and the next step's lookup and update use them
    without uploading their own: the CPU model's losses all the way. A next batch with an index
    out of range is not uploaded ahead; its own step refuses it with the host path's error
    before any table changes, and training goes on."""
    import dataclasses
    import cupy as cp
    from dlrm import DLRM, DLRMConfig
    from dlrm.data import SyntheticData
    from embeddings import SimpleEmbedding
    from embeddings.gpu.backend import CudaBackend

    sizes, F = [50, 200, 30, 1000], 4
    cfg = DLRMConfig(sizes, F, (6, 16, F), (16, 1))
    data = SyntheticData(sizes, 6, 64, num_indices=3, seed=2)
    batches = [data.batch(i) for i in range(6)]
    bad = dataclasses.replace(batches[3], indices=[i.copy() for i in batches[3].indices])
    bad.indices[2][5, 1] = 30
    batches[3] = bad
    rng = np.random.default_rng(1)
    W = [rng.random((n, F), dtype=np.float32) - 0.5 for n in sizes]
    plain = DLRM(cfg, [SimpleEmbedding(w.copy(), name=f"t{i}") for i, w in enumerate(W)], lr=0.1)
    model = DLRM(cfg, [SimpleEmbedding(cp.asarray(w), name=f"t{i}") for i, w in enumerate(W)], lr=0.1, device="gpu")
    uploads = []
    real_be = CudaBackend.asarray
    monkeypatch.setattr(CudaBackend, "asarray",
                        lambda be, a, *k, **kw: (uploads.append(id(a)), real_be(be, a, *k, **kw))[1])
    for j in range(3):
        uploads.clear()
        nxt = batches[j + 1]
        np.testing.assert_allclose(model.train_step(batches[j], nxt).loss, plain.train_step(batches[j]).loss,
                                   rtol=1e-4)
        own = [x for x in uploads if x in {id(i) for i in batches[j].indices}]
        assert own == ([] if j else [id(i) for i in batches[j].indices])  # the first batch had no step before it
        ahead = [a for a in model._ahead if a[0] is nxt]
        assert (len(ahead) == 1) == (nxt is not bad)
        if ahead:
            assert all(v.dtype == np.int32 and v.shape == i.shape and np.array_equal(v.get(), i)
                       for v, i in zip(ahead[0][1], nxt.indices))
    before = [t.data.get() for t in model.tables]
    with pytest.raises(IndexError, match=r"t2: index 30 at position \(5, 1\) is out of range for a table of 30 rows"):
        model.train_step(bad, batches[4])
    assert all(np.array_equal(t.data.get(), w) for t, w in zip(model.tables, before))
    for j in (4, 5):
        np.testing.assert_allclose(model.train_step(batches[j], batches[j + 1] if j < 5 else None).loss,
                                   plain.train_step(batches[j]).loss, rtol=1e-4)


def test_the_model_refuses_an_unknown_device():
    from dlrm import DLRM, DLRMConfig
    from embeddings import SimpleEmbedding

    with pytest.raises(ValueError, match="device must be one of"):
        DLRM(DLRMConfig([3], 4, (2, 4), (1,)), [SimpleEmbedding(np.zeros((3, 4), np.float32))], device="tpu")
