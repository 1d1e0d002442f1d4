"""`CorrelationPrefetchPolicy` on scripted sequences of uses whose right answers are worked out by hand.

Every script runs on a fast DRAM of 1 MiB (20 GB/s) over PM ("optane": 39 GB/s read), with objects of
240,000 bytes: four fit in fast memory, and the device model predicts 12 us per PM->DRAM copy.  A
scripted clock makes the recorded times (and so the look-ahead's time bound) exact.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cachedarrays as ca
from cachedarrays import DRAM, PM, CachedArray, CorrelationPrefetchPolicy, Manager, readable
from cachedarrays.policies.correlation import NEVER, Recording, accuracy_and_coverage

pytestmark = pytest.mark.usefixtures("young_gc")

N = 60_000  # float32 elements: 240,000 bytes


class Clock:
    """Seconds that move only when the script says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(n_objects, clock, fast="1MiB", **kw):
    pol = CorrelationPrefetchPolicy(clock=clock, **kw)
    m = Manager(DRAM(fast, bandwidth=(20, 20)), PM(None, "16MiB", bandwidth="optane"), policy=pol)
    xs = [CachedArray(np.full(N, i, np.float32), m) for i in range(n_objects)]
    return m, pol, xs


def places(xs):
    return [x.device for x in xs]


def use(x, clock, gap=1e-3):
    clock.t += gap
    with readable(x) as a:
        assert a[0] == a[-1]  # contents intact wherever the object went


def iteration(m, pol, xs, clock, gap=1e-3):
    """Mark, use ``xs`` in order ``gap`` seconds apart; return this iteration's counters."""
    clock.t += 1.0  # copies of the previous iteration are predicted done
    m.reset_telemetry()
    pol.mark_iteration()
    for x in xs:
        use(x, clock, gap)
    m.check()
    return m.telemetry()["counters"]


def moved(counters):
    keys = ("uses", "uses_in_fast", "demand_fetches", "learned_prefetches", "learned_prefetches_useful")
    return [counters.get(k, 0) for k in keys]


# ---------------------------------------------------------------------- the learned order and the look-ahead
def test_a_cycle_of_six_over_room_for_four_is_learned_and_prefetched_one_use_ahead():
    clock = Clock()
    m, pol, W = setup(6, clock)
    assert places(W) == ["PM", "PM", "DRAM", "DRAM", "DRAM", "DRAM"]  # LRU while nothing is learned
    # iteration 0 learns; nothing predicted yet: LRU with fetch on use thrashes, every use a miss
    assert moved(iteration(m, pol, W, clock)) == [6, 0, 6, 0, 0] and pol.learned is None

    # iteration 1: the mark prefetches W0 (next use 0) and evicts W5, whose next use (5) is furthest.
    # Recorded uses are 1 ms apart and a copy is predicted at 12 us, so each use prefetches only the next:
    # W0's use brings W1 (evicting W4: W0 itself is in use), W3's brings W4 (evicting W2, next used in the
    # next iteration at 2 + 6 = 8), W4's brings W5 (evicting W3: 9).
    clock.t += 1.0
    m.reset_telemetry()
    pol.mark_iteration()                               # iteration 0's uses become the learned order
    assert pol.learned.keys == [("id", w.object.id) for w in W]
    assert pol.learned.times == pytest.approx([1e-3 * (i + 1) for i in range(6)])
    assert places(W) == ["DRAM", "PM", "DRAM", "DRAM", "DRAM", "PM"]
    for i, w in enumerate(W):
        assert w.device == "DRAM"  # every use finds its object already in fast memory
        use(w, clock)
    counters = m.telemetry()["counters"]
    assert moved(counters) == [6, 6, 0, 4, 4]
    assert accuracy_and_coverage(counters) == (1.0, 1.0)
    assert places(W) == ["DRAM", "DRAM", "PM", "PM", "DRAM", "DRAM"]

    # iteration 2: W1's use brings W2 (evicting W0: 6 beats W4: 4, W5: 5), W2's brings W3 (evicting W1: 7),
    # W5's brings the next iteration's W0 (evicting W4: 10); W0 stays pending into iteration 3.
    assert moved(iteration(m, pol, W, clock)) == [6, 6, 0, 3, 2]
    assert places(W) == ["DRAM", "PM", "DRAM", "DRAM", "PM", "DRAM"]
    report = pol.report()
    assert report["prefetches_pending"] == 1 and report["prefetches_issued"] == 7
    assert report["prefetches_useful"] == 6 and report["accuracy"] == 1.0
    assert report["iterations"] == 3 and report["learned_uses"] == 6
    assert report["uses"] == 6 + 18 and report["uses_in_fast"] == 6 + 12  # the creation writes found fast memory


