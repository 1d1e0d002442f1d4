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


def test_dram_policy_refuses_a_table_larger_than_dram(tmp_path):
    with make_manager(tmp_path) as m:
        with pytest.raises(MemoryError, match="fast-capacity"):
            make_tables((1 << 20,), 4, "dram", m)
