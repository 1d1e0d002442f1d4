"""One DLRM training step against a pure-JAX reference with dense embedding matrices and jax.grad.

The reference below is written independently of ``dlrm.dense``: embeddings as dense ``(rows, F)``
matrices gathered and segment-summed, interaction by explicit (i, j) pairs, loss as
``-y log s - (1-y) log(1-s)``, updates applied by hand. Every placement policy is tested
(dram, simple, static, dynamic).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cachedarrays import DRAM, PM, LRUPolicy, Manager
from dlrm import DLRM, DLRMConfig, make_tables
from dlrm.data import SyntheticData
from dlrm.dense import init_dense
from dlrm.placement import POLICIES, read_table, table_devices

SIZES = (7, 13, 50, 4)
F = 4
LR = 0.5


def ref_step(params, tables, batch, interaction, lr, optimizer, eps=1e-8):
    """Reference: (loss, logits, new params, new tables) with jax.grad over everything."""
    B = len(batch)

    def forward(params, tables):
        h = batch.dense
        for W, b in params["bot"]:
            h = jax.nn.relu(h @ W + b)
        embs = []
        for t, M in enumerate(tables):
            idx, off = batch.bags(t)
            seg = np.repeat(np.arange(B), np.diff(off))
            embs.append(jax.ops.segment_sum(M[idx], seg, num_segments=B))
        if interaction == "dot":
            vecs = [h] + embs
            pairs = [jnp.sum(vecs[i] * vecs[j], axis=1) for i in range(len(vecs)) for j in range(i)]
            z = jnp.concatenate([h, jnp.stack(pairs, 1)], 1)
        else:
            z = jnp.concatenate([h] + embs, 1)
        n = len(params["top"])
        for k, (W, b) in enumerate(params["top"]):
            z = z @ W + b
            if k < n - 1:
                z = jax.nn.relu(z)
        logit = z[:, 0]
        s = jax.nn.sigmoid(logit)
        y = batch.labels
        return -jnp.mean(y * jnp.log(s) + (1 - y) * jnp.log(1 - s)), logit

    (loss, logit), (gp, gt) = jax.value_and_grad(forward, argnums=(0, 1), has_aux=True)(params, tables)
    new_params = jax.tree.map(lambda w, g: w - lr * g, params, gp)
    new_tables = []
    for M, G in zip(tables, gt):
        if optimizer == "sgd":
            new_tables.append(M - lr * G)
        else:
            state = jnp.mean(G * G, axis=1, keepdims=True)  # row-wise Adagrad from a zero accumulator
            new_tables.append(M - lr * G / (jnp.sqrt(state) + eps))
    return float(loss), np.asarray(logit), new_params, [np.asarray(M) for M in new_tables]


def make_manager(tmp_path):
    return Manager(DRAM("8MiB", bandwidth="ddr4"), PM(tmp_path, "8MiB", bandwidth="optane"), policy=LRUPolicy())


def batch_for(kind, seed=1):
    k, fixed = {"single": (1, True), "fixed": (3, True), "variable": (4, False)}[kind]
    return SyntheticData(SIZES, 5, 16, num_indices=k, fixed=fixed, distribution="zipf", seed=seed).batch(0)


CASES = [("single", "dot", "sgd"), ("fixed", "dot", "sgd"), ("variable", "dot", "sgd"),
         ("fixed", "cat", "sgd"), ("variable", "dot", "adagrad"), ("single", "cat", "adagrad")]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bags,interaction,optimizer", CASES)
def test_one_step_matches_pure_jax_reference(tmp_path, policy, bags, interaction, optimizer):
    cfg = DLRMConfig(SIZES, F, (5, 8, F), (6, 1), interaction)
    batch = batch_for(bags)
    assert batch.labels.min() == 0 and batch.labels.max() == 1
    with make_manager(tmp_path) as m:
        tables = make_tables(SIZES, F, policy, m, cache_fraction=0.3, seed=3)
        expected_dev = "DRAM" if policy == "dram" else "PM"
        assert set(table_devices(tables)) == {expected_dev}
        params0 = init_dense(cfg, seed=2)
        tables0 = [read_table(t) for t in tables]
        model = DLRM(cfg, tables, optimizer=optimizer, lr=LR, params=params0)
        r = model.train_step(batch)
        loss, logit, new_params, new_tables = ref_step(jax.tree.map(jnp.asarray, params0),
                                                       [jnp.asarray(M) for M in tables0], batch, interaction, LR,
                                                       optimizer)
        np.testing.assert_allclose(r.logits, logit, rtol=1e-5, atol=1e-5)
        assert abs(r.loss - loss) < 1e-5
        got = model.dense_numpy()
        for part in ("bot", "top"):
            for (W, b), (Wr, br) in zip(got[part], new_params[part]):
                np.testing.assert_allclose(W, np.asarray(Wr), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(b, np.asarray(br), rtol=1e-5, atol=1e-5)
        changed = 0
        for t, before, after in zip(tables, tables0, new_tables):
            now = read_table(t)
            np.testing.assert_allclose(now, after, rtol=1e-5, atol=1e-5)
            changed += int(np.any(now != before, axis=1).sum())
        assert changed > 0  # the step really updated rows
        m.check()


def test_every_policy_gives_the_same_losses_over_several_steps(tmp_path):
    cfg = DLRMConfig(SIZES, F, (5, 8, F), (6, 1))
    data = SyntheticData(SIZES, 5, 32, num_indices=2, distribution="zipf", seed=4)
    curves = {}
    for k, policy in enumerate(POLICIES):
        with make_manager(tmp_path / str(k)) as m:
            model = DLRM(cfg, make_tables(SIZES, F, policy, m, cache_fraction=0.3, seed=1), lr=0.3, seed=1)
            curves[policy] = [model.train_step(data.batch(i)).loss for i in range(6)]
    ref = curves["dram"]
    assert len(set(ref)) > 1
    for policy, c in curves.items():
        np.testing.assert_allclose(c, ref, rtol=1e-6, err_msg=policy)


def test_a_steps_result_is_read_when_asked_for_and_equals_a_result_read_at_once(tmp_path):
    """``train_step`` returns its loss and logits as the device left them; reading one converts
    it once (a float, a numpy array) and reading late gives what reading at once gives, however
    many steps ran in between."""
    from dlrm import StepResult
    cfg = DLRMConfig(SIZES, F, (5, 8, F), (6, 1))
    data = SyntheticData(SIZES, 5, 32, num_indices=2, distribution="zipf", seed=4)
    runs = []
    for k in range(2):
        with make_manager(tmp_path / str(k)) as m:
            model = DLRM(cfg, make_tables(SIZES, F, "dram", m, seed=1), lr=0.3, seed=1)
            rs = []
            for i in range(4):
                rs.append(model.train_step(data.batch(i)))
                if k == 0:
                    rs[-1].loss, rs[-1].logits
            assert k == 0 or not any(isinstance(r._loss, float) or isinstance(r._logits, np.ndarray) for r in rs)
            runs.append([(r.loss, r.logits) for r in rs])
    for (l0, p0), (l1, p1) in zip(*runs):
        assert type(l1) is float and l0 == l1 and isinstance(p1, np.ndarray) and np.array_equal(p0, p1)
    r = StepResult(jnp.float32(0.5), jnp.arange(3.0))
    assert r.loss == 0.5 and r.loss is r.loss and r.logits is r.logits and "loss=0.5" in repr(r)


def test_initialisation_follows_the_reference_dlrm(tmp_path):
    cfg = DLRMConfig((20000, 3), 16, (13, 512, 256, 16), (64, 1))
    p = init_dense(cfg, seed=0)
    W, b = p["bot"][0]
    assert W.shape == (13, 512) and b.shape == (512,)
    assert abs(W.std() - np.sqrt(2 / (13 + 512))) < 0.05 * np.sqrt(2 / (13 + 512))
    assert abs(b.std() - np.sqrt(1 / 512)) < 0.1 * np.sqrt(1 / 512)
    assert p["top"][0][0].shape == (16 + 3, 64)  # dot interaction: F + T(T+1)/2 with T = 2 tables
    with make_manager(tmp_path) as m:
        t = read_table(make_tables(cfg.table_sizes, 16, "dram", m, seed=0)[0])
        bound = np.sqrt(1 / 20000)
        assert t.min() >= -bound and t.max() <= bound
        assert abs(t.std() - bound / np.sqrt(3)) < 0.02 * bound


def test_config_checks():
    with pytest.raises(ValueError, match="feature size"):
        DLRMConfig((10,), 16, (13, 8), (4, 1))
    with pytest.raises(ValueError, match="end in 1"):
        DLRMConfig((10,), 8, (13, 8), (4, 2))
    with pytest.raises(ValueError, match="interaction"):
        DLRMConfig((10,), 8, (13, 8), (4, 1), "sum")
    assert DLRMConfig((10, 20, 30), 8, (13, 8), (4, 1), "cat").interaction_dim == 32


def test_unknown_policy_or_cache_fraction_is_refused(tmp_path):
    with make_manager(tmp_path) as m:
        with pytest.raises(ValueError, match="cache_fraction"):
            make_tables(SIZES, F, "static", m, cache_fraction=1.5)
        with pytest.raises(ValueError, match="policy"):
            make_tables(SIZES, F, "hbm", m)
        for policy in ("lru", "lfu"):
            with pytest.raises(ValueError, match=f"policy '{policy}' is the GPU cache"):
                make_tables(SIZES, F, policy, m)
        m.check()


def test_dram_policy_refuses_a_table_larger_than_dram(tmp_path):
    with make_manager(tmp_path) as m:
        with pytest.raises(MemoryError, match="fast-capacity"):
            make_tables((1 << 20,), 4, "dram", m)


@pytest.mark.parametrize("T,F_", [(1, 3), (4, 5), (9, 16)])
def test_dot_interaction_gradient_equals_autodiff_of_explicit_pairs(T, F_):
    """The hand-written backward of the dot interaction (pair gradients gathered into a symmetric
    matrix) against jax.grad of an independent pair-by-pair formulation."""
    from dlrm.dense import dot_interaction

    def explicit(h, emb):
        z = [h] + [emb[:, t] for t in range(T)]
        pairs = [jnp.sum(z[i] * z[j], axis=1) for i in range(T + 1) for j in range(i)]
        return jnp.concatenate([h, jnp.stack(pairs, axis=1)], axis=1)

    rng = np.random.default_rng(T)
    h = jnp.asarray(rng.standard_normal((5, F_), dtype=np.float32))
    emb = jnp.asarray(rng.standard_normal((5, T, F_), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((5, F_ + T * (T + 1) // 2), dtype=np.float32))
    np.testing.assert_allclose(dot_interaction(h, emb), explicit(h, emb), rtol=1e-5, atol=1e-5)
    ours = jax.grad(lambda h, e: jnp.sum(jnp.sin(dot_interaction(h, e)) * w), argnums=(0, 1))(h, emb)
    ref = jax.grad(lambda h, e: jnp.sum(jnp.sin(explicit(h, e)) * w), argnums=(0, 1))(h, emb)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("last_linear", [True, False])
def test_bf16_mlp_rounds_operands_and_keeps_float32_gradients(last_linear):
    """The bf16 MLP (hand-written transposed backward) against float64 numpy with the same
    operands rounded to bfloat16, and against float32 autodiff within bfloat16 accuracy."""
    from dlrm.dense import _mlp

    rng = np.random.default_rng(0)
    sizes = (40, 64, 48, 32)
    layers = [(jnp.asarray(rng.standard_normal((n, m), dtype=np.float32) * 0.2),
               jnp.asarray(rng.standard_normal(m, dtype=np.float32) * 0.1)) for n, m in zip(sizes[:-1], sizes[1:])]
    x = jnp.asarray(rng.standard_normal((64, sizes[0]), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((64, sizes[-1]), dtype=np.float32))
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    # forward and backward by hand in float64 with every matmul operand rounded to bf16
    hs, h = [np.asarray(x, np.float64)], np.asarray(x, np.float64)
    for i, (W, b) in enumerate(layers):
        h = bf(h) @ bf(W) + np.asarray(b, np.float64)
        if not (last_linear and i == len(layers) - 1):
            h = np.maximum(h, 0)
        hs.append(h)
    y = _mlp(layers, x, last_linear, "bf16")
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-4)
    D = np.asarray(w, np.float64)
    ref = []
    for i in range(len(layers) - 1, -1, -1):
        if not (last_linear and i == len(layers) - 1):
            D = D * (hs[i + 1] > 0)
        ref.append((bf(hs[i]).T @ bf(D), D.sum(0)))
        D = bf(D) @ bf(layers[i][0]).T
    ref = ref[::-1]
    grads, dx = jax.grad(lambda p, x: jnp.sum(_mlp(p, x, last_linear, "bf16") * w), argnums=(0, 1))(layers, x)
    for (gW, gb), (rW, rb) in zip(grads, ref):
        assert gW.dtype == jnp.float32
        np.testing.assert_allclose(gW, rW, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(gb, rb, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, D, rtol=1e-4, atol=1e-3)
    # (how close that is to float32 training is checked on a whole model below: rounded
    # pre-activations near zero flip ReLU masks, so single gradients can differ a lot)
    f32 = jax.grad(lambda p: jnp.sum(_mlp(p, x, last_linear, "f32") * w))(layers)
    assert any(not np.allclose(gW, fW, rtol=1e-6, atol=1e-6) for (gW, _), (fW, _) in zip(grads, f32))


def test_bf16_training_follows_float32_training(tmp_path):
    """Mixed precision changes rounding only: a few steps of a small model track float32."""
    cfg = DLRMConfig(SIZES, 32, (5, 64, 32), (64, 1))  # products of at least 32 in every dimension
    data = SyntheticData(SIZES, 5, 64, num_indices=2, fixed=True, seed=3)
    curves = {}
    for precision in ("f32", "bf16"):
        with make_manager(tmp_path / precision) as m:
            model = DLRM(cfg, make_tables(SIZES, 32, "dram", m, seed=0), lr=0.1, seed=0, precision=precision)
            curves[precision] = [model.train_step(data.batch(i)).loss for i in range(10)]
    np.testing.assert_allclose(curves["bf16"], curves["f32"], rtol=0.02, atol=0.01)
    assert curves["bf16"] != curves["f32"]


def test_unknown_dense_precision_is_refused():
    from dlrm.dense import make_grad_step

    with pytest.raises(ValueError, match="precision.*fp8"):
        make_grad_step("dot", "fp8")


def test_each_optimizer_name_gives_the_tables_that_optimizer(tmp_path):
    from embeddings import RowwiseAdagrad, SGD
    from dlrm.model import OPTIMIZERS
    cfg = DLRMConfig(SIZES, F, (5, 8, F), (6, 1))
    with make_manager(tmp_path) as m:
        tables = make_tables(SIZES, F, "dram", m, seed=1)
        got = {name: DLRM(cfg, tables, optimizer=name, lr=0.3).table_opt for name in OPTIMIZERS}
    assert got["sgd"] == SGD(0.3) and got["sgd"].deterministic
    assert got["sgd-any"] == SGD(0.3, deterministic=False)
    assert isinstance(got["adagrad"], RowwiseAdagrad) and got["adagrad"].lr == 0.3
