"""Reindexing for the backward pass (dissertation Figure 5.2, step 4).

The lookup indices are turned into a CSR "update plan" with one entry per *unique* row. Two
methods: the radix sort over the batch at the end of this module (what ``pullback`` and the
ensemble use), and the dense per-table map below (tables too large for the sort's packed keys):

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


def plan_arrays(L: int, need_coef: bool, counts: bool = True) -> tuple[np.ndarray, ...]:
    """Allocate the output arrays of :func:`reindex_into` for ``L`` indices
    (``counts`` False: an empty placeholder for the counts, which the radix sort does not use)."""
    return (np.empty(L, np.int64), np.empty(L if counts else 0, np.int64), np.empty(L + 1, np.int64),
            np.empty(L, np.int32), np.empty(L if need_coef else 0, np.float32))


@njit(parallel=True, cache=True)
def reindex_many(idxs, offsetss, weightss, mean, scratches, uniqs, countss, startss, ent_bags,
                 ent_coefs, Us):
    """:func:`reindex_into` for several tables at once, in parallel across tables (tuples of arrays)."""
    T = len(idxs)
    for t in prange(T):
        Us[t] = reindex_into(idxs[t], offsetss[t], weightss[t], mean, scratches[t], uniqs[t],
                             countss[t], startss[t], ent_bags[t], ent_coefs[t])


# ---------------------------------------------------------------------------------------------
# Reindexing over the batch: a stable LSD radix sort of (row, payload) keys.
#
# The dense map above costs one random access into an nvectors-long array per index and pass
# (three passes), which dominated the backward pass of large tables. Here the work depends on
# the batch only: every index becomes one int64 key ``row << 32 | payload``, the keys are sorted
# by their row bits in ``npass`` counting-sort passes of ``dbits`` bits each (histogram, prefix
# sum, scatter: dissertation Figure 5.2, the histogram taken over digits of the row), and the
# sorted keys give the CSR directly: a unique row starts wherever the row changes. The sort is
# stable, so each row's entries keep their batch order.
#
# * :func:`reindex_sort_serial` (one thread; what ``pullback.make_plan`` uses): payload = position.
#   Small batches get their unique rows in order of first use (as :func:`reindex_into`), by a
#   walk over the positions that visits each row's group at its first position: the update then
#   reads the gradient rows in order, the table rows being random anyway. Large batches get
#   ascending rows (the first-use walk would read the sorted keys at random).
# * :func:`reindex_part` (one partition of a parallel update): thread ``t`` of ``P`` owns the
#   rows ``r`` with ``(r * P) >> rbits == t`` (a row range), scans the whole batch, sorts the keys
#   of its own rows and emits their CSR in ascending row order into its own buffers. Rows of
#   different threads are disjoint, so the threads then update their own rows with no locks and
#   no barrier in between (see ``update.pullback_parts``).
# ---------------------------------------------------------------------------------------------

KEY_SHIFT = 32  # payload bits below the row
_LOW = (1 << KEY_SHIFT) - 1
MAX_DIGIT_BITS = 11  # at most 2048 buckets per pass: the histogram stays in L1


def row_bits(nvectors: int) -> int:
    """Bits needed for a row below ``nvectors``."""
    return max(int(nvectors) - 1, 0).bit_length()


def sort_params(nvectors: int) -> tuple[int, int]:
    """``(npass, dbits)`` for sorting rows below ``nvectors``: the fewest passes of at most
    :data:`MAX_DIGIT_BITS` bits, with the bits shared evenly between passes."""
    rbits = row_bits(nvectors)
    npass = -(-rbits // MAX_DIGIT_BITS)
    return npass, (-(-rbits // npass) if npass else 0)


def sortable(nvectors: int, nindices: int) -> bool:
    """Whether rows and payloads fit the packed int64 key (rows < 2**31, positions < 2**32)."""
    return nvectors <= 1 << 31 and nindices < 1 << KEY_SHIFT


@njit(cache=True, inline="always")
def _count_digits(h, npass, nb, r, dbits, mask):
    """Count row ``r``'s digit of every pass in ``h`` (the npass x nb histograms, flat). Digit
    counts do not depend on the order of the keys, so all passes' histograms come from the one
    pass that builds the keys. Two passes (tables of 2**12 to 2**22 rows) are spelled out."""
    if npass == 2:
        h[r & mask] += 1
        h[nb + ((r >> dbits) & mask)] += 1
    else:
        for i in range(npass):
            h[i * nb + ((r >> (i * dbits)) & mask)] += 1


@njit(cache=True)
def _sort(keys, tmp, n, dbits, hists):
    """Stable LSD radix sort of ``keys[:n]`` by the row bits (above :data:`KEY_SHIFT`), one pass
    per row of ``hists`` (npass x 2**dbits digit counts, see :func:`_count_digits`; used up),
    using ``tmp[:n]``; returns whichever of the two holds the result."""
    mask = (np.int64(1) << dbits) - 1
    src = keys
    dst = tmp
    for i in range(hists.shape[0]):
        shift = KEY_SHIFT + i * dbits
        hist = hists[i]
        if hist[(src[0] >> shift) & mask] == n:
            continue  # one digit value only: this pass would not move anything
        acc = 0
        for d in range(hist.size):
            c = hist[d]
            hist[d] = acc
            acc += c
        for p in range(n):
            k = src[p]
            d = (k >> shift) & mask
            q = hist[d]
            dst[q] = k
            hist[d] = q + 1
        src, dst = dst, src
    return src


@njit(cache=True)
def _emit_sorted(srt, n, offsets, mean, by_position, bagpos, coefpos, uniq, starts, ent_bag, ent_coef):
    """CSR of sorted keys ``srt[:n]`` in row order; returns U. Payloads are positions (bag and
    coefficient looked up in ``bagpos``/``coefpos``) when ``by_position``, else bags."""
    has_coef = ent_coef.size > 0
    U = 0
    prev = -1
    for q in range(n):
        k = srt[q]
        r = k >> KEY_SHIFT
        if r != prev:
            uniq[U] = r
            starts[U] = q
            U += 1
            prev = r
        pl = k & _LOW
        if by_position:
            ent_bag[q] = bagpos[pl]
            if has_coef:
                ent_coef[q] = coefpos[pl]
        else:
            ent_bag[q] = pl
            if has_coef:
                ent_coef[q] = (np.float32(1.0) / np.float32(offsets[pl + 1] - offsets[pl])) if mean else np.float32(1.0)
    starts[U] = n
    return U


@njit(cache=True, inline="always")
def _bag_of(offsets, b, p, mean, scale):
    """(bag holding position ``p``, its mean scale), scanning forward from bag ``b``."""
    while offsets[b + 1] <= p:
        b += 1
    if mean:
        scale = np.float32(1.0) / np.float32(offsets[b + 1] - offsets[b])
    return b, scale


@njit(cache=True, inline="always")
def _first_bag(offsets, L, mean):
    """(first non-empty bag, its mean scale) of a batch of L > 0 indices; (0, 1) when L == 0."""
    if L > 0:
        return _bag_of(offsets, 0, 0, mean, np.float32(1.0))
    return 0, np.float32(1.0)


@njit(cache=True)
def reindex_sort_serial(idx, offsets, weights, mean, npass, dbits, first_use, keys, tmp, hists, bagpos, coefpos,
                        head, uniq, starts, ent_bag, ent_coef):
    """Build the update plan of :func:`reindex_into` (same outputs) by radix sort; return the
    number of unique rows U.

    ``first_use``: emit the unique rows in order of first use, as :func:`reindex_into` does (for
    small batches, where it lets the update read the gradient rows in order), else in ascending
    row order (cheaper for large batches: the walk in first-use order reads the sorted keys at
    random). Keys carry the position when ``first_use`` or weighted, else the bag. Workspace:
    ``keys``/``tmp`` (len(idx) int64), ``hists`` (npass x 2**dbits int64), ``bagpos`` (len(idx)
    int32, or empty when keys carry bags), ``coefpos`` (len(idx) float32, or empty when keys carry
    bags or no coefficients are needed), ``head`` (len(idx) int64, all -1 on entry and again on
    return; unused unless ``first_use``).
    """
    L = idx.size
    has_coef = ent_coef.size > 0
    has_w = weights.size > 0
    by_pos = first_use or has_w
    mask = (np.int64(1) << dbits) - 1
    npass, nb = hists.shape
    h = hists.reshape(-1)
    h[:] = 0
    b, scale = _first_bag(offsets, L, mean)
    for p in range(L):  # one flat loop: with one index per bag a loop per bag cost 1.5x more
        if offsets[b + 1] <= p:
            b, scale = _bag_of(offsets, b, p, mean, scale)
        r = np.int64(idx[p])
        _count_digits(h, npass, nb, r, dbits, mask)
        if by_pos:
            keys[p] = (r << KEY_SHIFT) | p
            bagpos[p] = b
            if has_coef:
                coefpos[p] = (weights[p] * scale) if has_w else scale
        else:
            keys[p] = (r << KEY_SHIFT) | b
    if L == 0:
        starts[0] = 0
        return 0
    srt = _sort(keys, tmp, L, dbits, hists)
    if not first_use:
        return _emit_sorted(srt, L, offsets, mean, by_pos, bagpos, coefpos, uniq, starts, ent_bag, ent_coef)
    prev = -1
    for q in range(L):  # each row's first position (its first sorted entry) -> its group
        r = srt[q] >> KEY_SHIFT
        if r != prev:
            head[srt[q] & _LOW] = q
            prev = r
    U = 0
    e = 0
    for p in range(L):
        q = head[p]
        if q < 0:
            continue
        head[p] = -1
        r = srt[q] >> KEY_SHIFT
        uniq[U] = r
        starts[U] = e
        U += 1
        while q < L and (srt[q] >> KEY_SHIFT) == r:
            pl = srt[q] & _LOW
            ent_bag[e] = bagpos[pl]
            if has_coef:
                ent_coef[e] = coefpos[pl]
            e += 1
            q += 1
    starts[U] = L
    return U


@njit(parallel=True, cache=True)
def reindex_sort_many(idxs, offsetss, weightss, mean, npasses, dbitss, first_uses, keyss, tmps, histss, bagposs,
                      coefposs, heads, uniqs, startss, ent_bags, ent_coefs, Us):
    """:func:`reindex_sort_serial` for several tables at once, in parallel across tables (tuples of
    arrays, one per table; ``npasses``/``dbitss``/``first_uses`` arrays); ``Us[t]`` gets table
    ``t``'s number of unique rows."""
    for t in prange(len(idxs)):
        Us[t] = reindex_sort_serial(idxs[t], offsetss[t], weightss[t], mean, npasses[t], dbitss[t],
                                    first_uses[t], keyss[t], tmps[t], histss[t], bagposs[t], coefposs[t],
                                    heads[t], uniqs[t], startss[t], ent_bags[t], ent_coefs[t])


