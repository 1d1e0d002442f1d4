"""The GPU path's driver: validation, the update plan and kernel dispatch, over a backend.

Validation follows the CPU rules exactly and runs before anything is written. Host index arrays
(the usual case: batches come from the host) go through :func:`embeddings.batch.make_bags`
itself, then are uploaded. Device index arrays (CuPy, JAX) are checked on the device, every check
in flight at once with one host sync (:meth:`~.backend.CudaBackend.validate`); on a failure the
host copies go through ``make_bags`` for the same exception and message (table, position, value).

An update sorts the keys ``row << pbits | position`` (unique, so any sort gives one order: a
row's entries in batch order, rows ascending), marks where rows start (one sync for their
count), and runs one fused accumulate-and-apply kernel over the unique rows: no table gradient
is materialised and duplicates accumulate in batch order, deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np

from ..batch import make_bags
from ..optim import SGD, RowwiseAdagrad


@dataclass(frozen=True)
class DeviceBags:
    """A validated batch on the device: bag ``b`` is ``idx[off[b]:off[b+1]]``, or
    ``idx[b*k:(b+1)*k]`` when ``off`` is None (non-reducing: ``k == 1``)."""

    idx: Any  # 1-d int32/int64
    off: Any | None  # 1-d int64 (nout + 1) or None
    k: int
    w: Any | None  # 1-d float32 or None
    mean: bool
    nout: int


def _host(be, x: Any) -> Any:
    return None if x is None else be.to_host(x)


def _structure_ok(idx, offsets, weights, mode) -> bool:
    """Whether a device batch passes make_bags' structural checks (else make_bags on host copies raises)."""
    if mode not in (None, "sum", "mean") or np.dtype(idx.dtype).kind not in "iu" or idx.ndim not in (1, 2):
        return False
    if offsets is not None:
        if idx.ndim != 1 or np.dtype(offsets.dtype).kind not in "iu" or offsets.ndim != 1 or offsets.size == 0:
            return False
    elif idx.ndim == 1 and (mode is not None or weights is not None):
        return False
    if weights is not None and (np.dtype(weights.dtype).kind != "f" or tuple(weights.shape) != tuple(idx.shape)):
        return False
    return True


def device_bags(be, name: str, nvectors: int, indices: Any, offsets: Any = None, weights: Any = None,
                mode: str | None = None, grad_fn: Callable[[int], Any] | None = None
                ) -> tuple[DeviceBags, Any, int]:
    """Validate a batch and put it on the device. ``grad_fn(nout)``, when given, returns the
    checked device gradient, whose finiteness is checked in the same sync as device indices.
    Returns the bags, the gradient (or None) and its first non-finite row (-1: none).

    Errors come in the CPU order (indices, gradient shape, finiteness), except that device
    indices with both a bad value and a bad gradient shape report the shape."""
    if not be.is_device(indices):
        bags = make_bags(name, nvectors, indices, offsets, weights, mode)
        grad = grad_fn(bags.nout) if grad_fn is not None else None
        if bags.offsets is None:
            off, k = None, 1
        elif offsets is None:  # (batch, k) indices: fixed-width bags, no offsets to upload
            off, k = None, bags.shape[1]
        else:
            off, k = be.asarray(bags.offsets), 0
        w = be.asarray(bags.weights) if bags.weights.size else None
        bad_row = be.validate(None, nvectors, None, grad)[2] if grad is not None else -1
        return DeviceBags(be.asarray(bags.indices), off, k, w, bags.mean, bags.nout), grad, bad_row
    idx = be.asarray(indices)
    off = None if offsets is None else be.asarray(offsets)
    w = None if weights is None else be.asarray(weights)
    if not _structure_ok(idx, off, w, mode):
        make_bags(name, nvectors, _host(be, idx), _host(be, off), _host(be, w), mode)
        raise AssertionError("make_bags accepted a batch the device checks refused")  # pragma: no cover
    if idx.dtype != np.int32 and idx.dtype != np.int64:
        idx = idx.astype(np.int64)
    shape = tuple(idx.shape)
    flat = be.xp.ascontiguousarray(idx).reshape(-1)
    if off is not None:
        off = be.xp.ascontiguousarray(off.astype(np.int64))
        k = 0
    elif len(shape) == 2:
        k = shape[1]
    else:
        k = 1
    nout = flat.size if (off is None and len(shape) == 1) else (off.size - 1 if off is not None else shape[0])
    grad = grad_fn(nout) if grad_fn is not None else None
    bad_i, bad_o, bad_row = be.validate(flat, nvectors, off, grad)
    ends_ok = off is None or (int(off[0]) == 0 and int(off[-1]) == flat.size)
    if bad_i >= 0 or bad_o >= 0 or not ends_ok:
        make_bags(name, nvectors, _host(be, idx), _host(be, off), _host(be, w), mode)
        raise AssertionError("make_bags accepted a batch the device checks refused")  # pragma: no cover
    if w is not None:
        w = be.xp.ascontiguousarray(w.astype(np.float32)).reshape(-1)
    return DeviceBags(flat, off, k, w, mode == "mean", nout), grad, bad_row


def check_table(name: str, W: Any) -> None:
    """The GPU kernels read float32 row-major tables."""
    if W.dtype != np.float32:
        raise TypeError(f"{name}: GPU tables must be float32, not {W.dtype}")
    if W.ndim != 2 or W.strides[1] != 4 or W.strides[0] != 4 * W.shape[1]:
        raise ValueError(f"{name}: a GPU table must be a row-major (C-contiguous) 2-d array")


