"""Layers: parameters held as CachedArrays, forward and backward passes that only call kernels.

A layer's ``forward(ex, *xs)`` returns ``(y, saved)``: the output CachedArray and
the tuple of CachedArrays (and plain shapes) the backward pass needs (the saved activations are
ordinary CachedArrays, so the manager sees and can move every one of them; no
tensor hides in a JAX closure).  ``backward(ex, dy, saved, need, into=())`` returns
``(dxs, dparams)``: one gradient per input (None where ``need`` is False or
the input is not differentiable) and one per parameter.  ``into``, where given, holds per input
an existing gradient of that input (or None), given to layers whose ``adds_into`` is True: they
add their gradient into it inside their own kernel (`Executor.call`'s ``into``) and return that
object, which saves the kernel, object and store of a separate sum.

Layers know nothing of memory management: the annotations of `cnn.annotate`
wrap these calls (Listing 4.6), so the maths here stays plain.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from cachedarrays import CachedArray, Manager

from . import kernels as K
from .execute import Executor

Saved = tuple


class Layer:
    """Base class: no parameters; subclasses define `forward` and `backward`."""

    params: tuple[CachedArray, ...] = ()
    name = "layer"
    adds_into = False  # backward adds each input's gradient into ``into``'s entry where there is one

    def forward(self, ex: Executor, *xs: CachedArray) -> tuple[CachedArray, Saved]:
        raise NotImplementedError

    def backward(self, ex: Executor, dy: CachedArray, saved: Saved,
                 need: Sequence[bool], into: Sequence[CachedArray | None] = ()) -> tuple[tuple, tuple]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _first(into: Sequence[CachedArray | None]) -> CachedArray | None:
    """The gradient to add the first input's gradient into, if any."""
    return into[0] if into else None


def _param(m: Manager, value: np.ndarray) -> CachedArray:
    return CachedArray(np.ascontiguousarray(value, dtype=np.float32), m)


