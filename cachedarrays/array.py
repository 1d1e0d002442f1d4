"""`CachedArray`: an n-d array of plain-bits dtype whose bytes are an object managed by a policy.

An array has a *status* (Listing 4.3): ``NotBusy`` arrays give no direct access
to memory, so the policy may move them at will; ``ReadOnly`` and ``ReadWrite``
wrappers (from `readable` / `writable`) pin the object while they are held, so
no eviction can move the bytes under a reader or tear a writer's stores.
Converting to a status tells the policy of the use (`read_use` / `write_use`).

Transparent use also works: NumPy ufuncs, array functions, operators, indexing
and ``np.asarray`` pin their inputs for the duration of the call, and array
results come back as new CachedArrays allocated through the policy.

When the primary is on a GPU, views are device arrays: ``with readable(x) as a`` gives a
zero-copy JAX array (a CuPy array for 64-bit dtypes unless ``jax_enable_x64`` is set, since
JAX would narrow them), ``with writable(x) as w`` (and ``.array``) a CuPy array, and
``jax.dlpack.from_dlpack(readable(x))`` works too.  None of these block the host on a copy in
flight: the consumer's stream waits for it (the DLPack stream handshake), and releasing the
view records the consumer's work, so the region's bytes are not moved or reused under it.
Release GPU views explicitly (``with`` or ``.release()``) for that record to be made.
Element indexing and ``np.asarray`` of a GPU-resident array copy to the host.
"""

from __future__ import annotations

import enum
import math
import warnings
import weakref
from typing import Any, Callable

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .errors import StatusError
from .manager import Manager, Object


class Status(enum.Enum):
    NotBusy = "NotBusy"
    ReadOnly = "ReadOnly"
    ReadWrite = "ReadWrite"


def _check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects; a CachedArray holds plain bits only "
                        "(numbers, bool, and structured dtypes of those)")
    return dtype


def _policy(manager: Manager):
    if manager.policy is None:
        from .policies import LRUPolicy
        manager.set_policy(LRUPolicy())
    return manager.policy


