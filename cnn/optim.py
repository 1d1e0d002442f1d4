"""SGD with optional momentum; weights, gradients and momentum buffers are all CachedArrays.

The step is a kernel like any other: its inputs are handed over zero-copy and
its outputs overwrite the weight and momentum objects in place, so the
parameters keep their identity (and their place in the policy's order).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cachedarrays import CachedArray

from . import kernels as K
from .annotate import Annotations
from .execute import Executor


class SGD:
    """``SGD(params, lr, momentum=0.0)``; `step` takes ``[(param, grad), ...]`` from `Tape.backward`."""

    def __init__(self, params: Sequence[CachedArray], lr: float = 0.05, momentum: float = 0.0):
        self.lr = np.float32(lr)
        self.momentum = np.float32(momentum)
        self.state: dict[int, CachedArray] = {}
        if momentum:
            for p in params:
                v = CachedArray(p.shape, p.manager, np.float32)
                v[...] = 0
                self.state[p.object.id] = v

    def step(self, ex: Executor, ann: Annotations, pgrads: Sequence[tuple[CachedArray, CachedArray]]) -> None:
        """Update every parameter from its gradient; the gradient is freed afterwards (in mode M)."""
        for p, g in pgrads:
            v = self.state.get(p.object.id)
            if v is None:
                ann.update(ex, lambda: ex.call_into(K.sgd_step, (p, g), (p,), self.lr), (p, g), g)
            else:
                ann.update(ex, lambda: ex.call_into(K.sgd_momentum_step, (p, g, v), (p, v), self.lr, self.momentum),
                           (p, g, v), g)
