"""Reindexing for the backward pass (dissertation Figure 5.2, step 4).

The lookup indices are turned into a CSR "update plan" with one entry per *unique* row:

1. histogram: walk the indices, give each new row the next unique id (``scratch[row]``, a dense
   int32 map per table that is all -1 between calls) and count its uses;
2. prefix sum of the counts gives each unique row its range of CSR entries;
3. a second walk fills the entries with the output row (bag) that used the table row, and the
   coefficient (per-sample weight, 1/bag size for mean) if any.

The dense map makes both walks O(len(indices)) with no sorting and no hashing, and it is reset
by visiting only the unique rows, so the cost never depends on the table size.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True)
def reindex_into(idx, offsets, weights, mean, scratch, uniq, counts, starts, ent_bag, ent_coef):
    """Build the update plan; return the number of unique rows U.

    ``uniq``/``counts``/``ent_bag`` have len(idx) entries, ``starts`` len(idx) + 1, ``ent_coef``
    len(idx) or 0 (no coefficients needed). Valid output: ``uniq[:U]``, ``starts[:U + 1]``.
    """
    L = idx.size
    B = offsets.size - 1
    U = 0
    for p in range(L):
        r = idx[p]
        u = scratch[r]
        if u < 0:
            u = U
            scratch[r] = U
            uniq[U] = r
            counts[U] = 0
            U += 1
        counts[u] += 1
    acc = 0
    for u in range(U):
        starts[u] = acc
        acc += counts[u]
        counts[u] = starts[u]  # reused as the fill cursor
    starts[U] = acc
    has_coef = ent_coef.size > 0
    has_w = weights.size > 0
    for b in range(B):
        s = offsets[b]
        e = offsets[b + 1]
        scale = np.float32(1.0)
        if mean and e > s:
            scale = np.float32(1.0) / np.float32(e - s)
        for p in range(s, e):
            u = scratch[idx[p]]
            q = counts[u]
            counts[u] = q + 1
            ent_bag[q] = b
            if has_coef:
                ent_coef[q] = (weights[p] * scale) if has_w else scale
    for u in range(U):
        scratch[uniq[u]] = -1
    return U


def plan_arrays(L: int, need_coef: bool) -> tuple[np.ndarray, ...]:
    """Allocate the output arrays of :func:`reindex_into` for ``L`` indices."""
    return (np.empty(L, np.int64), np.empty(L, np.int64), np.empty(L + 1, np.int64),
            np.empty(L, np.int32), np.empty(L if need_coef else 0, np.float32))


@njit(parallel=True, cache=True)
def reindex_many(idxs, offsetss, weightss, mean, scratches, uniqs, countss, startss, ent_bags,
                 ent_coefs, Us):
    """:func:`reindex_into` for several tables at once, in parallel across tables (tuples of arrays)."""
    T = len(idxs)
    for t in prange(T):
        Us[t] = reindex_into(idxs[t], offsetss[t], weightss[t], mean, scratches[t], uniqs[t],
                             countss[t], startss[t], ent_bags[t], ent_coefs[t])


@njit(cache=True, inline="always")
def _part(r, nvec, P):
    return (r * P) // nvec


@njit(parallel=True, cache=True)
def reindex_parallel(idx, offsets, weights, mean, scratch, P, uniq, counts, starts, ent_bag, ent_coef, local):
    """:func:`reindex_into` split over ``P`` threads by row range; returns U.

    Partition ``p`` owns rows ``[p * n / P, (p + 1) * n / P)``: every thread reads all indices
    (sequential, cheap) but only histograms, numbers and fills the CSR entries of its own rows,
    so the random accesses to ``scratch`` are shared out with no synchronisation. Partition
    ``p``'s entries occupy the contiguous range after those of partitions ``< p``; unique rows
    are numbered partition by partition, in order of first use within each. ``local`` is an
    int64 scratch array of len(idx) (per-partition unique rows before compaction).
    """
    L = idx.size
    B = offsets.size - 1
    nvec = scratch.size
    cnt = np.zeros(P, np.int64)  # positions per partition
    nu = np.zeros(P, np.int64)  # unique rows per partition
    for p in prange(P):
        c = 0
        for q in range(L):
            if _part(idx[q], nvec, P) == p:
                c += 1
        cnt[p] = c
    E0 = np.zeros(P + 1, np.int64)
    for p in range(P):
        E0[p + 1] = E0[p] + cnt[p]
    for p in prange(P):
        base = E0[p]
        U = 0
        for q in range(L):
            r = idx[q]
            if _part(r, nvec, P) != p:
                continue
            u = scratch[r]
            if u < 0:
                u = U
                scratch[r] = U
                local[base + U] = r
                counts[base + U] = 0
                U += 1
            counts[base + u] += 1
        nu[p] = U
    U0 = np.zeros(P + 1, np.int64)
    for p in range(P):
        U0[p + 1] = U0[p] + nu[p]
    has_coef = ent_coef.size > 0
    has_w = weights.size > 0
    for p in prange(P):
        base = E0[p]
        acc = base
        for u in range(nu[p]):
            starts[U0[p] + u] = acc
            uniq[U0[p] + u] = local[base + u]
            c = counts[base + u]
            counts[base + u] = acc
            acc += c
        for b in range(B):
            s = offsets[b]
            e = offsets[b + 1]
            scale = np.float32(1.0)
            if mean and e > s:
                scale = np.float32(1.0) / np.float32(e - s)
            for q in range(s, e):
                r = idx[q]
                if _part(r, nvec, P) != p:
                    continue
                u = scratch[r]
                pos = counts[base + u]
                counts[base + u] = pos + 1
                ent_bag[pos] = b
                if has_coef:
                    ent_coef[pos] = (weights[q] * scale) if has_w else scale
        for u in range(nu[p]):
            scratch[local[base + u]] = -1
    starts[U0[P]] = L
    return U0[P]
