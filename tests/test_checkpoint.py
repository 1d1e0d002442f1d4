"""Checkpoint files: atomic writes, one clear error for every way a file is not a checkpoint, intervals."""

import os
import pickle

import numpy as np
import pytest

import cachedarrays.checkpoint as C
from cachedarrays.checkpoint import CheckpointError, Interval, check_writable, open_npz, save_npz


def test_round_trip_and_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.npz")
    save_npz(path, {"w": np.arange(10.0)}, {"step": 1})
    before = open(path, "rb").read()

    def dies_mid_write(f, **arrays):               # half an archive, then the "crash"
        f.write(b"PK\x03\x04" + b"\0" * 1000)
        raise KeyboardInterrupt
    monkeypatch.setattr(C.np, "savez", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        save_npz(path, {"w": np.zeros(10)}, {"step": 2})
    monkeypatch.undo()
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["ck.npz"]  # no temporary left
    with open_npz(path) as ck:
        assert ck.meta == {"step": 1} and ck.names == ["w"] and ck["w"].tolist() == list(range(10))
    with pytest.raises(ValueError, match="reserved"):
        save_npz(path, {"meta": np.zeros(1)}, {})


def test_every_kind_of_bad_file_is_one_clear_error_naming_it(tmp_path):
    good = str(tmp_path / "good.npz")
    save_npz(good, {"w": np.arange(100_000.0)}, {"step": 3})
    data = open(good, "rb").read()
    cases = {
        "truncated.npz": (data[:len(data) // 2], r"truncated.npz is not a checkpoint .*not a complete \.npz archive: truncated"),
        "tail-cut.npz": (data[:-10], "not a complete .npz archive"),
        "pickle.pkl": (pickle.dumps({"w": 1}), "is a Python pickle"),
        "text.txt": (b"hello world", r"not a zip archive \(it starts with b'hello "),
        "empty.npz": (b"", "it is empty"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=message):
            with open_npz(str(tmp_path / name)):
                pass
    np.save(tmp_path / "one.npy", np.arange(3))
    np.savez(tmp_path / "nometa.npz", a=np.arange(3))
    np.savez(tmp_path / "objects.npz", meta=np.frombuffer(b"{}", np.uint8), w=np.array([{"x": 1}], dtype=object))
    flipped = bytearray(data)
    flipped[3000] ^= 0xFF
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"one.npy is not a checkpoint .*single numpy array"):
        open_npz(str(tmp_path / "one.npy")).__enter__()
    with pytest.raises(CheckpointError, match="nometa.npz is an .npz archive but not a checkpoint: it has no 'meta'"):
        open_npz(str(tmp_path / "nometa.npz")).__enter__()
    with open_npz(str(tmp_path / "objects.npz")) as ck:
        with pytest.raises(CheckpointError, match="objects.npz: its array 'w' cannot be read: it holds pickled Python objects"):
            ck["w"]
        with pytest.raises(CheckpointError, match="has no array 'v'"):
            ck["v"]
    with open_npz(str(tmp_path / "flipped.npz")) as ck:
        with pytest.raises(CheckpointError, match="flipped.npz: its array 'w' cannot be read: .*CRC"):
            ck["w"]
    with pytest.raises(CheckpointError, match="missing.npz does not exist"):
        open_npz(str(tmp_path / "missing.npz")).__enter__()


def test_check_writable_refuses_before_training(tmp_path):
    check_writable(str(tmp_path / "ok.npz"))
    with pytest.raises(CheckpointError, match="does not exist"):
        check_writable(str(tmp_path / "no" / "ck.npz"))
    with pytest.raises(CheckpointError, match="is a directory"):
        check_writable(str(tmp_path))


def test_interval_by_steps_and_by_minutes():
    now = [0.0]
    by_steps = Interval(steps=3, clock=lambda: now[0])
    assert by_steps.enabled and [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    by_time = Interval(minutes=0.5, clock=lambda: now[0])
    assert not by_time.due(1)
    now[0] = 31.0
    assert by_time.due(2)
    by_time.done()
    assert not by_time.due(3)
    assert not Interval().enabled and not Interval().due(5)
    with pytest.raises(ValueError, match="negative"):
        Interval(steps=-1)
