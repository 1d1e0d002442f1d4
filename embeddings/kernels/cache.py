"""Kernels of the software row cache (dissertation section 5.4, Figure 5.7).

State shared by all threads of a kernel:

* ``ptr``  – the pointer table (see ``rowaccess``): ``entry_of(base, r)`` while row ``r`` lives in
  the base table, ``entry_of(cache, slot) | CACHED`` once cached; ``LOCKED`` is set while a thread
  moves the row.
* ``backedge`` – per cache slot, the row it holds, or -1.
* ``ref`` – per cache slot, a small saturating count of hits since the row was cached or last
  spared by a flush (second chance, see `flush_page`).
* ``freq`` – per row (not per slot), a saturating uint8 count of accesses, halved now and then
  by the caller so that it counts recent accesses (a TinyLFU-style frequency estimate); empty
  when the table keeps no counts.  Updates are plain stores: racing threads may lose a count.
* ``state`` – int64 ``[HEAD, TAIL, LIMIT, RING, ADMIT]``: slots are handed out by a bump pointer
  (``HEAD``, positions grow forever, slot = position % ``RING``); positions ``[TAIL, HEAD)`` are
  live, and at most ``LIMIT`` may be (cachelower + cacheslack).  Flushing advances ``TAIL`` a
  page at a time between kernel calls.  ``ADMIT`` is the admission threshold: a missed row is
  cached only when its count (this access included) is at least ``ADMIT``, so rows seen once
  (most misses of a skewed stream) do not push hot rows out.

A thread that finds a row uncached and unlocked takes ownership with a compare-and-swap on its
pointer entry; the loser of a race simply reads the row where it is.  The owner claims a slot by
a CAS on ``HEAD`` (refusing when the cache is at ``LIMIT``), copies the row, records the
back-edge and publishes the new pointer with an atomic exchange, which also unlocks.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .atomics import cas, exchange, fetch_add
from .intrinsics import prefetch
from .rowaccess import entry_of, slot_of

CACHED = 1
LOCKED = 2
MAX_REF = 3
PREFETCH = 16  # pointer-table entries fetched this many indices ahead
HEAD, TAIL, LIMIT, RING, ADMIT = 0, 1, 2, 3, 4
MAX_FREQ = 255


@njit(cache=True, inline="always")
def _claim_slot(state, tail, limit, ring):
    """A free slot index, or -1 when the cache holds ``limit`` rows."""
    while True:
        head = fetch_add(state, HEAD, 0)
        if head - tail >= limit:
            return -1
        if cas(state, HEAD, head, head + 1) == head:
            return head % ring


@njit(cache=True)
def _cache_chunk(base, cache, ptr, backedge, ref, freq, state, idx, i0, i1, tail, limit, ring, admit, out):
    """`access_and_cache` over ``idx[i0:i1]``; ``out[:] = (hits, misses, cached)``.

    Every access bumps the row's ``freq`` count (when ``freq`` is not empty); a hit also bumps the
    slot's reference counter (saturating at ``MAX_REF``; races only lose counts).  A miss is cached
    only when the row's count is at least ``admit``.  Once a slot claim fails the cache is full
    until the next flush, so the rest of the chunk stops trying (a failed attempt costs three
    atomic operations on shared lines: at k=40 with a full cache they dominated the pass).
    """
    F = base.shape[1]
    hits = 0
    misses = 0
    cached = 0
    full = False
    counting = freq.size > 0
    for i in range(i0, i1):
        if i + PREFETCH < i1:
            prefetch(ptr.ctypes.data + idx[i + PREFETCH] * 8)
            if counting:
                prefetch(freq.ctypes.data + idx[i + PREFETCH])
        r = idx[i]
        e = ptr[r]
        f = 0
        if counting:
            f = freq[r]
            if f < MAX_FREQ:
                f += 1
                freq[r] = f
        if e & CACHED:
            hits += 1
            s = slot_of(cache, e)
            if ref[s] < MAX_REF:
                ref[s] += 1
            continue
        misses += 1
        if full or f < admit:
            continue  # no room left, or not (yet) frequent enough to be worth a slot
        if e & LOCKED or cas(ptr, r, e, e | LOCKED) != e:
            continue  # another thread owns the row: read it where it is
        slot = _claim_slot(state, tail, limit, ring)
        if slot < 0:
            exchange(ptr, r, e)  # full: give the row back unchanged
            full = True  # and stay full: nothing frees slots while the kernel runs
            continue
        src = base[r]
        dst = cache[slot]
        for j in range(F):
            dst[j] = src[j]
        backedge[slot] = r
        ref[slot] = 0
        exchange(ptr, r, entry_of(cache, slot) | CACHED)
        cached += 1
    out[0] = hits
    out[1] = misses
    out[2] = cached


@njit(parallel=True, cache=True)
def access_and_cache(base, cache, ptr, backedge, ref, freq, state, idx, nchunks, counts):
    """Cache every uncached row of ``idx`` that passes admission while room lasts;
    ``counts += (hits, misses, cached)``."""
    n = idx.size
    tail = state[TAIL]
    limit = state[LIMIT]
    ring = state[RING]
    admit = state[ADMIT]
    part = np.zeros((nchunks, 3), np.int64)
    for c in prange(nchunks):
        _cache_chunk(base, cache, ptr, backedge, ref, freq, state, idx, c * n // nchunks, (c + 1) * n // nchunks,
                     tail, limit, ring, admit, part[c])
    for c in range(nchunks):
        for q in range(3):
            counts[q] += part[c, q]


@njit(cache=True)
def _count_chunk(ptr, idx, i0, i1):
    h = 0
    for i in range(i0, i1):
        if i + PREFETCH < i1:
            prefetch(ptr.ctypes.data + idx[i + PREFETCH] * 8)
        if ptr[idx[i]] & CACHED:
            h += 1
    return h


@njit(parallel=True, cache=True)
def count_hits(ptr, idx, nchunks, counts):
    """``counts += (hits, misses, 0)`` for an access that does not cache."""
    n = idx.size
    part = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        part[c] = _count_chunk(ptr, idx, c * n // nchunks, (c + 1) * n // nchunks)
    h = part.sum()
    counts[0] += h
    counts[1] += n - h


@njit(cache=True)
def flush_page(base, cache, ptr, backedge, ref, state, stop, writeback, second_chance):
    """Retire positions ``[TAIL, stop)`` (the oldest page) and set ``TAIL = stop``.

    A row whose reference counter is non-zero gets a second chance when ``second_chance``: it
    moves (within the fast device) to the head of the ring with its counter decremented.  Other
    rows are uncached, copied back to the base table first when ``writeback``.  Returns the
    number of rows copied back.  Runs between lookups, so plain stores suffice; processing the
    page in order keeps every destination slot free (positions ``[TAIL, TAIL + moved)`` are).
    """
    ring = state[RING]
    head = state[HEAD]
    F = base.shape[1]
    written = 0
    for p in range(state[TAIL], stop):
        s = p % ring
        r = backedge[s]
        if r < 0:
            continue
        if second_chance and ref[s] > 0:
            t = head % ring
            head += 1
            if t != s:
                for j in range(F):
                    cache[t, j] = cache[s, j]
                backedge[t] = r
                backedge[s] = -1
            ref[t] = ref[s] - 1
            ptr[r] = entry_of(cache, t) | CACHED
            continue
        if writeback:
            for j in range(F):
                base[r, j] = cache[s, j]
            written += 1
        ptr[r] = entry_of(base, r)
        backedge[s] = -1
        ref[s] = 0
    state[HEAD] = head
    state[TAIL] = stop
    return written


@njit(parallel=True, cache=True)
def write_back_live(base, cache, backedge, state):
    """Copy every live cached row back to the base table, keeping it cached; returns the count."""
    tail = state[TAIL]
    ring = state[RING]
    F = base.shape[1]
    written = 0
    for p in prange(state[HEAD] - tail):
        s = (tail + p) % ring
        r = backedge[s]
        if r >= 0:
            for j in range(F):
                base[r, j] = cache[s, j]
            written += 1
    return written


@njit(cache=True)
def access_and_cache_serial(base, cache, ptr, backedge, ref, freq, state, idx, admit, counts):
    """`access_and_cache` on the calling thread, admitting misses seen ``admit`` times: small
    batches (no parallel region to start, and access counts exact, where parallel chunks may lose
    increments of a row they share), and, with an empty ``freq`` and ``admit`` 0, the static
    policy's one-time fill."""
    part = np.zeros(3, np.int64)
    _cache_chunk(base, cache, ptr, backedge, ref, freq, state, idx, 0, idx.size, state[TAIL],
                 state[LIMIT], state[RING], admit, part)
    for q in range(3):
        counts[q] += part[q]


@njit(cache=True)
def count_hits_serial(ptr, idx, counts):
    """:func:`count_hits` on the calling thread (small batches)."""
    h = _count_chunk(ptr, idx, 0, idx.size)
    counts[0] += h
    counts[1] += idx.size - h


@njit(parallel=True, cache=True)
def cache_slots(cache, ptr, idx, out):
    """``out[i]`` = the slot of ``cache`` holding row ``idx[i]``, or -1 where the row is not cached
    (a GPU table's lookups read the device copy of the cache by slot)."""
    for i in prange(idx.size):
        e = ptr[idx[i]]
        out[i] = slot_of(cache, e) if e & CACHED else -1
