"""The training script end to end: learning on synthetic data, checkpoint and resume (from a file
or from a persistent pool, also after kill -9) with identical losses, checkpoint intervals and bad
checkpoint files, Criteo files (gzip, malformed lines) through preprocessing to training, the
report and plots, and the demo's fallback."""

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachedarrays.checkpoint import CheckpointError
from dlrm import train
from dlrm.placement import POLICIES

TINY = ["--arch-embedding-size", "50-200-30-1000", "--arch-sparse-feature-size", "4",
        "--arch-mlp-bot", "6-16-4", "--arch-mlp-top", "16-1", "--mini-batch-size", "64",
        "--print-freq", "5", "--test-num-batches", "4", "--no-progress", "--fast-capacity", "8MiB",
        "--slow-capacity", "8MiB"]


def run(tmp_path, *extra):
    return train.main(TINY + ["--pm-path", str(tmp_path)] + list(extra))


def test_training_learns_the_teacher_and_reports_everything(tmp_path, capsys):
    rep = run(tmp_path, "--num-batches", "150", "--learning-rate", "0.2", "--test-freq", "50",
              "--num-indices-per-lookup", "3", "--report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p"))
    assert rep["evals"][-1]["auc"] > 0.7  # the hidden teacher is learnable
    assert rep["evals"][-1]["loss"] < rep["evals"][0]["loss"] + 0.02
    assert [e["step"] for e in rep["evals"]] == [50, 100, 150]
    assert len(rep["losses"]) == 150
    out = capsys.readouterr()
    for phase in ("data loading", "lookup", "dense fwd+bwd", "embedding update", "dense update", "cache flush"):
        assert phase in out.out
    assert "bytes moved between devices" in out.out and "peak memory per device: DRAM" in out.out
    assert "step 150/150: loss" in out.out and "AUC" in out.out
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["summary"]["steps"] == 150 and on_disk["summary"]["samples_per_second"] > 0
    assert on_disk["summary"]["peak_memory"]["DRAM"] >= (50 + 200 + 30 + 1000) * 4 * 4  # dram policy
    assert (tmp_path / "p_loss.png").stat().st_size > 1000 and (tmp_path / "p_phases.png").stat().st_size > 1000


@pytest.mark.parametrize("policy,optimizer", [("dram", "adagrad"), ("simple", "sgd")]
                         + [(p, "sgd") for p in POLICIES if p in ("static", "dynamic")])
def test_resume_from_checkpoint_or_pool_continues_with_identical_losses(tmp_path, policy, optimizer, capsys):
    common = ["--policy", policy, "--optimizer", optimizer, "--num-indices-per-lookup", "4",
              "--num-indices-per-lookup-fixed", "False", "--test-freq", "0"]
    straight = run(tmp_path / "a", *common, "--num-batches", "12")
    ck = str(tmp_path / "ck.npz")
    first = run(tmp_path / "b", *common, "--num-batches", "6", "--save", ck)
    resumed = run(tmp_path / "c", *common, "--num-batches", "12", "--load", ck)
    assert resumed["start_step"] == 6
    assert first["losses"] == straight["losses"][:6]
    assert [s for s, _ in resumed["losses"]] == list(range(7, 13))
    assert resumed["losses"] == straight["losses"][6:]  # bit-identical continuation
    assert resumed["evals"][-1]["loss"] == straight["evals"][-1]["loss"]
    # the same from a persistent pool: the tables stay where they are, no file is read
    pool = ["--pm-path", str(tmp_path / "run.pool"), "--resume-from-pool"]
    first = train.main(TINY + pool + common + ["--num-batches", "6", "--checkpoint-every", "4"])
    capsys.readouterr()
    resumed = train.main(TINY + pool + common + ["--num-batches", "12"])
    assert "at durable point 2" in capsys.readouterr().err  # the interval's (step 4) and the end's
    assert first["losses"] == straight["losses"][:6]
    assert resumed["start_step"] == 6 and resumed["losses"] == straight["losses"][6:]
    assert resumed["evals"][-1]["loss"] == straight["evals"][-1]["loss"]


