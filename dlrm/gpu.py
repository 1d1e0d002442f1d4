"""The GPU side of ``python -m dlrm.train --device gpu``: the HBM budget, the manager and the
cached-table API.

Placement on a GPU (``--policy``): ``dram`` keeps every table in HBM (a ``SimpleEmbedding`` over a
CachedArray on the GPU level); ``simple``, ``static`` and ``dynamic`` keep the tables in host DRAM
and cache hot rows in HBM (the GPU ``CachedEmbeddings``; ``lru``/``lfu``: the set-associative
``LRUCachedEmbeddings`` run by the GPU itself), whose ``prefetch(cached, next_indices)`` brings
the next batch's missing rows in while the current batch computes. ``--fast-budget``
is the capacity of the manager's GPU level, so it caps the HBM the tables may use; what must be
in HBM (:func:`hbm_need`) is checked against it before any memory is touched.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from cachedarrays import parse_size
from embeddings.gpu import prefetcher
from embeddings.gpu.cached import STAGING_ROWS, STATE_BYTES, prefetch
from embeddings.gpu.lru import WAYS, slot_bytes

from .placement import GPU_POLICIES

SLACK = 64 << 20  # bytes a level keeps beyond what is counted (alignment, small objects)


def parse_budget(text: str) -> str:
    """argparse type of ``--fast-budget``: ``auto``, a size (``8GiB``) or a percentage of the
    tables' bytes (``10%``); returned unchanged once it is known to be one of them."""
    s = str(text).strip()
    if s == "auto":
        return s
    try:
        if s.endswith("%"):
            pct = float(s[:-1])
            if not pct > 0:
                raise ValueError
        else:
            parse_size(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--fast-budget must be 'auto', a size like 8GiB or a positive percentage of the tables like 10%, "
            f"got {text!r}") from None
    return s


