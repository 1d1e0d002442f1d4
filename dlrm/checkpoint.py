"""Saving and restoring a training run: to a checkpoint file, or as durable points of a persistent pool.

A checkpoint file (``--save`` / ``--load``) holds the dense weights, every table's rows, the
optimizer state and the step counter in one ``.npz`` file, written atomically (a temporary file
renamed over the old one), so a crash mid-write keeps the previous checkpoint.  Cached tables
write their rows back (keeping them cached) before their base arrays are read.

A persistent pool (``--pm-path POOL --resume-from-pool``) holds the tables themselves as named
objects (``dlrm/table/I``), with the dense weights (``dlrm/dense/...``) and the Adagrad state
(``dlrm/adagrad/I``) beside them and the step counter in the pool's attributes; a durable point
(`pool_save`) writes back only what changed, and resuming (`pool_tables`, `pool_load`) reads
nothing: the tables are used where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachedarrays import CachedArray, Manager, readable, writable
from cachedarrays.checkpoint import CheckpointError, open_npz, save_npz
from cachedarrays.pool import Pool, persistent

from .model import DLRM
from .placement import is_cached, read_table, write_table

__all__ = ["CheckpointError", "describe", "load", "pool_load", "pool_save", "pool_tables", "read_meta", "save"]


def describe(model: DLRM, step: int, extra: dict | None = None) -> dict:
    """The metadata that identifies a run's architecture and position (``step``: batches done)."""
    c = model.config
    return {"step": int(step), "lr": model.lr, "optimizer": model.optimizer,
            "table_sizes": list(c.table_sizes), "featuresize": c.featuresize, "bottom": list(c.bottom),
            "top": list(c.top), "interaction": c.interaction, "extra": extra or {}}


