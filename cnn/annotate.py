"""Memory annotations for CNN layers, after Listing 4.6 of the dissertation, as wrappers around layer calls.

Forward: prefetch the layer's inputs and weights (``force=True``; a policy
without P ignores it), run the layer under `noescape` (temporaries it made are
freed at once), then `softevict` inputs and weights: they are the first to go
if room is needed before the backward pass wants them again.

Backward: prefetch what the backward kernel reads (saved activations, the
incoming gradient, the weights, the gradients it adds into), run it under
`noescape`, then `cleanup` what is now dead — the layer's output, its saved
activations and the incoming gradient — `preserve`-ing the layer's inputs,
weights and every gradient still wanted.  In reverse topological order a tensor's producer runs its backward
after all its consumers, so freeing the producer's output there is safe for any
data flow, residual and dense blocks included.  With ``granularity="block"``
the cleanup of nodes inside a block (a tape scope) is deferred until the whole
block's backward is done, which is how the dissertation annotated ResNet and
DenseNet; ``"layer"`` (default) frees sooner.

The order of the backward pass is known before it runs, so once a layer's backward
kernel is dispatched the next layer's saved activations and weights are prefetched
into free fast memory (`Annotations.ahead`): their copies run beside this layer's
kernel instead of in front of the next one's.

A policy without M ignores every free, so the same annotated program runs in
every mode of Table 4.7; what changes is the policy.
"""

from __future__ import annotations

from typing import Any, Sequence

from cachedarrays import Manager, cleanup, noescape, prefetch, preserve, softevict

from .execute import Executor
from .layers import Layer


class Annotations:
    """Wraps `Layer.forward` / `Layer.backward` with hints; ``enabled=False`` gives the bare program."""

    def __init__(self, manager: Manager, enabled: bool = True, granularity: str = "layer", look_ahead: bool = True):
        if granularity not in ("layer", "block"):
            raise ValueError(f"granularity must be 'layer' or 'block', got {granularity!r}")
        self.m = manager
        self.enabled = enabled
        self.granularity = granularity
        self.look_ahead = look_ahead  # `ahead` prefetches (False: only at each layer's own call)

    def forward(self, ex: Executor, layer: Layer, xs: Sequence) -> tuple:
        """``(y, saved)`` of ``layer`` on ``xs``, annotated."""
        if not self.enabled:
            return layer.forward(ex, *xs)
        prefetch(xs, layer.params, force=True)
        y, saved = noescape(self.m, layer.forward, ex, *xs)
        softevict(xs, layer.params)
        return y, saved

    def backward(self, ex: Executor, layer: Layer, dy: Any, saved: tuple, need: Sequence[bool],
                 into: Sequence = ()) -> tuple:
        """``(dxs, dparams)`` of ``layer``, annotated (the cleanup is `release_dead`'s job); ``into``:
        the gradients it adds into (`Layer.backward`), read by its kernel like ``saved``."""
        if not self.enabled:
            return layer.backward(ex, dy, saved, need, into)
        prefetch(saved, dy, layer.params, [g for g in into if g is not None], force=True)
        out = noescape(self.m, layer.backward, ex, dy, saved, need, into)
        softevict(layer.params)
        return out

    def ahead(self, layer: Layer, saved: tuple) -> None:
        """Prefetch what ``layer``'s backward kernel reads besides gradients, its saved tensors and
        weights, while the kernel dispatched before it runs: called with the layer whose backward
        comes next. Into free room only: forcing it, on a GPU, evicted for copies that moved more
        bytes than they hid; `backward` forces what is still missing when the layer runs."""
        if self.enabled and self.look_ahead:
            prefetch(saved, layer.params, force=False)

    def release_dead(self, dead: Any, keep: Any) -> int:
        """`cleanup` ``dead`` except what ``keep`` holds (a tree, or a `Preserved` set of object
        ids); returns the number of objects handed to the policy."""
        if not self.enabled:
            return 0
        return cleanup(dead, keep)

    def update(self, ex: Executor, step, tensors: Sequence, dead: Any) -> None:
        """An optimiser step on ``tensors`` (weight, gradient, state): prefetch, run, free the gradient."""
        if not self.enabled:
            step()
            return
        prefetch(tensors, force=True)
        step()
        softevict(tensors)
        cleanup(dead, preserve(()))
