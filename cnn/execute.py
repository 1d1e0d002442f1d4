"""The kernel programming model: hand CachedArrays to a jitted kernel zero-copy, store its outputs through the policy.

`Executor.call` takes ``readable`` views of the input CachedArrays (telling the
policy of the use and pinning them), imports them into JAX with
``jax.dlpack.from_dlpack`` (zero-copy: regions are 64-byte aligned and
C-contiguous), runs the kernel to completion, drops the JAX aliases and
releases the views, and only then copies each output into a new CachedArray
allocated through the policy.  Releasing the inputs before the outputs are
allocated means a kernel needs room in fast memory for its inputs, or for one
output, never for both at once.

The executor also counts where the kernels' operands lived (fast or slow) when
they were touched, because a kernel reading or writing the slow device directly
is traffic the manager's copy counters do not see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from cachedarrays import CachedArray, Manager, readable, writable


@dataclass
class KernelStats:
    """Operand traffic of kernels by device, and the working-set high-water mark."""

    calls: int = 0
    seconds: float = 0.0
    read_fast: int = 0
    read_slow: int = 0
    written_fast: int = 0
    written_slow: int = 0
    max_working_set: int = 0          # largest bytes of operands one kernel had pinned at once
    max_working_set_kernel: str = ""

    def reset(self) -> None:
        for f in ("calls", "seconds", "read_fast", "read_slow", "written_fast", "written_slow"):
            setattr(self, f, 0)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Executor:
    """Runs kernels on CachedArrays of one manager; see the module docstring."""

    manager: Manager
    stats: KernelStats = field(default_factory=KernelStats)

    def _where(self, x: CachedArray) -> bool:
        return x.policy.in_fast(x.object)

    def _working_set(self, nbytes: int, name: str) -> None:
        if nbytes > self.stats.max_working_set:
            self.stats.max_working_set = nbytes
            self.stats.max_working_set_kernel = name

    def run(self, kernel: Callable, inputs: Sequence[CachedArray], *args: Any, **static: Any) -> tuple:
        """Run ``kernel(*jax_inputs, *args, **static)`` with zero-copy inputs; return its outputs as host
        numpy arrays (views of JAX buffers, owned by no device), after the inputs were released."""
        t0 = time.perf_counter()
        views = [readable(x) for x in inputs]
        try:
            seen = set()
            nbytes = 0
            for v in views:
                if v.object.id in seen:
                    continue
                seen.add(v.object.id)
                nbytes += v.nbytes
                if self._where(v):
                    self.stats.read_fast += v.nbytes
                else:
                    self.stats.read_slow += v.nbytes
            jx = [jax.dlpack.from_dlpack(v) for v in views]
            out = kernel(*jx, *args, **static)
            out = jax.block_until_ready(out)
            del jx
        finally:
            for v in views:
                v.release()
        single = not isinstance(out, (tuple, list))
        outs = (out,) if single else tuple(out)
        host = tuple(np.asarray(o) for o in outs)
        self._working_set(max(nbytes, max((h.nbytes for h in host), default=0)), getattr(kernel, "__name__", "kernel"))
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t0
        return host

    def store(self, host: np.ndarray) -> CachedArray:
        """Copy a kernel output into a new CachedArray placed by the policy."""
        y = CachedArray(host.shape, self.manager, host.dtype)
        self.copy_into(y, host)
        return y

    def copy_into(self, y: CachedArray, host: np.ndarray) -> None:
        """Overwrite ``y`` with ``host`` (a write use: the policy marks it dirty)."""
        with writable(y) as dst:
            if self._where(y):
                self.stats.written_fast += y.nbytes
            else:
                self.stats.written_slow += y.nbytes
            np.copyto(dst, host.reshape(dst.shape), casting="no")

    def call(self, kernel: Callable, inputs: Sequence[CachedArray], *args: Any, **static: Any) -> tuple[CachedArray, ...]:
        """`run` then `store` every output: the outputs as CachedArrays, always a tuple."""
        return tuple(self.store(h) for h in self.run(kernel, inputs, *args, **static))

    def call_into(self, kernel: Callable, inputs: Sequence[CachedArray], targets: Sequence[CachedArray],
                  *args: Any, **static: Any) -> None:
        """`run`, then write the outputs into existing ``targets`` (in-place updates: SGD, accumulation)."""
        for t, h in zip(targets, self.run(kernel, inputs, *args, **static)):
            self.copy_into(t, h)
