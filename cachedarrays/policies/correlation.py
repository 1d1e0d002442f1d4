"""`CorrelationPrefetchPolicy`: learn one iteration's order of uses, prefetch ahead of it in the
next, and evict the object whose next use is furthest away (Belady with the learned order).

Training repeats one sequence of array uses per iteration; DeepUM (ASPLOS '23, section 4) records
that sequence in correlation tables and prefetches the successors of what is used now.  This policy
does the same at the level of objects, with no annotations: it sees every use (`on_use`), records
the sequence of one iteration, and in the next one walks that sequence ahead of the program.

Keys.  Activations and gradients are new objects in every iteration, so object ids do not repeat.
A use is recorded under the key of its object:

- an object born in the current iteration: ``("new", nbytes, n)``, the ``n``-th allocation of
  ``nbytes`` bytes since the iteration began (an allocation-site signature).  Counting per size
  keeps the key stable when an allocation of another size is added or dropped, where a plain
  allocation index or the position in the use sequence would shift every later key;
- an object born before it (weights, optimiser state, anything that survives an iteration):
  ``("id", object id)``: the very same object is used again in every later iteration.

An object thus changes key once, when its first iteration ends.  Objects of the recorded
iteration map to the objects of the current one with the same key; where a key has no live
object (not born yet, or gone) nothing is prefetched for it.

Iteration boundary: explicit.  The program calls `mark_iteration` at the start of every iteration
(the CNN trainer does, at the start of each step); the uses between two marks become the learned
order (re-learned every iteration, so the order follows a program that changes).  Nothing is
recorded before the first mark, and a program that never marks gets least-recently-used eviction
with fetch on use (`LRUPolicy` with insert on use).  Detecting the boundary from the keys alone
does not work here: the ``"new"`` keys are counted from the boundary they would have to detect.

Cursor.  The ``j``-th use of a key in this iteration is matched to the ``j``-th use of that key in
the recorded one; that position is the cursor, so a use the recording lacks (or an extra one)
shifts nothing.  Predicted next use of an object: the first recorded position of its key after
the cursor; for ``"id"`` keys, past the end of the recording, their first use in the next
iteration (positions ``L + i`` for a recording of ``L`` uses).  Otherwise: never.

Look-ahead.  After each use (and at each mark) the policy walks the learned order from the cursor
and prefetches to the fast level the live objects that are not there, within two bounds:

- time: the recording keeps when each use happened, so the predicted compute time from the next
  use to a use ``q`` is ``gap(q) = t(q) - t(cursor + 1)``.  A copy that can still be hidden if it
  starts at the next use waits: ``q`` is prefetched now only when ``gap(q) < slack * (backlog +
  copy(q))``, where ``copy(q)`` is the device model's time (`devices.perf.copy_seconds` with the
  source's and the fast level's `Bandwidth`) and ``backlog`` the modeled time of the copies this
  policy has issued and that are not predicted done yet.  The walk ends where even the largest
  recorded object could wait (``gap(q) >= slack * (backlog + copy(largest))``), or after
  ``max_ahead`` uses.  The measured gaps include any wait for copies in the recorded iteration:
  an iteration that stalled makes the next look further ahead.
- free fast memory: making room for ``q`` may evict only objects whose predicted next use comes
  after ``q``'s (those needed sooner, and the object in use, are pinned while room is made).
  When no room can be made that way the walk ends: fast memory is full of objects needed sooner.
  Room is also left for what the recording says is born before ``q`` (`Recording.growth`: the
  most bytes born less bytes freed at any use up to ``q``): those allocations would otherwise
  evict the prefetched object, whose next use is then the furthest, before its use.  (On the
  H100's DenseNet at half its footprint: 19.2 -> 11.1 GiB moved in a step, accuracy 76 -> 83%,
  coverage 98% either way.)

The walk skips what it has already found settled: the positions from where a walk started up to
the first one it left unsettled (an object not on the fast level that it did not bring there) all
had their objects on the fast level, and stay so until one of those objects leaves it (or is born
elsewhere), which moves that bound back to the object's first position in the range.  A later walk
whose start falls in that range begins at its bound: it would have stepped over the same objects,
and the time bound, which grows with the position, cannot have ended it earlier.  (On a GPU
DenseNet a walk from the next use steps over about fifty settled positions per use.)

Eviction (`victims_on`, any level): Belady with the learned order: furthest predicted next use
first, objects never used again before everything else; ties (e.g. before anything is learned)
in least-recently-used order.  One refinement counts bytes: the recording also notes where objects
are freed, and an object not used again whose eviction would write bytes (dirty, or no copy below)
ranks by its predicted free instead, as if it were used there: written back, its bytes would be
read by nobody.  (In the CNN, activations are dead and dirty between their last read and the
cleanup a layer later; evicting them first wrote 42.7 MiB per iteration to PM instead of 24.6 at
half the footprint, resnet26.)  Without a predicted free it is never used again, and goes first.
Evictions cascade down the levels as in every policy.

Misses: a use whose object is not on the fast level fetches it there first (``insert_on_use``,
default on: a GPU kernel cannot read host memory), evicting in Belady order.

Metrics (`report`, and telemetry counters through ``manager.record``): ``uses`` and
``uses_in_fast`` (coverage: uses that found their object on the fast level, where the copy may
still be in flight), ``learned_prefetches`` issued and, once each is resolved,
``learned_prefetches_useful`` (used while still on the fast level), ``_evicted_unused`` and
``_freed_unused``; accuracy is useful over resolved.  ``demand_fetches`` counts misses fetched.

Hints: `prefetch` hints are ignored unless ``hints=True`` (the policy needs none), `softevict` is
ignored (the learned order knows better), frees are honoured unless ``honor_frees=False``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import time
from typing import Callable

from ..devices import Device
from ..devices.perf import copy_seconds
from ..errors import InvariantError
from ..manager import Manager, Object, Region
from .base import Policy
from .lru import LRUPolicy

Key = tuple  # ("id", object id) or ("new", nbytes, n)
NEVER = math.inf


class Recording:
    """One iteration's uses: keys in order, seconds since the iteration began, its length in seconds, and
    where objects were freed."""

    __slots__ = ("keys", "times", "period", "positions", "max_nbytes", "frees", "_net", "_peaks")

    def __init__(self, keys: list[Key], times: list[float], period: float, max_nbytes: int,
                 frees: dict[Key, int] | None = None):
        self.keys = keys
        self.times = times
        self.frees = frees or {}  # key -> number of uses before its object was freed
        self.period = max(period, times[-1] if times else 0.0)
        self.max_nbytes = max_nbytes
        self.positions: dict[Key, list[int]] = collections.defaultdict(list)  # ascending
        for i, key in enumerate(keys):
            self.positions[key].append(i)
        self.positions = dict(self.positions)
        delta = [0] * (len(keys) + 1)  # bytes born (first use of a "new" key) less bytes freed, by position
        for key, pos in self.positions.items():
            if key[0] == "new":
                delta[pos[0]] += key[1]
        for key, f in self.frees.items():
            if key[0] == "new" and key in self.positions:
                delta[min(f, len(keys))] -= key[1]
        self._net = net = list(itertools.accumulate(delta, initial=0))  # net[p]: sum of delta[:p]
        self._peaks = [net]  # _peaks[k][p]: the largest of net[p : p + 2**k] (a sparse table)
        while 2 ** len(self._peaks) <= len(net):
            prev, half = self._peaks[-1], 2 ** (len(self._peaks) - 1)
            self._peaks.append([max(prev[p], prev[p + half]) for p in range(len(prev) - half)])

    def __len__(self) -> int:
        return len(self.keys)

    def growth(self, c: int, q: int) -> int:
        """The most bytes that objects born after use ``c`` occupy (less those freed since) at any use
        up to ``q``, as recorded; ``q`` up to one recording past its end."""
        n, net = len(self.keys), self._net
        base = net[c + 1]
        if q < n:
            return self._peak(c + 2, q + 2) - base
        return max(self._peak(c + 2, n + 1), net[n + 1] + self._peak(1, q - n + 2)) - base

    def _peak(self, lo: int, hi: int) -> int:
        """The largest of ``_net[lo:hi]`` (the smallest integer for an empty range)."""
        if hi <= lo:
            return -(1 << 62)
        k = (hi - lo).bit_length() - 1
        row = self._peaks[k]
        return max(row[lo], row[hi - (1 << k)])

    def time(self, q: int) -> float:
        """Seconds from the recorded iteration's start to use ``q`` (``q >= len``: the next iteration;
        ``q = -1``: the start)."""
        n = len(self.keys)
        if q < 0:
            return 0.0
        return self.times[q] if q < n else self.period + self.times[q - n]


def accuracy_and_coverage(counters: dict) -> tuple[float | None, float | None]:
    """``(accuracy, coverage)`` from this policy's counters (e.g. one iteration's telemetry counters);
    None where there is nothing to divide."""
    useful = counters.get("learned_prefetches_useful", 0)
    resolved = useful + counters.get("learned_prefetches_evicted_unused", 0) + \
        counters.get("learned_prefetches_freed_unused", 0)
    uses = counters.get("uses", 0)
    return (useful / resolved if resolved else None,
            counters.get("uses_in_fast", 0) / uses if uses else None)


class HostStamps:
    """Stamps of host time: ``clock()`` readings."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def stamp(self) -> float:
        return self.clock()

    def seconds(self, stamps: list) -> list[float]:
        return [t - stamps[0] for t in stamps] if stamps else []


