"""Persistent object pools: named arrays in a PM device that survive a restart, a crash or kill -9.

::

    pool = PM("/mnt/pmem/run1.pool", "64GiB")           # creates, or reopens an existing pool
    m = Manager(DRAM("8GiB"), pool, policy=LRUPolicy())
    w = persistent(m, "tables/0", shape=(10_000_000, 64), dtype=np.float32)
    ...                                                 # train; the policy caches w in DRAM
    m.persist()                                         # a durable point
    # a new process, later (or after kill -9):
    m = Manager(DRAM("8GiB"), PM("/mnt/pmem/run1.pool"), policy=LRUPolicy())
    w = persistent(m, "tables/0")                       # same contents as at the durable point, no copy

A `Pool` is the layer between the manager and the program that keeps a *name table* of root
objects (name, shape, dtype, and the *home*: the region in the PM device holding the object's
bytes as of the last *durable point*).  The table and the heap's allocation state are committed
by the PM device crash-consistently (`cachedarrays.devices.pmmeta`: two checksummed slots and an
atomic commit record).  Named objects are ordinary objects of the manager: the policy caches and
evicts them like any other; the pool only keeps their durable copies intact.

The guarantee: after a crash at any moment, reopening gives every named object exactly the
contents it had at the last durable point (`persist`), with the names, shapes, dtypes and
`attrs` of that point.  Changes made after it are lost, and `recovery` says so.

How, with object-level dirty tracking and writers that write in place:

* A home is never written while it is the committed home.  At a durable point (and on open) an
  object's home is one of its own regions when that is free (no copy); from then on:
  - the first `mark_dirty` of any of its regions (every write goes through one: ``writable``,
    ``write_use``) calls the pool first.  If the home is linked but not the primary (the object
    is cached in DRAM), the pool unlinks it: the policy's eviction then writes back to a fresh
    region instead of into the home.  If the home is the primary (it is written in place, e.g. a
    table in PM), the pool copies it to a new region, commits that as the home (the same durable
    state, moved) and lets the write go ahead in the old one;
  - an object pinned at a durable point may be written through a view taken long before (a
    ``CachedEmbeddings`` base table), so its durable copy is a separate snapshot every time;
  - `Manager.free` of a named object is refused; defragmenting the PM device is refused.
  Code that writes a named object's bytes through `Manager.bytes` must call `mark_dirty` first,
  as the policies' ``write_use`` does; a write made before it would land in the durable copy.
* A durable point writes back each changed object: a DRAM primary is copied into its PM linked
  region (allocated if it has none: never into the old home); a PM primary becomes the home in
  place.  Those bytes are persisted, then one commit publishes the new table, then the old
  homes are freed.  A crash before the commit leaves the previous table, whose homes nobody
  wrote; after it, the new one, whose bytes were durable before it.

Costs: a durable point writes each changed object once (dirty DRAM copies, as an eviction
would) and persists it; an object written in place in PM costs one extra copy of itself per
interval between durable points (at its first write), and a pinned object one copy per durable
point.  A named object changed since the last durable point holds up to two PM regions.
Namespace changes (`create`, `delete`) also take effect at the next durable point.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .array import CachedArray, _check_dtype
from .devices import Device
from .errors import (InvariantError, ObjectNotFoundError, OutOfMemoryError, PMCorruptError, PMFormatError,
                     PersistentObjectError, PoolMismatchError, UseAfterFreeError)
from .manager import Manager, Object, Region

__all__ = ["FORMAT", "Pool", "RecoveryReport", "persistent"]

FORMAT = "cachedarrays.pool/1"
MAX_NAME = 1024


@dataclass
class _Entry:
    """A named object as the pool tracks it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int                 # bytes of the object's regions
    obj: Object
    home: Region | None         # the committed durable copy (None: created since the last durable point)
    changed: bool               # written (or created) since the last durable point
    deleted: bool = False       # deleted; the deletion becomes durable at the next durable point

    def record(self, home: Region) -> dict:
        return {"offset": home.offset, "nbytes": self.nbytes, "shape": list(self.shape),
                "dtype": _descr(self.dtype)}