def test_objects_born_every_iteration_are_keyed_by_allocation_signature():
    clock = Clock()
    m, pol, (w,) = setup(1, clock)
    pol.mark_iteration()
    a = CachedArray(np.zeros(N, np.float32), m)
    b = CachedArray(np.zeros(1000, np.float32), m)
    c = CachedArray(np.zeros(N, np.float32), m)
    assert [pol.key(x.object.id) for x in (a, b, c)] == [("new", 240_000, 0), ("new", 4000, 0), ("new", 240_000, 1)]
    assert pol.key(w.object.id) == ("id", w.object.id)  # born before the iteration: its id is its key
    survivor = a.object.id
    pol.mark_iteration()
    assert pol.key(survivor) == ("id", survivor)  # a survivor is the same object in every later iteration
    extra = CachedArray(np.zeros(500, np.float32), m)   # an allocation of another size shifts nothing
    d = CachedArray(np.zeros(N, np.float32), m)
    assert pol.key(d.object.id) == ("new", 240_000, 0) and pol.key(extra.object.id) == ("new", 2000, 0)
    del a, b, c, d, extra
    m.check()


def test_a_new_object_of_each_iteration_is_prefetched_in_the_next():
    """Each iteration makes A (an activation), which is evicted while W0..W3 are used, then reads A."""
    clock = Clock()
    m, pol, W = setup(4, clock)

    def step():
        clock.t += 1.0
        m.reset_telemetry()
        pol.mark_iteration()
        clock.t += 1e-3
        a = CachedArray(np.full(N, 7, np.float32), m)   # born in fast memory (its write is a use)
        for w in W:
            use(w, clock)
        where = a.device
        use(a, clock)
        m.check()
        return where, m.telemetry()["counters"]

    where, counters = step()          # learning: A is pushed out by W3's fetch and fetched again at its use
    assert where == "PM" and counters["demand_fetches"] >= 1
    where, counters = step()          # the new A has the recorded A's key: W3's use prefetches it
    assert where == "DRAM"
    assert counters["uses"] == 6 and counters["uses_in_fast"] == 6 and not counters.get("demand_fetches")


def test_belady_victims_furthest_next_use_first_and_never_again_before_all():
    clock = Clock()
    m, pol, X = setup(4, clock)                        # A B C D fill fast memory
    iteration(m, pol, X, clock)                        # learn A B C D
    clock.t += 1.0
    pol.mark_iteration()
    use(X[0], clock)                                   # cursor at A
    assert [pol.next_use(x.object.id) for x in X] == [4, 1, 2, 3]  # A's next use is next iteration's first
    ids = [x.object.id for x in X]
    assert [v.id for v in pol.victims_on(m.fast, N)] == [ids[i] for i in (0, 3, 2, 1)]
    stray = CachedArray(np.zeros(N, np.float32), m)    # born now, under a key the learned order lacks
    assert places(X) == ["PM", "DRAM", "DRAM", "DRAM"]  # room for it: A, used furthest ahead, went
    assert pol.next_use(stray.object.id) == NEVER
    assert [v.id for v in pol.victims_on(m.fast, N)] == [stray.object.id] + [ids[i] for i in (3, 2, 1)]
    use(X[1], clock)                                   # cursor at B: B goes to the back of the line
    assert [v.id for v in pol.victims_on(m.fast, N)] == [stray.object.id] + [ids[i] for i in (1, 3, 2)]
    m.pin(X[3].object), m.pin(stray.object)           # pinned (no use): last, whatever their rank
    assert [v.id for v in pol.victims_on(m.fast, N)] == [ids[i] for i in (1, 2)] + [ids[3], stray.object.id]
    m.unpin(X[3].object), m.unpin(stray.object)
    other = CachedArray(np.zeros(N, np.float32), m)    # the object never used again goes first
    assert stray.device == "PM" and places(X) == ["PM", "DRAM", "DRAM", "DRAM"] and other.device == "DRAM"
    m.check()


