"""The same models as one jitted JAX function: the baseline a JAX user writes when the model fits.

`train_step(model, lr, momentum, variant)` returns a jitted ``step(params, momenta, x, y) ->
(params, momenta, loss)``: the forward pass, ``jax.value_and_grad`` and the SGD-with-momentum update
of `cnn.optim` under one ``jit``, reading the layers' weights from ``params`` (a list in
``model.params`` order) and calling the same kernels' maths as the layer-by-layer trainer.

Variants, JAX's own answers to a model that does not fit:

- ``"whole"``: plain; XLA keeps every saved activation in HBM.
- ``"remat"``: every residual / dense block (a tape scope) is a ``jax.checkpoint``: only block
  inputs are kept, everything inside a block is recomputed in the backward pass.
- ``"offload"``: the forward pass is one ``jax.checkpoint`` whose policy
  (``save_and_offload_only_these_names``) moves every layer output to ``pinned_host`` memory and
  brings it back for the backward pass (JAX's host offload of saved activations).

The models' wiring is plain Python over a tape, so a `FunctionalTape` runs it on JAX values;
for ``"remat"`` it records the calls made inside a scope and replays them as one checkpointed
function when the scope closes (only the scope's last output is used after it, as in every model
here).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import kernels as K
from .layers import (Add, AddReLU, AvgPool, BatchNorm, BNReLU, BNReLUConv, Chain, Concat, ConcatChain,
                     Conv2D, ConvBN, Dense, GlobalAvgPool, Layer, MaxPool, ReLU, ResidualChain, SoftmaxCrossEntropy)
from .models import Model

VARIANTS = ("whole", "remat", "offload")


def apply(layer: Layer, params: tuple, xs: list):
    """``layer``'s forward output on JAX values ``xs`` with weights ``params`` (the kernels' maths)."""
    if isinstance(layer, ConcatChain):
        return apply(layer.chain, params, [K.concat_fwd(*xs)])
    if isinstance(layer, (Chain, ConvBN)):
        return _sequence(layer, params, xs[0])[-1][3]
    if isinstance(layer, ResidualChain):  # the shortcut: the projection's output, or the block's input
        return K.add_relu_fwd(apply(layer.chain, params, xs[:1]), xs[-1])
    if isinstance(layer, Conv2D):
        return K._conv(xs[0], params[0], layer.stride, layer.pad)
    if isinstance(layer, BNReLUConv):
        return K.bn_relu_conv_fwd(xs[0], *params, stride=layer.conv.stride, pad=layer.conv.pad)[0]
    if isinstance(layer, Dense):
        return K.dense_fwd(xs[0], *params)
    if isinstance(layer, BNReLU):
        return K.bn_relu_fwd(xs[0], *params)[0]
    if isinstance(layer, AddReLU):
        return K.add_relu_fwd(*xs)
    if isinstance(layer, BatchNorm):
        return K.bn_fwd(xs[0], *params)[0]
    if isinstance(layer, ReLU):
        return K.relu_fwd(xs[0])
    if isinstance(layer, MaxPool):
        return K._maxpool(xs[0], layer.k, layer.s)
    if isinstance(layer, AvgPool):
        return K._avgpool(xs[0], layer.k, layer.s)
    if isinstance(layer, GlobalAvgPool):
        return K.gap_fwd(xs[0])
    if isinstance(layer, Concat):
        return K.concat_fwd(*xs)
    if isinstance(layer, Add):
        return K.add_fwd(*xs)
    if isinstance(layer, SoftmaxCrossEntropy):
        return K.xent_fwd(*xs)
    raise TypeError(f"no functional form for {layer!r}")


class _Pending:
    """A value made inside a scope that `FunctionalTape` has not computed yet (``remat``)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


class FunctionalTape:
    """Runs a model's wiring on JAX values (see the module docstring)."""

    def __init__(self, weights: dict[int, tuple], remat: bool = False, name: str | None = None):
        self.weights = weights      # id(layer) -> that layer's weights
        self.remat = remat
        self.name = name            # checkpoint_name given to every layer output (offload)
        self._calls: list | None = None

    def __call__(self, layer: Layer, *xs):
        if self._calls is not None:
            out = _Pending()
            self._calls.append((layer, xs, out))
            return out
        y = apply(layer, self._params(layer), [self._value(x) for x in xs])
        return y if self.name is None else checkpoint_name(y, self.name)

    def _params(self, layer: Layer) -> tuple:
        parts = getattr(layer, "parts", None)  # a fused layer wraps layers of the model, whose weights it uses
        if parts is not None:
            return sum((self.weights[id(part)] for part in parts), ())
        return self.weights[id(layer)]

    @staticmethod
    def _value(x):
        if isinstance(x, _Pending):
            if x.value is None:
                raise ValueError("a value made inside a rematerialised block is used after it, but only the "
                                 "block's last output is kept")
            return x.value
        return x

    @contextmanager
    def scope(self) -> Iterator[None]:
        if not self.remat or self._calls is not None:
            yield
            return
        self._calls = []
        try:
            yield
        finally:
            calls, self._calls = self._calls, None
        if not calls:
            return
        made = {id(out) for _, _, out in calls}
        outside, seen = [], set()
        for _, xs, _ in calls:
            for x in xs:
                if id(x) not in made and id(x) not in seen:
                    seen.add(id(x))
                    outside.append(x)
        layers = list({id(layer): layer for layer, _, _ in calls}.values())

        def block(ext, weights):
            env = {id(x): v for x, v in zip(outside, ext)}
            by_layer = {id(layer): w for layer, w in zip(layers, weights)}
            for layer, xs, out in calls:
                env[id(out)] = apply(layer, by_layer[id(layer)], [env[id(x)] for x in xs])
            return env[id(calls[-1][2])]

        calls[-1][2].value = jax.checkpoint(block)([self._value(x) for x in outside],
                                                   [self._params(layer) for layer in layers])