@dataclass(frozen=True)
class RecoveryReport:
    """What reopening a pool found: where it stands and, after an unclean end, what was lost."""

    path: str
    durable_point: int
    durable_time: float
    unclean: bool
    previous_pid: int
    note: str | None

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.durable_time)) if self.durable_time else "never"
        if self.durable_point == 0 and not self.durable_time:
            where = "no durable point yet (the pool is empty)"
        else:
            where = f"durable point {self.durable_point}, made {when}"
        text = f"{self.path}: at {where}"
        if self.unclean:
            text += (f"; the previous writer (pid {self.previous_pid}) ended without closing the pool, so every "
                     f"change it made after that durable point was lost")
        if self.note:
            text += f"; {self.note}"
        return text


def _descr(dtype: np.dtype) -> Any:
    return json.loads(json.dumps(np.lib.format.dtype_to_descr(dtype)))


def _from_descr(descr: Any) -> np.dtype:
    def tup(x):
        return tuple(tup(v) for v in x) if isinstance(x, list) else x
    return np.lib.format.descr_to_dtype(descr if isinstance(descr, str) else [tup(f) for f in descr])


def _shape(shape: Any) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or "\x00" in name:
        raise ValueError(f"a pool object's name must be a non-empty string of at most {MAX_NAME} characters "
                         f"without NUL, got {name!r}")
    return name


