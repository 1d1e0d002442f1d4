"""A tape of layer applications and reverse-mode differentiation over it.

Models are Python functions that call ``tape(layer, *inputs)``; the tape runs
the (annotated) forward pass and records a `Node` per call: the layer, its
input and output CachedArrays and its saved activations.  `Tape.backward` walks
the nodes in reverse, accumulating gradients of tensors used more than once
(residual shortcuts, DenseNet feature maps; inside the backward kernel of a layer that
`adds_into`, else by a sum of its own), and hands dead tensors to the
annotations' cleanup as soon as the node that produced them is done.

The tape keeps every node and every gradient it made (and so every tensor of
the iteration) referenced until it is dropped, like a tracing garbage collector that has not run yet: Python's
reference counting would otherwise free dead tensors at once, which would make
every mode behave as if it had the memory optimisations (M).  Dropping the tape
at the end of an iteration is the garbage collection the dissertation ran after
each iteration.

Given the schedule from `plan_last_uses`, the tape also frees, during the
forward pass, activations that no backward kernel needs once their last
consumer has run (a batch norm's output after the ReLU read it; DenseNet's
feature maps after the block's last concatenation).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, KeysView, Sequence

from cachedarrays import CachedArray, Preserved, preserve

from . import kernels as K
from .annotate import Annotations
from .execute import Executor
from .layers import Layer


@dataclass
class Node:
    layer: Layer
    inputs: tuple
    output: CachedArray
    saved: tuple
    scope: int | None


class GradStore:
    """Gradients by tensor (object id); a gradient object may serve several tensors (Add shares dy)."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.grads: dict[int, CachedArray] = {}
        self.users: dict[int, int] = {}

    def add(self, key: int, g: CachedArray) -> None:
        """Accumulate ``g`` into the gradient of ``key`` (in place when that gradient is not shared)."""
        acc = self.grads.get(key)
        if acc is None:
            self.grads[key] = g
            self.users[g.object.id] = self.users.get(g.object.id, 0) + 1
            return
        if self.users[acc.object.id] == 1 and acc.object.id != g.object.id:
            self.ex.call_into(K.add_fwd, (acc, g), (acc,))
            return
        (total,) = self.ex.call(K.add_fwd, (acc, g))
        self._drop(acc)
        self.grads[key] = total
        self.users[total.object.id] = 1

    def targets(self, keys: Sequence[int | None]) -> tuple[CachedArray | None, ...]:
        """Per key (None: no gradient wanted), the gradient a layer may add the key's next
        contribution into (`Layer.backward`'s ``into``): one held and not shared with another
        tensor; None for a key's repeats, so that one sum is not written twice."""
        seen: set[int] = set()
        out = []
        for key in keys:
            acc = self.grads.get(key) if key is not None and key not in seen else None
            out.append(acc if acc is not None and self.users[acc.object.id] == 1 else None)
            if key is not None:
                seen.add(key)
        return tuple(out)

    def __contains__(self, key: int) -> bool:
        """Whether tensor ``key`` has a gradient so far."""
        return key in self.grads

    def pop(self, key: int) -> CachedArray | None:
        g = self.grads.pop(key, None)
        if g is not None:
            self._drop(g)
        return g

    def _drop(self, g: CachedArray) -> None:
        self.users[g.object.id] -= 1
        if not self.users[g.object.id]:
            del self.users[g.object.id]

    def ids(self) -> KeysView[int]:
        """The object ids of the gradients held (a live set-like view: ``users`` counts, per
        gradient object, the tensors it serves)."""
        return self.users.keys()