class CachedArray(NDArrayOperatorsMixin):
    """``CachedArray(ndarray_or_shape, manager, dtype=None, place=None)``.

    Given array-like data, the data is copied (C order) into a new object, so
    non-contiguous or Fortran-ordered sources are fine.  Given a shape (an int
    or a tuple of ints), the contents are uninitialised, like ``np.empty``.
    The object is placed by the manager's policy (an `LRUPolicy` is attached if
    the manager has none); ``place="fast"`` or ``"slow"`` asks the policy for
    that device explicitly (`Policy.alloc_fast` / `Policy.alloc_slow`).
    """

    __array_priority__ = 20

    def __init__(self, data_or_shape: Any, manager: Manager, dtype: Any = None, *, place: str | None = None,
                 _object: Object | None = None, _status: Status = Status.NotBusy):
        if not isinstance(manager, Manager):
            raise TypeError(f"manager must be a cachedarrays.Manager, got {type(manager).__name__}")
        self.manager = manager
        self.policy = _policy(manager)
        self._status = _status
        self._released = False
        self._gpu_consumers: set = set()  # "cupy" and/or a JAX device that received the view
        if _object is not None:
            self.shape, self.dtype, self.object = tuple(data_or_shape), np.dtype(dtype), _object
            return
        if isinstance(data_or_shape, (int, np.integer)) or (
                isinstance(data_or_shape, tuple) and all(isinstance(d, (int, np.integer)) for d in data_or_shape)):
            shape = (int(data_or_shape),) if isinstance(data_or_shape, (int, np.integer)) else tuple(map(int, data_or_shape))
            if shape and min(shape) < 0:
                raise ValueError(f"negative dimension in shape {shape}")
            source = None
            dtype = _check_dtype(np.float64 if dtype is None else dtype)
        else:
            if isinstance(data_or_shape, CachedArray):
                source = np.array(data_or_shape, dtype=dtype, order="C")
            elif hasattr(data_or_shape, "__cuda_array_interface__"):  # a CuPy array: copied device to device
                source = data_or_shape if dtype is None else data_or_shape.astype(dtype)
            else:
                source = np.asarray(data_or_shape, dtype=dtype)
            dtype, shape = _check_dtype(source.dtype), source.shape
        self.shape, self.dtype = shape, dtype
        policy = self.policy
        allocate = policy.new if place is None else {"fast": policy.alloc_fast, "slow": policy.alloc_slow}.get(place)
        if allocate is None:
            raise ValueError(f"place must be None, 'fast' or 'slow', got {place!r}")
        self.object = allocate(max(math.prod(shape) * dtype.itemsize, 1))
        if source is not None and self.nbytes:
            with writable(self) as dst:
                assign_into(dst, source)

    # ------------------------------------------------------------------ basic properties
    @property
    def status(self) -> Status:
        return self._status

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d CachedArray")
        return self.shape[0]

    @property
    def device(self) -> str:
        """Name of the device that holds the primary copy now (a policy may move it at any time)."""
        return self.manager.primary(self.object).device.name

    def __repr__(self) -> str:
        where = self.device if self.object.alive else "freed"
        return f"CachedArray(shape={self.shape}, dtype={self.dtype}, status={self._status.value}, on={where})"

    # ------------------------------------------------------------------ raw access (pinned statuses only)
    @property
    def array(self) -> np.ndarray:
        """The numpy view of the bytes; only for ``readable``/``writable`` wrappers, valid while they are held."""
        if self._status is Status.NotBusy:
            raise StatusError("a NotBusy CachedArray gives no direct access to its data; "
                              "use readable(x) or writable(x) (or a `with` block)")
        if self._released:
            raise StatusError(f"this {self._status.value} view was released; take a new one with readable/writable")
        region = self.manager.primary(self.object)
        if region.device.memory_space != "host":
            self._gpu_consumers.add("cupy")
            return self._gpu_view(region, self._status is Status.ReadWrite)
        return self._view(writeable=self._status is Status.ReadWrite)

    def _view(self, writeable: bool) -> np.ndarray:
        raw = self.manager.bytes(self.manager.primary(self.object))[:self.nbytes]
        arr = raw.view(self.dtype).reshape(self.shape)
        if not writeable:
            arr.flags.writeable = False
        return arr

    def _gpu_view(self, region, write: bool, stream=None, mark=None):
        """A CuPy view of a GPU region, ordered after its copies on ``stream`` (default: CuPy's current)."""
        from .devices.gpu import cupy
        cp = cupy()
        if self.dtype.fields is not None:
            raise TypeError(f"a GPU-resident array of structured dtype {self.dtype} has no CuPy view; "
                            f"evict it to a host device to read it")
        self.manager.ready_on(region, cp.cuda.get_current_stream() if stream is None else stream, write, mark)
        raw = self.manager.bytes(region, wait=False)[:self.nbytes]
        return raw.view(self.dtype).reshape(self.shape)

    def _on_gpu(self) -> bool:
        return self.manager.primary(self.object).device.memory_space != "host"

    def release(self) -> "CachedArray":
        """End this view's pin now (also happens on ``with`` exit or when the view is collected)."""
        if self._status is not Status.NotBusy and not self._released:
            self._released = True
            self._pinned = False
            if self._gpu_consumers:
                self._record_gpu_uses()
            self.manager.unpin(self.object)
        return self

    def __del__(self):
        # a pinned view collected without `release`: the pin goes at the next manager call (taking the
        # manager's lock here could deadlock, as collection may run inside a locked section)
        if self.__dict__.get("_pinned"):
            self.manager.unpin_later(self.object)

    def _record_gpu_uses(self, uses: dict | None = None) -> None:
        """Record this view's GPU consumers as uses of its region; ``uses`` (consumer -> use) shares
        one record among several views (`release_together`)."""
        from .devices.gpu import CudaUse, JaxUse
        region = self.manager.primary(self.object)
        uses = {} if uses is None else uses
        for consumer in self._gpu_consumers:
            if consumer not in uses:
                uses[consumer] = CudaUse() if consumer == "cupy" else JaxUse(consumer)
            self.manager.add_use(region, uses[consumer])
        self._gpu_consumers.clear()

    def __enter__(self):
        try:
            if self._status is Status.ReadOnly and self._on_gpu() and _jax_holds(self.dtype):
                from .jaxdlpack import from_dlpack
                return from_dlpack(self)
            return self.array
        except BaseException:
            self.release()  # ``with`` will not call __exit__: do not leave the object pinned
            raise

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ numpy interop
    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._status is Status.NotBusy:
            if copy is False:
                raise ValueError("a NotBusy CachedArray cannot be exposed without a copy: use readable(x) for a view")
            v = readable(self)  # pin first: the use may move the object (insert on use)
            try:
                return np.array(_host(v.array), dtype=dtype, copy=True)
            finally:
                v.release()
        arr = self.array
        if not isinstance(arr, np.ndarray):
            if copy is False:
                raise ValueError("a GPU-resident CachedArray cannot be exposed to NumPy without a copy")
            host = arr.get()
            return host if dtype is None else host.astype(dtype, copy=False)
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(f"cannot convert {arr.dtype} to {np.dtype(dtype)} without a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        from .interop import call_pinned
        if out is not None:
            kwargs["out"] = out
        return call_pinned(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        from .interop import call_pinned
        return call_pinned(func, args, kwargs)

    def __getitem__(self, key):
        if self._status is not Status.NotBusy:
            result = self.array[_unwrap_key(key)]
            return result if isinstance(result, np.ndarray) or not hasattr(result, "get") else _to_host(result)
        v = readable(self)  # pin first: the use may move the object (insert on use)
        try:
            result = v.array[_unwrap_key(key)]
            if isinstance(result, np.ndarray):
                return result.copy()
            return _to_host(result) if hasattr(result, "get") else result
        finally:
            v.release()

    def __setitem__(self, key, value) -> None:
        if self._status is Status.ReadOnly:
            raise StatusError("cannot write through a ReadOnly view; use writable(x)")
        from .interop import pinned_values
        with pinned_values(value) as plain:
            if self._status is Status.ReadWrite:
                assign_into(self.array, plain, _unwrap_key(key))
                return
            w = writable(self)
            try:
                assign_into(w.array, plain, _unwrap_key(key))
            finally:
                w.release()

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        return bool(self.__array__())

    def __float__(self) -> float:
        return float(self.__array__())

    def __int__(self) -> int:
        return int(self.__array__())

    def __dlpack__(self, *, stream=None, **kwargs):
        """Zero-copy export for ``jax.dlpack.from_dlpack(readable(x))`` (64-byte aligned, C-contiguous)."""
        if self._status is Status.NotBusy:
            raise StatusError("export a readable(x) or writable(x) view, not a NotBusy array, through DLPack")
        if self._released:
            raise StatusError("this view was released")
        region = self.manager.primary(self.object)
        if region.device.memory_space != "host":
            return self._gpu_export(region, stream, kwargs)
        # DLPack as JAX requests it has no read-only flag; consumers like JAX never write.
        return self._view(writeable=True).__dlpack__(stream=stream, **kwargs)

    def _gpu_export(self, region, stream, kwargs):
        """DLPack export of a GPU region: the consumer's ``stream`` waits for the region's copies."""
        from .devices.gpu import JaxUse, cupy
        cp = cupy()
        consumer = _external_stream(cp, stream) if isinstance(stream, int) and stream > 2 else None
        device = _jax_device(region.device.index)
        mark = None
        if device is not None:
            self._gpu_consumers.add(device)
            # JAX hands out a side stream for the handshake: where its compute stream reaches this
            # use is marked, if a copy is still running, by a tiny computation dispatched then, or
            # after the JAX value `jax_array` was told of (the copy's exposed time counts from it)
            after = self.__dict__.get("_after")
            mark = lambda: JaxUse(device, after).cuda_event  # noqa: E731
        view = self._gpu_view(region, write=self._status is Status.ReadWrite, stream=consumer, mark=mark)
        return view.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        region = self.manager.primary(self.object)
        if region.device.memory_space != "host":
            return (2, region.device.index)  # kDLCUDA
        return self._view(writeable=False).__dlpack_device__()


_JAX_DEVICES: dict = {}
_STREAMS: dict = {}  # a consumer's DLPack stream (JAX hands out the same few) -> CuPy's handle of it
_JAX_VIEWS: "weakref.WeakKeyDictionary[Manager, dict]" = weakref.WeakKeyDictionary()
JAX_VIEWS_KEPT = 4096  # per manager: the oldest kept view goes when one more would pass this


def jax_array(view: CachedArray, after: Any = None):
    """A zero-copy JAX array of a `readable` (or `writable`) view's bytes, for a kernel to read while
    the view is held; on a GPU, releasing the view records JAX's use of the region.

    ``after`` (GPU): a JAX array made by the last computation dispatched to the device (the
    previous kernel's output), after which the kernel that reads this array starts; where a
    copy into the region is still running, that point marks the start of the copy's exposed time
    (`devices.gpu.JaxUse`) without a marker computation of its own.

    Importing through DLPack costs host time on every call (the stream handshake and CuPy's and
    JAX's wrappers), so the JAX arrays made are kept, keyed by the bytes they alias (device, offset,
    shape, dtype), and handed out again to any view whose primary region starts there while
    `Manager.settled` says that no copy or use a reader must be ordered after is in flight;
    otherwise, and the first time, the view is imported (`jaxdlpack.from_dlpack`).
    Keying by address rather than by region lets the next object placed at the same offset (a
    training step's activations, freed and allocated again in the same order every step) reuse the
    import.  Only arrays that alias the region's own bytes are kept (never a copy, which a later
    write would make stale); at most `JAX_VIEWS_KEPT` per manager, dropped when it closes.  The
    manager's API is all this uses: which region is primary, and whether it is settled.
    """
    if view._status is Status.NotBusy or view._released:
        raise StatusError("jax_array needs a held readable(x) or writable(x) view")
    m = view.manager
    region = m.primary(view.object)
    views = _JAX_VIEWS.get(m)
    key = (region.device, region.offset, view.shape, view.dtype)
    arr = None if views is None else views.get(key)
    if arr is not None and m.settled(region):
        if region.device.memory_space != "host":
            view._gpu_consumers.add(_jax_device(region.device.index))
        return arr
    from .jaxdlpack import from_dlpack
    view._after = after
    try:
        arr = from_dlpack(view)
    finally:
        view._after = None
    if view.nbytes and arr.unsafe_buffer_pointer() == region.device.address(region.offset):
        if views is None:
            views = _JAX_VIEWS[m] = {}
            m.add_hooks(close=views.clear)
        views.pop(key, None)
        views[key] = arr
        if len(views) > JAX_VIEWS_KEPT:
            del views[next(iter(views))]
    return arr


def _external_stream(cp: Any, stream: int) -> Any:
    """CuPy's handle of a consumer's stream ``stream`` (an address), made once per stream."""
    handle = _STREAMS.get(stream)
    if handle is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external for protocol objects
            warnings.simplefilter("ignore", DeprecationWarning)
            handle = _STREAMS[stream] = cp.cuda.ExternalStream(stream)
    return handle


def _jax_device(index: int):
    """JAX's device for CUDA device ``index`` (None if JAX has none), looked up once."""
    if index not in _JAX_DEVICES:
        import jax
        _JAX_DEVICES[index] = next((d for d in jax.devices() if d.platform == "gpu"
                                    and getattr(d, "local_hardware_id", d.id) == index), None)
    return _JAX_DEVICES[index]


def cuda_reachable(x: CachedArray) -> bool:
    """Whether CUDA copies reach ``x``'s bytes where they are now: GPU memory, or host memory
    page-locked for the GPU (`Device.cuda_reachable`); `device_pointer` gives their address."""
    return x.manager.primary(x.object).device.cuda_reachable


def device_pointer(view: CachedArray, stream=None) -> int:
    """The address of a `writable` (or `readable`) view's bytes for raw CUDA calls
    (``cudaMemcpyAsync``) that skip CuPy's array wrappers: GPU memory, or host memory page-locked
    for the GPU (`Device.page_locked`), which CUDA copies reach directly.  ``stream`` (default CuPy's
    current) is ordered after the region's copies and uses as for ``view.array``, and releasing the
    view records CuPy's use, which later readers and copies of the region wait for (the host ones
    too).  Raises for a view whose bytes are in host memory that is not page-locked."""
    if view._status is Status.NotBusy or view._released:
        raise StatusError("device_pointer needs a held readable(x) or writable(x) view")
    if not cuda_reachable(view):
        raise ValueError(f"{view!r} is in host memory that is not page-locked for the GPU; use view.array")
    region = view.manager.primary(view.object)
    from .devices.gpu import cupy
    view.manager.ready_on(region, cupy().cuda.get_current_stream() if stream is None else stream,
                          view._status is Status.ReadWrite)
    view._gpu_consumers.add("cupy")
    return region.device.address(region.offset)


def write_later(x: CachedArray, write: Callable[[Any, Any], Any]) -> None:
    """Write ``x``'s bytes (all of them) when something first needs them, not now: a view of
    ``x``, the policy moving it, `write_now`; never if ``x`` is freed before
    (`Manager.fill_later`). The policy is told of the write use now, as by `writable`.

    ``write(target, stream)`` makes the write: where ``x`` is in GPU memory or in page-locked
    host memory (`cuda_reachable`), ``target`` is the bytes' address and ``stream`` the CuPy
    stream current now, on which it queues the write (a ``cudaMemcpyAsync``) and records what it
    returns: a use whose event marks the write's end (`devices.gpu.CudaUse`); elsewhere
    ``target`` is a numpy view of the bytes (shape and dtype of ``x``), ``stream`` None, and the
    write is done on return (returns None). It runs on whichever thread needs the bytes first,
    under the manager's lock, so it must not call the policy or take views."""
    _require(x)
    m = x.manager
    # the write holds neither x nor its object: an object whose last reference dies is freed
    # (and its write dropped) as any other
    nbytes, dtype, shape = x.nbytes, x.dtype, x.shape
    with m.lock():  # no move between the use and the fill (a view's pin is not needed for that)
        x.policy.write_use(x.object)
        region = m.primary(x.object)
        if region.device.cuda_reachable:
            from .devices.gpu import cupy
            stream = cupy().cuda.get_current_stream()

            def fill():
                m.ready_on(region, stream, True)  # after the region's earlier readers
                return write(region.device.address(region.offset), stream)
        else:
            def fill():
                m.ready(region)
                return write(m.bytes(region, wait=False)[:nbytes].view(dtype).reshape(shape), None)
        m.fill_later(region, fill)


def write_now(x: CachedArray) -> None:
    """Issue ``x``'s deferred write (`write_later`) now; nothing when it has none or was freed."""
    if x.object.alive:
        x.manager.issue_fill(x.manager.primary(x.object))


def assign_into(target, value, key=Ellipsis) -> None:
    """``target[key] = value`` where ``target`` is a numpy or CuPy view and ``value`` is numpy, JAX,
    CuPy or anything array-like; GPU targets take device values through DLPack without a host trip."""
    if isinstance(target, np.ndarray):
        if hasattr(value, "__cuda_array_interface__"):
            value = value.get()  # a CuPy array into host memory
        target[key] = value
        return
    from .devices.gpu import cupy
    cp = cupy()
    if isinstance(value, cp.ndarray) or not hasattr(value, "__dlpack__") or isinstance(value, np.ndarray):
        target[key] = cp.asarray(value)
        return
    try:
        source = cp.from_dlpack(value)  # a JAX array on the GPU: zero-copy, ordered on CuPy's stream
    except (BufferError, TypeError, ValueError, RuntimeError):
        target[key] = cp.asarray(np.asarray(value))
        return
    target[key] = source
    # The foreign buffer stays allocated only while ``value`` lives, and its owner (JAX) frees it
    # without waiting for our stream: finish reading it before returning (measured: without this,
    # JAX's next small allocations landed in the result's freed bytes before the copy read them).
    cp.cuda.get_current_stream().synchronize()


def assign(view, value) -> None:
    """Write ``value`` (e.g. a JAX result) into a writable view, on the device where its bytes
    live: ``with writable(x) as w: assign(w, y)``.  ``view`` is what ``with writable(x)`` gives
    (a numpy or CuPy array) or the `writable` wrapper itself.  Shapes broadcast as in NumPy."""
    if isinstance(view, CachedArray):
        if view.status is not Status.ReadWrite:
            raise StatusError("assign needs a writable(x) view, not a NotBusy or ReadOnly one")
        view = view.array
    elif isinstance(view, np.ndarray) and not view.flags.writeable:
        raise StatusError("assign needs a writable view; this array is read-only")
    assign_into(view, value)


def _jax_holds(dtype: np.dtype) -> bool:
    """Whether JAX keeps ``dtype`` as it is (64-bit types need ``jax_enable_x64``; else they would
    be narrowed, so GPU views of them stay CuPy arrays)."""
    import jax
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


def _host(arr):
    """A numpy array of a view: itself on the host, a copy of a GPU one."""
    return arr if isinstance(arr, np.ndarray) else arr.get()


def _to_host(result):
    return result.get() if result.ndim else result.item()


def _unwrap_key(key):
    if isinstance(key, CachedArray):
        return np.asarray(key)
    if isinstance(key, tuple):
        return tuple(np.asarray(k) if isinstance(k, CachedArray) else k for k in key)
    return key


def _wrap(x: CachedArray, status: Status) -> CachedArray:
    """A pinned view of ``x``'s object (the caller holds the manager's lock): ``x``'s fields,
    copied without `CachedArray.__init__`'s checks, which ``x`` passed."""
    x.manager.pin(x.object)
    view = CachedArray.__new__(CachedArray)
    view.__dict__.update(manager=x.manager, policy=x.policy, _status=status, _released=False, _gpu_consumers=set(),
                         shape=x.shape, dtype=x.dtype, object=x.object, _pinned=True)
    return view


def readable(x: CachedArray) -> CachedArray:
    """A ReadOnly view of ``x``: tells the policy of a read use, then pins the object while held.

    ``with readable(x) as a:`` gives a numpy array with ``writeable=False``.
    """
    _require(x)
    with x.manager.lock():  # no move between the use and the pin
        x.policy.read_use(x.object)
        return _wrap(x, Status.ReadOnly)


def writable(x: CachedArray) -> CachedArray:
    """A ReadWrite view of ``x``: a write use (marks the primary dirty), then pinned while held.

    The use and the pin happen under one manager lock: were another thread to move ``x`` in
    between (evict the dirty copy, prefetch it back clean), the writes would land in a region
    not marked dirty, and the next eviction would drop them (seen in the Listing 6.1 test).
    """
    _require(x)
    with x.manager.lock():
        x.policy.write_use(x.object)
        return _wrap(x, Status.ReadWrite)


def release_together(views, use=None) -> list:
    """Release several views at once; returns the GPU use records made (CUDA events).

    A device runs a consumer's work in order, so one record per consumer (one CuPy event, one tiny
    JAX computation per JAX device) covers every view used before it: a kernel that read three
    views pays for one record, not three.  ``use``: a record the caller already has that marks
    the end of every consumer's work on these views (e.g. an event recorded after a stream waited
    for the kernel's outputs), taken for all of them instead.  Host views are released as by
    `CachedArray.release`."""
    uses: dict = {}
    if use is not None:
        uses = _AllConsumers(use)
    for v in views:
        if v.status is Status.NotBusy or v._released:
            continue
        if v._gpu_consumers:
            v._record_gpu_uses(uses)
        v.release()
    return list(uses.values())


class _AllConsumers(dict):
    """A use map that gives one record for every consumer (`release_together` with ``use``)."""

    def __init__(self, use):
        super().__init__()
        self.use = use

    def __contains__(self, consumer) -> bool:
        return True

    def __getitem__(self, consumer):
        return self.use

    def values(self):
        return [self.use]


def release(x: CachedArray) -> CachedArray:
    """A NotBusy handle on ``x``'s object; releases ``x`` itself if it is a pinned view."""
    _require(x)
    if x.status is not Status.NotBusy:
        x.release()
    return CachedArray(x.shape, x.manager, x.dtype, _object=x.object)


def similar(x: CachedArray, dtype: Any = None, shape: tuple[int, ...] | None = None) -> CachedArray:
    """A new uninitialised CachedArray like ``x`` (same manager; same shape and dtype unless given)."""
    _require(x)
    return CachedArray(x.shape if shape is None else shape, x.manager, x.dtype if dtype is None else dtype)


def _require(x) -> None:
    if not isinstance(x, CachedArray):
        raise TypeError(f"expected a CachedArray, got {type(x).__name__}")