def hbm_need(policy: str, sizes: Sequence[int], featuresize: int, cache_rows: Sequence[int]) -> int:
    """Bytes that must be in HBM: every table under ``dram``; under the cached policies each
    table's cache and staging rows with room for row-wise Adagrad's accumulator beside them
    (``lru``/``lfu``: and each cache slot's tag, stamp, dirty bit and under ``lfu`` count of
    use, the cache rounded up to whole sets; the other policies keep their pointer tables on
    the host)."""
    if policy == "dram":
        return sum(int(n) * featuresize * 4 for n in sizes)
    per_row = featuresize * 4 + STATE_BYTES
    if policy in GPU_POLICIES:
        slots = sum(-(-int(c) // WAYS) * WAYS for c in cache_rows)
        return (per_row + slot_bytes(policy)) * slots + per_row * STAGING_ROWS * len(sizes)
    cached = 0 if policy == "simple" else sum(int(c) for c in cache_rows)
    return per_row * (cached + STAGING_ROWS * len(sizes))


def resolve_budget(budget: str, table_bytes: int, need: int, policy: str) -> int:
    """The GPU level's capacity in bytes for ``--fast-budget`` ``budget`` (``auto``: ``need``
    plus slack); SystemExit when it cannot hold ``need``, the bytes ``policy`` must keep in HBM."""
    if budget == "auto":
        return need + SLACK
    cap = int(table_bytes * float(budget[:-1]) / 100) if budget.endswith("%") else parse_size(budget)
    if cap < need:
        from cachedarrays import format_size
        what, fix = (("every table", "or choose a cached --policy (static, dynamic, simple)") if policy == "dram"
                     else ("the cache and staging rows", "or lower --cache-fraction"))
        raise SystemExit(f"error: --fast-budget {budget} ({format_size(cap)}) cannot hold what --policy {policy} "
                         f"must keep in HBM ({format_size(need)}: {what}); raise the budget {fix}")
    return cap


def require_gpu() -> None:
    """SystemExit naming why there is no usable GPU here (CuPy missing, no driver, no device)."""
    from cachedarrays.devices import gpu
    from cachedarrays.errors import DeviceUnavailableError

    if gpu.available():
        return
    try:
        gpu.cupy()
    except DeviceUnavailableError as e:
        raise SystemExit(f"error: --device gpu: {e}") from None
    raise SystemExit("error: --device gpu: no GPU is usable here")


def make_manager(capacity: int, host_bytes: int):
    """``Manager(GPU(capacity), DRAM(host_bytes))``: tables' home in page-locked host DRAM, HBM above it."""
    from cachedarrays import DRAM, LRUPolicy, Manager
    from cachedarrays.devices.gpu import GPU

    return Manager(GPU(capacity), DRAM(host_bytes), policy=LRUPolicy())


def prefetch_next(tables: Sequence[Any], indices: Sequence[Any], background: bool = True) -> Any:
    """Start bringing the rows of the next batch (``indices[t]``, flat) into the cached GPU
    tables (other tables ignore it). ``background``: the tables that prefetch on a worker thread
    (``lru``), started before the current batch's lookups so that the row traffic overlaps the
    whole step (their prefetch never moves the current batch's rows); returns what
    :func:`finish_prefetch` waits for (None: nothing in the background). Otherwise the
    host-bookkept caches, synchronously (after the current batch's lookups: their prefetch may
    evict any row the current batch does not hold)."""
    bg = [prefetcher.in_background(t) for t in tables]
    if background:
        return prefetcher.start([t for t, b in zip(tables, bg) if b], [i for i, b in zip(indices, bg) if b], None)
    for t, idx, b in zip(tables, indices, bg):
        if not b:
            prefetch(t, idx)
    return None


def upload_indices(tables: Sequence[Any], indices: Sequence[np.ndarray]) -> tuple[list, Any, list] | None:
    """Every table's next batch of host ``indices`` on the device, for tables all in HBM: checked
    and narrowed where the rows allow (int32 below 2**31 rows) into page-locked blocks in one
    parallel pass (:func:`embeddings.gpu.backend.checked_index_blocks`: a narrowed value must
    not wrap into range), and copied up on a side stream without waiting (beside the current
    step, not between its kernels). Returns the device arrays (shaped as ``indices``), the event
    after the copies (for the stream that uses them to follow) and the blocks, which must stay
    allocated, as must the device arrays, until that event has passed; None when some batch is
    not integers or has a value out of range (its lookup then uploads and checks it itself,
    raising there). Done a step ahead, this is the host copy a lookup of device tables
    otherwise makes on the training thread (8 x 2.6 MB of int64 for the DLRM benchmark's step)."""
    from embeddings.gpu.backend import checked_index_blocks, cuda_backend

    flats = [np.ascontiguousarray(np.asarray(i).reshape(-1)) for i in indices]
    if any(f.dtype.kind != "i" for f in flats):
        return None
    be = cuda_backend()
    blocks, bad = checked_index_blocks([be] * len(flats), flats, [int(t.nvectors()) for t in tables])
    if (bad >= 0).any():
        return None
    devs = [be.xp.empty(b.shape, b.dtype) for b in blocks]  # allocated on this stream, which frees them
    with be.aside():  # the copies beside this stream's work, after what is queued on it so far
        for dev, block in zip(devs, blocks):
            be.upload_blocks([block], out=dev)
        fence = be.fence()
    return [d.reshape(np.shape(i)) for d, i in zip(devs, indices)], fence, blocks


def finish_prefetch(pending: Any) -> None:
    """Wait for a background prefetch (before the next batch's lookups)."""
    prefetcher.finish(pending)


def cache_fraction_for(budget: int, policy: str, sizes: Sequence[int], featuresize: int) -> float:
    """The largest cache fraction whose cache and staging rows (:func:`hbm_need`) fit in
    ``budget`` bytes beside :data:`SLACK`: how much of the tables a budget can cache."""
    rows = sum(int(n) for n in sizes)
    spare = budget - SLACK - hbm_need(policy, sizes, featuresize, [0] * len(sizes))
    if spare <= 0:
        return 0.0
    sets = policy in GPU_POLICIES
    per_row = featuresize * 4 + STATE_BYTES + (slot_bytes(policy) if sets else 0)
    spare -= (WAYS * per_row * len(sizes) if sets else 0)  # each table's last set, rounded up
    return max(0.0, min(1.0, spare / (rows * per_row)))
