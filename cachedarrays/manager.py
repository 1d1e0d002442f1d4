"""The data manager: objects, their regions on devices, and the data management API.

This is Table 4.4 of the dissertation.  The manager tracks every *object*, its
*primary region* and its *linked regions* (at most one per device), dirty bits,
pin counts and telemetry.  It makes no placement decisions: a policy does, using
only the methods here.  One re-entrant lock guards all state; when an object's handle
dies, its weak reference's callback only appends to a free queue, which is drained under the
lock at the next manager call, so garbage collection can never run manager code at a bad moment.

Devices form *levels*, fastest first: ``Manager(GPU(..), DRAM(..), PM(..))``; ``fast`` is the
first and ``slow`` the last, so two-level code keeps working.  A region's *dirty* bit says it is
newer than the object's next region below it (per link, not per object).

Copies are asynchronous: `copyto_async` submits a copy to the `CopyEngine` and records, per
region, the completion that *fills* it and those that *drain* it (copies reading it, consumers
on a GPU still using it).  The manager still makes no decisions; it only enforces the order:
a region is not read before its fill completes (`bytes` waits), not written before its drains
complete, and its bytes are not reused before both: a region freed with copies in flight leaves
a *busy range* on its device, and a region later allocated over it starts with those copies as
drains, so its first write or incoming copy waits for them (a copy engine orders that on the
GPU, without blocking the host).  `copyto` keeps the synchronous meaning of Table 4.4.  A copy
that fails at submission raises `CopyError` at once and changes nothing; one that fails in
flight into an object's primary puts the primary back on the copy's source, whose bytes are
intact, and raises `CopyError` at the object's next use.

A region's fill may also be a write deferred by the layer above (`fill_later`: a kernel's output
kept in its producer's buffer): it is issued the first time anything must see the bytes (a view,
a copy from or into the region, `wait_all`) and cancelled if the region is freed first, so an
object that dies unread never costs the write.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable

import numpy as np

from .deferred import Deferred
from .devices import DeadEnds, Device
from .devices.perf import copy_seconds
from .engine import Completion, CopyEngine, Waitable
from .errors import CopyError, InvariantError, OutOfMemoryError, PinnedError, UseAfterFreeError
from .telemetry import Telemetry


class Region:
    """A contiguous, aligned range on one device; the unit of allocation and movement."""

    __slots__ = ("device", "offset", "nbytes", "owner", "dirty", "freed", "fill", "drains", "__weakref__")

    def __init__(self, device: Device, offset: int, nbytes: int):
        self.device = device
        self.offset = offset
        self.nbytes = nbytes
        self.owner: _Record | None = None
        self.dirty = False
        self.freed = False
        self.fill: Completion | None = None  # the copy writing this region
        self.drains: list[Waitable] = []  # copies reading it, consumers still using it

    def pending(self) -> list[Waitable]:
        """The fill and drains not yet done."""
        items = self.drains if self.fill is None else [self.fill, *self.drains]
        return [w for w in items if not w.done()]

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("dirty" if self.dirty else "clean")
        owner = f" of object {self.owner.id}" if self.owner is not None else ""
        return f"<Region {self.device.name}[{self.offset}:+{self.nbytes}] {state}{owner}>"


class _HandleRef(weakref.ref):
    """The record's weak reference to its `Object` handle; when the handle dies, the reference
    itself is queued (its callback appends it to the manager's free queue), and the queue is
    drained under the lock at the next manager call."""

    __slots__ = ("id",)


class _Record:
    """The manager's strong record of an object; survives the handle until the free queue drains."""

    __slots__ = ("id", "nbytes", "primary", "regions", "pins", "alive", "handle", "error")

    def __init__(self, id_: int, primary: Region):
        self.id = id_
        self.nbytes = primary.nbytes
        self.primary = primary
        self.regions: dict[str, Region] = {primary.device.name: primary}
        self.pins = 0
        self.alive = True
        self.handle: _HandleRef | None = None
        self.error: CopyError | None = None  # a failed copy, raised at the next use


class Object:
    """What the program holds: an id and a handle on the manager's record.

    When the last reference dies, its regions are queued for freeing.
    """

    __slots__ = ("id", "manager", "_record", "__weakref__")

    def __init__(self, manager: "Manager", record: _Record):
        self.id = record.id
        self.manager = manager
        self._record = record

    @property
    def nbytes(self) -> int:
        return self._record.nbytes

    @property
    def alive(self) -> bool:
        return self._record.alive

    def __repr__(self) -> str:
        if not self._record.alive:
            return f"<Object {self.id} freed>"
        return f"<Object {self.id} {self.nbytes} B primary on {self._record.primary.device.name}>"


class _Guard:
    """``with manager._locked():`` when a queue waits to be drained: takes the lock and, unless
    this thread holds it already (a nested call), drains the queues first.

    A plain class rather than a generator context manager: it runs on manager calls.
    """

    __slots__ = ("m",)

    def __init__(self, manager: "Manager"):
        self.m = manager

    def __enter__(self) -> None:
        m = self.m
        lock = m._lock
        nested = lock._is_owned()
        lock.acquire()
        if not nested and (m._free_queue or m._unpin_queue):
            try:
                m._drain()
            except BaseException:
                lock.release()
                raise

    def __exit__(self, *exc) -> None:
        self.m._lock.release()


class Manager:
    """Owns the devices, the object registry, the lock, the copy engine and the telemetry.

    ``Manager(*devices, policy=None)`` with two or more devices ordered fastest first
    (``Manager(fast=..., slow=...)`` also works).  ``copy_workers``: host copy threads of the
    copy engine.  When a device lives on a GPU, host devices are page-locked for DMA where the
    OS allows it (a warning says where it does not; their GPU copies are then staged).
    """

    def __init__(self, *devices: Device, policy=None, fast: Device | None = None, slow: Device | None = None,
                 copy_workers: int = 1):
        levels = list(devices)
        if fast is not None:
            levels.insert(0, fast)
        if slow is not None:
            levels.append(slow)
        _check_levels(levels)
        self.levels: list[Device] = levels
        self.fast = levels[0]
        self.slow = levels[-1]
        self.devices: dict[str, Device] = {dev.name: dev for dev in levels}
        self._level = {dev.name: i for i, dev in enumerate(levels)}
        self.engine = CopyEngine(copy_workers)
        self._inflight: collections.deque[tuple[Completion, Region, Region]] = collections.deque()
        self._busy: dict[str, list[tuple[int, int, list[Waitable]]]] = {dev.name: [] for dev in levels}
        self.closed = False
        if any(dev.memory_space != "host" for dev in levels):
            from .devices.gpu import pagelock
            for dev in levels:
                if dev.memory_space == "host":
                    pagelock(dev)
        self._lock = threading.RLock()
        self._guard = _Guard(self)
        self._next_id = 1
        self._records: dict[int, _Record] = {}
        self._regions: dict[str, dict[int, Region]] = {name: {} for name in self.devices}
        self._free_queue: collections.deque[_HandleRef] = collections.deque()  # handles that died
        self._unpin_queue: collections.deque[_Record] = collections.deque()
        self.telemetry_data = Telemetry(self.devices)
        self.policy = None
        if policy is not None:
            self.set_policy(policy)

    def set_policy(self, policy) -> None:
        """Attach a policy; it receives this manager and is told when objects die."""
        with self._locked():
            policy.attach(self)
            self.policy = policy

    # ------------------------------------------------------------------ levels
    def level(self, device: Device) -> int:
        """``device``'s place in the hierarchy: 0 for the fastest."""
        return self._level[self._device(device).name]

    def below(self, device: Device) -> Device | None:
        """The next slower level (None for the slowest)."""
        i = self.level(device) + 1
        return self.levels[i] if i < len(self.levels) else None

    def above(self, device: Device) -> Device | None:
        """The next faster level (None for the fastest)."""
        i = self.level(device)
        return self.levels[i - 1] if i > 0 else None

    def regions_of(self, obj: Object) -> list[Region]:
        """``obj``'s regions, fastest level first (the first is the primary under a policy)."""
        with self._locked():
            record = self._rec(obj)
            return sorted(record.regions.values(), key=lambda r: self._level[r.device.name])

    def objects_on(self, device: Device) -> list[Object]:
        """Live objects with a region on ``device`` (primary or linked), in address order."""
        with self._locked():
            dev = self._device(device)
            found = []
            for offset in sorted(self._regions[dev.name]):
                owner = self._regions[dev.name][offset].owner
                handle = owner.handle() if owner is not None and owner.handle is not None else None
                if handle is not None:
                    found.append(handle)
            return found

    # ------------------------------------------------------------------ locking and the free queue
    def lock(self):
        """The manager's re-entrant lock, for policies that must make several calls atomically.

        As a context manager: the plain `RLock` (no Python frames, as it is taken dozens of times
        a kernel) when no queue waits, else the `_Guard` that drains the queues first."""
        return self._guard if self._free_queue or self._unpin_queue else self._lock

    _locked = lock  # the manager's own calls

    def _drain(self) -> None:
        while self._unpin_queue:
            self._unpin_queue.popleft().pins -= 1
        while self._free_queue:
            record = self._records.get(self._free_queue.popleft().id)
            if record is not None and record.alive:
                self._free_record(record)

    def collect(self) -> int:
        """Free every object whose last reference has died; returns how many were freed."""
        with self._locked():
            n = len(self._free_queue)
            self._drain()
            return n

    # ------------------------------------------------------------------ objects
    def new_object(self, region: Region) -> Object:
        """Create an object whose primary region is the unowned live ``region``."""
        with self._locked():
            self._live(region)
            if region.owner is not None:
                raise ValueError(f"{region} already belongs to object {region.owner.id}")
            record = _Record(self._next_id, region)
            self._next_id += 1
            region.owner = record
            self._records[record.id] = record
            handle = Object(self, record)
            record.handle = ref = _HandleRef(handle, self._free_queue.append)
            ref.id = record.id
            self.telemetry_data.count("objects_created")
            return handle

    @property
    def next_id(self) -> int:
        """The id the next new object will get (ids only grow)."""
        return self._next_id

    def getobject(self, id_: int) -> Object | None:
        """The live object with id ``id_``, or None."""
        with self._locked():
            record = self._records.get(id_)
            return record.handle() if record is not None and record.alive else None

    def objects(self, since: int = 0) -> list[Object]:
        """Every live object with id ``>= since`` (those whose handle is still referenced)."""
        with self._locked():
            return [h for i, r in list(self._records.items()) if i >= since and (h := r.handle()) is not None]

    def primary(self, obj: Object) -> Region:
        return self._rec(obj).primary

    def set_primary(self, obj: Object, region: Region) -> None:
        """Make ``region`` the primary of ``obj``; an unowned region is adopted as a linked region first."""
        with self._locked():
            record = self._rec(obj)
            self._live(region)
            if region.owner is None:
                self._adopt(record, region)
            elif region.owner is not record:
                raise ValueError(f"{region} belongs to object {region.owner.id}, not object {record.id}")
            record.primary = region

    def pin(self, obj: Object) -> None:
        """Forbid moving ``obj`` until a matching `unpin` (pins nest)."""
        with self._locked():
            self._rec(obj).pins += 1

    def unpin(self, obj: Object) -> None:
        with self._locked():
            record = self._rec(obj, allow_dead=True)
            if record.pins <= 0:
                raise RuntimeError(f"object {record.id} is not pinned")
            record.pins -= 1

    def unpin_later(self, obj: Object) -> None:
        """`unpin` for finalizers: queued without taking the lock, applied at the next manager call."""
        self._unpin_queue.append(obj._record)

    def pinned(self, obj: Object) -> bool:
        with self._locked():
            return self._rec(obj).pins > 0

    # ------------------------------------------------------------------ regions
    def allocate(self, device: Device, nbytes: int) -> Region | None:
        """A new unowned region of ``nbytes`` on ``device``, or None when it does not fit."""
        with self._locked():
            dev = self._device(device)
            self._reap()
            offset = dev.allocate(nbytes)
            if offset is None:
                self.telemetry_data.count("allocation_failures")
                return None
            region = Region(dev, offset, nbytes)
            busy = self._busy[dev.name]
            if busy:
                end = offset + nbytes
                region.drains = [w for lo, hi, ws in busy if lo < end and offset < hi for w in ws if not w.done()]
            self._regions[dev.name][offset] = region
            self.telemetry_data.allocated(dev, region.nbytes)
            return region

    def allocate_or_raise(self, device: Device, nbytes: int) -> Region:
        """Like `allocate`, but a full device raises `OutOfMemoryError` with the sizes."""
        region = self.allocate(device, nbytes)
        if region is None:
            dev = self._device(device)
            raise OutOfMemoryError(f"{dev.name} heap exhausted: {dev.heap.exhausted_message(nbytes)}")
        return region

    def free(self, x: "Region | Object") -> None:
        """Free a region (a non-primary linked region is unlinked first) or a whole object."""
        with self._locked():
            if isinstance(x, Object):
                record = self._rec(x)
                if record.pins:
                    raise PinnedError(f"object {record.id} is pinned by {record.pins} live view(s); release them before freeing")
                for hook in self._free_hooks:  # may refuse by raising (a persistent pool's named objects)
                    hook(x)
                self._free_record(record)
                return
            self._live(x)
            owner = x.owner
            if owner is not None:
                if owner.primary is x:
                    raise ValueError(f"{x} is the primary of object {owner.id}: set another primary or free the object")
                del owner.regions[x.device.name]
                x.owner = None
            self._release(x)

    def link(self, a: Region, b: Region) -> None:
        """Link two regions of one object: an unowned region joins the other's object."""
        with self._locked():
            self._live(a)
            self._live(b)
            if a.nbytes != b.nbytes:
                raise ValueError(f"cannot link regions of different sizes: {a} and {b}")
            if a.device is b.device:
                raise ValueError(f"cannot link two regions on the same device {a.device.name}")
            if a.owner is not None and b.owner is not None:
                if a.owner is not b.owner:
                    raise ValueError(f"cannot link regions of different objects ({a.owner.id} and {b.owner.id})")
                return
            if a.owner is None and b.owner is None:
                raise ValueError("cannot link two regions that belong to no object; create an object first")
            owned, orphan = (a, b) if a.owner is not None else (b, a)
            self._adopt(owned.owner, orphan)

    def unlink(self, a: Region, b: Region) -> None:
        """Unlink two regions of one object; the one that is not primary (else ``b``) is detached."""
        with self._locked():
            self._live(a)
            self._live(b)
            if a.owner is None or a.owner is not b.owner:
                raise ValueError(f"regions {a} and {b} are not linked")
            detach = a if b.owner.primary is b else b
            if detach.owner.primary is detach:
                raise ValueError(f"cannot unlink {detach}: it is the primary")
            del detach.owner.regions[detach.device.name]
            detach.owner = None

    def copyto(self, dst: Region, src: Region) -> None:
        """Copy the bytes of ``src`` into ``dst`` (same size) now; returns when the copy is done."""
        with self._locked():
            if self._check_copy(dst, src):
                return
            self._issue(src, dst)
            after = self._copy_order(dst, src)
            completion = self.engine.copy_now(dst.device, dst.offset, src.device, src.offset, src.nbytes, after)
            if completion.error is not None:
                self.telemetry_data.count("copy_failures")
                raise CopyError(f"copy from {src} to {dst} failed: {completion.error!r}") from completion.error
            seconds = completion.duration()  # the caller waited for all of it: exposed
            self.telemetry_data.copied(src.device, dst.device, src.nbytes, 0.0,
                                       copy_seconds(src.nbytes, src.device.bandwidth, dst.device.bandwidth))
            self.telemetry_data.timed(src.device, dst.device, seconds, seconds)
            dst.fill = None  # whatever filled dst before was waited for

    def copyto_async(self, dst: Region, src: Region) -> Completion:
        """Start copying ``src`` into ``dst``; returns at once with the copy's completion.

        ``dst`` is not readable (`bytes` waits) until the copy completes, and ``src`` is not
        writable or reusable before; the copy itself waits for ``src``'s own fill and for
        ``dst``'s earlier uses.
        """
        with self._locked():
            if self._check_copy(dst, src):
                return self._noop(src)
            self._issue(src, dst)
            after = self._copy_order(dst, src)
            completion = self.engine.submit(dst.device, dst.offset, src.device, src.offset, src.nbytes, after)
            if completion.done() and completion.error is not None:
                self.telemetry_data.count("copy_failures")
                raise CopyError(f"copy of {self._what(src)} from {src.device.name} to {dst.device.name} failed: "
                                f"{completion.error!r}; nothing was moved") from completion.error
            self._submitted(completion, dst, src)
            dst.fill = completion
            src.drains = [w for w in src.drains if not w.done()]
            src.drains.append(completion)
            return completion

    def ready(self, region: Region, write: bool = True) -> float:
        """Block until ``region`` can be read (its fill and its consumers' queued work are done) or,
        with ``write``, also written (every drain done).  Returns the seconds blocked; raises
        `CopyError` if its fill failed."""
        self._live(region)
        self.issue_fill(region)
        record = region.owner
        blocked = 0.0
        fill = region.fill
        if fill is not None and not fill.done():
            blocked += fill.wait()
        for w in _waits(region, write):
            blocked += w.wait()
        self._raise_if_failed(fill, record)
        return blocked

    def ready_on(self, region: Region, stream, write: bool = True, mark=None) -> None:
        """Make the GPU ``stream`` wait until ``region`` can be read (or written): like `ready`, but
        the host does not block on copies that run on a CUDA stream (the DLPack stream handshake).
        ``mark``: an event where the consumer's work reaches this point, or a function that makes
        one when a copy is still running (for exposed-time telemetry, `devices.gpu.wait_on_stream`)."""
        from .devices.gpu import wait_on_stream
        self._live(region)
        self.issue_fill(region)
        record = region.owner
        fill = region.fill
        wait_on_stream([w for w in (fill, *_waits(region, write)) if w is not None and not w.done()], stream, mark)
        self._raise_if_failed(fill, record)

    def settled(self, region: Region, write: bool = False) -> bool:
        """Whether ``region`` can be read (or, with ``write``, written) now without any wait: it is
        live, its fill is done without error, and no use it would wait for (see `ready`) is in
        flight.  A consumer that keeps a view of the region's bytes may reuse it while this holds,
        instead of ordering itself after the region's copies again."""
        if region.freed:
            return False
        fill = region.fill
        if fill is not None and (not fill.done() or fill.error is not None):
            return False
        owner = region.owner
        if owner is not None and owner.error is not None:
            return False
        return all(w.done() for w in _waits(region, write))

    def fill_later(self, region: Region, write: Callable[[], "Waitable | None"]) -> None:
        """Make ``write()`` the fill of ``region``, issued when something first needs the bytes
        (a reader, a copy from or into the region, `wait_all`, `issue_fill`) and never if the
        region is freed before (see the module docstring). ``write`` must write all of the
        region's contents where it is then (it cannot move before: a move copies from it), after
        its earlier readers (`ready`/`ready_on` with ``write=True``, which do not wait for this
        fill), and return what marks the write's end (a `Waitable`, or None when it is done on
        return). A deferred fill not issued yet is replaced: no one has seen its bytes. The
        caller has told the policy of the write use (the region is dirty)."""
        with self._locked():
            self._live(region)
            fill = region.fill
            if _deferred(region):
                fill.cancel()
                self.telemetry_data.count("deferred_fills_cancelled")
            elif fill is not None and not fill.done():  # an earlier fill still running: the write waits for it
                region.drains.append(fill)
            region.fill = Deferred(write)

    def issue_fill(self, region: Region) -> None:
        """Issue ``region``'s deferred fill now (nothing when it has none, or was freed)."""
        if _deferred(region):
            with self._locked():
                self._issue(region)

    def add_use(self, region: Region, use: Waitable) -> None:
        """Record that a consumer (e.g. a GPU kernel) still uses ``region``'s bytes until ``use`` is done."""
        with self._locked():
            self._live(region)
            region.drains = [w for w in region.drains if not w.done()]
            region.drains.append(use)

    def wait_all(self) -> None:
        """Issue every deferred fill, then wait for every copy in flight and every recorded use of
        freed bytes (a reporting or closing wait: not counted as exposed copy time)."""
        with self._locked():
            self._issue(*(r for table in self._regions.values() for r in table.values()))
            self._finish_inflight()
            for busy in self._busy.values():
                for _, _, waitables in busy:
                    for w in waitables:
                        w.wait()
            self._reap()

    def sizeof(self, region: Region) -> int:
        return self._live(region).nbytes

    def getlinked(self, region: Region, device: Device) -> Region | None:
        """The region of ``region``'s object on ``device`` (None if there is none)."""
        self._live(region)
        if region.owner is None:
            return region if region.device is device else None
        return region.owner.regions.get(self._device(device).name)

    def in_device(self, region: Region, device: Device) -> bool:
        return self._live(region).device is device

    def mark_dirty(self, region: Region) -> None:
        self._live(region)
        for hook in self._dirty_hooks:  # before the write lands (persistent pools protect durable copies)
            hook(region)
        region.dirty = True

    def mark_clean(self, region: Region) -> None:
        self._live(region).dirty = False

    def isdirty(self, region: Region) -> bool:
        return self._live(region).dirty

    def parent(self, region: Region) -> Object | None:
        """The object ``region`` belongs to (None for an unowned region or a dead handle)."""
        owner = self._live(region).owner
        if owner is None or owner.handle is None:
            return None
        return owner.handle()

    def reclaim(self, region: Region) -> bool:
        """Free ``region``'s object if its last reference already died (its id waits in the free queue).

        Eviction callbacks use this for regions whose `parent` is None: dead data
        need not be moved.  Returns False when the object is still alive.
        """
        with self._locked():
            owner = self._live(region).owner
            if owner is None:
                self._release(region)
                return True
            if owner.handle is not None and owner.handle() is not None:
                return False
            self._free_record(owner)
            return True

    def account(self, src: Device, dst: Device, nbytes: int, seconds: float) -> None:
        """Count a copy made outside `copyto` (e.g. row-granular caching inside a kernel).

        Such copies move data within objects the caller has pinned; reporting them keeps
        ``telemetry()`` complete, with a modeled time from the device model as for `copyto`.
        """
        with self._locked():
            src, dst = self._device(src), self._device(dst)
            self.telemetry_data.copied(src, dst, nbytes, seconds, copy_seconds(nbytes, src.bandwidth, dst.bandwidth))

    def record(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the telemetry counter ``name`` (policies count their decisions here)."""
        self.telemetry_data.count(name, n)

    def bytes(self, region: Region, wait: bool = True) -> np.ndarray:
        """A writable uint8 view of the region's bytes (numpy, or CuPy on a GPU).

        Waits until the region may be written (see `ready`); ``wait=False`` is for GPU
        consumers that order themselves after the region's copies on a stream instead.
        """
        if wait:
            self.ready(region)
        else:
            self._live(region)
        return region.device.view(region.offset, region.nbytes)

    def evictfrom(self, device: Device, region: Region, nbytes: int, callback: Callable[[Region], object],
                  dead_ends: DeadEnds | None = None) -> bool:
        """Make ``nbytes`` contiguous bytes free on ``device`` starting the walk at ``region``.

        ``callback(region)`` is called for each occupied region of the span and must
        free it (typically by evicting its object) and return True, or return False to
        refuse.  Regions of pinned objects are never handed to the callback: a walk
        that would need one is planned around it, and fails (returns False) if it
        cannot.  Returns True when the space is free.  ``dead_ends`` (a
        :class:`~cachedarrays.devices.heap.DeadEnds` for ``nbytes``, kept by a caller trying
        region after region for one request while no pin changes) skips walks that must fail
        because an earlier one walked the same run.
        """
        with self._locked():
            dev = self._device(device)
            self._live(region)
            if region.device is not dev:
                raise ValueError(f"{region} is not on device {dev.name}")
            table = self._regions[dev.name]

            def on_region(offset: int, _requested: int) -> bool:
                victim = table[offset]
                if not callback(victim):
                    return False
                if not victim.freed:
                    raise InvariantError(f"eviction callback accepted {victim} but did not free it")
                return True

            done = dev.evictfrom(region.offset, nbytes, on_region, self._movable(dev), dead_ends) is not None
            self.telemetry_data.count("evictfrom_calls")
            if not done:
                self.telemetry_data.count("evictfrom_failures")
            return done

    def room_possible(self, device: Device, nbytes: int) -> bool:
        """Whether `evictfrom` could make ``nbytes`` contiguous bytes on ``device`` from some region:
        some run of free space and regions of unpinned objects (or of no object) holds them.  A
        policy that would try victim after victim learns in one walk that none would do."""
        with self._locked():
            dev = self._device(device)
            return dev.room_possible(nbytes, self._movable(dev))

    def _movable(self, dev: Device) -> Callable[[int], bool]:
        """Whether the region at an offset of ``dev`` may be evicted: it belongs to no object, or to
        one no view pins."""
        table = self._regions[dev.name]

        def movable(offset: int) -> bool:
            owner = table[offset].owner
            return owner is None or owner.pins == 0
        return movable

    def defragment(self, device: Device) -> int:
        """Compact ``device``; refuses while any object on it is pinned.  Returns the number of moves."""
        with self._locked():
            dev = self._device(device)
            self.wait_all()
            table = self._regions[dev.name]
            pinned = [r.owner.id for r in table.values() if r.owner is not None and r.owner.pins]
            if pinned:
                raise PinnedError(f"cannot defragment {dev.name}: objects {pinned[:5]} are pinned")

            def moved(old: int, new: int, nbytes: int) -> None:
                region = table.pop(old)
                region.offset = new
                table[new] = region
                self.telemetry_data.copied(dev, dev, nbytes, 0.0, copy_seconds(nbytes, dev.bandwidth, dev.bandwidth))

            return len(dev.defragment(moved))

    # ------------------------------------------------------------------ reporting
    def telemetry(self) -> dict:
        """Counters: copies per device pair (bytes, count, measured and modeled seconds),
        allocations, frees, occupancy and high-water marks per device, and an occupancy timeline."""
        with self._locked():
            self._finish_inflight()  # a snapshot reports finished copies only
            return self.telemetry_data.snapshot()

    def reset_telemetry(self) -> None:
        """Zero every counter and the timeline (e.g. after a warm-up); high-water marks restart from now."""
        with self._locked():
            self._finish_inflight()  # copies before the reset are counted before it
            self.telemetry_data.reset()

    def check(self) -> None:
        """Cross-check heaps, the registry, links and copies in flight (a region allocated over bytes
        freed with copies still reading or writing them waits for those copies); raise
        `InvariantError` on the first problem."""
        with self._locked():
            self._reap()
            for dev in self.devices.values():
                dev.check()
                table = self._regions[dev.name]
                occupied = {b.offset: b.requested for b in dev.heap.blocks() if not b.free}
                if occupied.keys() != table.keys():
                    extra = sorted(occupied.keys() - table.keys())[:5]
                    missing = sorted(table.keys() - occupied.keys())[:5]
                    raise InvariantError(f"{dev.name}: heap blocks without regions {extra}, regions without blocks {missing}")
                for lo, hi, waitables in self._busy[dev.name]:
                    pending = [w for w in waitables if not w.done()]
                    for offset, region in table.items():
                        if offset < hi and lo < offset + region.nbytes and any(w not in region.drains for w in pending):
                            raise InvariantError(f"{region} overlaps bytes [{lo}, {hi}) that copies in flight still use, "
                                                 f"but does not wait for them")
                for offset, region in table.items():
                    if region.freed or region.offset != offset or region.device is not dev:
                        raise InvariantError(f"{dev.name}: registry entry {offset} holds {region}")
                    if occupied[offset] != region.nbytes:
                        raise InvariantError(f"{region} has {region.nbytes} bytes but its heap block was asked for {occupied[offset]}")
                    if region.owner is not None and region.owner.regions.get(dev.name) is not region:
                        raise InvariantError(f"{region} claims object {region.owner.id}, which does not list it")
            for completion, dst, src in self._inflight:
                for region in (dst, src):
                    if region.freed and not completion.done() and not any(
                            completion in ws for lo, hi, ws in self._busy[region.device.name]
                            if lo <= region.offset < hi):
                        raise InvariantError(f"{region} was freed while {completion} is in flight, and its bytes are "
                                             f"not marked busy")
            for record in self._records.values():
                if not record.alive:
                    raise InvariantError(f"dead object {record.id} is still registered")
                if record.primary.owner is not record or record.regions.get(record.primary.device.name) is not record.primary:
                    raise InvariantError(f"object {record.id}: primary {record.primary} is not one of its regions")
                for name, region in record.regions.items():
                    if region.freed or region.owner is not record or region.device.name != name:
                        raise InvariantError(f"object {record.id}: linked region {region} is inconsistent")
                    if region.nbytes != record.nbytes:
                        raise InvariantError(f"object {record.id}: region {region} has the wrong size")
                if record.pins < 0:
                    raise InvariantError(f"object {record.id} has a negative pin count")
            if self.policy is not None:
                self.policy.check()

    def close(self) -> None:
        """Wait for copies in flight, stop the copy engine, close every device (their memory goes
        once no view aliases it).  Closing twice is harmless."""
        if self.closed:
            return
        with self._locked():
            try:
                self.wait_all()
            finally:
                self.closed = True
                self.engine.close()
                for hook in self._close_hooks:  # views a layer above keeps of the devices' bytes
                    hook()
                if any(dev.memory_space != "host" for dev in self.levels):
                    from .devices.gpu import pageunlock
                    for dev in self.levels:
                        pageunlock(dev)
                for dev in self.levels:
                    dev.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ extension hooks (persistent pools)
    _dirty_hooks: tuple = ()
    _free_hooks: tuple = ()
    _persist_hooks: tuple = ()
    _close_hooks: tuple = ()

    def add_hooks(self, *, dirty: Callable[[Region], None] | None = None,
                  free: Callable[[Object], None] | None = None,
                  persist: Callable[[], object] | None = None, close: Callable[[], None] | None = None) -> None:
        """Register callbacks of a layer above the manager (a persistent pool, `cachedarrays.pool`).

        ``dirty(region)`` runs inside `mark_dirty`, before the dirty bit is set and so before the
        caller writes (a pool moves a durable copy out of the way there); ``free(obj)`` runs before
        `free` releases an object and may refuse by raising; ``persist()`` runs in `persist`;
        ``close()`` runs in `close` before the devices close (a layer drops views it keeps there).
        The manager decides nothing with them.
        """
        with self._locked():
            for attr, fn in (("_dirty_hooks", dirty), ("_free_hooks", free), ("_persist_hooks", persist),
                             ("_close_hooks", close)):
                if fn is not None:
                    setattr(self, attr, getattr(self, attr) + (fn,))

    def persist(self) -> list:
        """Make a durable point: every persistent pool open on this manager writes back the dirty data
        of its named objects and commits (see `cachedarrays.pool`).  Returns the hooks' results
        (each pool's durable point number); raises `RuntimeError` when no pool is open."""
        with self._locked():
            if not self._persist_hooks:
                raise RuntimeError("no persistent pool is open on this manager: open one with "
                                   "cachedarrays.pool.Pool.open(manager) (or persistent(manager, name, ...))")
            return [hook() for hook in self._persist_hooks]

    # ------------------------------------------------------------------ internals
    def _device(self, device: Device) -> Device:
        dev = self.devices.get(getattr(device, "name", None))
        if dev is not device:
            raise ValueError(f"{device!r} is not a device of this manager")
        return dev

    def _rec(self, obj: Object, allow_dead: bool = False) -> _Record:
        if not isinstance(obj, Object):
            raise TypeError(f"expected an Object, got {type(obj).__name__}")
        if obj.manager is not self:
            raise ValueError(f"object {obj.id} belongs to a different manager")
        if not obj._record.alive and not allow_dead:
            raise UseAfterFreeError(f"object {obj.id} was freed")
        return obj._record

    def _live(self, region: Region) -> Region:
        if not isinstance(region, Region):
            raise TypeError(f"expected a Region, got {type(region).__name__}")
        if region.freed:
            raise UseAfterFreeError(f"{region} was freed")
        if self.devices.get(region.device.name) is not region.device:
            raise ValueError(f"{region} is on a device of a different manager")
        return region

    def _adopt(self, record: _Record, region: Region) -> None:
        if region.nbytes != record.nbytes:
            raise ValueError(f"{region} has {region.nbytes} bytes, object {record.id} has {record.nbytes}")
        name = region.device.name
        if name in record.regions:
            raise ValueError(f"object {record.id} already has a region on {name}: {record.regions[name]}")
        record.regions[name] = region
        region.owner = record
        region.dirty = False

    def _release(self, region: Region) -> None:
        """Free ``region``; bytes that copies in flight still use are remembered as a busy range."""
        dev = region.device
        del self._regions[dev.name][region.offset]
        region.freed = True
        region.owner = None
        if _deferred(region):  # a write no one will read
            region.fill.cancel()
            self.telemetry_data.count("deferred_fills_cancelled")
        pending = region.pending()
        if pending:
            self._busy[dev.name].append((region.offset, region.offset + region.nbytes, pending))
            self.telemetry_data.count("frees_with_copies_in_flight")
        dev.free(region.offset)
        self.telemetry_data.freed(dev, region.nbytes)

    # ------------------------------------------------------------------ copies in flight
    def _check_copy(self, dst: Region, src: Region) -> bool:
        """Validate a copy; True when there is nothing to copy (``dst is src``)."""
        self._live(dst)
        self._live(src)
        if dst.nbytes != src.nbytes:
            raise ValueError(f"cannot copy {src.nbytes} bytes from {src} into {dst} of {dst.nbytes} bytes")
        return dst is src

    def _issue(self, *regions: Region) -> None:
        """Issue the deferred fills of ``regions`` (under the lock); those without one are skipped."""
        for region in regions:
            if _deferred(region):
                region.fill.issue()
                self.telemetry_data.count("deferred_fills_issued")

    @staticmethod
    def _copy_order(dst: Region, src: Region) -> list[Waitable]:
        """What a copy from ``src`` to ``dst`` must wait for: src's fill and its consumers' uses (a
        GPU writer's stores may still be queued), dst's fill and everything still reading it."""
        return [w for w in (src.fill, *_waits(src, False), dst.fill, *dst.drains) if w is not None and not w.done()]

    def _noop(self, src: Region) -> Completion:
        completion = Completion(src.device.name, src.device.name, 0)
        completion.finish()
        return completion

    def _submitted(self, completion: Completion, dst: Region, src: Region) -> None:
        modeled = copy_seconds(src.nbytes, src.device.bandwidth, dst.device.bandwidth)
        self.telemetry_data.copied(src.device, dst.device, src.nbytes, 0.0, modeled)
        self._inflight.append((completion, dst, src))

    def _finish_inflight(self) -> None:
        for completion, _, _ in list(self._inflight):
            completion.wait(account=False)
        self._reap()

    def _reap(self) -> None:
        """Account for finished copies, handle failed ones, forget busy ranges that are idle."""
        if self._inflight:
            self._reap_inflight()
        for name, busy in self._busy.items():
            if busy:
                self._busy[name] = [(lo, hi, ws) for lo, hi, ws in busy if not all(w.done() for w in ws)]

    def _reap_inflight(self) -> None:
        keep = collections.deque()
        while self._inflight:
            entry = self._inflight.popleft()
            completion, dst, src = entry
            if not completion.done():
                keep.append(entry)
                continue
            if not all(e.done for e in list(completion.gpu_uses)):
                keep.append(entry)  # the exposed time is known once the consumer got there
                continue
            self.telemetry_data.timed(src.device, dst.device, completion.duration(), completion.exposed())
            if completion.error is not None:
                self._failed(completion, dst, src)
        self._inflight = keep

    def _failed(self, completion: Completion, dst: Region, src: Region) -> None:
        """A copy into ``dst`` failed in flight: keep the object's data on ``src`` where it still is,
        and remember the error for the object's next use."""
        self.telemetry_data.count("copy_failures")
        record = dst.owner if not dst.freed else None
        if record is None:
            return
        kept = not src.freed and src.owner is record
        moved = record.primary is dst and kept
        if moved:
            record.primary = src
            src.dirty = True  # dst never got its bytes: the regions below are older than src
        elif kept:
            src.dirty = True  # the write-back did not happen: src is still newer than dst
        outcome = (f"its data is kept on {src.device.name}" if kept else
                   f"its data was on a region of {src.device.name} already freed: the object's contents are lost")
        record.error = CopyError(f"copy of object {record.id} from {src.device.name} to {dst.device.name} failed: "
                                 f"{completion.error!r}; {outcome}")
        if record.primary is not dst:
            del record.regions[dst.device.name]
            self._release(dst)
        if moved and self.policy is not None and record.handle is not None and record.handle() is not None:
            self.policy.restored(record.handle(), dst.device, src.device)

    def _what(self, region: Region) -> str:
        return f"object {region.owner.id}" if region.owner is not None else str(region)

    def _raise_if_failed(self, fill: Completion | None, record: _Record | None) -> None:
        """After a wait: if the region's fill failed, settle it (`_failed`) and raise its `CopyError`."""
        if (fill is not None and fill.error is not None) or (record is not None and record.error is not None):
            with self._locked():
                self._reap()
                self._raise_failed(record)

    @staticmethod
    def _raise_failed(record: _Record | None) -> None:
        if record is not None and record.error is not None:
            error, record.error = record.error, None
            raise error

    def _free_record(self, record: _Record) -> None:
        if self.policy is not None:
            self.policy.forget(record.id, dict(record.regions))
        record.alive = False
        del self._records[record.id]
        for region in list(record.regions.values()):
            region.owner = None
            self._release(region)
        record.regions.clear()
        self.telemetry_data.count("objects_freed")


def _deferred(region: Region) -> bool:
    """Whether ``region``'s fill is a deferred write not issued yet (`Manager.fill_later`)."""
    fill = region.fill
    return type(fill) is Deferred and fill.pending


def _waits(region: Region, write: bool) -> list[Waitable]:
    """What a reader (``write=False``) or writer of ``region`` waits for besides its fill: a writer
    waits for every drain, a reader for consumers' uses only (a GPU writer's stores may be queued
    on its stream), not for other copies that read the region."""
    return list(region.drains) if write else [w for w in region.drains if not isinstance(w, Completion)]


def _check_levels(levels: list[Device]) -> None:
    if len(levels) < 2:
        raise ValueError(f"a manager needs two or more devices, fastest first; got {len(levels)}")
    names = [dev.name for dev in levels]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two devices are named {name!r}: give each a distinct name "
                             f"(e.g. DRAM('4GiB', name='dram1'))")
    for a, b in zip(levels, levels[1:]):
        if a.tier > b.tier:
            order = ", ".join(f"{d.name} ({d.kind})" for d in levels)
            raise ValueError(f"devices must be ordered fastest first, but {a.name} ({a.kind}) comes before "
                             f"the faster {b.name} ({b.kind}): {order}")
