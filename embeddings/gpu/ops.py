"""The GPU path's driver: validation, the update plan and kernel dispatch, over a backend.

Validation follows the CPU rules exactly and raises before anything is written. Host index
arrays (the usual case: batches come from the host) go through :func:`embeddings.batch.make_bags`
itself, then are uploaded. Device index arrays (CuPy, JAX) are checked on the device without
stopping the host: a lookup into a new output checks inside its kernel, other calls run one
check kernel; each sets flags in mapped host memory (:class:`Pending`) that the driver reads
after its next synchronisation (a lookup's end, an update's plan), before the caller's output or
the table is written. On a flag the host copies go through ``make_bags`` for the CPU's exception
and message (table, position, value). A lookup of a host batch does not synchronise at all.

An update sorts the batch positions by row (stable, so a row's entries stay in batch order),
finds the long rows (their count stays on the device, read there by the kernels), and runs fused
accumulate-and-apply kernels: no table gradient is materialised, duplicates accumulate in a fixed
order (long rows in chunks, :mod:`.cuda`), deterministically. ``SGD(deterministic=False)`` has
no plan: after the checks, one kernel adds each row's sums over tiles of the batch atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np

from ..batch import Bags, make_bags
from ..optim import SGD, RowwiseAdagrad
from . import reference
from .backend import Plan


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


class Pending:
    """The checks of one batch in flight: flags ``slot``, ``slot + 1``, ``slot + 2`` (index,
    offsets, gradient) and how to raise the CPU's error for each from host copies."""

    def __init__(self, flags: Any, slot: int, explain_batch: Callable[[], None] | None,
                 explain_grad: Callable[[], None] | None) -> None:
        self.flags, self.slot, self.explain_batch, self.explain_grad = flags, slot, explain_batch, explain_grad

    def raise_if_bad(self) -> None:
        """Raise the CPU's error if a check failed (the flags must be final: after a sync)."""
        f, s = self.flags, self.slot
        if (f[s] or f[s + 1]) and self.explain_batch is not None:
            self.explain_batch()
            raise AssertionError("make_bags accepted a batch the device checks refused")  # pragma: no cover
        if f[s + 2] and self.explain_grad is not None:
            self.explain_grad()
            raise AssertionError("the device saw a non-finite gradient the host copy lacks")  # pragma: no cover


def confirm(be, pending: list[Pending | None]) -> None:
    """Wait for the checks in flight and raise the first failure, in batch order."""
    if any(p is not None for p in pending):
        be.sync()
        for p in pending:
            if p is not None:
                p.raise_if_bad()


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
                mode: str | None = None, grad_fn: Callable[[int], Any] | None = None, *, flags: Any,
                slot: int = 0, fused: bool = False) -> tuple[DeviceBags, Any, Pending | None]:
    """Put a batch on the device, validated (host batches) or with its checks in flight in
    ``flags[slot:slot + 3]`` (device batches; ``fused``: the lookup kernel will check the indices
    and offsets, so no check kernel runs for them). ``grad_fn(nout)``, when given, returns the
    shape-checked device gradient, whose finiteness is checked in flight too.
    Returns the bags, the gradient (or None) and the checks to confirm (None: nothing pending).

    Errors come in the CPU order (indices, gradient shape, finiteness), except that device
    indices with both a bad value and a bad gradient shape report the shape."""
    if not be.is_device(indices):
        bags = make_bags(name, nvectors, indices, offsets, weights, mode)
        grad = grad_fn(bags.nout) if grad_fn is not None else None
        pending = None
        if grad is not None:
            pending = check_finite(be, name, grad, flags, slot)
        return upload_bags(be, bags, offsets is not None), grad, pending
    idx = be.asarray(indices)
    off = None if offsets is None else be.asarray(offsets)
    w = None if weights is None else be.asarray(weights)

    def explain() -> None:
        make_bags(name, nvectors, _host(be, idx), _host(be, off), _host(be, w), mode)

    if not _structure_ok(idx, off, w, mode):
        explain()
        raise AssertionError("make_bags accepted a batch the device checks refused")  # pragma: no cover
    if idx.dtype != np.int32 and idx.dtype != np.int64:
        idx = idx.astype(np.int64)
    shape = tuple(idx.shape)
    flat = idx.reshape(-1) if idx.flags.c_contiguous else be.xp.ascontiguousarray(idx).reshape(-1)
    if off is not None:
        off = be.xp.ascontiguousarray(off.astype(np.int64, copy=False))
        k = 0
    elif len(shape) == 2:
        k = shape[1]
    else:
        k = 1
    nout = flat.size if (off is None and len(shape) == 1) else (off.size - 1 if off is not None else shape[0])
    grad = grad_fn(nout) if grad_fn is not None else None
    if not fused or grad is not None:
        be.check(flags, slot, None if fused else flat, nvectors, None if fused else off, grad)
    pending = Pending(flags, slot, explain, None if grad is None else _grad_error(be, name, grad))
    if w is not None:
        w = be.xp.ascontiguousarray(w.astype(np.float32, copy=False)).reshape(-1)
    return DeviceBags(flat, off, k, w, mode == "mean", nout), grad, pending