def test_a_dirty_object_not_used_again_ranks_by_its_predicted_free():
    """Learned: T is born, A and B are used, T is freed (after 3 uses), C is used.  Next iteration, after
    T' and A: A is next used in the next iteration (5), C at 3, B at 2; T' is never used again, but it is
    dirty and freed at 3, so writing it back now would be wasted: it ranks as if used at 3 (after C in
    least-recent order), and A goes first."""
    clock = Clock()
    m, pol, (A, B, C) = setup(3, clock)

    def step():
        clock.t += 1.0
        pol.mark_iteration()
        t = CachedArray(np.full(N, 9, np.float32), m)
        use(A, clock)
        return t

    t = step()
    use(B, clock)
    ca.unsafe_free(t)
    use(C, clock)
    t = step()
    assert pol.learned.frees == {("new", 240_000, 0): 3}
    assert pol.next_use(t.object.id) == NEVER and pol.predicted_free(t.object.id) == 3
    assert [v.id for v in pol.victims_on(m.fast, N)] == [x.object.id for x in (A, C, t, B)]
    CachedArray(np.zeros(N, np.float32), m)            # needs one object's room
    assert places([A, B, C, t]) == ["PM", "DRAM", "DRAM", "DRAM"]
    m.check()


def test_look_ahead_is_bounded_by_free_fast_memory():
    """With no time bound, the mark prefetches until fast memory holds only objects needed sooner."""
    clock = Clock()
    m, pol, W = setup(6, clock, slack=float("inf"))
    iteration(m, pol, W, clock)                        # learned; W2..W5 in fast, W0 W1 in PM
    assert places(W) == ["PM", "PM", "DRAM", "DRAM", "DRAM", "DRAM"]
    m.reset_telemetry()
    pol.mark_iteration()
    # W0 evicts W5 (next use 5), W1 evicts W4 (4); W4 would have to evict an object needed before it: stop
    assert places(W) == ["DRAM", "DRAM", "DRAM", "DRAM", "PM", "PM"]
    assert m.telemetry()["counters"]["learned_prefetches"] == 2
    m.check()