class Conv2D(Layer):
    """k x k convolution, NHWC input, HWIO filter, no bias (a batch norm usually follows)."""

    adds_into = True

    def __init__(self, m: Manager, rng: np.random.Generator, cin: int, cout: int, k: int = 3, stride: int = 1,
                 pad: int | None = None, name: str = "conv"):
        self.k, self.stride, self.pad = k, stride, (k // 2 if pad is None else pad)
        self.cin, self.cout, self.name = cin, cout, name
        w = rng.standard_normal((k, k, cin, cout), dtype=np.float32) * math.sqrt(2.0 / (k * k * cin))
        self.params = (_param(m, w),)

    def forward(self, ex, x):
        (y,) = ex.call(K.conv_fwd, (x, self.params[0]), stride=self.stride, pad=self.pad)
        return y, (x,)

    def backward(self, ex, dy, saved, need, into=()):
        (x,), (w,) = saved, self.params
        if need[0]:
            dx, dw = ex.call(K.conv_bwd, (dy, x, w), into=(_first(into), None), stride=self.stride, pad=self.pad)
            return (dx,), (dw,)
        (dw,) = ex.call(K.conv_bwd_weights, (dy, x, w), stride=self.stride, pad=self.pad)
        return (None,), (dw,)


class Dense(Layer):
    """y = x W + b for x of shape (N, D)."""

    adds_into = True

    def __init__(self, m: Manager, rng: np.random.Generator, din: int, dout: int, name: str = "dense"):
        self.name = name
        w = rng.standard_normal((din, dout), dtype=np.float32) * math.sqrt(1.0 / din)
        self.params = (_param(m, w), _param(m, np.zeros(dout, np.float32)))

    def forward(self, ex, x):
        (y,) = ex.call(K.dense_fwd, (x, *self.params))
        return y, (x,)

    def backward(self, ex, dy, saved, need, into=()):
        dx, dw, db = ex.call(K.dense_bwd, (dy, saved[0], self.params[0]), into=(_first(into), None, None))
        return (dx,), (dw, db)


class BatchNorm(Layer):
    """Batch normalisation over N, H, W with batch statistics (saved: the input and its mean and 1/std as one array)."""

    adds_into = True

    def __init__(self, m: Manager, channels: int, name: str = "bn"):
        self.name = name
        self.params = (_param(m, np.ones(channels, np.float32)), _param(m, np.zeros(channels, np.float32)))

    def forward(self, ex, x):
        y, stats = ex.call(K.bn_fwd, (x, *self.params))
        return y, (x, stats)

    def backward(self, ex, dy, saved, need, into=()):
        x, stats = saved
        dx, dgamma, dbeta = ex.call(K.bn_bwd, (dy, x, self.params[0], stats), into=(_first(into), None, None))
        return (dx,), (dgamma, dbeta)


class BNReLU(Layer):
    """A batch norm and the ReLU after it as one layer, one kernel each way: the batch norm's output,
    which only the ReLU reads, is never stored (a per-kernel host cost and a store saved, as whole-jit
    XLA fuses them too).  Saves the input and the statistics; backward recomputes the ReLU's mask
    from them.  Wraps the existing batch norm and its parameters."""

    adds_into = True

    def __init__(self, bn: "BatchNorm"):
        self.bn = bn
        self.parts = (bn,)
        self.params = bn.params
        self.name = f"{bn.name}+relu"

    def forward(self, ex, x):
        y, stats = ex.call(K.bn_relu_fwd, (x, *self.params))
        return y, (x, stats)

    def backward(self, ex, dy, saved, need, into=()):
        x, stats = saved
        dx, dgamma, dbeta = ex.call(K.bn_relu_bwd, (dy, x, *self.params, stats),
                                    into=(_first(into), None, None))
        return (dx,), (dgamma, dbeta)


class AddReLU(Layer):
    """A residual addition and the ReLU after it as one layer (saves its output, the mask); both
    inputs get the same gradient object."""

    name = "add+relu"
    parts = ()

    def forward(self, ex, a, b):
        (y,) = ex.call(K.add_relu_fwd, (a, b))
        return y, (y,)

    def backward(self, ex, dy, saved, need, into=()):
        (dx,) = ex.call(K.relu_bwd, (dy, saved[0]))
        return (dx, dx), ()


class BNReLUConv(Layer):
    """A batch norm, a ReLU and the convolution after them as one layer that keeps only the batch
    norm's input and statistics for backward: the normalised activations (the ReLU output every
    convolution would save) are recomputed there instead of being kept or moved (MemFerry's trade
    of cheap compute for memory and traffic).  Wraps the existing layers and their parameters."""

    adds_into = True

    def __init__(self, bn: "BatchNorm", conv: "Conv2D"):
        self.bn, self.conv = bn, conv
        self.parts = (bn, conv)
        self.params = bn.params + conv.params
        self.name = f"{bn.name}+relu+{conv.name}"

    def forward(self, ex, x):
        z, stats = ex.call(K.bn_relu_conv_fwd, (x, *self.params), stride=self.conv.stride, pad=self.conv.pad)
        return z, (x, stats)

    def backward(self, ex, dz, saved, need, into=()):
        x, stats = saved
        dx, dgamma, dbeta, dw = ex.call(K.bn_relu_conv_bwd, (dz, x, *self.params, stats),
                                        into=(_first(into), None, None, None),
                                        stride=self.conv.stride, pad=self.conv.pad)
        return (dx,), (dgamma, dbeta, dw)


class ConvBN(Layer):
    """A convolution and the `BatchNorm` or `BNReLU` after it as one layer, one kernel each way: saves
    the convolution's input and output (what the two layers save) and never stores the gradient
    between them.  Wraps the existing layers and their parameters."""

    adds_into = True

    def __init__(self, conv: Conv2D, bn: "BatchNorm | BNReLU"):
        self.conv, self.bn = conv, bn
        self.layers = (conv, bn)  # in the order they apply, as `Chain`'s
        self.parts = (conv, *getattr(bn, "parts", (bn,)))
        self.params = conv.params + bn.params
        self.name = f"{conv.name}+{bn.name}"
        self.static = {"stride": conv.stride, "pad": conv.pad, "relu": isinstance(bn, BNReLU)}

    def forward(self, ex, x):
        z, y, stats = ex.call(K.conv_bn_fwd, (x, *self.params), **self.static)
        return y, (x, z, stats)

    def backward(self, ex, dy, saved, need, into=()):
        x, z, stats = saved
        if need[0]:
            dx, *dps = ex.call(K.conv_bn_bwd, (dy, x, z, *self.params, stats),
                               into=(_first(into), None, None, None), **self.static)
            return (dx,), tuple(dps)
        return (None,), ex.call(K.conv_bn_bwd_weights, (dy, x, z, *self.params, stats), **self.static)


class Chain(Layer):
    """Consecutive one-input layers (`CHAINABLE`: convolutions and batch norms, alone or fused) as
    one layer, one kernel each way (`cnn.kernels.chain_kernels`): the forward kernel returns every
    tensor the layers save, the backward kernel runs their backward passes in reverse, and the
    outputs and gradients between them are never stored.  A DenseNet layer (batch norm, ReLU and
    two convolutions), a ResNet bottleneck's main path.  Wraps the existing layers and their
    parameters."""

    adds_into = True

    def __init__(self, layers: Sequence[Layer]):
        self.layers = tuple(layers)
        self.parts = tuple(part for layer in self.layers for part in getattr(layer, "parts", (layer,)))
        self.params = sum((layer.params for layer in self.layers), ())
        self.name = "+".join(layer.name for layer in self.layers)
        self.signatures = tuple(_signature(layer) for layer in self.layers)
        self.kernels = K.chain_kernels(self.signatures)

    def forward(self, ex, x):
        y, *saved = ex.call(self.kernels[0], (x, *self.params))
        return y, (x, *saved)

    def backward(self, ex, dy, saved, need, into=()):
        if need[0]:
            dx, *dps = ex.call(self.kernels[1], (dy, *saved, *self.params),
                               into=(_first(into),) + (None,) * len(self.params))
            return (dx,), tuple(dps)
        return (None,), ex.call(self.kernels[2], (dy, *saved, *self.params))


class ResidualChain(Layer):
    """A residual block as one layer: its main path (a `Chain`), the addition of the shortcut and
    the ReLU after it (an `AddReLU`), one kernel each way (`cnn.kernels.chain_kernels` with
    ``residual``).  The main path's output, which only the addition reads, is never stored; the
    layer saves its own output (the ReLU's mask) and what the chain saves.  Inputs: the block's
    input x and, unless ``identity``, the projected shortcut s; with ``identity`` the shortcut is x
    itself, whose two gradients the backward kernel sums.  Wraps the existing layers and their
    parameters."""

    adds_into = True

    def __init__(self, chain: Chain, add_relu: AddReLU, identity: bool):
        self.chain, self.add_relu, self.identity = chain, add_relu, identity
        self.parts = chain.parts
        self.params = chain.params
        self.name = f"{chain.name}+{add_relu.name}"
        self.kernels = K.chain_kernels(chain.signatures, "identity" if identity else "projection")

    def forward(self, ex, x, *shortcut):
        if len(shortcut) != (0 if self.identity else 1):
            raise ValueError(f"{self!r} takes {'x alone' if self.identity else 'x and the projected shortcut'}")
        y, *saved = ex.call(self.kernels[0], (x, *shortcut, *self.params))
        return y, (y, x, *saved)

    def backward(self, ex, dy, saved, need, into=()):
        operands = (dy, *saved, *self.params)
        none = (None,) * len(self.params)
        targets = tuple(into) + (None,) * (2 - len(into))
        if self.identity:
            if need[0]:
                dx, *dps = ex.call(self.kernels[1], operands, into=(targets[0], *none))
                return (dx,), tuple(dps)
            return (None,), ex.call(self.kernels[2], operands)
        if need[0]:
            dx, ds, *dps = ex.call(self.kernels[1], operands, into=(targets[0], targets[1], *none))
            return (dx, ds), tuple(dps)
        ds, *dps = ex.call(self.kernels[2], operands, into=(targets[1], *none))
        return (None, ds), tuple(dps)


class ConcatChain(Layer):
    """A concatenation and the `Chain` that reads it, one kernel each way (DenseNet: the
    concatenation of the block's feature maps, a batch norm, ReLU and two convolutions; or a chain
    of one member, the batch norm + ReLU before the head's pooling): saves the concatenation, as
    the chain saves its input, and hands the gradient back split per concatenated tensor without
    storing it whole.  Wraps the chain and its parameters."""

    adds_into = True

    def __init__(self, chain: Chain):
        self.chain = chain
        self.parts = chain.parts
        self.params = chain.params
        self.name = f"concat+{chain.name}"

    def forward(self, ex, *xs):
        sizes = tuple(x.shape[-1] for x in xs)
        y, *saved = ex.call(K.chain_kernels(self.chain.signatures, concat=sizes)[0], (*xs, *self.params))
        return y, (*saved, sizes)

    def backward(self, ex, dy, saved, need, into=()):
        *saved, sizes = saved
        n = len(sizes)
        outs = ex.call(K.chain_kernels(self.chain.signatures, concat=sizes)[1], (dy, *saved, *self.params),
                       into=tuple(into or (None,) * n) + (None,) * len(self.params))
        return outs[:n], outs[n:]


def _signature(layer: Layer) -> tuple:
    """A chain member's kernel signature (`cnn.kernels.chain_kernels`)."""
    if isinstance(layer, Conv2D):
        return ("conv", layer.stride, layer.pad)
    if isinstance(layer, ConvBN):
        return ("conv_bn", layer.conv.stride, layer.conv.pad, layer.static["relu"])
    if isinstance(layer, BNReLUConv):
        return ("bn_relu_conv", layer.conv.stride, layer.conv.pad)
    if isinstance(layer, BNReLU):
        return ("bn_relu",)
    if isinstance(layer, BatchNorm):
        return ("bn",)
    raise TypeError(f"{layer!r} cannot be a member of a chain: its members are one-input layers "
                    f"({', '.join(kind.__name__ for kind in CHAINABLE)})")


CHAINABLE = (Conv2D, ConvBN, BatchNorm, BNReLU, BNReLUConv)  # layers a `Chain` runs: one input, one output


def fuse_chains(seq: Sequence[Layer]) -> list[Layer]:
    """``seq`` with every run of two or more consecutive `CHAINABLE` layers as one `Chain`."""
    out: list[Layer] = []
    run: list[Layer] = []
    for layer in [*seq, None]:
        if isinstance(layer, CHAINABLE):
            run.append(layer)
            continue
        out.extend([Chain(run)] if len(run) > 1 else run)
        run = []
        if layer is not None:
            out.append(layer)
    return out


def _fuse(seq: Sequence[Layer], pattern: tuple, make) -> list[Layer]:
    """``seq`` with every run of consecutive layers that are instances of ``pattern``'s types, in
    order, replaced by ``make(*run)``."""
    out, i, n = [], 0, len(pattern)
    while i < len(seq):
        run = seq[i:i + n]
        if len(run) == n and all(isinstance(layer, kinds) for layer, kinds in zip(run, pattern)):
            out.append(make(*run))
            i += n
        else:
            out.append(seq[i])
            i += 1
    return out


def fuse_conv_bn(seq: Sequence[Layer]) -> list[Layer]:
    """``seq`` with every convolution directly followed by a `BatchNorm` or `BNReLU` replaced by one `ConvBN`."""
    return _fuse(seq, (Conv2D, (BatchNorm, BNReLU)), ConvBN)


def fuse_recomputed(seq: Sequence[Layer]) -> list[Layer]:
    """``seq`` with every batch norm, ReLU, convolution run replaced by one `BNReLUConv`."""
    return _fuse(seq, (BatchNorm, ReLU, Conv2D), lambda bn, relu, conv: BNReLUConv(bn, conv))


def fuse_bn_relu(seq: Sequence[Layer]) -> list[Layer]:
    """``seq`` with every batch norm directly followed by a ReLU replaced by one `BNReLU`."""
    return _fuse(seq, (BatchNorm, ReLU), lambda bn, relu: BNReLU(bn))


class ReLU(Layer):
    """max(x, 0); saves its output, whose sign is the backward mask (the next layer saves it anyway)."""

    adds_into = True

    name = "relu"

    def forward(self, ex, x):
        (y,) = ex.call(K.relu_fwd, (x,))
        return y, (y,)

    def backward(self, ex, dy, saved, need, into=()):
        (dx,) = ex.call(K.relu_bwd, (dy, saved[0]), into=(_first(into),))
        return (dx,), ()


class MaxPool(Layer):
    """k x k max pooling with stride s (saved: the input; the maxima are recomputed in backward)."""

    adds_into = True

    def __init__(self, k: int = 2, s: int | None = None, name: str = "maxpool"):
        self.k, self.s, self.name = k, (k if s is None else s), name

    def forward(self, ex, x):
        (y,) = ex.call(K.maxpool_fwd, (x,), k=self.k, s=self.s)
        return y, (x,)

    def backward(self, ex, dy, saved, need, into=()):
        (dx,) = ex.call(K.maxpool_bwd, (dy, saved[0]), into=(_first(into),), k=self.k, s=self.s)
        return (dx,), ()


class AvgPool(Layer):
    """k x k average pooling with stride s (saves only the input shape)."""

    adds_into = True

    def __init__(self, k: int = 2, s: int | None = None, name: str = "avgpool"):
        self.k, self.s, self.name = k, (k if s is None else s), name

    def forward(self, ex, x):
        (y,) = ex.call(K.avgpool_fwd, (x,), k=self.k, s=self.s)
        return y, (tuple(x.shape),)

    def backward(self, ex, dy, saved, need, into=()):
        (dx,) = ex.call(K.avgpool_bwd, (dy,), into=(_first(into),), k=self.k, s=self.s, shape=saved[0])
        return (dx,), ()


class GlobalAvgPool(Layer):
    """(N, H, W, C) -> (N, C) mean over the spatial axes."""

    adds_into = True

    name = "gap"

    def forward(self, ex, x):
        (y,) = ex.call(K.gap_fwd, (x,))
        return y, ((x.shape[1], x.shape[2]),)

    def backward(self, ex, dy, saved, need, into=()):
        (dx,) = ex.call(K.gap_bwd, (dy,), into=(_first(into),), hw=saved[0])
        return (dx,), ()


class Concat(Layer):
    """Concatenation along channels (DenseNet); backward slices dy."""

    adds_into = True

    name = "concat"

    def forward(self, ex, *xs):
        (y,) = ex.call(K.concat_fwd, xs)
        return y, (tuple(x.shape[-1] for x in xs),)

    def backward(self, ex, dy, saved, need, into=()):
        return ex.call(K.concat_bwd, (dy,), into=tuple(into) or None, sizes=saved[0]), ()


class Add(Layer):
    """Residual addition; the gradient of both inputs is dy itself (shared, not copied)."""

    name = "add"

    def forward(self, ex, a, b):
        (y,) = ex.call(K.add_fwd, (a, b))
        return y, ()

    def backward(self, ex, dy, saved, need, into=()):
        return (dy, dy), ()


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy of logits (N, classes) against int32 labels (N,); output is a 0-d loss."""

    adds_into = True

    name = "xent"

    def forward(self, ex, logits, labels):
        (loss,) = ex.call(K.xent_fwd, (logits, labels))
        return loss, (logits, labels)

    def backward(self, ex, dy, saved, need, into=()):
        (dlogits,) = ex.call(K.xent_bwd, saved, into=(_first(into),))
        return (dlogits, None), ()