def upload_bags(be, bags: Bags, csr: bool, idx: Any = None) -> DeviceBags:
    """A host-validated batch on the device; ``csr``: the caller gave offsets (else 2-d
    ``(batch, k)`` indices are fixed-width bags with no offsets to upload); ``idx``: other flat
    indices to upload in place of ``bags.indices`` (a cached table's slots)."""
    if bags.offsets is None:
        off, k = None, 1
    elif not csr:
        off, k = None, bags.shape[1]
    else:
        off, k = be.asarray(bags.offsets), 0
    w = be.asarray(bags.weights) if bags.weights.size else None
    flat = bags.indices if idx is None else idx
    return DeviceBags(be.asarray(flat), off, k, w, bags.mean, bags.nout)


def check_finite(be, name: str, grad: Any, flags: Any, slot: int = 0) -> Pending:
    """Check a device gradient's finiteness in flight into ``flags[slot + 2]``."""
    be.check(flags, slot, None, 0, None, grad)
    return Pending(flags, slot, None, _grad_error(be, name, grad))


def _grad_error(be, name: str, grad: Any) -> Callable[[], None]:
    """Raises the CPU's error for the first non-finite row of ``grad`` (read from a host copy)."""
    def explain() -> None:
        host = be.to_host(grad)
        bad = np.flatnonzero(~np.isfinite(host).all(axis=1))
        if bad.size:
            raise nonfinite_error(name, int(bad[0]))
    return explain


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


def run_pooled(be, out: Any, W: Any, bags: DeviceBags, flags: Any = None, slot: int = 0) -> None:
    """The lookup kernel into ``out`` (rows of contiguous floats; else through a temporary).
    ``flags``: the batch is unchecked; the kernel checks it into ``flags[slot]``."""
    if bags.nout == 0 or out.shape[1] == 0:
        if flags is not None:  # no kernel reads the batch: check it on its own
            be.check(flags, slot, bags.idx, W.shape[0], bags.off, None)
        return
    if out.strides[1] != 4:
        tmp = be.xp.empty(out.shape, np.float32)
        run_pooled(be, tmp, W, bags, flags, slot)
        out[...] = tmp
        return
    be.pooled(out, W, bags.idx, bags.off, bags.k, bags.w, bags.mean, flags, slot)


def lookup(be, name: str, W: Any, indices: Any, offsets: Any = None, *, mode: str | None = None,
           weights: Any = None, out: Any = None, wrap: Callable[[Any, bool], Any] | None = None) -> Any:
    """Lookup (non-reducing or pooled, as :func:`embeddings.lookup`) from device table ``W``;
    into ``out`` when given (a device batch is confirmed first), else a new device array (the
    kernel checks a device batch as it reads it; confirmed before returning).

    ``wrap(out, ordered)`` makes what a new output is returned as (the tables' JAX array):
    while the kernel runs where the call waits for it to confirm the checks (``ordered``
    False: nothing after needs ordering on the device), else after the launch."""
    check_table(name, W)
    flags = be.flags(3)
    fresh = out is None
    bags, _, pending = device_bags(be, name, W.shape[0], indices, offsets, weights, mode, flags=flags, fused=fresh)
    shape = (bags.nout, W.shape[1])
    if not fresh:
        check_out(be, out, shape, name)
        confirm(be, [pending])
        run_pooled(be, out, W, bags)
        return out
    out = be.xp.empty(shape, np.float32)
    run_pooled(be, out, W, bags, None if pending is None else flags)
    return handed(be, out, [pending], wrap)


def handed(be, out: Any, pending: list[Pending | None], wrap: Callable[[Any, bool], Any] | None) -> Any:
    """A new lookup output whose kernels are queued, once its checks are confirmed, as
    ``wrap(out, ordered)`` makes it (:func:`lookup`). Host batches were validated before: nothing
    waits for the kernels, so the result is ordered after them on the device."""
    if wrap is None:
        confirm(be, pending)
        return out
    if all(p is None for p in pending):
        return wrap(out, True)
    res = wrap(out, False)
    confirm(be, pending)
    return res


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
    if isinstance(optimizer, SGD) and not isinstance(optimizer.deterministic, bool):
        raise TypeError(f"SGD's deterministic must be True or False, got {optimizer.deterministic!r}")