class CorrelationPrefetchPolicy(LRUPolicy):
    """Learned prefetch and Belady eviction for programs that repeat a sequence of uses; see the module
    docstring.

    ``slack``: how many times the predicted copy time must fit between the next use and a use before
    that use's prefetch may wait (``math.inf``: only free fast memory bounds the look-ahead).
    ``max_ahead``: the most uses the look-ahead walks (default: one iteration).  ``hints``: honour
    `prefetch` hints too.  ``honor_frees``: as `LRUPolicy`'s M.  ``insert_on_use``: fetch a missed
    object to the fast level at its use.  ``max_uses``: an iteration with more uses is not learned
    (memory bound).  ``clock``: seconds, for the recorded times and the copy backlog (tests script it).
    ``stamps``: where the recorded times come from instead, an object with ``stamp()`` (a token for
    now) and ``seconds(tokens)`` (seconds after the first token): on a GPU a
    `devices.gpu.DeviceClock`, so the gaps are device time, not the host time of asynchronous
    dispatch.
    """

    skip_settled = True  # False: every walk starts at the next use (the tests compare both)
    skip_futile = True   # False: every prefetch the walk reaches tries to make room (the tests compare both)

    def __init__(self, slack: float = 2.0, max_ahead: int | None = None, hints: bool = False,
                 honor_frees: bool = True, insert_on_use: bool = True, max_uses: int = 1 << 20,
                 clock: Callable[[], float] = time.perf_counter, stamps=None):
        if not (isinstance(slack, (int, float)) and slack > 0):
            raise ValueError(f"slack must be a positive number (math.inf for no time bound), got {slack!r}")
        if max_ahead is not None and (not isinstance(max_ahead, int) or max_ahead < 1):
            raise ValueError(f"max_ahead must be a positive int or None, got {max_ahead!r}")
        if not isinstance(max_uses, int) or max_uses < 1:
            raise ValueError(f"max_uses must be a positive int, got {max_uses!r}")
        super().__init__(local_alloc=True, honor_frees=honor_frees, prefetch=hints, insert_on_use=insert_on_use)
        self.slack = float(slack)
        self.max_ahead = max_ahead
        self.max_uses = max_uses
        self.clock = clock
        self.stamps = HostStamps(clock) if stamps is None else stamps
        self._reset()

    def __repr__(self) -> str:
        return f"CorrelationPrefetchPolicy(slack={self.slack}, max_ahead={self.max_ahead})"

    def _reset(self) -> None:
        self.iterations = 0                               # marks seen
        self.learned: Recording | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self._start = None                                # stamp at the last mark
        self._keys: list[Key] = []                        # this iteration's uses so far
        self._times: list = []                            # their stamps
        self._max_nbytes = 0
        self._overflow = False
        self._frees: dict[Key, int] = {}                  # key -> uses before it was freed, this iteration
        self._seen: collections.Counter[Key] = collections.Counter()  # uses of each key this iteration
        self._cursor = -1                                 # position in `learned` of the latest use
        self._born: collections.Counter[int] = collections.Counter()  # allocations per size this iteration
        self._newborn: dict[int, Key] = {}                # id -> key, objects born this iteration
        self._by_key: dict[Key, int] = {}                 # key -> id, objects born this iteration
        self._speculative: set[int] = set()               # prefetched by the look-ahead, not used yet
        self._busy_until = 0.0                            # when the copies issued here are predicted done
        self._settled = (0, 0)                            # [lo, hi): learned positions whose objects are in fast
        self._quiet: tuple | None = None                  # (t, busy_until, lo): see `_quiet_until`
        self._moved_out = 0                               # objects that left the fast level (or were born below)
        self._longest = 0.0                               # modeled copy time of the largest learned object
        self._ranked: list[Object] | None = None          # `victims_on(fast)` within `_prefetch_before`
        self._futile: tuple | None = None                 # (id, q, bytes needed by q, released then): `_prefetch_before`
        self._released = 0                                # bytes that may have stopped being needed since

    def attach(self, manager: Manager) -> None:
        super().attach(manager)
        self._reset()

    # ------------------------------------------------------------------ the iteration boundary
    def mark_iteration(self) -> None:
        """A new iteration begins: the uses since the previous mark become the learned order, and
        the look-ahead starts prefetching the new iteration's first uses."""
        with self.m.lock():
            now = self.stamps.stamp()
            if self.iterations and self._keys and not self._overflow:
                seconds = self.stamps.seconds([self._start, *self._times, now])
                self.learned = rec = Recording(self._keys, seconds[1:-1], seconds[-1], self._max_nbytes,
                                               self._frees)
                self._longest = max(self._copy_seconds(rec.max_nbytes, dev) for dev in self.levels[1:])
            elif self._overflow:
                self._count("recordings_too_long")
            self.iterations += 1
            self._start = now
            self._keys, self._times, self._max_nbytes, self._overflow, self._frees = [], [], 0, False, {}
            self._seen.clear()
            self._born.clear()
            self._newborn.clear()
            self._by_key.clear()
            self._cursor = -1
            self._settled = (0, 0)
            self._quiet = None
            self._futile = None
            self.m.record("iterations_marked")
            self._look_ahead(None)

    # ------------------------------------------------------------------ keys and predictions
    def key(self, obj_id: int) -> Key:
        """The key uses of object ``obj_id`` are recorded under now (see the module docstring)."""
        return self._newborn.get(obj_id) or ("id", obj_id)

    def next_use(self, obj_id: int) -> float:
        """Predicted position (in the learned order) of ``obj_id``'s next use after the cursor; `NEVER`
        (infinity) for an object not expected again."""
        rec = self.learned
        if rec is None:
            return NEVER
        key = self.key(obj_id)
        pos = rec.positions.get(key)
        if not pos:
            return NEVER
        i = bisect.bisect_right(pos, self._cursor)
        if i < len(pos):
            return pos[i]
        return pos[0] + len(rec) if key[0] == "id" else NEVER

    def predicted_free(self, obj_id: int) -> float:
        """Predicted position (in the learned order) where ``obj_id`` is freed, after the cursor; `NEVER`
        if no free is predicted."""
        rec = self.learned
        f = rec.frees.get(self.key(obj_id)) if rec is not None else None
        return f if f is not None and f > self._cursor else NEVER

    def eviction_rank(self, obj: Object, device: Device) -> float:
        """How long evicting ``obj`` from ``device`` can wait (larger goes first): its predicted next use;
        for an object not used again whose eviction would write bytes, its predicted free (the bytes would
        be written for nobody), or `NEVER` when no free is predicted either."""
        rank = self.next_use(obj.id)
        if rank == NEVER and self._writes_back(obj, device):
            return self.predicted_free(obj.id)
        return rank

    def _writes_back(self, obj: Object, device: Device) -> bool:
        """Whether evicting ``obj`` from ``device`` copies bytes (no current copy on the level below)."""
        x = self.m.primary(obj)
        below = self.m.below(device)
        if x.device is not device or below is None:
            return False  # a copy kept below a faster primary is dropped, not written
        return self.m.getlinked(x, below) is None or self.m.isdirty(x)

    def _object_for(self, key: Key, next_iteration: bool) -> Object | None:
        """The live object that will make the recorded use of ``key``."""
        if key[0] == "id":
            return self.m.getobject(key[1])
        if next_iteration:
            return None  # born in an iteration that has not begun
        obj_id = self._by_key.get(key)
        return None if obj_id is None else self.m.getobject(obj_id)

    # ------------------------------------------------------------------ hooks
    def on_move(self, obj: Object, old: Device | None, new: Device) -> None:
        if old is None:  # born
            n = self._born[obj.nbytes]
            self._born[obj.nbytes] = n + 1
            key = ("new", obj.nbytes, n)
            self._newborn[obj.id] = key
            self._by_key[key] = obj.id
        elif old is self.fast and new is not self.fast and obj.id in self._speculative:
            self._speculative.discard(obj.id)
            self._count("learned_prefetches_evicted_unused")
        if new is not self.fast and (old is None or old is self.fast):
            self._unsettle(obj)
            if old is self.fast:
                self._released += obj.nbytes
        super().on_move(obj, old, new)

    def _unsettle(self, obj: Object) -> None:
        """``obj`` is not on the fast level (any more): the settled range ends before its first use in it,
        and the next walk may have to bring it back."""
        self._quiet = None
        self._moved_out += 1
        lo, hi = self._settled
        rec = self.learned
        if hi <= lo or rec is None:
            return
        key = self.key(obj.id)
        pos = rec.positions.get(key)
        if not pos:
            return
        n = len(rec)
        i = bisect.bisect_left(pos, lo)
        first = pos[i] if i < len(pos) else NEVER
        if key[0] == "id":  # also used in the next iteration, at positions n + p
            i = bisect.bisect_left(pos, lo - n)
            if i < len(pos):
                first = min(first, pos[i] + n)
        if first < hi:
            self._settled = (lo, first)

    def forget(self, obj_id: int, regions: dict[str, Region]) -> None:
        gone = regions.get(self.fast.name)
        if gone is not None:
            self._released += gone.nbytes
        if self.iterations and not self._overflow:
            self._frees[self.key(obj_id)] = len(self._keys)
        super().forget(obj_id, regions)
        if obj_id in self._speculative:
            self._speculative.discard(obj_id)
            self._count("learned_prefetches_freed_unused")
        key = self._newborn.pop(obj_id, None)
        if key is not None:
            self._by_key.pop(key, None)

    def on_softevict(self, obj: Object) -> None:
        """Ignored: the learned order ranks victims."""

    def on_use(self, obj: Object, write: bool) -> None:
        hit = self.in_fast(obj)
        self._count("uses")
        if hit:
            self._count("uses_in_fast")
        if obj.id in self._speculative:
            self._speculative.discard(obj.id)
            self._count("learned_prefetches_useful")
        cursor = self._cursor
        self._record(obj)
        futile = self._futile
        if futile is not None:
            if self._cursor > cursor + 1:
                self._futile = None  # the uses it skipped moved other objects' next uses
            elif self.next_use(obj.id) > futile[1]:
                self._released += obj.nbytes
        self._touch(obj)
        if not hit and self.insert_on_use and self._fetch(obj, force=True):
            self._count("demand_fetches")
        self._look_ahead(obj)

    def victims_on(self, device: Device, nbytes: int) -> list[Object]:
        """Objects with a region on ``device`` by `eviction_rank`, largest first (furthest next use; never
        used again first, unless that would write back bytes of an object predicted to be freed), ties
        least recently used first. Pinned objects, which no eviction can take (a forced prefetch pins
        every object used before the one it brings in), come last, unranked: ranking was a third of
        the time cap spent making room on the H100's DenseNet (0.66 of 1.99 s in two profiled steps).
        Within `_prefetch_before` the fast level's order is the one it ranked already."""
        if device is self.fast and self._ranked is not None:
            ranked, self._ranked = self._ranked, None
            return ranked
        found: dict[int, Object] = {}
        for obj_id in self._orders.get(device.name, ()):
            obj = self.m.getobject(obj_id)
            if obj is not None:
                found[obj_id] = obj
        if device is not self.fast:  # copies kept below faster primaries take room here too
            for obj in self.m.objects_on(device):
                found.setdefault(obj.id, obj)
        free, pinned = [], []
        for o in found.values():
            (pinned if self.m.pinned(o) else free).append(o)
        return sorted(free, key=lambda o: -self.eviction_rank(o, device)) + pinned  # stable: LRU among ties

    # ------------------------------------------------------------------ recording and look-ahead
    def _record(self, obj: Object) -> None:
        if not self.iterations:
            return  # nothing is learned before the first mark
        key = self.key(obj.id)
        if not self._overflow:
            if len(self._keys) >= self.max_uses:
                self._overflow = True
            else:
                self._keys.append(key)
                self._times.append(self.stamps.stamp())
                self._max_nbytes = max(self._max_nbytes, obj.nbytes)
        j = self._seen[key]
        self._seen[key] = j + 1
        rec = self.learned
        pos = rec.positions.get(key) if rec is not None else None
        if pos and j < len(pos):
            self._cursor = pos[j]

    def _copy_seconds(self, nbytes: int, src: Device) -> float:
        return copy_seconds(nbytes, src.bandwidth, self.fast.bandwidth)

    def _look_ahead(self, current: Object | None) -> None:
        """Prefetch the objects of the next recorded uses, within the time and memory bounds (from the
        end of the settled range when the walk would start inside it)."""
        rec = self.learned
        if rec is None or not len(rec):
            return
        c = self._cursor
        t_next = rec.time(c + 1)
        quiet = self._quiet
        if (quiet is not None and t_next < quiet[0] and quiet[1] == self._busy_until and quiet[2] <= c + 1
                and self.skip_settled):
            return  # it would defer the same copies and end at the same use
        self._quiet = None
        backlog = max(0.0, self._busy_until - self.clock())
        longest = self._longest
        timed = math.isfinite(self.slack)
        steps = len(rec) if self.max_ahead is None else min(len(rec), self.max_ahead)
        end = c + 1 + steps
        lo, hi = self._settled
        if not (self.skip_settled and lo <= c + 1 <= hi):
            lo = hi = c + 1
        stop, unsettled = hi, NEVER  # the walk's end, and the first position it left unsettled
        deferred: list[tuple[int, float]] = []  # (position, copy time) of the copies left for a later use
        moved_out = self._moved_out
        ended_by_time = False
        self._settled = (lo, NEVER)  # evictions below may end it early (`_unsettle`)
        try:
            for stop in range(hi, end):
                q = stop
                gap = rec.time(q) - t_next
                if timed and gap >= self.slack * (backlog + longest):
                    ended_by_time = True
                    break  # even the largest copy could start at a later use
                obj = self._object_for(rec.keys[q % len(rec)], q >= len(rec))
                if obj is None or self.in_fast(obj):
                    continue
                if obj is current or self.m.pinned(obj):
                    unsettled = min(unsettled, q)
                    deferred = None  # it may move once unpinned: no quiet
                    continue
                need = self._copy_seconds(obj.nbytes, self.m.primary(obj).device)
                if timed and gap >= self.slack * (backlog + need):
                    unsettled = min(unsettled, q)
                    if deferred is not None:
                        deferred.append((q, need))
                    continue  # its copy can start at the next use and still be hidden
                if not self._prefetch_before(obj, q, current):
                    deferred = None
                    break  # fast memory is full of objects needed before q
                self._speculative.add(obj.id)
                self._count("learned_prefetches")
                backlog += need
            else:
                stop = end
        finally:
            self._settled = (lo, min(self._settled[1], stop, unsettled))
        if ended_by_time and deferred is not None and self._moved_out == moved_out:  # nothing it evicted
            self._quiet = self._quiet_until(rec, lo, stop, deferred)

    def _quiet_until(self, rec: Recording, lo: int, stop: int, deferred: list[tuple[int, float]]) -> tuple:
        """After a walk over the positions from ``lo`` (settled ones skipped) that ended at ``stop`` by
        the time bound, having deferred the copies of ``deferred``: ``(t, busy_until, lo)``, the
        recorded time of the next use before which a new walk from ``lo`` on would issue nothing.

        Until then every position it would visit is settled, or deferred again, or past its end: the
        backlog a later walk sees is at most today's (``busy_until`` less a later clock) as long as
        no copy is issued (the returned ``busy_until`` must still hold), and a smaller backlog
        defers more and ends sooner.  Objects leaving the fast level, or born outside it, end the
        quiet (`_unsettle`)."""
        backlog = max(0.0, self._busy_until - self.clock())
        t = rec.time(stop) - self.slack * (backlog + self._longest)
        for q, need in deferred:
            t = min(t, rec.time(q) - self.slack * (backlog + need))
        return t, self._busy_until, lo

    def _prefetch_before(self, obj: Object, q: int, current: Object | None) -> bool:
        """Bring ``obj`` (next used at ``q``) to the fast level, evicting only objects used after ``q``
        (and never ``current``, the object in use), and only where the objects needed by ``q`` and
        those born before it (`Recording.growth`) leave room for it.

        Making room is tried only where it can succeed.  The objects needed by ``q`` stay, and so do
        pinned ones: where their bytes and ``obj``'s exceed the fast level, nothing is tried.  That
        is how two of three walks end once fast memory is full of objects needed sooner (the H100's
        DenseNet at half its footprint), and each try cost a sort and a search of the heap.  Such
        an outcome is remembered for ``(obj, q)`` with the bytes of the objects needed by ``q``;
        until bytes that may no longer be needed by ``q`` (a use whose object's next use moves past
        ``q``, a free, a move off the fast level) could close the gap, the next walk that reaches
        the same ``(obj, q)`` ends there without looking at the fast level again.  The cursor
        skipping recorded uses, or a new iteration, forgets it.  Where the bytes would fit but the
        objects that must stay wall every run of evictable space into pieces too short
        (`Manager.room_possible`, one walk of the heap), no victim is tried either."""
        m, fast = self.m, self.fast
        futile = self._futile if self.skip_futile else None
        growth = max(0, self.learned.growth(self._cursor, q))
        if (futile is not None and futile[0] == obj.id and futile[1] == q
                and futile[2] - (self._released - futile[3]) + growth > fast.capacity):
            return False
        if fast.used_bytes + obj.nbytes + growth <= fast.capacity and self._fetch(obj, force=False):
            return True
        protected, free, tail = [], [], []  # tail: what no eviction can take now, in recency order
        needed, kept = obj.nbytes, 0  # needed: by q (obj included); kept: current or pinned
        for o in map(m.getobject, list(self._orders[fast.name])):
            if o is None:
                continue
            if self.next_use(o.id) <= q:
                protected.append(o)
                tail.append(o)
                needed += o.nbytes
            elif o is current:
                protected.append(o)
                tail.append(o)
                kept += o.nbytes
            elif m.pinned(o):
                tail.append(o)
                kept += o.nbytes
            else:
                free.append(o)
        # what is born before q would push obj (or one needed sooner) out; or what must stay leaves no room
        if needed + growth > fast.capacity or (self.skip_futile and needed + kept > fast.capacity):
            if self.skip_futile:
                self._futile = (obj.id, q, needed, self._released)
            return False
        if self._fetch(obj, force=False):
            return True
        for o in protected:
            m.pin(o)
        try:
            if self.skip_futile:
                if not m.room_possible(fast, obj.nbytes):
                    return False  # every run of evictable space is too short: no victim would do
                self._ranked = sorted(free, key=lambda o: -self.eviction_rank(o, fast)) + tail
            return self._fetch(obj, force=True)
        finally:
            self._ranked = None
            for o in protected:
                m.unpin(o)

    def _fetch(self, obj: Object, force: bool) -> bool:
        """`Policy.prefetch` to the fast level (hints aside), adding the copy to the predicted backlog."""
        src = self.m.primary(obj).device
        if not Policy.prefetch(self, obj, force=force):
            return False
        now = self.clock()
        self._busy_until = max(self._busy_until, now) + self._copy_seconds(obj.nbytes, src)
        return True

    # ------------------------------------------------------------------ metrics and invariants
    def _count(self, name: str) -> None:
        self.stats[name] += 1
        self.m.record(name)

    def report(self) -> dict:
        """Cumulative metrics since attach: coverage (uses that found their object on the fast level),
        accuracy (learned prefetches used before being evicted or freed, of those resolved), the counts
        behind them, and the size of the learned order."""
        s = self.stats
        accuracy, coverage = accuracy_and_coverage(s)
        return {"iterations": self.iterations, "learned_uses": len(self.learned) if self.learned else 0,
                "uses": s["uses"], "uses_in_fast": s["uses_in_fast"], "coverage": coverage,
                "prefetches_issued": s["learned_prefetches"], "prefetches_useful": s["learned_prefetches_useful"],
                "prefetches_evicted_unused": s["learned_prefetches_evicted_unused"],
                "prefetches_freed_unused": s["learned_prefetches_freed_unused"],
                "prefetches_pending": len(self._speculative), "accuracy": accuracy,
                "demand_fetches": s["demand_fetches"]}

    def check(self) -> None:
        super().check()
        for obj_id in self._speculative:
            obj = self.m.getobject(obj_id)
            if obj is None or not self.in_fast(obj):
                raise InvariantError(f"object {obj_id} is counted as prefetched and unused, but is not on "
                                     f"{self.fast.name}")
        for key, obj_id in self._by_key.items():
            if self._newborn.get(obj_id) != key:
                raise InvariantError(f"key {key} names object {obj_id}, whose key is {self.key(obj_id)}")