def test_sgd_any_trains_cpu_tables_as_sgd_and_shares_sgds_checkpoints(tmp_path):
    common = ["--num-indices-per-lookup", "4", "--test-freq", "0"]
    sgd = run(tmp_path / "a", *common, "--num-batches", "8")
    ck = str(tmp_path / "ck.npz")
    first = run(tmp_path / "b", *common, "--optimizer", "sgd-any", "--num-batches", "4", "--save", ck)
    assert first["losses"] == sgd["losses"][:4]  # CPU tables are deterministic whatever the order allowed
    resumed = run(tmp_path / "c", *common, "--num-batches", "8", "--load", ck)
    assert resumed["start_step"] == 4 and resumed["losses"] == sgd["losses"][4:]
    with pytest.raises(CheckpointError, match="used optimizer sgd-any, this run adagrad"):
        run(tmp_path / "d", *common, "--optimizer", "adagrad", "--num-batches", "8", "--load", ck)
    from dlrm.model import DLRM
    with pytest.raises(ValueError, match="optimizer must be one of 'sgd', 'sgd-any', 'adagrad', got 'adam'"):
        DLRM(None, [], optimizer="adam")


def test_kill_9_mid_training_resumes_from_the_last_durable_point(tmp_path, capsys):
    pool = str(tmp_path / "run.pool")
    args = TINY + ["--pm-path", pool, "--resume-from-pool", "--num-batches", "300", "--checkpoint-every", "3",
                   "--test-freq", "0", "--print-freq", "1000"]
    proc = subprocess.Popen([sys.executable, "-m", "dlrm.train"] + args, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        for line in proc.stderr:
            if line.startswith("durable point 2 "):
                break
        time.sleep(np.random.default_rng().uniform(0.0, 0.2))  # somewhere in the next steps or durable points
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9
    resumed = train.main(args)
    err = capsys.readouterr().err
    assert "ended without closing the pool" in err
    start = resumed["start_step"]
    assert start >= 6 and start % 3 == 0
    straight = run(tmp_path / "a", "--num-batches", "300", "--test-freq", "0", "--print-freq", "1000")
    assert resumed["losses"] == straight["losses"][start:]


def test_checkpoint_interval_writes_during_training(tmp_path, capsys):
    ck = str(tmp_path / "ck.npz")
    run(tmp_path, "--num-batches", "7", "--test-freq", "0", "--save", ck, "--checkpoint-every", "3")
    err = capsys.readouterr().err
    assert [f"(step {s})" in err for s in (3, 6, 7)] == [True] * 3
    assert train.checkpoint.read_meta(ck)["step"] == 7 and sorted(os.listdir(tmp_path))[0] == "ck.npz"


def test_bad_checkpoints_and_persistence_flags_are_clear_errors(tmp_path):
    truncated, foreign = tmp_path / "cut.npz", tmp_path / "notes.txt"
    ck = str(tmp_path / "ck.npz")
    run(tmp_path / "a", "--num-batches", "2", "--test-freq", "0", "--save", ck)
    truncated.write_bytes(Path(ck).read_bytes()[:3000])
    foreign.write_text("not a checkpoint")
    for path, message in ((truncated, "cut.npz is not a checkpoint .*truncated"), (foreign, "notes.txt is not a checkpoint")):
        with pytest.raises(CheckpointError, match=message):
            run(tmp_path / "b", "--num-batches", "3", "--load", str(path))
    cli = subprocess.run([sys.executable, "-m", "dlrm.train"] + TINY + ["--pm-path", str(tmp_path), "--num-batches", "3",
                         "--load", str(truncated)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith(f"error: {truncated} is not a checkpoint")
    pool = str(tmp_path / "p.pool")
    with pytest.raises(SystemExit, match="needs --pm-path to name a pool file"):
        run(tmp_path, "--num-batches", "2", "--resume-from-pool")
    with pytest.raises(SystemExit, match="--load and --resume-from-pool"):
        train.main(TINY + ["--pm-path", pool, "--resume-from-pool", "--load", ck])
    with pytest.raises(SystemExit, match="needs --save FILE or"):
        run(tmp_path, "--num-batches", "2", "--checkpoint-every", "2")
    with pytest.raises(CheckpointError, match="directory .* does not exist"):
        run(tmp_path, "--num-batches", "2", "--save", str(tmp_path / "no" / "ck.npz"))
    train.main(TINY + ["--pm-path", pool, "--resume-from-pool", "--num-batches", "2", "--test-freq", "0"])
    with pytest.raises(SystemExit, match="holding 12 objects of an earlier --resume-from-pool run"):
        train.main(TINY + ["--pm-path", pool, "--num-batches", "2"])
    with pytest.raises(CheckpointError, match="is for a different architecture"):
        train.main(TINY[:1] + ["50-200-30-999"] + TINY[2:] + ["--pm-path", pool, "--resume-from-pool",
                                                                 "--num-batches", "3"])


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    ck = str(tmp_path / "ck.npz")
    run(tmp_path / "a", "--num-batches", "2", "--save", ck)
    with pytest.raises(ValueError, match="different architecture"):
        train.main(TINY[:1] + ["50-200-30-999"] + TINY[2:] + ["--pm-path", str(tmp_path / "b"),
                                                                 "--num-batches", "3", "--load", ck])


def criteo_text(n, seed=0, bad_every=0):
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            lines.append("1\tnot-enough-fields\n")
            continue
        w = rng.standard_normal(13)
        ints = rng.integers(-2, 50, 13)
        cats = [f"{int(rng.integers(0, 40)) * 7919:08x}" for _ in range(26)]
        label = int(rng.random() < 1 / (1 + np.exp(-(ints[:3].sum() / 40.0 - 1 + 0.1 * w[0]))))
        fields = [str(label)] + ["" if rng.random() < 0.05 else str(v) for v in ints] + cats
        lines.append("\t".join(fields) + "\n")
    return "".join(lines)


def test_criteo_gzip_file_trains_end_to_end(tmp_path, capsys):
    raw = tmp_path / "day_0.gz"
    with gzip.open(raw, "wt") as f:
        f.write(criteo_text(700, bad_every=100))
    rep = train.main(["--data-generation", "dataset", "--raw-data-file", str(raw), "--processed-data-file",
                      str(tmp_path / "day_0.bin"), "--arch-sparse-feature-size", "4", "--arch-mlp-bot", "13-8-4",
                      "--arch-mlp-top", "8-1", "--mini-batch-size", "32", "--num-batches", "0", "--nepochs", "2",
                      "--test-num-batches", "2", "--test-freq", "0", "--no-progress", "--pm-path", str(tmp_path),
                      "--policy", "simple"])
    err = capsys.readouterr().err
    assert "7 malformed lines skipped" in err and "day_0.gz:100: expected 40 tab-separated fields" in err
    assert rep["config"]["table_sizes"] and len(rep["config"]["table_sizes"]) == 26
    assert max(rep["config"]["table_sizes"]) <= 40
    n_train = 693 - int(693 * 0.1)
    assert len(rep["losses"]) == 2 * (n_train // 32)
    assert np.isfinite(rep["evals"][-1]["loss"])
    with pytest.raises(ValueError, match="day_0.gz:100"):
        train.main(["--data-generation", "dataset", "--raw-data-file", str(raw), "--processed-data-file",
                    str(tmp_path / "strict.bin"), "--strict-data", "--no-progress"])


def test_bad_flags_exit_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, "--policy", "hbm", "--num-batches", "1")
    assert exit_info.value.code == 2 and "invalid choice: 'hbm'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="feature size"):
        train.main(["--arch-mlp-bot", "13-8-5", "--no-progress", "--num-batches", "1"])


def test_demo_runs_and_prints_the_summary(tmp_path, capsys):
    from dlrm import demo

    demo.main(["--arch-embedding-size", "100-200", "--num-batches", "5", "--mini-batch-size", "32",
               "--no-progress", "--test-freq", "0", "--pm-path", str(tmp_path)])
    out = capsys.readouterr().out
    assert "policy dynamic" in out and "hit rate" in out
    assert "embedding update" in out and "peak memory per device" in out


def test_static_policy_caches_the_rows_most_used_in_sample_batches(tmp_path):
    common = ["--policy", "static", "--num-batches", "20", "--test-freq", "0", "--cache-fraction", "0.1",
              "--index-distribution", "zipf"]
    sampled = run(tmp_path / "a", *common)
    random = run(tmp_path / "b", *common, "--static-sample-batches", "0")
    big = [t for t in sampled["summary"]["tables"] if t["rows"] == 1000][0]["hitrate"]
    big_random = [t for t in random["summary"]["tables"] if t["rows"] == 1000][0]["hitrate"]
    assert big > 0.4 and big_random < 0.25  # Zipf(1): the top 10% of rows take about half the lookups


def test_hot_rows_are_the_most_frequent_rows_of_the_sample():
    from dlrm.data.batch import Batch
    from dlrm.placement import hot_rows

    def batch(a, b):
        return Batch(np.zeros((len(a), 1), np.float32), [np.asarray(a), np.asarray(b).reshape(len(a), -1)],
                     np.zeros(len(a), np.float32))

    got = hot_rows([batch([3, 3, 1, 7], [5, 5, 5, 2, 2, 9, 9, 9]), batch([7, 3, 0, 0], [9] * 8)], 2, [2, 5])
    assert got[0].tolist() == [3, 0]  # 3 thrice, then 0 and 7 twice: ties go to the smaller row
    assert got[1].tolist() == [9, 5, 2]  # only three distinct rows