def test_a_prefetch_that_an_object_born_before_its_use_would_push_out_is_not_issued():
    """Learned order W2 A W0 W2 W1 W4 W3, where A is born just before its use and freed after W4's;
    room for four, no time bound. Without counting A, a walk fills the fourth slot with a weight
    needed after A's birth, and A's allocation evicts it unused (a prefetch wasted: 5 issued, 4 used).
    Counting the bytes born before each use, the walk leaves A its room: 4 issued, all used, and
    every use still finds its object in fast memory."""
    clock = Clock()
    m, pol, W = setup(5, clock, slack=float("inf"))
    order = [2, "A", 0, 2, 1, 4, 3]
    for _ in range(4):
        clock.t += 1.0
        m.reset_telemetry()
        pol.mark_iteration()
        for j, w in enumerate(order):
            if w == "A":
                A = CachedArray(np.full(N, 77, np.float32), m)
                use(A, clock)
            else:
                use(W[w], clock)
            if j == 5:
                ca.unsafe_free(A)
        m.check()
    assert moved(m.telemetry()["counters"]) == [8, 8, 0, 4, 4]
    assert m.telemetry()["counters"].get("learned_prefetches_evicted_unused", 0) == 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_recorded_growth_is_the_peak_of_bytes_born_less_bytes_freed_over_the_window(data):
    """`Recording.growth(c, q)` against a direct sum: the largest, over the uses t in (c, q], of the
    bytes of objects first used in (c, t] less those freed in (c, t] (frees after the last use count
    at the iteration's end, before the next iteration's first use)."""
    n_new = data.draw(st.integers(0, 5), label="new objects")
    ids = data.draw(st.lists(st.integers(0, 3), max_size=6), label="weights used")
    keys = [("new", data.draw(st.sampled_from([8, 16, 40]), label="size"), i) for i in range(n_new)]
    seq = data.draw(st.permutations(keys + [("id", i) for i in ids] + keys), label="order") if keys or ids else []
    if not seq:
        return
    n = len(seq)
    frees = {k: data.draw(st.integers(seq.index(k) + 1, n), label="free") for k in keys
             if data.draw(st.booleans(), label="freed")}
    rec = Recording(list(seq), [float(i) for i in range(n)], float(n), 40, frees)
    delta = [0] * (n + 1)
    for k in keys:
        delta[seq.index(k)] += k[1]
        if k in frees:
            delta[frees[k]] -= k[1]
    stream = delta[:n] + [delta[n] + delta[0]] + delta[1:n]  # next iteration: the end's frees, then its uses
    for c in range(-1, n - 1):
        for q in range(c + 1, 2 * n):
            running, best = 0, None
            for t in range(c + 1, q + 1):
                running += stream[t]
                best = running if best is None else max(best, running)
            assert rec.growth(c, q) == best, (seq, frees, c, q)


@pytest.mark.parametrize("gap, prefetched", [(1e-3, 1), (40e-6, 2), (1e-6, 6)])
def test_look_ahead_is_bounded_by_predicted_copy_time(gap, prefetched):
    """Room for all six; the mark prefetches use q while gap(q) < 2 * (backlog + 12 us): uses 1 ms apart
    need only the first, 40 us apart the first two (80 us >= 2 * (24 + 12) us), 1 us apart all six."""
    clock = Clock()
    m, pol, W = setup(6, clock, fast="2MiB")
    iteration(m, pol, W, clock, gap)                   # recorded with these gaps
    ca.evict(W)
    clock.t += 1.0
    pol.mark_iteration()
    assert places(W) == ["DRAM"] * prefetched + ["PM"] * (6 - prefetched)
    assert pol.stats["learned_prefetches"] == prefetched
    m.check()


def test_max_ahead_caps_the_walk():
    clock = Clock()
    m, pol, W = setup(6, clock, fast="2MiB", slack=float("inf"), max_ahead=3)
    iteration(m, pol, W, clock)
    ca.evict(W)
    clock.t += 1.0
    pol.mark_iteration()
    assert places(W) == ["DRAM"] * 3 + ["PM"] * 3
    m.check()


# ---------------------------------------------------------------------- accuracy and coverage
def test_accuracy_and_coverage_count_wasted_prefetches():
    """Learned A B C D; then A's use prefetches B, which the program evicts before using it (a miss),
    and C's use prefetches D, which the program frees: 4 issued, 2 useful (A, C), 1 evicted unused,
    1 freed unused, so accuracy 2/4; coverage 2/3 (B was not in fast memory at its use)."""
    clock = Clock()
    m, pol, X = setup(4, clock)
    iteration(m, pol, X, clock)
    ca.evict(X)
    clock.t += 1.0
    m.reset_telemetry()
    pol.mark_iteration()                               # prefetches A
    use(X[0], clock)                                   # prefetches B
    ca.evict(X[1])
    use(X[1], clock)                                   # fetched on use; prefetches C
    use(X[2], clock)                                   # prefetches D
    ca.unsafe_free(X[3])
    counters = m.telemetry()["counters"]
    assert [counters.get(k, 0) for k in ("learned_prefetches", "learned_prefetches_useful",
                                         "learned_prefetches_evicted_unused", "learned_prefetches_freed_unused",
                                         "demand_fetches", "uses", "uses_in_fast")] == [4, 2, 1, 1, 1, 3, 2]
    assert accuracy_and_coverage(counters) == (0.5, pytest.approx(2 / 3))
    report = pol.report()
    assert report["accuracy"] == 0.5 and report["prefetches_pending"] == 0
    m.check()