def _weights(model: Model, params: list) -> dict[int, tuple]:
    out, k = {}, 0
    for layer in model.layers:
        n = len(layer.params)
        out[id(layer)] = tuple(params[k:k + n])
        k += n
    out[id(_LOSS)] = ()
    return out


_LOSS = SoftmaxCrossEntropy()


def loss_fn(model: Model, variant: str = "whole") -> Callable:
    """``loss(params, x, y)`` of ``model`` as a JAX function, under ``variant``'s memory answer."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")

    def loss(params, x, y):
        tape = FunctionalTape(_weights(model, params), remat=variant == "remat",
                              name="act" if variant == "offload" else None)
        return tape(_LOSS, tape._value(model.forward(tape, x)), y)

    if variant == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["act"],
            offload_src="device", offload_dst="pinned_host")
        return jax.checkpoint(loss, policy=policy)
    return loss


def train_step(model: Model, lr: float, momentum: float, variant: str = "whole") -> Callable:
    """A jitted ``step(params, momenta, x, y) -> (params, momenta, loss)`` (params and momenta donated)."""
    loss = loss_fn(model, variant)
    lr, mu = np.float32(lr), np.float32(momentum)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, momenta, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        momenta = [mu * v + g for v, g in zip(momenta, grads)]
        params = [p - lr * v for p, v in zip(params, momenta)]
        return params, momenta, value

    return step


def initial_state(model: Model, device=None) -> tuple[list, list]:
    """The model's weights (copied out of its CachedArrays) and zero momenta, as JAX arrays."""
    params = [jax.device_put(np.asarray(p), device) for p in model.params]
    return params, [jnp.zeros_like(p) for p in params]


def _sequence(layer: "Chain | ConvBN", params: tuple, x) -> list[tuple]:
    """``(member, its params, its input, its output)`` for each of ``layer``'s members, in order."""
    steps, i = [], 0
    for member in layer.layers:
        n = len(member.params)
        y = apply(member, params[i:i + n], [x])
        steps.append((member, params[i:i + n], x, y))
        x, i = y, i + n
    return steps


def _inner_bytes(layer: Layer, params: tuple, xs: list) -> list[int]:
    """Bytes of the outputs fused ``layer`` makes inside, as the separate layers would store them."""
    if isinstance(layer, ConcatChain):  # the concatenation, and the chain's inside
        h = K.concat_fwd(*xs)
        return [h.size * h.dtype.itemsize] + _inner_bytes(layer.chain, params, [h])
    if isinstance(layer, ResidualChain):  # the chain's inside and its output, which the addition reads
        h = apply(layer.chain, params, xs[:1])
        return _inner_bytes(layer.chain, params, xs[:1]) + [h.size * h.dtype.itemsize]
    if not isinstance(layer, (Chain, ConvBN)):
        return []
    steps = _sequence(layer, params, xs[0])
    return ([b for member, ps, x, _ in steps for b in _inner_bytes(member, ps, [x])]
            + [y.size * y.dtype.itemsize for *_, y in steps[:-1]])  # every member's output but the layer's


def output_bytes(model: Model, batch: int) -> int:
    """Bytes of every layer output of one forward pass at ``batch``, counting the outputs a fused
    layer makes inside (a `ConvBN`'s convolution output, a `ConcatChain`'s concatenation) as the
    separate layers would (shapes only: nothing is computed)."""
    sizes: list[int] = []

    class _Counting(FunctionalTape):
        def __call__(self, layer, *xs):
            y = super().__call__(layer, *xs)
            sizes.append(y.size * y.dtype.itemsize)
            sizes.extend(_inner_bytes(layer, self._params(layer), [self._value(x) for x in xs]))
            return y

    params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in model.params]
    h, w, c = model.input_shape
    jax.eval_shape(lambda p, x: model.forward(_Counting(_weights(model, p)), x), params,
                   jax.ShapeDtypeStruct((batch, h, w, c), jnp.float32))
    return sum(sizes)