def nonfinite_error(name: str, row: int) -> FloatingPointError:
    """The CPU path's error for a NaN or inf in output-gradient row ``row``."""
    return FloatingPointError(f"{name}: non-finite gradient in output row {row}; update refused, table unchanged")


@dataclass(frozen=True)
class PreparedUpdate:
    """An update whose host-side checks passed: its bags and gradient on the device, and the
    device-side checks still in flight (confirmed before the table is written)."""

    bags: DeviceBags
    grad: Any
    pending: Pending | None


def prepare_pullback(be, name: str, nvectors: int, F: int, grad: Any, indices: Any, offsets: Any = None, *,
                     mode: str | None = None, weights: Any = None, optimizer: Any, flags: Any = None,
                     slot: int = 0) -> PreparedUpdate:
    """Every check of :func:`embeddings.pullback`, in its order: the host's now, the device's in
    flight in ``flags[slot:slot + 3]`` (new flags when None)."""
    check_optimizer(optimizer)
    flags = be.flags(3) if flags is None else flags
    bags, g, pending = device_bags(be, name, nvectors, indices, offsets, weights, mode,
                                   grad_fn=lambda nout: check_grad(be, name, grad, nout, F), flags=flags, slot=slot)
    return PreparedUpdate(bags, g, pending)


def plans(be, idxs: list, F: int | None = None) -> list[Plan]:
    """The update plan of each batch's flat indices (:class:`~.backend.Plan`): a stable argsort
    (one sort for all the batches), the sorted rows, and the long rows, queued without waiting
    for the GPU when the update's rows of ``F`` floats allow it (:meth:`~.backend.CudaBackend.long_rows`;
    else one wait for all the batches)."""
    perms = be.argsorts(idxs)
    srows = [be.sorted_rows(idx, perm) for idx, perm in zip(idxs, perms)]
    runs = be.long_rows(srows, reference.CHUNK, F)
    return [Plan(perm, srow, *r) for perm, srow, r in zip(perms, srows, runs)]


def plan(be, idx: Any, F: int | None = None) -> Plan:
    """:func:`plans` of one batch."""
    return plans(be, [idx], F)[0]


def writes(prep: PreparedUpdate, F: int) -> bool:
    """Whether a prepared update writes anything (an empty batch or table does not)."""
    return bool(prep.bags.idx.size) and F > 0


def planned(optimizer: Any) -> bool:
    """Whether the optimizer's update runs by a plan (all but ``SGD(deterministic=False)``)."""
    return not (isinstance(optimizer, SGD) and not optimizer.deterministic)


def needs_plan(prep: PreparedUpdate, F: int, optimizer: Any) -> bool:
    """Whether a prepared update has a plan to make: it writes, and by a plan."""
    return writes(prep, F) and planned(optimizer)


def apply_pullback(be, W: Any, state: Any, prep: PreparedUpdate, optimizer: Any, p: Plan | None = None) -> None:
    """Plan (unless the plan ``p`` is given, or the optimizer needs none), confirm the checks, and
    run the fused update of a prepared batch on table ``W`` (row-wise Adagrad: ``state``)."""
    bags = prep.bags
    if p is None and needs_plan(prep, W.shape[1], optimizer):
        p = plan(be, bags.idx, W.shape[1])
    confirm(be, [prep.pending])
    if not writes(prep, W.shape[1]):
        return
    if planned(optimizer):
        be.update(W, state, prep.grad, p, bags.off, bags.nout, max(bags.k, 1), bags.w, bags.mean,
                  optimizer.code, float(optimizer.lr), float(optimizer.eps))
    else:
        be.sgd_any(W, prep.grad, bags.idx, bags.off, bags.nout, max(bags.k, 1), bags.w, bags.mean,
                   float(optimizer.lr))


def pullback(be, name: str, W: Any, state: Any, grad: Any, indices: Any, offsets: Any = None, *,
             mode: str | None = None, weights: Any = None, optimizer: Any) -> None:
    """:func:`embeddings.pullback` on device table ``W`` in place (``state``: the Adagrad accumulator)."""
    check_table(name, W)
    prep = prepare_pullback(be, name, W.shape[0], W.shape[1], grad, indices, offsets, mode=mode, weights=weights,
                            optimizer=optimizer)
    apply_pullback(be, W, state, prep, optimizer)
