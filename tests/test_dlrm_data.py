"""DLRM data: Criteo format parsing and preprocessing (plain, gzip, malformed lines), the batch
loader, synthetic data with a learnable teacher, and ROC AUC against its pairwise definition."""

import gzip
import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from dlrm.data import CriteoDataset, Prefetcher, SyntheticData, preprocess, read_processed
from dlrm.data.criteo import NUM_DENSE, NUM_SPARSE
from dlrm.metrics import accuracy, bce, roc_auc


def make_rows(n, seed=0):
    """n random well-formed Criteo rows as (label, ints (None = missing), hex strings ('' = missing))."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        label = int(rng.random() < 0.3)
        ints = [None if rng.random() < 0.1 else int(rng.integers(-3, 1000)) for _ in range(NUM_DENSE)]
        cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 6)) * 0x1F3A5C7 % (1 << 32):08x}"
                for _ in range(NUM_SPARSE)]
        rows.append((label, ints, cats))
    return rows


def line(label, ints, cats):
    return "\t".join([str(label)] + ["" if v is None else str(v) for v in ints] + cats) + "\n"


BAD = {
    "fields": "1\t2\t3\n",
    "hex": line(0, [1] * NUM_DENSE, ["zz12"] + ["ab"] * (NUM_SPARSE - 1)),
    "long hex": line(0, [1] * NUM_DENSE, ["123456789"] + ["ab"] * (NUM_SPARSE - 1)),
    "int": line(1, ["12a"] + [1] * (NUM_DENSE - 1), ["ab"] * NUM_SPARSE),
    "label": line(2, [1] * NUM_DENSE, ["ab"] * NUM_SPARSE),
}


def write(path, text, gz=False):
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("gz", [False, True])
def test_preprocess_transforms_and_skips_malformed_lines_with_line_numbers(tmp_path, gz):
    rows = make_rows(40)
    lines = [line(*r) for r in rows]
    # malformed lines at (1-based) lines 3, 10, 11, 25, 41
    for pos, key in zip((2, 9, 10, 24, 40), BAD):
        lines.insert(pos, BAD[key])
    raw = write(tmp_path / ("day.gz" if gz else "day.txt"), "".join(lines), gz)
    rep = preprocess(raw, str(tmp_path / "day.bin"), max_ind_range=0)
    assert (rep.lines, rep.records, rep.malformed) == (45, 40, 5)
    assert [n for _, n, _ in rep.examples] == [3, 10, 11, 25, 41]
    reasons = " ".join(r for _, _, r in rep.examples)
    for word in ("fields", "hex", "integer", "label"):
        assert word in reasons
    assert "day" in rep.summary() and ":25:" in rep.summary()
    rec, meta = read_processed(str(tmp_path / "day.bin"))
    assert rec.shape == (40,) and meta["records"] == 40
    labels = np.array([r[0] for r in rows], np.float32)
    ints = np.array([[0 if v is None else max(v, 0) for v in r[1]] for r in rows], np.float64)
    np.testing.assert_array_equal(rec["label"], labels)
    np.testing.assert_allclose(rec["dense"], np.log1p(ints), rtol=1e-6)
    raw_cats = np.array([[int(c, 16) if c else 0 for c in r[2]] for r in rows], np.uint64)
    for j in range(NUM_SPARSE):
        ids = rec["sparse"][:, j]
        assert ids.min() >= 0 and ids.max() < meta["table_sizes"][j]
        assert meta["table_sizes"][j] == len(set(raw_cats[:, j]))
        for a, b in itertools.combinations(range(40), 2):  # same raw value <=> same id
            assert (raw_cats[a, j] == raw_cats[b, j]) == (ids[a] == ids[b])


def test_hashing_modulo_max_ind_range(tmp_path):
    rows = make_rows(30, seed=1)
    raw = write(tmp_path / "d.txt", "".join(line(*r) for r in rows))
    rep = preprocess(raw, str(tmp_path / "d.bin"), max_ind_range=97)
    assert rep.malformed == 0
    rec, meta = read_processed(str(tmp_path / "d.bin"))
    assert meta["table_sizes"] == [97] * NUM_SPARSE
    expect = np.array([[(int(c, 16) if c else 0) % 97 for c in r[2]] for r in rows])
    np.testing.assert_array_equal(rec["sparse"], expect)


def test_strict_mode_makes_a_malformed_line_fatal(tmp_path):
    rows = make_rows(5)
    raw = write(tmp_path / "d.txt", "".join(line(*r) for r in rows[:3]) + BAD["int"] + line(*rows[3]))
    with pytest.raises(ValueError, match=r"d.txt:4: malformed line: integer feature 1"):
        preprocess(raw, str(tmp_path / "d.bin"), strict=True)
    assert not (tmp_path / "d.bin").exists()


def test_read_processed_refuses_foreign_and_truncated_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"hello world" * 500)
    with pytest.raises(ValueError, match="not a preprocessed"):
        read_processed(str(tmp_path / "x.bin"))
    raw = write(tmp_path / "d.txt", "".join(line(*r) for r in make_rows(10)))
    preprocess(raw, str(tmp_path / "d.bin"))
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(4096 + 160 * 9 + 7)
    with pytest.raises(ValueError, match="truncated"):
        read_processed(str(tmp_path / "d.bin"))


def test_dataset_batches_split_and_wrap(tmp_path):
    rows = make_rows(100, seed=2)
    raw = write(tmp_path / "d.txt", "".join(line(*r) for r in rows))
    preprocess(raw, str(tmp_path / "d.bin"), max_ind_range=50)
    ds = CriteoDataset(str(tmp_path / "d.bin"), 16, test_fraction=0.2)
    assert ds.nbatches("train") == 5 and ds.nbatches("test") == 1
    b = ds.batch(1)
    assert b.dense.shape == (16, 13) and len(b.indices) == 26 and b.indices[0].shape == (16,)
    np.testing.assert_array_equal(b.labels, [r[0] for r in rows[16:32]])
    np.testing.assert_array_equal(ds.batch(6).labels, b.labels)  # epoch wrap
    np.testing.assert_array_equal(ds.batch(0, "test").labels, [r[0] for r in rows[80:96]])


def test_prefetcher_yields_in_order_and_forwards_errors():
    with Prefetcher(lambda i: i * i, 3, 9, depth=2) as p:
        assert list(p) == [(i, i * i) for i in range(3, 9)]

    def boom(i):
        if i == 2:
            raise KeyError("bad batch")
        return i

    with pytest.raises(KeyError, match="bad batch"):
        with Prefetcher(boom, 0, 5) as p:
            list(p)


def test_synthetic_batches_are_reproducible_and_shaped():
    d = SyntheticData((100, 1000, 10), 7, 64, num_indices=5, fixed=False, distribution="zipf", seed=3)
    a, b = d.batch(4), d.batch(4)
    np.testing.assert_array_equal(a.dense, b.dense)
    for x, y in zip(a.indices + a.offsets, b.indices + b.offsets):
        np.testing.assert_array_equal(x, y)
    counts = np.diff(a.offsets[0])
    assert counts.min() >= 1 and counts.max() <= 5 and a.indices[0].size == counts.sum()
    assert all(ix.max() < n for ix, n in zip(a.indices, (100, 1000, 10)))
    assert not np.array_equal(d.batch(4, "test").dense, a.dense)
    f = SyntheticData((100,), 7, 64, num_indices=3, fixed=True, seed=3).batch(0)
    assert f.indices[0].shape == (64, 3) and f.offsets is None
    z = SyntheticData((100_000,), 2, 20000, distribution="zipf", seed=0).batch(0).indices[0]
    top = np.bincount(z).max() / z.size
    assert top > 0.05  # Zipf(1) over 1e5 rows: the hottest row takes ~8% of the draws
    assert np.argmax(np.bincount(z)) != 0  # hot rows scattered by the LFSR permutation


def test_teacher_labels_are_learnable_signal_not_coin_flips():
    d = SyntheticData((1000, 500), 13, 4096, distribution="zipf", seed=0)
    b = d.batch(0)
    auc = roc_auc(d.teacher.logits(b), b.labels)  # the Bayes-optimal scorer
    assert auc > 0.8
    assert 0.2 < b.labels.mean() < 0.6


def brute_auc(s, y):
    pos = [a for a, l in zip(s, y) if l]
    neg = [a for a, l in zip(s, y) if not l]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=60))
def test_roc_auc_matches_pairwise_definition(pairs):
    s = np.array([p[0] for p in pairs], np.float64) / 3.0  # few distinct values: many ties
    y = np.array([p[1] for p in pairs])
    if y.all() or not y.any():
        assert np.isnan(roc_auc(s, y))
    else:
        assert roc_auc(s, y) == pytest.approx(brute_auc(s, y), abs=1e-12)


def test_metric_edge_cases():
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0
    assert roc_auc([0.9, 0.1], [0, 1]) == 0.0
    assert roc_auc([0.5] * 4, [0, 1, 0, 1]) == 0.5
    assert accuracy(np.array([-1.0, 2.0, 0.5]), np.array([0, 1, 0])) == pytest.approx(2 / 3)
    assert bce(np.array([0.0]), np.array([1.0])) == pytest.approx(np.log(2))
    assert bce(np.array([-800.0]), np.array([1.0])) == pytest.approx(800.0)  # stable, no inf