class Tape:
    """Records the forward pass of one iteration; see the module docstring."""

    def __init__(self, ex: Executor, annotations: Annotations, last_uses: list[list[int]] | None = None):
        self.ex = ex
        self.ann = annotations
        self.last_uses = last_uses or []
        self.saved_ids: set[int] = set()
        self.nodes: list[Node] = []
        self._scope: int | None = None
        self._scopes = 0
        self.produced: set[int] = set()
        self.retained: list = []  # gradients made by backward, kept until the tape is dropped

    def __call__(self, layer: Layer, *xs: CachedArray) -> CachedArray:
        y, saved = self.ann.forward(self.ex, layer, xs)
        k = len(self.nodes)
        self.nodes.append(Node(layer, tuple(xs), y, tuple(saved), self._scope))
        self.produced.add(y.object.id)
        self.saved_ids.update(s.object.id for s in saved if isinstance(s, CachedArray))
        if k < len(self.last_uses):
            # inputs whose last consumer this was and that no backward kernel needs are dead already
            dead = [xs[i] for i in self.last_uses[k] if xs[i].object.id in self.produced
                    and xs[i].object.id not in self.saved_ids]
            if dead:
                self.ann.release_dead(dead, ())
        return y

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Group the nodes recorded inside into one block (for block-granularity cleanup)."""
        outer = self._scope
        self._scopes += 1
        self._scope = self._scopes
        try:
            yield
        finally:
            self._scope = outer

    def backward(self, loss: CachedArray) -> list[tuple[CachedArray, CachedArray]]:
        """Gradients of every layer parameter, as ``[(param, grad), ...]`` in the order the parameters
        were first used; ``loss`` must be the output of the last node (its own gradient is implicit)."""
        if not self.nodes or self.nodes[-1].output is not loss:
            raise ValueError("backward(loss) needs loss to be the output of the last recorded layer")
        grads = GradStore(self.ex)
        pgrads = GradStore(self.ex)
        params: dict[int, CachedArray] = {}
        deferred: list[Node] = []
        dead_block: list = []
        block = self.ann.granularity == "block"
        for i in range(len(self.nodes) - 1, -1, -1):
            node = self.nodes[i]
            dy = None if i == len(self.nodes) - 1 else grads.pop(node.output.object.id)
            if dy is None and i != len(self.nodes) - 1:
                continue  # nothing downstream needs this node's gradient
            need = [x.object.id in self.produced if isinstance(x, CachedArray) else False for x in node.inputs]
            into = (grads.targets([x.object.id if wanted else None for x, wanted in zip(node.inputs, need)])
                    if node.layer.adds_into else ())
            dxs, dps = self.ann.backward(self.ex, node.layer, dy, node.saved, need, into)
            for x, dx, wanted, acc in zip(node.inputs, dxs, need, into or (None,) * len(dxs)):
                if dx is not None and wanted and acc is None:  # else the layer added dx into acc
                    grads.add(x.object.id, dx)
            for p, dp in zip(node.layer.params, dps):
                params.setdefault(p.object.id, p)
                pgrads.add(p.object.id, dp)
            dead = (node.output, node.saved, dy, dxs)
            self.retained.append((dy, dxs, dps))  # a tracing GC would not see these die before it runs
            self._ahead(i, grads)
            inputs: tuple | list = node.inputs
            if block and node.scope is not None:
                deferred.append(node)
                dead_block.append(dead)
                first_of_scope = i == 0 or self.nodes[i - 1].scope != node.scope
                if not first_of_scope:
                    continue
                # the block is done: free everything it made, keeping what flowed in from outside it
                made = {n.output.object.id for n in deferred}
                inputs = [x for n in deferred for x in n.inputs
                          if isinstance(x, CachedArray) and x.object.id not in made]
                dead, deferred, dead_block = dead_block, [], []
            # by id: walking every parameter and gradient at every node made the backward pass quadratic
            keep = Preserved(preserve(inputs) | params.keys() | grads.ids() | pgrads.ids())
            self.ann.release_dead(dead, keep)
        order = list(reversed(list(params)))
        return [(params[k], pgrads.grads[k]) for k in order]

    def _ahead(self, i: int, grads: GradStore) -> None:
        """`Annotations.ahead` for the node whose backward follows node ``i``'s: the first one before
        it whose output has a gradient by now."""
        for j in range(i - 1, -1, -1):
            node = self.nodes[j]
            if node.output.object.id in grads:
                self.ann.ahead(node.layer, node.saved)
                return


class _Token:
    """A stand-in tensor for `plan_last_uses`."""

    shape = ()


class _PlanTape:
    def __init__(self):
        self.nodes: list[list[int]] = []
        self.tokens: list[_Token] = []  # kept alive so that ids stay unique

    def __call__(self, layer: Layer, *xs) -> _Token:
        t = _Token()
        self.tokens.append(t)
        self.nodes.append([id(x) for x in xs])
        return t

    @contextmanager
    def scope(self) -> Iterator[None]:
        yield


def plan_last_uses(forward, *extra_layers: Layer) -> list[list[int]]:
    """For each node of ``forward(tape, x)`` (then ``extra_layers`` applied to its output and a second
    input, like the loss), the input positions for which that node is the last consumer.

    The models are static, so running the wiring once on tokens (no kernels) gives the schedule a
    compiler would use for liveness; `Tape` frees, in the forward pass, an activation whose last
    consumer has run and that no backward kernel saved (mode M), instead of leaving it until the
    backward pass reaches its producer.
    """
    pt = _PlanTape()
    x = _Token()
    pt.tokens.append(x)
    out = forward(pt, x)
    for layer in extra_layers:
        other = _Token()
        pt.tokens.append(other)
        out = pt(layer, out, other)
    last: dict[int, int] = {}
    for k, ins in enumerate(pt.nodes):
        for t in ins:
            last[t] = k
    return [[i for i, t in enumerate(ins) if last[t] == k and ins.index(t) == i] for k, ins in enumerate(pt.nodes)]
