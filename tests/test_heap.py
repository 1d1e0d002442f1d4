"""The heap allocator: placement, alignment, coalescing, evictfrom, defragment, and a stateful model."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachedarrays import DRAM, InvariantError, UseAfterFreeError
from cachedarrays.devices.heap import ALIGN, PAGE, DeadEnds, Heap, round_up


def fits_anywhere(heap: Heap, nbytes: int) -> bool:
    need, align = round_up(nbytes, ALIGN), PAGE if nbytes >= PAGE else ALIGN
    return any(b.free and b.size >= need + (-b.offset) % align for b in heap.blocks())


def test_alignment_and_exact_sizes():
    h = Heap(1 << 20)
    small = h.allocate(100)
    big = h.allocate(5000)
    assert small % ALIGN == 0 and big % PAGE == 0
    assert h.block(small).size == 128 and h.block(big).size == round_up(5000, ALIGN)
    assert h.used_bytes == 128 + round_up(5000, ALIGN)
    h.check()


def test_free_coalesces_both_neighbours():
    h = Heap(64 * 1024)
    offs = [h.allocate(1000) for _ in range(3)]
    h.free(offs[0])
    h.free(offs[2])
    assert h.nblocks == 3  # free, occupied, free(merged with the tail)
    h.free(offs[1])
    assert h.nblocks == 1 and h.free_bytes == h.capacity
    h.check()


def test_allocation_fails_only_when_nothing_fits():
    h = Heap(16 * 1024)
    offs = [h.allocate(1024) for _ in range(16)]
    assert h.allocate(1) is None and h.free_bytes == 0
    for o in offs[::2]:
        h.free(o)
    assert h.free_bytes == 8 * 1024 and h.largest_free() == 1024
    assert h.allocate(2048) is None  # fragmented: 8 KiB free, none contiguous
    assert h.allocate(1024) is not None
    assert "largest free region 1024" in h.exhausted_message(2048)


def test_bad_requests_are_refused_and_leave_heap_intact():
    h = Heap(4096)
    o = h.allocate(64)
    for bad, exc in ((0, ValueError), (-5, ValueError), (8192, MemoryError), (1.5, TypeError)):
        with pytest.raises(exc):
            h.allocate(bad)
    h.free(o)
    with pytest.raises(UseAfterFreeError, match="double free"):
        h.free(o)
    with pytest.raises(UseAfterFreeError, match="not the start"):
        h.free(3)
    h.check()


def test_evictfrom_walks_forward_then_backward():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]
    seen = []
    start = h.evictfrom(offs[6], 3 * 1024, lambda off, n: seen.append(off) or True)
    assert seen == [offs[5], offs[6], offs[7]]  # reached the end, went back one block; callbacks in address order
    assert start == offs[5] and h.block(start).size == 3 * 1024
    assert h.allocate(3 * 1024) == offs[5]
    h.check()


def test_evictfrom_refusal_frees_only_accepted_blocks():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]
    calls = []

    def cb(off, n):
        calls.append(off)
        return len(calls) < 3

    assert h.evictfrom(offs[0], 4 * 1024, cb) is None
    assert not h.is_occupied(offs[0]) and not h.is_occupied(offs[1])
    assert all(h.is_occupied(o) for o in offs[2:])
    h.check()


def test_evictfrom_raising_callback_rolls_back():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]

    def cb(off, n):
        if off == offs[2]:
            raise KeyError("boom")
        return True

    with pytest.raises(KeyError):
        h.evictfrom(offs[0], 4 * 1024, cb)
    assert [h.is_occupied(o) for o in offs] == [False, False] + [True] * 6
    h.check()


def test_evictfrom_plans_around_immovable_blocks_without_calling_back():
    h = Heap(4 * 1024)
    offs = [h.allocate(1024) for _ in range(4)]
    called = []
    r = h.evictfrom(offs[0], 3 * 1024, lambda o, n: called.append(o) or True, movable=lambda o: o != offs[2])
    assert r is None and called == []
    r = h.evictfrom(offs[3], 2 * 1024, lambda o, n: called.append(o) or True, movable=lambda o: o != offs[1])
    assert r == offs[2] and called == [offs[2], offs[3]]
    h.check()


def test_room_possible_looks_for_a_run_of_free_and_movable_blocks_long_enough():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]
    h.free(offs[1])
    pinned = {offs[3], offs[6]}
    movable = lambda o: o not in pinned  # noqa: E731
    assert h.room_possible(3 * 1024, movable)        # [0, 3): a free block between two movable ones
    assert not h.room_possible(4 * 1024, movable)    # the runs are 3, 2 and 1 KiB
    pinned.discard(offs[6])
    assert h.room_possible(4 * 1024, movable)        # [4, 8) is one run now
    with pytest.raises(ValueError, match="positive"):
        h.room_possible(0)
    h.check()


def test_dead_ends_skip_walks_inside_a_run_known_too_small():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]
    asked = []

    def movable(o):
        asked.append(o)
        return o not in (offs[2], offs[6])

    dead = DeadEnds(4 * 1024)
    cb = lambda o, n: pytest.fail("called back")  # noqa: E731
    assert h.evictfrom(offs[4], 4 * 1024, cb, movable, dead) is None
    assert len(dead) == 1 and dead.covers(offs[3]) and dead.covers(offs[5]) and not dead.covers(offs[6])
    asked.clear()
    assert h.evictfrom(offs[3], 4 * 1024, cb, movable, dead) is None
    assert h.evictfrom(offs[5], 4 * 1024, cb, movable, dead) is None
    assert asked == []  # neither walked: the run [3, 6) holds 3 KiB
    assert h.evictfrom(offs[7], 4 * 1024, cb, movable, dead) is None  # the run [7, 8) is another
    assert len(dead) == 2
    given = []
    assert h.evictfrom(offs[0], 2 * 1024, lambda o, n: given.append(o) or True, movable, DeadEnds(2 * 1024)) == 0
    assert given == offs[:2]
    with pytest.raises(ValueError, match="dead ends recorded for 4096 bytes"):
        h.evictfrom(offs[4], 1024, cb, movable, dead)
    h.check()


def test_a_walk_that_gives_blocks_up_forgets_the_dead_ends():
    h = Heap(8 * 1024)
    offs = [h.allocate(1024) for _ in range(8)]
    dead = DeadEnds(2 * 1024)
    assert h.evictfrom(offs[1], 2 * 1024, lambda o, n: False, lambda o: o not in offs[:1] + offs[2:], dead) is None
    assert len(dead) == 1  # [1, 2): one block, walled in
    assert h.evictfrom(offs[4], 2 * 1024, lambda o, n: True, None, dead) == offs[4]
    assert len(dead) == 0
    h.check()


def test_free_inside_evictfrom_callback_is_deferred_and_counts_as_given_up():
    h = Heap(4 * 1024)
    offs = [h.allocate(1024) for _ in range(4)]

    def cb(off, n):
        h.free(off)
        if off == offs[0]:
            h.free(offs[3])  # a block outside the span: freed after the walk
        return None  # freeing it is enough

    assert h.evictfrom(offs[0], 2 * 1024, cb) == 0
    assert h.free_bytes == 3 * 1024 and h.is_occupied(offs[2])
    h.check()


def test_defragment_slides_blocks_down_and_reports_moves():
    d = DRAM("64KiB", bandwidth=(10, 10))
    offs = [d.allocate(1000) for _ in range(6)]
    for i, o in enumerate(offs):
        d.view(o, 1000)[:] = i
    for o in offs[::2]:
        d.free(o)
    moves = d.defragment(lambda old, new, n: None)
    assert [(old, new) for old, new, _ in moves] == [(offs[1], 0), (offs[3], 1024), (offs[5], 2048)]
    for i, (_, new, n) in zip((1, 3, 5), moves):
        assert (d.view(new, n) == i).all()
    assert d.heap.largest_free() == d.capacity - 3 * 1024
    d.check()


def test_check_reports_corruption():
    h = Heap(4096)
    h.allocate(64)
    h._free_bytes += 64
    with pytest.raises(InvariantError, match="counter"):
        h.check()


class HeapMachine(RuleBasedStateMachine):
    """Random allocate/free/evictfrom/defragment on a device; live bytes never change unless written."""

    def __init__(self):
        super().__init__()
        self.dev = DRAM("256KiB", bandwidth=(10, 10))
        self.live: dict[int, np.ndarray] = {}
        self.rng = np.random.default_rng(0)

    def _fill(self, off: int, n: int) -> None:
        data = self.rng.integers(0, 256, n, dtype=np.uint8)
        self.dev.view(off, n)[:] = data
        self.live[off] = data

    @rule(n=st.one_of(st.integers(1, 300), st.integers(300, 70000)))
    def allocate(self, n):
        off = self.dev.allocate(n)
        if off is None:
            assert not fits_anywhere(self.dev.heap, n)
        else:
            assert off not in self.live
            self._fill(off, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.dev.free(off)
        del self.live[off]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 100000), refuse_after=st.integers(0, 6), raise_=st.booleans())
    def evictfrom(self, data, n, refuse_after, raise_):
        start = data.draw(st.sampled_from([b.offset for b in self.dev.heap.blocks()]))
        given_up = []

        def cb(off, size):
            assert off in self.live and size == self.live[off].size
            if len(given_up) == refuse_after:
                if raise_:
                    raise RuntimeError("refused")
                return False
            given_up.append(off)
            return True

        try:
            result = self.dev.evictfrom(start, n, cb)
        except RuntimeError:
            result = None
        for off in given_up:
            del self.live[off]
        if result is not None:
            off = self.dev.allocate(n)
            assert off is not None
            self._fill(off, n)

    @rule(data=st.data(), n=st.integers(1, 100000))
    def room_possible(self, data, n):
        """`room_possible` says yes exactly when a walk from some block would succeed (planned with
        no callback), and changes nothing."""
        pinned = set(data.draw(st.sets(st.sampled_from(sorted(self.live)))) if self.live else set())
        movable = lambda off: off not in pinned  # noqa: E731
        heap = self.dev.heap
        before = list(heap.blocks())
        some_walk = any(heap._plan_span(b.offset, round_up(n, ALIGN), PAGE if n >= PAGE else ALIGN, movable)[2]
                        for b in before)
        assert heap.room_possible(n, movable) == some_walk
        assert list(heap.blocks()) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 100000), tries=st.integers(1, 12))
    def evict_tries(self, data, n, tries):
        """A policy's forced eviction: victim after victim for one request, some blocks pinned,
        with one DeadEnds. A walk it skips must fail without calling back when tried without."""
        pinned = set(data.draw(st.sets(st.sampled_from(sorted(self.live)))))
        movable = lambda off: off not in pinned  # noqa: E731
        dead = DeadEnds(n)
        for _ in range(tries):
            start = data.draw(st.sampled_from([b.offset for b in self.dev.heap.blocks()]))
            if dead.covers(start):
                assert self.dev.evictfrom(start, n, lambda off, size: pytest.fail("called back"), movable) is None
                continue
            given_up = []
            result = self.dev.evictfrom(start, n, lambda off, size: given_up.append(off) or True, movable, dead)
            for off in given_up:
                assert off not in pinned
                del self.live[off]
            if result is not None:
                assert len(dead) == 0
                off = self.dev.allocate(n)
                assert off is not None
                self._fill(off, n)
            self.dev.check()

    @rule()
    def defragment(self):
        moved = {}
        self.dev.defragment(lambda old, new, n: moved.__setitem__(old, new))
        self.live = {moved.get(o, o): d for o, d in self.live.items()}

    @invariant()
    def consistent(self):
        self.dev.check()
        assert self.dev.heap.noccupied == len(self.live)
        for off, data in self.live.items():
            assert np.array_equal(self.dev.view(off, data.size), data)


TestHeapMachine = HeapMachine.TestCase
TestHeapMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
