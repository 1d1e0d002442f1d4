"""SGD with optional momentum; weights, gradients and momentum buffers are all CachedArrays.

The step overwrites the weight and momentum objects in place, so the parameters
keep their identity (and their place in the policy's order): written where they
are by `cnn.inplace.SGD` (a numba loop on the host, one CUDA kernel a group on
the GPU), or, where the executor cannot reach every level that way, as a kernel
like any other whose outputs are copied into them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cachedarrays import CachedArray

from . import inplace, kernels as K
from .annotate import Annotations
from .execute import Executor


class SGD:
    """``SGD(params, lr, momentum=0.0)``; `step` takes ``[(param, grad), ...]`` from `Tape.backward`.

    Parameters are updated in groups, one kernel per group, since one dispatch per tensor cost
    more host time than the update itself for the many small batch-norm vectors: consecutive
    parameters whose operands (weights, gradients and momenta) together stay within the largest
    working set a kernel of the step has had so far (`KernelStats.max_working_set`), or the
    largest parameter's bytes where that is more.  So no group's operands outgrow the step's
    largest kernel's, and the smallest workable budget stays what the model's kernels make it."""

    def __init__(self, params: Sequence[CachedArray], lr: float = 0.05, momentum: float = 0.0):
        self.lr = np.float32(lr)
        self.momentum = np.float32(momentum)
        self.state: dict[int, CachedArray] = {}
        self.group_bytes = max((p.nbytes for p in params), default=0)
        if momentum:
            for p in params:
                v = CachedArray(p.shape, p.manager, np.float32)
                v[...] = 0
                self.state[p.object.id] = v

    def groups(self, pgrads: Sequence[tuple[CachedArray, CachedArray]], limit: int = 0) -> list[list[tuple]]:
        """``pgrads`` cut into runs of consecutive pairs of at most ``limit`` parameter bytes, or
        ``group_bytes`` where that is more (a larger parameter alone)."""
        limit = max(limit, self.group_bytes)
        out: list[list[tuple]] = []
        size = 0
        for pair in pgrads:
            if not out or size + pair[0].nbytes > limit:
                out.append([])
                size = 0
            out[-1].append(pair)
            size += pair[0].nbytes
        return out

    def step(self, ex: Executor, ann: Annotations, pgrads: Sequence[tuple[CachedArray, CachedArray]]) -> None:
        """Update every parameter from its gradient; the gradients are freed afterwards (in mode M)."""
        operands = 3 if self.state else 2  # bytes of operands a parameter byte brings to its group's kernel
        for group in self.groups(pgrads, ex.stats.max_working_set // operands):
            ps = [p for p, _ in group]
            gs = [g for _, g in group]
            vs = [self.state.get(p.object.id) for p in ps]
            if any(v is None for v in vs):
                ann.update(ex, lambda: ex.call_into(K.sgd_steps, (*ps, *gs), ps, self.lr, in_place=inplace.SGD),
                           (ps, gs), gs)
            else:
                ann.update(ex, lambda: ex.call_into(K.sgd_momentum_steps, (*ps, *gs, *vs), (*ps, *vs), self.lr,
                                                    self.momentum, in_place=inplace.SGD), (ps, gs, vs), gs)