def test_hints_are_ignored_unless_asked_for_and_softevict_changes_nothing():
    clock = Clock()
    m, pol, X = setup(2, clock)
    ca.evict(X[0])
    ca.prefetch(X[0])
    assert X[0].device == "PM"
    assert m.telemetry()["counters"]["prefetches_ignored"] == 1
    m2, pol2, Y = setup(2, clock, hints=True)
    ca.evict(Y[0])
    ca.prefetch(Y[0])
    assert Y[0].device == "DRAM"
    order = [v.id for v in pol2.victims_on(m2.fast, 1)]
    ca.softevict(Y[1])
    assert [v.id for v in pol2.victims_on(m2.fast, 1)] == order
    m.check()
    m2.check()


def test_an_iteration_longer_than_max_uses_is_not_learned():
    clock = Clock()
    m, pol, X = setup(3, clock, max_uses=2)
    iteration(m, pol, X[:2], clock)
    iteration(m, pol, X, clock)                        # 3 uses: not learned; the 2-use order stays
    clock.t += 1.0
    pol.mark_iteration()
    assert len(pol.learned) == 2 and m.telemetry()["counters"]["recordings_too_long"] == 1
    m.check()


def test_without_marks_nothing_is_recorded_and_eviction_is_lru():
    clock = Clock()
    m, pol, X = setup(5, clock)                        # the fifth evicted the least recently used
    assert places(X) == ["PM", "DRAM", "DRAM", "DRAM", "DRAM"]
    use(X[1], clock)
    CachedArray(np.zeros(N, np.float32), m)
    assert places(X) == ["PM", "DRAM", "PM", "DRAM", "DRAM"] and pol.learned is None and not pol._keys
    m.check()


def test_bad_arguments_are_refused():
    for kw, msg in [({"slack": 0}, "slack"), ({"slack": "2"}, "slack"), ({"max_ahead": 0}, "max_ahead"),
                    ({"max_uses": 0}, "max_uses")]:
        with pytest.raises(ValueError, match=msg):
            CorrelationPrefetchPolicy(**kw)
    with pytest.raises(RuntimeError, match="not attached"):
        CorrelationPrefetchPolicy().mark_iteration()


def test_recorded_gaps_come_from_the_stamps_clock_not_the_host_clock():
    """On a GPU the stamps are CUDA events; here a scripted stamps object stands for them: the
    learned times must be its seconds, whatever the host clock said."""
    class Stamps:
        def __init__(self):
            self.n = 0

        def stamp(self):
            self.n += 1
            return self.n

        def seconds(self, stamps):
            return [0.5 * (s - stamps[0]) for s in stamps]   # half a second of device time per stamp

    clock = Clock()
    pol = CorrelationPrefetchPolicy(clock=clock, stamps=Stamps())
    with Manager(DRAM("1MiB"), PM(None, "16MiB"), policy=pol) as m:
        xs = [CachedArray(np.full(N, i, np.float32), m) for i in range(3)]
        iteration(m, pol, xs, clock, gap=1e-3)
        iteration(m, pol, xs, clock, gap=1e-3)
        assert pol.learned.times == [0.5, 1.0, 1.5] and pol.learned.period == 2.0


