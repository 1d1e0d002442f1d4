"""A heap allocator over offsets ``[0, capacity)``: the bookkeeping half of a device.

The heap owns no memory; a device pairs it with a buffer.  Every block (free or
occupied) is a run of bytes starting at a multiple of ``ALIGN``; blocks tile the
whole range in address order, and no two free blocks are neighbours.  Free
blocks are indexed by size in segregated bins (a two-level scheme in the
style of TLSF: eight sub-bins per power of two, and a bitmap of non-empty
bins), so finding a block that fits takes a bit scan, not a walk of the heap.

Requests of at least ``PAGE`` bytes start on a page boundary; smaller ones on a
64-byte boundary.  The occupied block of a request of ``n`` bytes is exactly
``round_up(n, ALIGN)`` bytes long.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Iterator, NamedTuple

from ..errors import InvariantError, OutOfMemoryError, UseAfterFreeError

ALIGN = 64
PAGE = 4096
_SUB_BITS = 3
_SUBS = 1 << _SUB_BITS


def round_up(n: int, a: int) -> int:
    """Smallest multiple of ``a`` that is ``>= n``."""
    return -(-n // a) * a


def alignment_for(nbytes: int) -> int:
    """The start alignment a request of ``nbytes`` gets: a page for large ones, 64 B otherwise."""
    return PAGE if nbytes >= PAGE else ALIGN


class DeadEnds:
    """Spans of a heap where room for one request size cannot be made: each a maximal run of
    free and movable blocks (between immovable blocks or the heap's ends) that a failed eviction
    plan walked in full and found too small. A walk started anywhere inside one would walk the
    same run and fail the same way, so :meth:`Heap.evictfrom` given a ``DeadEnds`` fails such a
    walk at once. A policy trying victim after victim for one request (most of them inside a few
    runs walled in by pinned objects) then walks each run once, not once per victim.

    Valid while the heap and what is movable stay as they were: the heap forgets every run when a
    walk hands blocks to its callback; a caller whose pins change makes a new one."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._lo: list[int] = []
        self._hi: list[int] = []

    def covers(self, offset: int) -> bool:
        """Whether ``offset`` lies in a run known too small."""
        i = bisect_right(self._lo, offset) - 1
        return i >= 0 and offset < self._hi[i]

    def add(self, lo: int, hi: int) -> None:
        """Record ``[lo, hi)``, a run too small (runs never overlap: each is maximal)."""
        i = bisect_right(self._lo, lo)
        self._lo.insert(i, lo)
        self._hi.insert(i, hi)

    def clear(self) -> None:
        self._lo.clear()
        self._hi.clear()

    def __len__(self) -> int:
        return len(self._lo)


def _bin(size: int) -> int:
    """Bin index of a free block of ``size`` bytes; bins grow by 1/8 of a power of two."""
    units = size // ALIGN
    if units < _SUBS:
        return units
    e = units.bit_length() - 1
    return (e - _SUB_BITS + 1) * _SUBS + ((units >> (e - _SUB_BITS)) & (_SUBS - 1))


class Block(NamedTuple):
    """One block of the heap as seen by a walk: ``requested`` is None for a free block."""

    offset: int
    size: int
    requested: int | None

    @property
    def free(self) -> bool:
        return self.requested is None


class Heap:
    """Allocator bookkeeping for one device; not thread-safe (the manager holds the lock)."""

    def __init__(self, capacity: int):
        capacity -= capacity % ALIGN
        if capacity <= 0:
            raise ValueError(f"heap capacity must be at least {ALIGN} bytes")
        self.capacity = capacity
        self._size: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._requested: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(_bin(capacity) + 1)]
        self._bin_of: dict[int, int] = {}  # free block start -> its bin
        self._nonempty = 0
        self._free_bytes = 0
        self._walk_depth = 0
        self._deferred: list[int] = []
        self._add_free(0, capacity, prev=-1)
        self._free_bytes = capacity

    # ------------------------------------------------------------------ queries
    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def used_bytes(self) -> int:
        return self.capacity - self._free_bytes

    @property
    def nblocks(self) -> int:
        return len(self._size)

    @property
    def noccupied(self) -> int:
        return len(self._requested)

    def largest_free(self) -> int:
        """Size of the largest free block (0 when the heap is full)."""
        if not self._nonempty:
            return 0
        top = self._bins[self._nonempty.bit_length() - 1]
        return max(self._size[s] for s in top)

    def is_occupied(self, offset: int) -> bool:
        return offset in self._requested

    def requested(self, offset: int) -> int:
        """Bytes asked for when the occupied block at ``offset`` was allocated."""
        try:
            return self._requested[offset]
        except KeyError:
            raise UseAfterFreeError(f"offset {offset} is not the start of an occupied block") from None

    def block(self, offset: int) -> Block:
        size = self._size[offset]
        return Block(offset, size, self._requested.get(offset))

    def next_block(self, offset: int) -> Block | None:
        nxt = offset + self._size[offset]
        return self.block(nxt) if nxt < self.capacity else None

    def prev_block(self, offset: int) -> Block | None:
        prv = self._prev[offset]
        return self.block(prv) if prv >= 0 else None

    def blocks(self) -> Iterator[Block]:
        """Every block in address order."""
        offset = 0
        while offset < self.capacity:
            size = self._size[offset]
            yield Block(offset, size, self._requested.get(offset))
            offset += size

    def exhausted_message(self, nbytes: int) -> str:
        return (
            f"requested {nbytes} bytes but only {self._free_bytes} bytes are free "
            f"(largest free region {self.largest_free()} bytes, capacity {self.capacity} bytes)"
        )

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new occupied block holding ``nbytes``, or None when nothing fits."""
        if type(nbytes) is not int or not 0 < nbytes <= self.capacity:
            self._validate_request(nbytes)
        if self._walk_depth:
            raise RuntimeError("cannot allocate from a heap while evictfrom is walking it")
        need = -(-nbytes // ALIGN) * ALIGN
        align = PAGE if nbytes >= PAGE else ALIGN
        start = self._find(need, align)
        if start is None:
            return None
        return self._carve(start, need, align, nbytes)

    def free(self, offset: int) -> None:
        """Return the occupied block at ``offset`` to the heap, coalescing free neighbours."""
        if offset not in self._requested:
            kind = "a free block (double free?)" if offset in self._size else "not the start of any block"
            raise UseAfterFreeError(f"cannot free offset {offset}: it is {kind}")
        if self._walk_depth:
            self._deferred.append(offset)
            return
        self._release(offset)

    def _validate_request(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"allocation size must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        if nbytes > self.capacity:
            raise OutOfMemoryError(f"requested {nbytes} bytes, larger than the whole device (capacity {self.capacity} bytes)")

    def _fits(self, start: int, size: int, need: int, align: int) -> bool:
        return size >= need + (-start) % align

    def _find(self, need: int, align: int) -> int | None:
        """Take a free block that fits out of the free index (the caller carves it), or None."""
        units = (need + align - ALIGN) >> 6  # _bin of the worst case, inlined (hot path)
        if units < _SUBS:
            first = units + 1
        else:
            e = units.bit_length() - 1
            first = (e - _SUB_BITS + 1) * _SUBS + ((units >> (e - _SUB_BITS)) & (_SUBS - 1)) + 1
        mask = self._nonempty >> first
        if mask:
            b = first + (mask & -mask).bit_length() - 1
            bucket = self._bins[b]
            start = bucket.popitem()[0]  # O(1), and leaves no deleted-entry holes to skip later
            del self._bin_of[start]
            if not bucket:
                self._nonempty &= ~(1 << b)
            return start
        # No bin is certain to fit: look through the bins that may hold a fitting block.
        for b in range(_bin(need), min(first, len(self._bins))):
            if self._nonempty >> b & 1:
                for start in self._bins[b]:
                    if self._fits(start, self._size[start], need, align):
                        self._remove_free(start)
                        return start
        return None

    def _carve(self, start: int, need: int, align: int, nbytes: int) -> int:
        """Occupy ``need`` bytes of the free block at ``start``, already taken out of the free index
        by `_find` (after alignment padding); returns the offset."""
        size = self._size[start]
        prev = self._prev[start]
        pad = (-start) % align
        at = start + pad
        if pad:
            self._add_free(start, pad, prev)
            prev = start
        self._size[at] = need
        self._prev[at] = prev
        self._requested[at] = nbytes
        self._free_bytes -= need
        rest = size - pad - need
        end = at + need
        if rest:
            self._add_free(end, rest, at)
            nxt = end + rest
            if nxt < self.capacity:
                self._prev[nxt] = end
        elif end < self.capacity:
            self._prev[end] = at
        return at

    def _release(self, offset: int) -> None:
        """Free one occupied block, merging it with free neighbours (the hot path of `free`)."""
        size = self._size[offset]
        del self._requested[offset]
        self._free_bytes += size
        lo, hi = offset, offset + size
        bin_of = self._bin_of
        prev = self._prev[lo]
        if prev in bin_of:  # a free neighbour below (prev is -1 at the heap start)
            self._remove_free(prev)
            del self._size[lo], self._prev[lo]
            lo = prev
        if hi in bin_of:  # a free neighbour above
            self._remove_free(hi)
            nxt = hi + self._size.pop(hi)
            del self._prev[hi]
            hi = nxt
        self._add_free(lo, hi - lo, self._prev[lo])
        if hi < self.capacity:
            self._prev[hi] = lo

    # ------------------------------------------------------------------ eviction and compaction
    def evictfrom(
        self,
        start: int,
        nbytes: int,
        callback: Callable[[int, int], object],
        movable: Callable[[int], bool] | None = None,
        dead_ends: DeadEnds | None = None,
    ) -> int | None:
        """Make room for ``nbytes`` contiguous bytes by reclaiming the blocks around ``start``.

        Walks forward in address order from the block at ``start`` and, if the end of
        the heap or an immovable block comes first, backward from it, until the span
        would hold an allocation of ``nbytes``.  ``movable(offset)`` (default: all)
        rules blocks out before anything happens, so a walk that cannot succeed calls
        no callback.  Then ``callback(offset, requested)`` runs for every occupied
        block of the span; a truthy return (or freeing the block from inside the
        callback) gives the block up.  On success the span becomes one free block and
        its offset is returned.  If a callback refuses (returns falsy) or raises,
        the blocks already given up are freed, the rest stay as they were, and None
        is returned (or the exception propagates).

        ``dead_ends`` (for ``nbytes``): a failed plan records its run there, and a walk starting
        in a recorded run fails without walking; a walk that calls back clears it.
        """
        self._validate_request(nbytes)
        if start not in self._size:
            raise ValueError(f"evictfrom: offset {start} is not the start of a block")
        if self._walk_depth:
            raise RuntimeError("evictfrom cannot be nested on the same heap")
        if dead_ends is not None:
            if dead_ends.nbytes != nbytes:
                raise ValueError(f"evictfrom: dead ends recorded for {dead_ends.nbytes} bytes, asked for {nbytes}")
            if dead_ends.covers(start):
                return None
        lo, hi, found = self._plan_span(start, round_up(nbytes, ALIGN), alignment_for(nbytes), movable)
        if not found:
            if dead_ends is not None and lo < hi:
                dead_ends.add(lo, hi)
            return None
        if dead_ends is not None:
            dead_ends.clear()
        victims = [b.offset for b in self._blocks_in(lo, hi) if not b.free]
        accepted: list[int] = []
        refused = True
        self._walk_depth += 1
        try:
            for off in victims:
                if callback(off, self._requested[off]) or off in self._deferred:
                    accepted.append(off)
                else:
                    break
            else:
                refused = False
        finally:
            self._walk_depth -= 1
            deferred = set(self._deferred)
            self._deferred = []
            in_span = set(victims)
            if refused:
                for off in sorted(set(accepted) | (deferred & in_span)):
                    self._release(off)
                result = None
            else:
                for off in victims:
                    del self._requested[off]
                    self._free_bytes += self._size[off]
                result = self._coalesce(lo, hi)
            for off in sorted(deferred - in_span):
                if off in self._requested:
                    self._release(off)
        return result

    def room_possible(self, nbytes: int, movable: Callable[[int], bool] | None = None) -> bool:
        """Whether some maximal run of free and movable blocks would hold an allocation of ``nbytes``:
        what `evictfrom` needs to succeed from a block of that run.  One walk of the heap, no side
        effects; a caller about to try victim after victim can learn first that none would do."""
        self._validate_request(nbytes)
        need, align = round_up(nbytes, ALIGN), alignment_for(nbytes)
        requested, sizes, lo, offset = self._requested, self._size, -1, 0
        while offset < self.capacity:
            if offset in requested and movable is not None and not movable(offset):
                if lo >= 0 and self._fits(lo, offset - lo, need, align):
                    return True
                lo = -1
            elif lo < 0:
                lo = offset
            offset += sizes[offset]
        return lo >= 0 and self._fits(lo, self.capacity - lo, need, align)

    def _blocks_in(self, lo: int, hi: int) -> Iterator[Block]:
        offset = lo
        while offset < hi:
            b = self.block(offset)
            yield b
            offset += b.size

    def _plan_span(self, start: int, need: int, align: int,
                   movable: Callable[[int], bool] | None) -> tuple[int, int, bool]:
        """``(lo, hi, True)``: the span around ``start`` to give up for ``need`` bytes; else
        ``(lo, hi, False)``: the run walked in full, its takeable blocks up to immovable ones
        (or the heap's ends), too small."""
        def can_take(offset: int) -> bool:
            return offset not in self._requested or movable is None or bool(movable(offset))

        lo = hi = start
        while hi < self.capacity and not self._fits(lo, hi - lo, need, align) and can_take(hi):
            hi += self._size[hi]
        while not self._fits(lo, hi - lo, need, align):
            prev = self._prev[lo]
            if prev < 0 or not can_take(prev):
                return lo, hi, False
            lo = prev
        return lo, hi, True

    def defragment(self, move_callback: Callable[[int, int, int], None]) -> list[tuple[int, int, int]]:
        """Slide occupied blocks toward offset 0, leaving one free block at the top.

        ``move_callback(old, new, requested)`` runs before each move (``new < old``;
        the ranges may overlap, so the caller must copy like ``memmove``) and must
        move the bytes and update its own references.  Returns the moves made.  If a
        callback raises, blocks moved so far stay moved and the rest stay put.
        """
        if self._walk_depth:
            raise RuntimeError("cannot defragment a heap while evictfrom is walking it")
        occupied = sorted(self._requested.items())
        placed: list[tuple[int, int]] = []
        moves: list[tuple[int, int, int]] = []
        cursor = 0
        try:
            for off, req in occupied:
                new = round_up(cursor, alignment_for(req))
                if new < off:
                    move_callback(off, new, req)
                    moves.append((off, new, req))
                    off = new
                placed.append((off, req))
                cursor = off + round_up(req, ALIGN)
        finally:
            self._rebuild(placed + occupied[len(placed):])
        return moves

    def restore(self, occupied: list[tuple[int, int]]) -> None:
        """Reset the heap to exactly the occupied blocks ``(offset, requested)`` given (a reopened pool's
        allocation state); raises ``ValueError`` naming the first block that could not have come from
        this heap (misaligned, overlapping, or past the end), leaving the heap unchanged."""
        if self._walk_depth:
            raise RuntimeError("cannot restore a heap while evictfrom is walking it")
        blocks = sorted((int(o), int(r)) for o, r in occupied)
        end = 0
        for off, req in blocks:
            if req <= 0 or off % alignment_for(req) or off < end or off + round_up(req, ALIGN) > self.capacity:
                raise ValueError(f"block ({off}, {req} bytes) is not a block this heap could hold "
                                 f"(capacity {self.capacity}, previous block ends at {end})")
            end = off + round_up(req, ALIGN)
        self._rebuild(blocks)

    def _rebuild(self, occupied: list[tuple[int, int]]) -> None:
        """Reset the heap to exactly the occupied blocks given, sorted by offset."""
        self._size.clear()
        self._prev.clear()
        self._requested.clear()
        for bucket in self._bins:
            bucket.clear()
        self._bin_of.clear()
        self._nonempty = 0
        self._free_bytes = 0
        prev, cursor = -1, 0
        for off, req in occupied + [(self.capacity, 0)]:
            if off > cursor:
                self._add_free(cursor, off - cursor, prev)
                self._free_bytes += off - cursor
                prev = cursor
            if off == self.capacity:
                break
            size = round_up(req, ALIGN)
            self._set_block(off, size, prev)
            self._requested[off] = req
            prev, cursor = off, off + size

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify every invariant; raise ``InvariantError`` naming the first broken one."""
        def fail(msg: str) -> None:
            raise InvariantError(f"heap(capacity={self.capacity}): {msg}")

        offset, prev, prev_free, seen, free_total, free_seen = 0, -1, False, 0, 0, set()
        while offset < self.capacity:
            if offset not in self._size:
                fail(f"walk reached offset {offset}, which is not a block start")
            size = self._size[offset]
            if size <= 0 or size % ALIGN or offset % ALIGN:
                fail(f"block at {offset} has size {size}; offsets and sizes must be positive multiples of {ALIGN}")
            if self._prev[offset] != prev:
                fail(f"block at {offset} records previous block {self._prev[offset]}, walk says {prev}")
            is_free = offset not in self._requested
            if is_free:
                if prev_free:
                    fail(f"free blocks at {prev} and {offset} are neighbours but not coalesced")
                if offset not in self._bins[_bin(size)]:
                    fail(f"free block at {offset} (size {size}) is missing from bin {_bin(size)}")
                free_total += size
                free_seen.add(offset)
            else:
                req = self._requested[offset]
                if round_up(req, ALIGN) != size:
                    fail(f"occupied block at {offset} has size {size} for a request of {req} bytes")
                if offset % alignment_for(req):
                    fail(f"occupied block at {offset} for {req} bytes is not {alignment_for(req)}-aligned")
            prev, prev_free, seen = offset, is_free, seen + 1
            offset += size
        if offset != self.capacity:
            fail(f"blocks sum to {offset} bytes, capacity is {self.capacity}")
        if seen != len(self._size) or len(self._prev) != len(self._size):
            fail(f"walk saw {seen} blocks but the index holds {len(self._size)} sizes and {len(self._prev)} links")
        if free_total != self._free_bytes:
            fail(f"free blocks sum to {free_total} bytes, counter says {self._free_bytes}")
        binned = set()
        for b, bucket in enumerate(self._bins):
            if bool(bucket) != bool(self._nonempty >> b & 1):
                fail(f"bitmap bit {b} disagrees with bin contents ({len(bucket)} blocks)")
            binned.update(bucket)
        if binned != free_seen or self._bin_of.keys() != free_seen:
            fail(f"bins hold {sorted(binned - free_seen)[:5]} that are not free blocks, or miss {sorted(free_seen - binned)[:5]}")
        if self._walk_depth or self._deferred:
            fail("an evictfrom walk is still in progress")

    # ------------------------------------------------------------------ low-level block edits
    def _set_block(self, start: int, size: int, prev: int) -> None:
        self._size[start] = size
        self._prev[start] = prev

    def _add_free(self, start: int, size: int, prev: int) -> None:
        self._size[start] = size
        self._prev[start] = prev
        units = size >> 6  # _bin(size), inlined: this is the allocator's hottest line
        if units < _SUBS:
            b = units
        else:
            e = units.bit_length() - 1
            b = (e - _SUB_BITS + 1) * _SUBS + ((units >> (e - _SUB_BITS)) & (_SUBS - 1))
        bucket = self._bins[b]
        if not bucket:
            self._nonempty |= 1 << b
        bucket[start] = None
        self._bin_of[start] = b

    def _remove_free(self, start: int) -> None:
        b = self._bin_of.pop(start)
        bucket = self._bins[b]
        del bucket[start]
        if not bucket:
            self._nonempty &= ~(1 << b)

    def _fix_next_prev(self, start: int) -> None:
        nxt = start + self._size[start]
        if nxt < self.capacity:
            self._prev[nxt] = start

    def _coalesce(self, lo: int, hi: int) -> int:
        """Turn ``[lo, hi)`` into one free block joined with its free neighbours.

        Every block start in the span must already be unoccupied (its bytes counted
        as free); free blocks in the span are still in their bins.
        """
        s = lo
        while s < hi:
            size = self._size[s]
            self._remove_free_if_indexed(s)
            if s != lo:
                del self._size[s], self._prev[s]
            s += size
        hi = s
        prev = self._prev[lo]
        if prev >= 0 and prev not in self._requested:
            self._remove_free(prev)
            del self._size[lo], self._prev[lo]
            lo = prev
        if hi < self.capacity and hi not in self._requested:
            self._remove_free(hi)
            nxt = hi + self._size.pop(hi)
            del self._prev[hi]
            hi = nxt
        self._add_free(lo, hi - lo, self._prev[lo])
        self._fix_next_prev(lo)
        return lo

    def _remove_free_if_indexed(self, start: int) -> None:
        if start in self._bin_of:
            self._remove_free(start)