def check_compatible(meta: dict, model: DLRM, source: str) -> None:
    """Raise `CheckpointError` when ``meta`` (from ``source``) describes another architecture or optimizer."""
    c = model.config
    try:
        same = (tuple(meta["table_sizes"]) == c.table_sizes and meta["featuresize"] == c.featuresize
                and tuple(meta["bottom"]) == c.bottom and tuple(meta["top"]) == c.top
                and meta["interaction"] == c.interaction)
        optimizer = meta["optimizer"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{source} is not a DLRM checkpoint: its metadata lacks {e}") from None
    if not same:
        raise CheckpointError(f"{source} is for a different architecture: tables {meta['table_sizes']} x "
                              f"{meta['featuresize']}, bottom {meta['bottom']}, top {meta['top']}, "
                              f"{meta['interaction']} interaction")
    if _state(optimizer) != _state(model.optimizer):
        raise CheckpointError(f"{source} used optimizer {optimizer}, this run {model.optimizer}")


def _state(optimizer: str) -> str:
    """What an optimizer keeps between steps: both SGDs the same (nothing)."""
    return "sgd" if optimizer == "sgd-any" else optimizer


def _dense_arrays(model: DLRM) -> dict[str, np.ndarray]:
    dense = model.dense_numpy()
    return {f"{part}_{kind}{i}": a for part in ("bot", "top")
            for i, (W, b) in enumerate(dense[part]) for kind, a in (("W", W), ("b", b))}


def _set_dense(model: DLRM, get) -> None:
    c = model.config
    model.set_dense({part: [(get(f"{part}_W{i}"), get(f"{part}_b{i}")) for i in range(n)]
                     for part, n in (("bot", len(c.bottom) - 1), ("top", len(c.top)))})


# ------------------------------------------------------------------ checkpoint files
def save(path: str, model: DLRM, step: int, extra: dict | None = None) -> str:
    """Write ``model`` at training step ``step`` (batches done) to ``path`` (atomically)."""
    arrays = _dense_arrays(model)
    for i, t in enumerate(model.tables):
        arrays[f"table{i}"] = read_table(t)
        if model.optimizer == "adagrad":
            arrays[f"adagrad{i}"] = model.table_state(i)
    return save_npz(path, arrays, describe(model, step, extra))


def read_meta(path: str) -> dict:
    with open_npz(path) as ck:
        return ck.meta


def load(path: str, model: DLRM) -> dict:
    """Restore ``model`` from ``path``; returns the checkpoint's metadata (``meta["step"]``).

    Raises `CheckpointError` (naming the file and the problem) for a file that is not a checkpoint,
    is truncated or damaged, or is for another architecture or optimizer."""
    with open_npz(path) as ck:
        meta = ck.meta
        check_compatible(meta, model, f"checkpoint {path}")
        _set_dense(model, ck.__getitem__)
        for i, t in enumerate(model.tables):
            write_table(t, _expect(ck[f"table{i}"], (t.nvectors(), t.featuresize()), f"{path}: table{i}"))
            if model.optimizer == "adagrad":
                model.set_table_state(i, _expect(ck[f"adagrad{i}"], (t.nvectors(),), f"{path}: adagrad{i}"))
    return meta


def _expect(a: np.ndarray, shape: tuple, what: str) -> np.ndarray:
    if a.shape != shape:
        raise CheckpointError(f"{what} has shape {a.shape}, expected {shape}")
    return a


# ------------------------------------------------------------------ persistent pools
def table_name(i: int) -> str:
    return f"dlrm/table/{i}"


def pool_tables(manager: Manager, sizes: Sequence[int], featuresize: int) -> tuple[list[CachedArray], dict | None]:
    """The tables of the run kept in the manager's pool, and the metadata of its last durable point.

    A pool without a run gets new (uninitialised) tables and None.  Raises `CheckpointError` for a
    pool holding another architecture's tables (or objects that are not a DLRM run's).
    """
    pool = Pool.open(manager)
    meta = pool.attrs.get("dlrm")
    if meta is None and pool.names():
        raise CheckpointError(f"pool {pool.device.path} holds objects that are not a dlrm.train run "
                              f"({', '.join(pool.names()[:5])}); use another --pm-path")
    if meta is not None and (list(meta.get("table_sizes", ())) != list(sizes) or meta.get("featuresize") != featuresize):
        raise CheckpointError(f"pool {pool.device.path} is for a different architecture: tables "
                              f"{meta.get('table_sizes')} x {meta.get('featuresize')}")
    return [persistent(manager, table_name(i), shape=(int(n), int(featuresize)), dtype=np.float32)
            for i, n in enumerate(sizes)], meta


def pool_load(manager: Manager, model: DLRM, meta: dict) -> int:
    """Restore the dense weights and the optimizer state of the last durable point; returns its step."""
    pool = Pool.open(manager)
    check_compatible(meta, model, f"pool {pool.device.path}")

    def get(name: str) -> np.ndarray:
        with readable(pool.get(f"dlrm/dense/{name}")) as a:
            return np.array(a)
    _set_dense(model, get)
    if model.optimizer == "adagrad":
        for i in range(len(model.tables)):
            with readable(pool.get(f"dlrm/adagrad/{i}")) as a:
                model.set_table_state(i, a)
    return int(meta["step"])


def pool_save(manager: Manager, model: DLRM, step: int, extra: dict | None = None) -> int:
    """A durable point at ``step``: cached tables write back their rows, the dense weights and the
    optimizer state are copied beside the tables, then the pool persists what changed."""
    pool = Pool.open(manager)
    for t in model.tables:
        if is_cached(t):
            t.writeback()
    state = {f"dlrm/dense/{k}": v for k, v in _dense_arrays(model).items()}
    if model.optimizer == "adagrad":
        state.update({f"dlrm/adagrad/{i}": model.table_state(i) for i in range(len(model.tables))})
    for name, value in state.items():
        with writable(persistent(manager, name, shape=value.shape, dtype=np.float32)) as a:
            a[...] = value
    return pool.persist({"dlrm": describe(model, step, extra)})