@njit(cache=True, inline="always")
def owner(r, P, rbits):
    """The thread (of ``P``) that owns row ``r`` of a table with ``rbits``-bit rows: a row range."""
    return (np.int64(r) * P) >> rbits


@njit(cache=True)
def reindex_part(idx, offsets, weights, mean, t, P, rbits, dbits, keys, tmp, hists, bagpos, coefpos,
                 uniq, starts, ent_bag, ent_coef):
    """Thread ``t``'s part of a parallel reindexing: the CSR of the rows it owns (:func:`owner`),
    in ascending row order, in its own buffers ``uniq``/``starts``/``ent_bag``/``ent_coef``/
    ``keys``/``tmp`` (len(idx) each, ``starts`` one more; ``ent_coef`` empty when no coefficients
    are needed) and ``hists`` (npass x 2**dbits). Weighted batches carry the position as payload
    and write the bag and coefficient of each of the thread's positions to the shared
    ``bagpos``/``coefpos`` (disjoint positions); otherwise the payload is the bag. Returns the
    number of unique rows.
    """
    L = idx.size
    has_w = weights.size > 0
    mask = (np.int64(1) << dbits) - 1
    npass, nb = hists.shape
    h = hists.reshape(-1)
    h[:] = 0
    n = 0
    b, scale = _first_bag(offsets, L, mean)
    for p in range(L):
        if offsets[b + 1] <= p:
            b, scale = _bag_of(offsets, b, p, mean, scale)
        r = np.int64(idx[p])
        if owner(r, P, rbits) == t:
            _count_digits(h, npass, nb, r, dbits, mask)
            if has_w:
                keys[n] = (r << KEY_SHIFT) | p
                bagpos[p] = b
                coefpos[p] = weights[p] * scale
            else:
                keys[n] = (r << KEY_SHIFT) | b
            n += 1
    if n == 0:
        starts[0] = 0
        return 0
    srt = _sort(keys, tmp, n, dbits, hists)
    return _emit_sorted(srt, n, offsets, mean, has_w, bagpos, coefpos, uniq, starts, ent_bag, ent_coef)
