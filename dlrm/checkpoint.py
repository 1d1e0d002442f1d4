"""Checkpoints: dense weights, every table's rows, optimizer state and the step counter in one
``.npz`` file. Cached tables write their rows back (keeping them cached) before their base arrays are read."""

from __future__ import annotations

import json
import os

import numpy as np

from .model import DLRM
from .placement import read_table, write_table


def save(path: str, model: DLRM, step: int, extra: dict | None = None) -> str:
    """Write ``model`` at training step ``step`` (batches done) to ``path`` (atomically)."""
    arrays: dict[str, np.ndarray] = {}
    dense = model.dense_numpy()
    for part in ("bot", "top"):
        for i, (W, b) in enumerate(dense[part]):
            arrays[f"{part}_W{i}"] = W
            arrays[f"{part}_b{i}"] = b
    for i, t in enumerate(model.tables):
        arrays[f"table{i}"] = read_table(t)
        if model.optimizer == "adagrad":
            arrays[f"adagrad{i}"] = np.array(model.table_opt.state(t))
    meta = {"step": int(step), "lr": model.lr, "optimizer": model.optimizer,
            "table_sizes": list(model.config.table_sizes), "featuresize": model.config.featuresize,
            "bottom": list(model.config.bottom), "top": list(model.config.top),
            "interaction": model.config.interaction, "extra": extra or {}}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def read_meta(path: str) -> dict:
    with np.load(path) as z:
        return json.loads(bytes(z["meta"]).decode())


def load(path: str, model: DLRM) -> dict:
    """Restore ``model`` from ``path``; returns the checkpoint's metadata (``meta["step"]``)."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        c = model.config
        if (tuple(meta["table_sizes"]) != c.table_sizes or meta["featuresize"] != c.featuresize
                or tuple(meta["bottom"]) != c.bottom or tuple(meta["top"]) != c.top
                or meta["interaction"] != c.interaction):
            raise ValueError(f"checkpoint {path} is for a different architecture: {meta}")
        if meta["optimizer"] != model.optimizer:
            raise ValueError(f"checkpoint {path} used optimizer {meta['optimizer']}, this run {model.optimizer}")
        dense = {part: [(z[f"{part}_W{i}"], z[f"{part}_b{i}"]) for i in range(n)]
                 for part, n in (("bot", len(c.bottom) - 1), ("top", len(c.top)))}
        model.set_dense(dense)
        for i, t in enumerate(model.tables):
            write_table(t, z[f"table{i}"])
            if model.optimizer == "adagrad":
                model.table_opt.state(t)[...] = z[f"adagrad{i}"]
    return meta