# ---------------------------------------------------------------------- the settled range changes no decision
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), slack=st.sampled_from([0.5, 2.0, math.inf]), fast=st.sampled_from(["600KiB", "1MiB", "2MiB"]))
def test_walks_with_shortcuts_decide_exactly_as_walks_without(data, slack, fast):
    """Two managers run the same random program (weights used every iteration in a mostly repeated
    order, activations born, read and freed each iteration, scripted gaps): one policy starts every
    walk at the next use and tries to make room for every prefetch it reaches, the other skips the
    settled range and the prefetches that cannot find room (`skip_futile`). After every use both hold
    every object on the same level and have counted the same prefetches, hits and fetches."""
    nw = data.draw(st.integers(2, 6), label="weights")
    order = data.draw(st.lists(st.integers(0, nw - 1), min_size=3, max_size=12), label="order")
    sizes = [N, N // 2, N // 3]
    runs = []
    for skip in (False, True):
        clock = Clock()
        pol = CorrelationPrefetchPolicy(clock=clock, slack=slack)
        pol.skip_settled = pol.skip_futile = skip
        m = Manager(DRAM(fast, bandwidth=(20, 20)), PM(None, "16MiB", bandwidth="optane"), policy=pol)
        runs.append((clock, pol, m, [CachedArray(np.full(sizes[i % 3], i, np.float32), m) for i in range(nw)]))
    for it in range(4):
        uses = list(order)
        if data.draw(st.booleans(), label=f"perturb {it}"):
            uses.insert(data.draw(st.integers(0, len(uses)), label="at"), data.draw(st.integers(0, nw - 1), label="w"))
        births = data.draw(st.lists(st.integers(0, len(uses)), max_size=3), label=f"births {it}")
        gaps = data.draw(st.lists(st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]), min_size=len(uses), max_size=len(uses)),
                         label=f"gaps {it}")
        acts = [[] for _ in runs]
        for clock, pol, m, _ in runs:
            clock.t += 1.0
            pol.mark_iteration()
        for j, (w, gap) in enumerate(zip(uses, gaps)):
            for r, (clock, pol, m, ws) in enumerate(runs):
                for b in births:
                    if b == j:
                        acts[r].append(CachedArray(np.full(N // 2, 100 + j, np.float32), m))
                use(ws[w], clock, gap)
                if acts[r] and j % 3 == 2:
                    use(acts[r][0], clock, gap)
            (_, p0, m0, w0), (_, p1, m1, w1) = runs
            assert places(w0) == places(w1) and places(acts[0]) == places(acts[1]), (it, j)
            assert p0.stats == p1.stats, (it, j)
        for r, (clock, pol, m, ws) in enumerate(runs):
            acts[r].clear()
            m.check()


@pytest.mark.parametrize("event", ["use", "free", "evict"])
def test_a_prefetch_found_without_room_is_retried_once_room_may_have_appeared(event):
    """Learned order A B C D A E, room for four, no time bound. The mark brings A B C D; E (position 5)
    cannot come, as A B C D are all needed before it, and that outcome is remembered. It must be retried
    as soon as room may have appeared: B's use moves B's next use past E's (E comes at C's use, evicting
    B), D is freed (E comes at A's use, into D's room), or D is evicted (A's use brings D back first,
    so E again waits for C's use). A policy that tries every time makes the same moves."""
    runs = []
    for shortcuts in (False, True):
        clock = Clock()
        m, pol, (A, B, C, D, E) = setup(5, clock, slack=float("inf"))
        pol.skip_settled = pol.skip_futile = shortcuts
        iteration(m, pol, [A, B, C, D, A, E], clock)
        clock.t += 1.0
        pol.mark_iteration()
        assert places([A, B, C, D, E]) == ["DRAM"] * 4 + ["PM"], shortcuts
        seen = []
        if event == "free":
            ca.unsafe_free(D)
        elif event == "evict":
            ca.evict(D)
        for x in (A, B, C):
            use(x, clock)
            seen.append(places([A, B, C, E]))
        m.check()
        runs.append(seen)
    assert runs[0] == runs[1]
    if event == "free":
        assert [s[3] for s in runs[1]] == ["DRAM"] * 3
    else:
        assert runs[1] == [["DRAM", "DRAM", "DRAM", "PM"], ["DRAM", "DRAM", "DRAM", "PM"],
                           ["DRAM", "PM", "DRAM", "DRAM"]]
