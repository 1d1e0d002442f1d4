"""The kernel programming model: hand CachedArrays to a jitted kernel zero-copy, store its outputs through the policy.

`Executor.call` takes ``readable`` views of the input CachedArrays (telling the
policy of the use and pinning them), hands them to JAX with `cachedarrays.jax_array`
(zero-copy: regions are 64-byte aligned and C-contiguous; a region's JAX array is
imported once and reused while it stays put), dispatches the kernel, releases the views, and only
then stores each output as a new CachedArray allocated through the policy.  Releasing the
inputs before the outputs are allocated means a kernel needs room in fast
memory for its inputs, or for one output, never for both at once.

An output's copy into its region is deferred (`cachedarrays.write_later`): the next two kernels
read it from the JAX value (`FRESH_KERNELS`), and an output freed after that without anything
reading its region (the gradient one layer's backward hands to the next: a third of a DenseNet
step's output bytes) is never copied.  Anything that reads or moves the object first (a view,
the policy evicting it) has the copy made before it; older outputs are copied when the next
kernel starts, and all of them at `Executor.sync`.

On the host the kernel runs to completion before the views are released.  On a
GPU nothing waits: the kernel is dispatched on JAX's stream (which waits on the
GPU for copies into its inputs), one use record (`release_together`: an event
after CuPy's stream waited for the kernel's outputs) keeps the inputs' regions
from being moved or reused before the kernel has read them, and
each output copy into the region the policy chose is one ``cudaMemcpyAsync``
on CuPy's stream, after the DLPack handshake with JAX's (no host wait: the JAX
value is kept alive until its copy is done instead), in HBM or in page-locked
host memory alike.  An input a policy left in page-locked host memory is copied
up the same way into a buffer of CuPy's that JAX imports.  Host memory that is
not page-locked goes through the host, which waits.  The use records double as
the device clock of learned prefetch (`timeline`).

The next kernels read an output of the last two from the JAX value it came as (kept until
then; the same bytes as its region, as nothing but the executor writes an object between
kernels), so the common chain of one layer feeding the next costs no import and no
cross-stream wait.

A kernel's output may be added into an existing object instead of stored (`Executor.call`'s
``into``: a gradient summed over a tensor's uses), the sum computed in the kernel's own program.

The executor also counts where the kernels' operands lived (fast or slow) when
they were touched, because a kernel reading or writing the slow device directly
is traffic the manager's copy counters do not see.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from cachedarrays import (CachedArray, Manager, cuda_reachable, device_pointer, jax_array, readable,
                          release_together, writable, write_later, write_now)
from cachedarrays.jaxdlpack import from_dlpack

_COPY = 4  # cudaMemcpyDefault: the direction from the addresses (GPU memory, page-locked host memory)
# kernels whose outputs the next kernels read from their JAX values, their copies deferred: two, so
# that a layer's second backward kernel (weights' gradient) reads the incoming gradient from it too
FRESH_KERNELS = 2
MIN_QUEUE = 256 << 20  # bytes of queued output copies the host may always run ahead by (`queue_limit`)
KEEP_POLL = 8  # kept kernel outputs whose copies may have ended are looked at once every this many copies


@dataclass
class KernelStats:
    """Operand traffic of kernels by device, and the working-set high-water mark."""

    calls: int = 0
    seconds: float = 0.0
    read_fast: int = 0
    read_slow: int = 0
    written_fast: int = 0
    written_slow: int = 0
    copies: int = 0                   # kernel outputs copied into their regions (`Executor.copy_into`)
    copied: int = 0                   # their bytes: GPU work that a whole-jitted program does not do
    elided: int = 0                   # outputs never copied: the object died unread, or a later write replaced them
    elided_bytes: int = 0             # their bytes (`Executor.copy_into`)
    max_working_set: int = 0          # largest bytes of operands one kernel had pinned at once
    max_working_set_kernel: str = ""

    def reset(self) -> None:
        for f in ("calls", "seconds", "read_fast", "read_slow", "written_fast", "written_slow", "copies", "copied",
                  "elided", "elided_bytes"):
            setattr(self, f, 0)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Executor:
    """Runs kernels on CachedArrays of one manager; see the module docstring.

    ``timeline``: on a GPU, a `cachedarrays.devices.gpu.DeviceClock` told of every kernel's use
    record (learned prefetch reads device time from it).  ``tape``: a list that each kernel run
    appends ``(kernel, input shapes and dtypes, args, static)`` to (None: nothing is recorded), so
    that the same kernels can be dispatched again on bare arrays (:func:`replay`)."""

    manager: Manager
    stats: KernelStats = field(default_factory=KernelStats)
    timeline: Any = None
    tape: list | None = None

    def __post_init__(self):
        self.gpu = self.manager.fast.memory_space != "host"
        self._device = None
        self._keep: collections.deque = collections.deque()  # (event, what it must outlive, bytes)
        self._keep_bytes = 0
        # outputs whose copies are still queued live in JAX's memory, outside the budget: the host may
        # run this far ahead of the GPU before it waits for the oldest copy (`queue_limit`)
        self.ahead_bytes = queue_limit(self.manager.fast) if self.gpu else 0
        self._ordered: tuple = ()  # the last kernel's outputs, which CuPy's stream waits for
        self._latest = None  # an output the last jitted kernel computed (marks where JAX's stream is)
        self._fresh: dict = {}  # object id -> (kernel number, the JAX value it stored), of the last kernels
        self._staged: list = []  # the running kernel's inputs copied up from host memory (CuPy buffers)
        self._kernels = 0  # kernels run so far (`run`)
        self._deferred: collections.deque = collections.deque()  # [kernel number, stored array, written?]
        # in-place updates reach every level: the host's code any host memory, CUDA's its own and page-locked
        self._writes_in_place = not self.gpu or all(d.cuda_reachable for d in self.manager.levels)

    def _where(self, x: CachedArray) -> bool:
        return x.policy.in_fast(x.object)

    def _working_set(self, nbytes: int, name: str) -> None:
        if nbytes > self.stats.max_working_set:
            self.stats.max_working_set = nbytes
            self.stats.max_working_set_kernel = name

    def _jax_input(self, view: CachedArray):
        if self.gpu and self.manager.primary(view.object).device.memory_space == "host":
            # a host-resident input of a GPU kernel (a policy that leaves misses where they are):
            # JAX gets its own copy of the bytes, which stays valid after the view is released
            if not cuda_reachable(view):
                return jax.device_put(np.array(view.array), self._gpu_device())
            # page-locked: copied up on CuPy's stream, without the host waiting for the copy or for
            # the kernels queued before it; the buffer is kept until the kernel's use record is done
            import cupy as cp
            stream = cp.cuda.get_current_stream()
            buf = cp.empty(view.shape, view.dtype)
            if view.nbytes:
                cp.cuda.runtime.memcpyAsync(buf.data.ptr, device_pointer(view, stream), view.nbytes, _COPY, stream.ptr)
            self._staged.append(buf)
            return from_dlpack(buf)  # JAX's stream waits for CuPy's
        return jax_array(view, after=self._latest)

    def upload(self, host: np.ndarray) -> Any:
        """``host`` in the fast device's memory outside the heap (a CuPy array on a GPU, ``host`` itself
        on the host), to be placed as an object later by a device-to-device copy: the transfer from
        pageable memory, synchronous on a GPU, done before a step starts."""
        if not self.gpu:
            return host
        import cupy as cp
        with cp.cuda.Device(self.manager.fast.index):
            return cp.asarray(host)

    def _gpu_device(self):
        if self._device is None:
            index = self.manager.fast.index
            self._device = next(d for d in jax.devices() if d.platform == "gpu"
                                and getattr(d, "local_hardware_id", d.id) == index)
        return self._device

    def run(self, kernel: Callable, inputs: Sequence[CachedArray], *args: Any, **static: Any) -> tuple:
        """Run ``kernel(*jax_inputs, *args, **static)`` with zero-copy inputs; return its outputs (JAX arrays;
        on the host, done), after the inputs were released."""
        t0 = time.perf_counter()
        self._kernels += 1
        oldest = self._kernels - FRESH_KERNELS  # the outputs of kernels from this one on are fresh
        self._write_stored(before=oldest)  # the others are copied now, if alive, and no longer fresh
        fresh = self._fresh
        views = [readable(x) for x in inputs]
        done = None  # if the kernel raises, the views are released with records of their own
        try:
            nbytes = self._count_reads({v.object.id: v for v in views}.values())
            # an output of the last kernels is read from its JAX value, which holds the same bytes:
            # no import of the region, and on a GPU no wait for its store (JAX orders its own work)
            jx = [fresh[v.object.id][1] if v.object.id in fresh else self._jax_input(v) for v in views]
            if self.tape is not None:
                self.tape.append((kernel, [(tuple(j.shape), j.dtype) for j in jx], args, static))
            out = kernel(*jx, *args, **static)
            if not self.gpu:
                out = jax.block_until_ready(out)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            done = self._kernel_done(outs, jx, hasattr(kernel, "lower")) if self.gpu else None
            del jx
        finally:
            uses = release_together(views, done)
            if self._staged:
                self._keep_staged(done)
        self._kernel_end(kernel, uses, max(nbytes, max((o.nbytes for o in outs), default=0)), t0)
        return outs

    def _count_reads(self, views) -> int:
        """Count the bytes of ``views`` (one per object) as read from the fast or the slow level; their sum."""
        nbytes = 0
        for v in views:
            nbytes += v.nbytes
            if self._where(v):
                self.stats.read_fast += v.nbytes
            else:
                self.stats.read_slow += v.nbytes
        return nbytes

    def _count_write(self, x: CachedArray) -> None:
        if self._where(x):
            self.stats.written_fast += x.nbytes
        else:
            self.stats.written_slow += x.nbytes

    def _kernel_end(self, kernel: Callable, uses: list, working_set: int, t0: float) -> None:
        """After a kernel's views were released: its use record to the device clock, its operands'
        bytes to the working-set mark, one call and its host time to the counters."""
        if self.timeline is not None and uses:
            self.timeline.note(uses[-1].cuda_event)
        self._working_set(working_set, getattr(kernel, "__name__", "kernel"))
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t0

    def _kernel_done(self, outs: tuple, inputs: list, one_program: bool):
        """A use record at the end of a dispatched kernel: CuPy's stream waits for its outputs (the
        DLPack stream handshake, on the GPU), then an event.  It stands for the kernel's reads of
        all its inputs, and `store` copies the outputs after it, where a JAX marker computation per
        kernel cost about a millisecond of host time on an H100 host.

        A jitted kernel (``one_program``) is one XLA program, whose outputs are defined together:
        CuPy's stream waits for one output it computed, which orders it after the whole program.
        An output that is one of the inputs handed back unchanged is waited for too.  Any other
        callable may run several programs: every output is waited for."""
        from cachedarrays.devices.gpu import CudaUse
        waits = outs
        if one_program:
            forwarded = [o for o in outs if any(o is x for x in inputs)]
            computed = next((o for o in outs if not any(o is f for f in forwarded)), None)
            waits = forwarded + ([computed] if computed is not None else [])
            if computed is not None:
                self._latest = computed
        stream = _stream_handle()
        for o in waits:
            _wait_for(o, stream)
        self._ordered = outs
        return CudaUse()

    def _keep_staged(self, done) -> None:
        """Keep the inputs copied up from host memory until the kernel has read them (``done``: its
        use record; None when it raised, after JAX may have queued part of it: wait for the GPU)."""
        if done is None:
            import cupy as cp
            cp.cuda.Device(self.manager.fast.index).synchronize()
        else:
            self._keep.append((done.cuda_event, self._staged, 0))
        self._staged = []

    def store(self, value) -> CachedArray:
        """A kernel output as a new CachedArray placed by the policy (`copy_into` it)."""
        y = CachedArray(tuple(value.shape), self.manager, np.dtype(value.dtype))
        self._write_later(y, value)
        return y

    def copy_into(self, y: CachedArray, value) -> None:
        """Overwrite ``y`` with ``value`` (a write use: the policy marks it dirty), later.

        The copy into the region is deferred (`cachedarrays.write_later`): the next
        `FRESH_KERNELS` kernels read the value itself (``_fresh``), and an object freed after
        them, unread (a gradient passed from one layer's backward to the next), is never copied,
        nor is a value another write replaces first. What reads or moves the object before
        writes it first; older values are written when the next kernel starts (`_write_stored`),
        so that at most `FRESH_KERNELS` kernels' outputs stay in JAX's memory beside their
        regions, and all at `sync`."""
        if math.prod(value.shape) != y.size or np.dtype(value.dtype) != y.dtype:
            raise ValueError(f"a kernel output of shape {tuple(value.shape)} and dtype {value.dtype} cannot be "
                             f"stored into an array of shape {y.shape} and dtype {y.dtype}")
        self._write_later(y, value)

    def _write_later(self, y: CachedArray, value) -> None:
        """`copy_into` for a ``value`` of ``y``'s size and dtype."""
        self._count_write(y)
        entry = [self._kernels, y, False]
        source = self._source(value) if self.gpu else 0
        nbytes = y.nbytes

        def write(target, stream):
            entry[2] = True
            self.stats.copies += 1
            self.stats.copied += nbytes
            if stream is None:  # host bytes (numpy)
                np.copyto(target, np.asarray(value).reshape(target.shape), casting="no")
                return None
            return self._copy_on(stream, target, source, nbytes, value)

        write_later(y, write)
        self._deferred.append(entry)
        self._fresh[y.object.id] = (self._kernels, value)

    def _write_stored(self, before: int | None = None) -> None:
        """Write the values stored by kernels numbered below ``before`` (all: None) into their
        objects where not written yet, and stop reading them from ``_fresh``; count those never
        written (the object died first, or a later write replaced the value) as elided."""
        pending, fresh = self._deferred, self._fresh
        while pending and (before is None or pending[0][0] < before):
            entry = pending.popleft()
            kernel, y = entry[0], entry[1]
            if fresh.get(y.object.id, (None,))[0] == kernel:  # not replaced by a later value
                del fresh[y.object.id]
            if not entry[2] and y.object.alive:
                write_now(y)
            if not entry[2]:
                self.stats.elided += 1
                self.stats.elided_bytes += y.nbytes

    def _source(self, value) -> int:
        """The device address of a kernel output ``value`` for a copy on CuPy's current stream,
        which is ordered after the kernel that makes it."""
        if not any(o is value for o in self._ordered):  # not an output of the last kernel
            _wait_for(value, _stream_handle())
        return value.unsafe_buffer_pointer() if math.prod(value.shape) else 0

    def _copy_on(self, stream, target: int, source: int, nbytes: int, value):
        """Copy ``nbytes`` from ``source`` to ``target`` on ``stream``; the use that marks its end."""
        import cupy as cp
        from cachedarrays.devices.gpu import CudaUse
        if nbytes:
            cp.cuda.runtime.memcpyAsync(target, source, nbytes, _COPY, stream.ptr)
        use = CudaUse(stream)
        self._keep_until(use.cuda_event, value, nbytes)
        return use

    def _keep_until(self, event, value, nbytes: int) -> None:
        """Keep ``value`` referenced until ``event``: its owner, JAX, would
        reuse the bytes at once, without waiting for our stream. The host waits for the oldest
        kept copies once more than `ahead_bytes` are queued."""
        keep = self._keep
        keep.append((event, value, nbytes))
        self._keep_bytes += nbytes
        if len(keep) % KEEP_POLL and self._keep_bytes <= self.ahead_bytes:
            return  # the oldest copy's end is asked once every KEEP_POLL copies (a driver call)
        while keep and (keep[0][0].done or self._keep_bytes > self.ahead_bytes):
            event, _, n = keep.popleft()
            event.synchronize()
            self._keep_bytes -= n

    def call(self, kernel: Callable, inputs: Sequence[CachedArray], *args: Any,
             into: Sequence[CachedArray | None] | None = None, **static: Any) -> tuple[CachedArray, ...]:
        """`run` then `store` every output: the outputs as CachedArrays, always a tuple.

        ``into`` (one entry per output): an existing CachedArray that output ``i`` is added to and
        written into (`copy_into`; returned in its place), or None for a new object.  The additions
        run in the kernel's own program (`accumulating`): a gradient summed over a tensor's uses
        costs no kernel, object or store of its own."""
        if into is None or all(t is None for t in into):
            return tuple(self.store(h) for h in self.run(kernel, inputs, *args, **static))
        if args:
            raise ValueError("a kernel called with into= takes its arguments as arrays and static keywords only")
        mask = tuple(t is not None for t in into)
        accs = [t for t in into if t is not None]
        outs = self.run(accumulating(kernel, mask, tuple(sorted(static))), (*accs, *inputs), **static)
        for i, (h, t) in enumerate(zip(outs, into)):
            if t is not None and (tuple(h.shape) != t.shape or np.dtype(h.dtype) != t.dtype):
                raise ValueError(f"into[{i}] has shape {t.shape} and dtype {t.dtype}, but the sum with output {i} "
                                 f"has shape {tuple(h.shape)} and dtype {h.dtype}")
        result = []
        for h, t in zip(outs, into):
            if t is None:
                result.append(self.store(h))
            else:
                self.copy_into(t, h)
                result.append(t)
        return tuple(result)

    def call_into(self, kernel: Callable, inputs: Sequence[CachedArray], targets: Sequence[CachedArray],
                  *args: Any, in_place: Any = None, **static: Any) -> None:
        """`run`, then write the outputs into existing ``targets`` (in-place updates: SGD, accumulation).

        ``in_place`` (a `cnn.inplace.InPlace`, for targets that are all among the inputs): the same
        update written into the targets' bytes where they are, without a kernel dispatch or output
        copies, when every level of the manager is reachable from the code that runs it (the host,
        or on a GPU its memory and page-locked host memory) and every operand has the type it
        takes; the kernel is still what `tape` records."""
        if in_place is not None and self._writes_in_place and all(x.dtype == in_place.dtype for x in inputs):
            self._update_in_place(in_place, kernel, inputs, targets, args, static)
            return
        for t, h in zip(targets, self.run(kernel, inputs, *args, **static)):
            self.copy_into(t, h)

    def _update_in_place(self, in_place: Any, kernel: Callable, inputs: Sequence[CachedArray],
                         targets: Sequence[CachedArray], args: tuple, static: dict) -> None:
        t0 = time.perf_counter()
        written = {t.object.id for t in targets}
        if not written <= {x.object.id for x in inputs}:
            raise ValueError("an in-place update writes only objects among its inputs")
        views: dict[int, CachedArray] = {}
        try:
            for x in inputs:
                if x.object.id not in views:
                    views[x.object.id] = writable(x) if x.object.id in written else readable(x)
            nbytes = self._count_reads(views.values())  # every operand is read; the targets are written too
            for v in views.values():
                if v.object.id in written:
                    self._count_write(v)
            if self.tape is not None:
                self.tape.append((kernel, [(x.shape, x.dtype) for x in inputs], args, static))
            ops = [views[x.object.id] for x in inputs]
            if self.gpu:
                import cupy as cp
                stream = cp.cuda.get_current_stream()
                in_place.cuda([device_pointer(v, stream) for v in ops], [v.size for v in ops], *args)
            else:
                in_place.host([v.array for v in ops], *args)
        finally:
            uses = release_together(list(views.values()))
        for t in targets:
            self._fresh.pop(t.object.id, None)
        self._kernel_end(kernel, uses, nbytes, t0)

    def sync(self) -> None:
        """Write every stored output not written yet, then wait until every kernel and output copy
        dispatched so far is done (the end of a step)."""
        self._write_stored()
        if self.gpu:
            import cupy as cp
            cp.cuda.Device(self.manager.fast.index).synchronize()
            self._keep.clear()
            self._keep_bytes = 0
        self._fresh.clear()


def queue_limit(fast: Any) -> int:
    """Bytes of kernel outputs whose copies may be queued at once on the GPU ``fast``: half of the
    device memory free outside its heap, at most the heap's capacity, at least `MIN_QUEUE`.

    The queued outputs are what lets the host run ahead of the GPU: a DenseNet's first block
    queues several GiB of copies within a few kernels, and a host that waits there leaves the GPU
    without work later, where the kernels are short.  The memory they take is JAX's, so the limit
    follows the memory free for it when the executor is made."""
    return max(MIN_QUEUE, min(fast.capacity, fast.free_memory() // 2))


_ACCUMULATING: dict = {}


def accumulating(kernel: Callable, mask: tuple[bool, ...], static: tuple[str, ...] = ()) -> Callable:
    """``kernel`` as one jitted program that takes, first, one array per True entry of ``mask`` and
    returns ``acc + output`` for those outputs (``acc + g``, the sum `cnn.kernels.add_fwd` makes, so
    the bits are the same); the others unchanged.  ``static``: the names of the kernel's static
    keyword arguments.  Made once per kernel, mask and static names."""
    key = (kernel, mask, static)
    fused = _ACCUMULATING.get(key)
    if fused is None:
        n = sum(mask)

        def fused(*arrays, **keywords):
            out = kernel(*arrays[n:], **keywords)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if len(outs) != len(mask):
                raise ValueError(f"into= has {len(mask)} entries for a kernel with {len(outs)} outputs")
            accs = iter(arrays[:n])
            return tuple(next(accs) + o if m else o for o, m in zip(outs, mask))

        fused.__name__ = f"{getattr(kernel, '__name__', 'kernel')}+acc"
        fused = _ACCUMULATING[key] = jax.jit(fused, static_argnames=static)
    return fused


def _stream_handle() -> int:
    """CuPy's current stream as a DLPack ``stream`` argument, as `cupy.from_dlpack` passes it (the
    null stream as the default stream's handle: 1, CUDA's legacy stream, unless per-thread)."""
    import cupy as cp
    ptr = cp.cuda.get_current_stream().ptr
    if ptr == 0:
        default = getattr(cp.cuda.stream, "get_default_stream_ptr", None)
        ptr = default() if default is not None else 1
    return ptr


def _wait_for(value, stream: int) -> None:
    """Make ``stream`` wait until JAX has written ``value``, without a host wait: the DLPack stream
    handshake of an import (JAX orders the consumer's stream after the buffer's definition event),
    without the import (the capsule is dropped unconsumed, which releases JAX's buffer at once)."""
    value.__dlpack__(stream=stream)


def replay(tape: Sequence[tuple], device: Any = None) -> Callable[[], None]:
    """A function that dispatches the kernels of ``tape`` (:attr:`Executor.tape`) again, in order,
    on bare JAX arrays of the recorded shapes (zeros, one per shape, on ``device``), and waits for
    the last: the same per-layer work with nothing of ours around it (no views, no policy, no
    copies of outputs into regions), what per-layer dispatch costs by itself."""
    arrays: dict = {}

    def bare(shape, dtype):
        key = (shape, np.dtype(dtype))
        if key not in arrays:
            arrays[key] = jax.device_put(np.zeros(shape, dtype), device)
        return arrays[key]

    calls = [(kernel, [bare(*sd) for sd in inputs], args, static) for kernel, inputs, args, static in tape]

    def run() -> None:
        out = None
        for kernel, xs, args, static in calls:
            out = kernel(*xs, *args, **static)
        jax.block_until_ready(out)
    return run