class Pool:
    """The named objects of one PM device of a manager; get it with `Pool.open(manager)`."""

    _registry: "weakref.WeakValueDictionary[tuple[int, str], Pool]" = weakref.WeakValueDictionary()

    @classmethod
    def open(cls, manager: Manager, device: Device | None = None) -> "Pool":
        """The pool of ``device`` (default: the manager's one device of kind ``"pm"``), opened once per manager.

        Opening claims every committed home as a region of a new object, in place: nothing is copied.
        Raises `PMFormatError` for a version-1 file (no metadata area) and `PMCorruptError` when the
        committed name table does not match the committed heap state.
        """
        if not isinstance(manager, Manager):
            raise TypeError(f"expected a cachedarrays.Manager, got {type(manager).__name__}")
        if device is None:
            pms = [d for d in manager.devices.values() if getattr(d, "kind", None) == "pm"]
            if len(pms) != 1:
                raise ValueError(f"the manager has {len(pms)} PM devices; pass the pool's device explicitly"
                                 if pms else "the manager has no PM device to hold a persistent pool")
            device = pms[0]
        elif manager.devices.get(device.name) is not device:
            raise ValueError(f"{device!r} is not a device of this manager")
        with manager.lock():
            pool = cls._registry.get((id(manager), device.name))
            if pool is None or pool.m is not manager:
                pool = cls(manager, device)
                cls._registry[(id(manager), device.name)] = pool
            return pool

    def __init__(self, manager: Manager, device: Device):
        if not getattr(device, "persistent", False):
            raise PMFormatError(f"{getattr(device, 'path', device.name)} has pool layout version 1: it has no metadata "
                                f"area, so it cannot hold named objects (its bytes are still there, but not its "
                                f"allocations); create a new pool file")
        self.m, self.device = manager, device
        committed = device.committed
        self._doc = self._parse(committed.blob) if committed.seq else self._document({}, {}, 0, 0.0)
        self.attrs: dict = json.loads(json.dumps(self._doc["attrs"]))
        self._entries: dict[str, _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        extents = dict(committed.extents)
        table = self._doc["objects"]
        offsets = sorted(rec["offset"] for rec in table.values())
        if sorted(extents) != offsets or any(extents[rec["offset"]] != rec["nbytes"] for rec in table.values()):
            raise PMCorruptError(f"{device.path}: the committed name table ({len(table)} objects) does not match the "
                                 f"committed heap state ({len(extents)} blocks); nothing was changed")
        for name, rec in sorted(table.items()):
            with device.claim(rec["offset"]):
                region = manager.allocate(device, rec["nbytes"])
            entry = _Entry(name, tuple(rec["shape"]), _from_descr(rec["dtype"]), rec["nbytes"],
                           manager.new_object(region), region, changed=False)
            self._track(entry)
        r = device.recovery
        self.recovery = RecoveryReport(device.path, self.durable_point, self.durable_time,
                                       bool(r and r.unclean), r.previous_pid if r else 0, r.note if r else None)
        manager.add_hooks(dirty=self._on_dirty, free=self._on_free, persist=self.persist)
        device.add_check_hook(self.check)

    # ------------------------------------------------------------------ the name table
    @property
    def durable_point(self) -> int:
        """How many durable points this pool has made (0: none yet)."""
        return int(self._doc["durable_point"])

    @property
    def durable_time(self) -> float:
        """When the last durable point was made (Unix seconds; 0.0 before the first)."""
        return float(self._doc["time"])

    def names(self) -> list[str]:
        """Names of the objects in the pool now (including those created since the last durable point)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """The shape and dtype stored with ``name``."""
        e = self._entry(name)
        return e.shape, e.dtype

    def create(self, name: str, shape: Any, dtype: Any = np.float64) -> CachedArray:
        """A new uninitialised named array with its primary region in the pool's device.

        Like every change, it becomes durable at the next durable point.  Raises `ValueError` if the
        name exists and `OutOfMemoryError` (naming the sizes) when the device cannot hold it.
        """
        name, shape, dtype = _check_name(name), _shape(shape), _check_dtype(dtype)
        with self.m.lock():
            self._check_open()
            if name in self._entries:
                raise ValueError(f"{self.device.path} already holds an object named {name!r}; open it with "
                                 f"persistent(manager, {name!r}) or delete it first")
            nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
            region = self._allocate(nbytes, f"create {name!r} ({shape}, {dtype})")
            entry = _Entry(name, shape, dtype, nbytes, self.m.new_object(region), None, changed=True)
            self._track(entry)
            return CachedArray(shape, self.m, dtype, _object=entry.obj)

    def get(self, name: str, shape: Any = None, dtype: Any = None) -> CachedArray:
        """The named array (the same object each time); ``shape`` and ``dtype``, when given, must be the stored ones.

        Raises `ObjectNotFoundError` for an unknown name and `PoolMismatchError` for a different shape or dtype.
        """
        with self.m.lock():
            self._check_open()
            e = self._entry(name)
            if shape is not None and _shape(shape) != e.shape:
                raise PoolMismatchError(f"{self.device.path}: object {name!r} has shape {e.shape}, "
                                        f"not {_shape(shape)} as requested")
            if dtype is not None and np.dtype(dtype) != e.dtype:
                raise PoolMismatchError(f"{self.device.path}: object {name!r} has dtype {e.dtype}, "
                                        f"not {np.dtype(dtype)} as requested")
            return CachedArray(e.shape, self.m, e.dtype, _object=e.obj)

    def delete(self, name: str) -> None:
        """Remove ``name`` from the pool; durable at the next durable point, when its home is freed.

        Arrays already holding the object stay usable in this process as ordinary (volatile) arrays.
        """
        with self.m.lock():
            self._check_open()
            e = self._entry(name)
            del self._entries[name]
            e.deleted = True
            if e.home is None:
                del self._by_id[e.obj.id]

    # ------------------------------------------------------------------ durable points
    def persist(self, attrs: dict | None = None) -> int:
        """Make a durable point: write back and persist every changed named object, then commit the
        name table, the heap state and ``attrs`` (JSON data stored beside the objects, e.g. the step
        of a training run; default: `self.attrs`) in one atomic step.  Returns the durable point number.

        On failure (e.g. `OutOfMemoryError`: no room for a write-back) nothing is committed, the pool
        stays at its previous durable point and every structure stays consistent.  No writer may
        write named objects while this runs (it holds the manager's lock, but kernels holding raw
        views do not take it).
        """
        with self.m.lock():
            self._check_open()
            if attrs is not None:
                self.attrs = dict(attrs)
            doc_attrs = json.loads(json.dumps(self.attrs))  # refuse what JSON cannot hold before any work
            staged: dict[str, Region] = {}
            fresh: list[Region] = []
            try:
                for name, e in sorted(self._entries.items()):
                    if e.home is None or e.changed or self.m.pinned(e.obj):
                        staged[name] = self._stage(e, fresh)
                homes = {name: staged.get(name, e.home) for name, e in self._entries.items()}
                for r in staged.values():
                    self.m.ready(r, write=False)  # a write-back into it (an eviction) may be in flight
                    self.device.persist(r.offset, r.nbytes)
                doc = self._document({name: self._entries[name].record(r) for name, r in homes.items()},
                                     doc_attrs, self.durable_point + 1, time.time())
                self._commit(doc, homes.values())
            except BaseException:
                for r in fresh:
                    if not r.freed and self.m.parent(r) is None:
                        self.m.free(r)
                raise
            for name, region in staged.items():
                e = self._entries[name]
                old, e.home, e.changed = e.home, region, False
                if old is not None and old is not region:
                    self._drop(old)
            self._forget_deleted()
            self.m.collect()  # deleted objects nobody else holds go now
            return self.durable_point

    def _forget_deleted(self) -> None:
        """After a commit without them: free deleted objects' homes and stop tracking them."""
        for e in [e for e in self._by_id.values() if e.deleted]:
            self._drop(e.home)
            del self._by_id[e.obj.id]

    def _stage(self, e: _Entry, fresh: list[Region]) -> Region:
        """A region of the pool's device, not the current home, holding ``e``'s bytes now (to become its home)."""
        m, dev = self.m, self.device
        primary = m.primary(e.obj)
        pinned = m.pinned(e.obj)
        if primary.device is dev:
            if not pinned and primary is not e.home:
                return primary  # written in place since the last durable point: it becomes the home
            return self._snapshot(e, primary, fresh)
        linked = m.getlinked(primary, dev)
        if linked is e.home and linked is not None:
            return self._snapshot(e, primary, fresh)  # pinned and unchanged: keep the home untouched
        if linked is None:
            linked = self._allocate(e.nbytes, f"write back {e.name!r}")
            m.copyto(linked, primary)
            m.link(primary, linked)
        elif m.isdirty(primary) or pinned:
            m.copyto(linked, primary)
        m.mark_clean(primary)
        if pinned:  # its writer may write again without marking it dirty: keep the home unlinked
            m.unlink(primary, linked)
            fresh.append(linked)
        return linked

    def _snapshot(self, e: _Entry, source: Region, fresh: list[Region]) -> Region:
        region = self._allocate(e.nbytes, f"snapshot {e.name!r}")
        fresh.append(region)
        self.m.copyto(region, source)
        return region

    # ------------------------------------------------------------------ protecting durable copies
    def _on_dirty(self, region: Region) -> None:
        """Before a region of a named object is written: keep its committed home out of the way."""
        m = self.m
        obj = m.parent(region)
        e = self._by_id.get(obj.id) if obj is not None else None
        if e is None:
            return
        with m.lock():
            home = e.home
            if home is not None and m.parent(home) is not None:  # the home is still one of its regions
                primary = m.primary(e.obj)
                if home is primary or home is region:
                    self._rehome(e)  # it is about to be written in place
                else:
                    m.unlink(primary, home)  # evictions now write back to a fresh region
            e.changed = True

    def _rehome(self, e: _Entry) -> None:
        """Copy the home (about to be written in place) to a new region and commit that as the home."""
        old = e.home
        new = self._allocate(e.nbytes, f"write to {e.name!r} in place: its durable copy (durable point "
                                       f"{self.durable_point}) must move out of the way first and needs")
        try:
            self.m.copyto(new, old)
            self.device.persist(new.offset, new.nbytes)
            doc = json.loads(json.dumps(self._doc))
            doc["objects"][e.name]["offset"] = new.offset
            homes = [new if h is old else h for h in self._homes()]
            self._commit(doc, homes)
        except BaseException:
            self.m.free(new)
            raise
        e.home = new
        self.m.record("pool_rehomes")
        self.m.record("pool_rehome_bytes", e.nbytes)

    def _on_free(self, obj: Object) -> None:
        e = self._by_id.get(obj.id)
        if e is not None:
            what = ("its deletion becomes durable at the next durable point (m.persist()); free it after that"
                    if e.deleted else f"delete it with Pool.delete({e.name!r}) and make a durable point first")
            raise PersistentObjectError(f"object {obj.id} is the persistent object {e.name!r} of {self.device.path}; {what}")

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify the pool against the manager and the device's committed metadata; raise `InvariantError`."""
        m, dev = self.m, self.device
        with m.lock():
            def fail(msg: str) -> None:
                raise InvariantError(f"pool {dev.path}: {msg}")

            if dev.closed:
                return
            if json.loads(dev.committed.blob or b"null") != (self._doc if dev.committed.seq else None):
                fail("the committed name table differs from the one this pool committed")
            table = self._doc["objects"]
            tracked = {e.name: e for e in self._by_id.values() if e.home is not None}
            if set(table) != set(tracked):
                fail(f"committed names {sorted(set(table) ^ set(tracked))[:5]} are not tracked (or the reverse)")
            extents = set(dev.committed.extents)
            seen = set()
            for name, e in tracked.items():
                h = e.home
                if h.freed or h.device is not dev or h.nbytes != e.nbytes:
                    fail(f"object {name!r}: home {h} is freed or not a region of {e.nbytes} bytes on {dev.name}")
                if (h.offset, h.nbytes) not in extents or table[name]["offset"] != h.offset:
                    fail(f"object {name!r}: home {h} is not the committed block of that name")
                if (h.offset, h.nbytes) in seen:
                    fail(f"two names share the home at offset {h.offset}")
                seen.add((h.offset, h.nbytes))
                owner = m.parent(h)
                if owner is not None:
                    if owner is not e.obj:
                        fail(f"object {name!r}: its home {h} belongs to object {owner.id}")
                    if e.changed:
                        fail(f"object {name!r} changed since the durable point but its home is still one of its regions")
                    primary = m.primary(e.obj)
                    if primary is not h and m.isdirty(primary):  # an eviction would write into the home
                        fail(f"object {name!r}: its primary {primary} is dirty while the home is still linked")
            if seen != extents:
                fail(f"committed blocks {sorted(extents - seen)[:5]} belong to no name")
            for e in self._by_id.values():
                try:
                    primary = m.primary(e.obj)
                except UseAfterFreeError:
                    fail(f"object {e.name!r} was freed behind the pool's back")
                if primary.nbytes != e.nbytes:
                    fail(f"object {e.name!r}: {primary.nbytes} bytes, the pool records {e.nbytes}")
            if set(self._entries) != {e.name for e in self._by_id.values() if not e.deleted}:
                fail("the live names and the tracked objects disagree")

    # ------------------------------------------------------------------ internals
    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            names = self.names()
            shown = ", ".join(repr(n) for n in names[:10]) + (", ..." if len(names) > 10 else "")
            raise ObjectNotFoundError(f"{self.device.path} holds no object named {name!r} "
                                      f"(it holds {len(names)}: {shown or 'none'})")
        return e

    def _track(self, e: _Entry) -> None:
        self._entries[e.name] = e
        self._by_id[e.obj.id] = e

    def _homes(self) -> list[Region]:
        return [e.home for e in self._by_id.values() if e.home is not None]

    def _allocate(self, nbytes: int, what: str) -> Region:
        region = self.m.allocate(self.device, nbytes)
        if region is None:
            self.m.collect()
            region = self.m.allocate(self.device, nbytes)
        if region is None:
            raise OutOfMemoryError(f"{self.device.path}: cannot {what} {nbytes} bytes: "
                                   f"{self.device.heap.exhausted_message(nbytes)}; the pool stays at durable point "
                                   f"{self.durable_point}")
        return region

    def _drop(self, home: Region) -> None:
        """Free a former home once no commit refers to it (kept when it is still a region of its object)."""
        if not home.freed and self.m.parent(home) is None:
            self.m.free(home)

    def _commit(self, doc: dict, homes) -> None:
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        self.device.commit([(h.offset, h.nbytes) for h in homes], blob)
        self._doc = json.loads(blob)

    @staticmethod
    def _document(objects: dict, attrs: dict, point: int, when: float) -> dict:
        return {"format": FORMAT, "durable_point": point, "time": when, "attrs": attrs, "objects": objects}

    def _parse(self, blob: bytes) -> dict:
        try:
            doc = json.loads(blob)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
            for rec in doc["objects"].values():
                _from_descr(rec["dtype"])
                int(rec["offset"]), int(rec["nbytes"]), _shape(rec["shape"])
            return doc
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PMCorruptError(f"{self.device.path}: the committed metadata passed its checksum but is not a "
                                 f"name table this library reads ({e}); nothing was changed") from None

    def _check_open(self) -> None:
        if self.device.closed:
            raise RuntimeError(f"the pool's device {self.device.name} ({self.device.path}) is closed")

    def __repr__(self) -> str:
        return (f"Pool({self.device.path!r}, {len(self._entries)} objects, durable point {self.durable_point})")


def persistent(manager: Manager, name: str, shape: Any = None, dtype: Any = None, *, create: bool = True) -> CachedArray:
    """The named array ``name`` of the manager's pool: opened if it exists (``shape`` and ``dtype``, when
    given, must match the stored ones), else created uninitialised when ``shape`` is given and ``create``.

    Raises `ObjectNotFoundError` when the name does not exist and cannot be created, `PoolMismatchError`
    for a different shape or dtype.  See the module docstring for what is durable when.
    """
    pool = Pool.open(manager)
    with manager.lock():
        if name in pool or not create or shape is None:
            return pool.get(name, shape, dtype)
        return pool.create(name, shape, np.float64 if dtype is None else dtype)