def check_out(be, out: Any, shape: tuple[int, ...], name: str) -> None:
    """Refuse an output of the wrong kind, type or shape (before anything is written)."""
    if not isinstance(out, be.xp.ndarray):
        raise TypeError(f"{name}: the output of a GPU lookup must be a writable device array "
                        f"({be.xp.__name__}.ndarray), not {type(out).__name__}; JAX arrays are immutable")
    if out.dtype != np.float32:
        raise TypeError(f"{name}: output must be float32, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: output shape {tuple(out.shape)}, expected {shape}")


def run_pooled(be, out: Any, W: Any, bags: DeviceBags) -> None:
    """The lookup kernel into ``out`` (rows of contiguous floats; else through a temporary)."""
    if bags.nout == 0 or out.shape[1] == 0:
        return
    if out.strides[1] != 4:
        tmp = be.xp.empty(out.shape, np.float32)
        run_pooled(be, tmp, W, bags)
        out[...] = tmp
        return
    be.pooled(out, W, bags.idx, bags.off, bags.k, bags.w, bags.mean)


def lookup(be, name: str, W: Any, indices: Any, offsets: Any = None, *, mode: str | None = None,
           weights: Any = None, out: Any = None) -> Any:
    """Lookup (non-reducing or pooled, as :func:`embeddings.lookup`) from device table ``W``;
    into ``out`` when given, else a new device array."""
    check_table(name, W)
    bags, _, _ = device_bags(be, name, W.shape[0], indices, offsets, weights, mode)
    shape = (bags.nout, W.shape[1])
    if out is None:
        out = be.xp.empty(shape, np.float32)
    else:
        check_out(be, out, shape, name)
    run_pooled(be, out, W, bags)
    return out


def check_grad(be, name: str, grad: Any, nout: int, F: int) -> Any:
    """The output gradient on the device: float, shape (nout, F), float32 with contiguous rows."""
    g = be.asarray(grad)
    if np.dtype(g.dtype).kind != "f":
        raise TypeError(f"{name}: gradient must be floating point, got {g.dtype}")
    if tuple(g.shape) != (nout, F):
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)}, expected {(nout, F)}")
    if g.dtype != np.float32:
        g = g.astype(np.float32)
    if g.ndim == 2 and g.size and g.strides[1] != 4:
        g = be.xp.ascontiguousarray(g)
    return g


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, (SGD, RowwiseAdagrad)):
        raise TypeError(f"unsupported optimizer {optimizer!r}")
    if not np.isfinite(optimizer.lr):
        raise ValueError(f"learning rate must be finite, got {optimizer.lr}")


def nonfinite_error(name: str, row: int) -> FloatingPointError:
    """The CPU path's error for a NaN or inf in output-gradient row ``row``."""
    return FloatingPointError(f"{name}: non-finite gradient in output row {row}; update refused, table unchanged")


@dataclass(frozen=True)
class PreparedUpdate:
    """A validated update: its bags and gradient on the device."""

    bags: DeviceBags
    grad: Any


def prepare_pullback(be, name: str, nvectors: int, F: int, grad: Any, indices: Any, offsets: Any = None, *,
                     mode: str | None = None, weights: Any = None, optimizer: Any) -> PreparedUpdate:
    """Every check of :func:`embeddings.pullback`, in its order, before anything is written."""
    check_optimizer(optimizer)
    bags, g, bad_row = device_bags(be, name, nvectors, indices, offsets, weights, mode,
                                   grad_fn=lambda nout: check_grad(be, name, grad, nout, F))
    if bad_row >= 0:
        raise nonfinite_error(name, bad_row)
    return PreparedUpdate(bags, g)


def plan(be, idx: Any, nvectors: int) -> tuple[Any, int, Any, int]:
    """``(sorted keys, pbits, starts, U)``: keys ``row << pbits | position`` sorted, so the
    entries of unique row ``u`` are ``keys[starts[u]:starts[u+1]]`` in batch order."""
    L = int(idx.size)
    pbits = max(1, (L - 1).bit_length())
    if (max(nvectors, 1) - 1).bit_length() + pbits > 62:
        raise ValueError(f"a batch of {L} indices into {nvectors} rows is too large for one GPU update")
    keys = be.xp.sort(be.make_keys(idx, pbits))
    heads = be.row_heads(keys, pbits)
    first = be.xp.flatnonzero(heads)
    U = int(first.size)
    starts = be.xp.empty(U + 1, np.int64)
    starts[:U] = first
    starts[U:] = L
    return keys, pbits, starts, U


def apply_pullback(be, W: Any, state: Any, prep: PreparedUpdate, optimizer: Any) -> None:
    """Plan and run the fused update of a prepared batch on table ``W`` (row-wise Adagrad: ``state``)."""
    bags = prep.bags
    if bags.idx.size == 0 or W.shape[1] == 0:
        return
    keys, pbits, starts, U = plan(be, bags.idx, W.shape[0])
    B = bags.nout
    be.update(W, state, prep.grad, keys, pbits, starts, U, bags.off, B, max(bags.k, 1), bags.w, bags.mean,
              optimizer.code, float(optimizer.lr), float(optimizer.eps))


def pullback(be, name: str, W: Any, state: Any, grad: Any, indices: Any, offsets: Any = None, *,
             mode: str | None = None, weights: Any = None, optimizer: Any) -> None:
    """:func:`embeddings.pullback` on device table ``W`` in place (``state``: the Adagrad accumulator)."""
    check_table(name, W)
    prep = prepare_pullback(be, name, W.shape[0], W.shape[1], grad, indices, offsets, mode=mode, weights=weights,
                            optimizer=optimizer)
    apply_pullback(be, W, state, prep, optimizer)
