"""VGG-, ResNet- and DenseNet-style models with width, depth, image size and class count as parameters.

A `Model` owns its layers (and so its parameters, all CachedArrays) and a
``forward(tape, x)`` that records the layer calls on a `Tape`.  Residual and
dense blocks are tape scopes, the unit of block-granularity cleanup.

Depth counts weighted layers, as the model names do: VGG ``depth`` = convolutions
+ 3 dense layers (VGG 16: 13 + 3; the dissertation's VGG 416 is the same pattern,
much deeper); ResNet ``depth`` = 3 per bottleneck block + 2 (ResNet 50: blocks
[3, 4, 6, 3]); DenseNet ``depth`` = 2 per dense layer + 5 (DenseNet 121: blocks
[6, 12, 24, 16]).  Other depths split the blocks in those proportions.  Activations are NHWC float32.

Every batch norm followed by a ReLU is wired as one `layers.BNReLU`, and every residual addition
followed by a ReLU as one `layers.AddReLU`: one kernel each way instead of two, as XLA fuses them
in a whole-jitted step.  ``recompute=True`` wires every batch norm, ReLU, convolution run as one
`layers.BNReLUConv`, which recomputes the normalised activations in backward instead of keeping them.
A convolution and the batch norm (+ ReLU) after it are one `layers.ConvBN`; runs of those,
convolutions and batch norms (+ ReLU, + convolution) one `layers.Chain`; a residual block's main
path that is one `Chain` and the addition and ReLU joining it to the shortcut one
`layers.ResidualChain`; and a DenseNet concatenation and the layer that reads it one
`layers.ConcatChain` (whose chain before the head's pooling is the batch norm + ReLU alone).
``wide=False`` leaves the last two apart (a ResNet block's join an `AddReLU`, a DenseNet
concatenation fused only with the batch norm reading it): more kernels a step, but a smaller
largest kernel, so a smaller smallest budget.
Neither changes the weights or their initialisation: the layer list, and so the parameters, stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cachedarrays import CachedArray, Manager

from .graph import Tape
from .layers import (AddReLU, AvgPool, BatchNorm, BNReLU, BNReLUConv, Chain, Concat, ConcatChain,
                     Conv2D, Dense, GlobalAvgPool, Layer, MaxPool, ReLU, ResidualChain, fuse_bn_relu, fuse_chains,
                     fuse_conv_bn, fuse_recomputed)

RESNET_BLOCKS = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3], 200: [3, 24, 36, 3]}
DENSENET_BLOCKS = {121: [6, 12, 24, 16], 169: [6, 12, 32, 32], 201: [6, 12, 48, 32], 264: [6, 12, 64, 48]}
FAMILIES = ("vgg", "resnet", "densenet")


@dataclass
class Model:
    """Layers plus the function that wires them; ``forward(tape, x)`` returns the logits."""

    name: str
    layers: list[Layer]
    wiring: Callable[[Tape, CachedArray], CachedArray]
    input_shape: tuple[int, int, int]        # H, W, C
    classes: int
    info: dict = field(default_factory=dict)

    def forward(self, tape: Tape, x: CachedArray) -> CachedArray:
        return self.wiring(tape, x)

    @property
    def params(self) -> list[CachedArray]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def _split(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` groups, the extra ones in the later-middle groups (like [3, 4, 6, 3])."""
    parts = max(1, min(parts, n)) if n else 1
    base, extra = divmod(n, parts)
    counts = [base] * parts
    for k in range(extra):
        counts[(parts - 2 - k) % parts if parts > 1 else 0] += 1
    return counts


def _proportional(n: int, weights: list[int]) -> list[int]:
    """``n`` items over ``len(weights)`` groups in proportion to ``weights`` (largest remainders), each
    group at least one when ``n`` allows; drops trailing groups when ``n`` is smaller than their count."""
    parts = max(1, min(len(weights), n))
    weights = weights[:parts]
    total = sum(weights)
    raw = [n * w / total for w in weights]
    counts = [max(1, int(r)) for r in raw]
    order = sorted(range(parts), key=lambda k: raw[k] - int(raw[k]), reverse=True)
    k = 0
    while sum(counts) < n:
        counts[order[k % parts]] += 1
        k += 1
    while sum(counts) > n:
        j = max(range(parts), key=lambda q: counts[q])
        counts[j] -= 1
    return counts


def _fused(seq: list[Layer], recompute: bool) -> list[Layer]:
    """``seq`` as wired: batch norm, ReLU, convolution runs as one recomputing layer with ``recompute``,
    then batch norm, ReLU pairs as one layer, then a convolution and the batch norm after it, then
    runs of those and convolutions as one `Chain`."""
    return fuse_chains(fuse_conv_bn(fuse_bn_relu(fuse_recomputed(seq) if recompute else seq)))


def _unchain(seq: list[Layer]) -> list[Layer]:
    """``seq`` with the first layer of a `Chain` that opens it taken out of the chain: the batch
    norm (+ ReLU, + convolution) that reads a DenseNet concatenation, for `ConcatChain` to wrap alone."""
    first = seq[0].layers if isinstance(seq[0], Chain) else seq[:1]
    return [first[0], *fuse_chains(list(first[1:])), *seq[1:]]


def _stages_for(image: int, wanted: int) -> int:
    return max(1, min(wanted, int(math.log2(max(image, 1))) if image > 1 else 1))


class _Builder:
    def __init__(self, m: Manager, seed: int):
        self.m, self.rng, self.layers = m, np.random.default_rng(seed), []

    def add(self, layer: Layer) -> Layer:
        self.layers.append(layer)
        return layer

    def conv(self, cin, cout, k=3, stride=1, name="conv"):
        return self.add(Conv2D(self.m, self.rng, cin, cout, k, stride, name=name))

    def bn(self, c, name="bn"):
        return self.add(BatchNorm(self.m, c, name=name))

    def dense(self, din, dout, name="dense"):
        return self.add(Dense(self.m, self.rng, din, dout, name=name))

    def new(self, layer):
        return self.add(layer)


def vgg(m: Manager, depth: int = 16, width: int = 16, image: int = 32, classes: int = 10, in_channels: int = 3,
        seed: int = 0, recompute: bool = False, wide: bool = True) -> Model:
    """Plain stacks of conv-BN-ReLU, max pooling between stages, global average pooling, 3 dense layers
    (``wide`` changes nothing: its chains have no join; it is taken so that `build` is uniform)."""
    if depth < 4:
        raise ValueError("VGG depth must be at least 4 (one convolution and three dense layers)")
    b = _Builder(m, seed)
    nconv = depth - 3
    stages = _stages_for(image, 5)
    counts = _split(nconv, stages)
    plan = []  # (layers of one stage, pool after?)
    cin = in_channels
    spatial = image
    for s, n in enumerate(counts):
        cout = width * min(2 ** s, 8)
        stage = []
        for j in range(n):
            stage += [b.conv(cin, cout, name=f"conv{s}.{j}"), b.bn(cout, name=f"bn{s}.{j}"), b.new(ReLU())]
            cin = cout
        pool = b.new(MaxPool(2)) if spatial >= 2 and s < len(counts) - 1 else None
        spatial = spatial // 2 if pool else spatial
        plan.append((_fused(stage, recompute), pool))
    gap = b.new(GlobalAvgPool())
    hidden = 4 * width
    fc = [b.dense(cin, hidden, "fc0"), b.new(ReLU()), b.dense(hidden, hidden, "fc1"), b.new(ReLU()),
          b.dense(hidden, classes, "fc2")]

    def wiring(tape: Tape, x: CachedArray) -> CachedArray:
        for stage, pool in plan:
            for layer in stage:
                x = tape(layer, x)
            if pool is not None:
                x = tape(pool, x)
        x = tape(gap, x)
        for layer in fc:
            x = tape(layer, x)
        return x

    return Model(f"vgg{depth}", b.layers, wiring, (image, image, in_channels), classes,
                 {"family": "vgg", "depth": depth, "width": width, "convs_per_stage": counts})


def resnet(m: Manager, depth: int = 50, width: int = 16, image: int = 32, classes: int = 10, in_channels: int = 3,
           seed: int = 0, recompute: bool = False, wide: bool = True) -> Model:
    """Bottleneck residual blocks (1x1, 3x3, 1x1, expansion 4) with projection shortcuts where shapes change."""
    if depth in RESNET_BLOCKS:
        blocks = RESNET_BLOCKS[depth]
    else:
        if depth < 5 or (depth - 2) % 3:
            raise ValueError(f"ResNet depth must be 3 * blocks + 2 (e.g. 11, 14, 50, 101), got {depth}")
        blocks = _proportional((depth - 2) // 3, [3, 4, 6, 3])
    b = _Builder(m, seed)
    stem = _fused([b.conv(in_channels, width, name="stem"), b.bn(width, name="stem.bn"), b.new(ReLU())], recompute)
    stem_pool = b.new(MaxPool(2)) if image >= 64 else None
    spatial = image // 2 if stem_pool else image
    cin = width
    plan = []
    for s, n in enumerate(blocks):
        mid = width * 2 ** s
        for j in range(n):
            stride = 2 if (j == 0 and s > 0 and spatial >= 2) else 1
            spatial //= stride
            main = [b.conv(cin, mid, 1, name=f"b{s}.{j}.c1"), b.bn(mid), b.new(ReLU()),
                    b.conv(mid, mid, 3, stride, name=f"b{s}.{j}.c2"), b.bn(mid), b.new(ReLU()),
                    b.conv(mid, 4 * mid, 1, name=f"b{s}.{j}.c3"), b.bn(4 * mid)]
            short = None
            if stride != 1 or cin != 4 * mid:
                short = _fused([b.conv(cin, 4 * mid, 1, stride, name=f"b{s}.{j}.proj"), b.bn(4 * mid)], recompute)
            main, join = _fused(main, recompute), b.new(AddReLU())
            if wide and len(main) == 1 and isinstance(main[0], Chain):  # the main path is one kernel: the join too
                main, join = [], ResidualChain(main[0], join, identity=short is None)
            plan.append((main, short, join))
            cin = 4 * mid
    head = (b.new(GlobalAvgPool()), b.dense(cin, classes, "fc"))

    def wiring(tape: Tape, x: CachedArray) -> CachedArray:
        for layer in stem:
            x = tape(layer, x)
        if stem_pool is not None:
            x = tape(stem_pool, x)
        for main, short, join in plan:
            with tape.scope():
                h = x
                for layer in main:
                    h = tape(layer, h)
                s = x
                for layer in short or ():
                    s = tape(layer, s)
                if isinstance(join, ResidualChain):
                    x = tape(join, x) if join.identity else tape(join, x, s)
                else:
                    x = tape(join, h, s)
        for layer in head:
            x = tape(layer, x)
        return x

    return Model(f"resnet{depth}", b.layers, wiring, (image, image, in_channels), classes,
                 {"family": "resnet", "depth": depth, "width": width, "blocks": blocks})


def densenet(m: Manager, depth: int = 121, width: int = 8, image: int = 32, classes: int = 10,
             in_channels: int = 3, seed: int = 0, recompute: bool = False, wide: bool = True) -> Model:
    """Dense blocks of BN-ReLU-1x1-BN-ReLU-3x3 layers on the concatenation of all earlier feature maps,
    with BN-ReLU-1x1-avgpool transitions (compression 0.5); ``width`` is the growth rate."""
    if depth in DENSENET_BLOCKS:
        blocks = DENSENET_BLOCKS[depth]
    else:
        if depth < 7 or (depth - 5) % 2:
            raise ValueError(f"DenseNet depth must be 2 * layers + 5 (e.g. 9, 13, 121), got {depth}")
        blocks = _proportional((depth - 5) // 2, [6, 12, 24, 16][:_stages_for(image, 4)])
    k = width
    b = _Builder(m, seed)
    stem = b.conv(in_channels, 2 * k, name="stem")
    c = 2 * k
    spatial = image
    plan = []
    for s, n in enumerate(blocks):
        layers = []
        for j in range(n):
            layers.append(_fused([b.bn(c), b.new(ReLU()), b.conv(c, 4 * k, 1, name=f"d{s}.{j}.c1"),
                                  b.bn(4 * k), b.new(ReLU()), b.conv(4 * k, k, 3, name=f"d{s}.{j}.c2")], recompute))
            c += k
        concat = b.new(Concat())  # stateless: one instance serves every concatenation of the block
        transition = None
        if s < len(blocks) - 1:
            cout = max(1, c // 2)
            pool = AvgPool(2) if spatial >= 2 else None
            transition = _fused([b.bn(c), b.new(ReLU()), b.conv(c, cout, 1, name=f"t{s}")] + ([b.new(pool)] if pool else []),
                                recompute)
            spatial = spatial // 2 if pool else spatial
            c = cout
        plan.append((layers, concat, transition))
    head = _fused([b.bn(c), b.new(ReLU()), b.new(GlobalAvgPool()), b.dense(c, classes, "fc")], recompute)
    if not wide:
        plan = [([_unchain(seq) for seq in layers], concat, transition and _unchain(transition))
                for layers, concat, transition in plan]
    fused = {id(seq[0]): ConcatChain(seq[0] if isinstance(seq[0], Chain) else Chain([seq[0]]))
             for seq in [head] + [t for _, _, t in plan if t] + [seq for layers, _, _ in plan for seq in layers]
             if isinstance(seq[0], (Chain, BNReLU, BNReLUConv))}

    def wiring(tape: Tape, x: CachedArray) -> CachedArray:
        x = tape(stem, x)
        for layers, concat, transition in plan:
            with tape.scope():
                features = [x]
                for layer_seq in layers:
                    h, rest = _concatenated(tape, concat, features, layer_seq)
                    features.append(_chain(tape, rest, h))
                # the block's output is what the next layers read: the transition's (or head's)
                # first layer, where it takes in the concatenation, is the block's last
                x, rest = _concatenated(tape, concat, features, head if transition is None else transition)
            x = _chain(tape, rest, x)
        return x

    def _concatenated(tape: Tape, concat: Concat, features: list, seq: list[Layer]) -> tuple:
        """The concatenation of ``features`` and what of ``seq`` is left to apply to it: its first
        layer and the concatenation are one `ConcatChain` where that can wrap it."""
        if len(features) == 1:
            return features[0], seq
        if id(seq[0]) in fused:
            return tape(fused[id(seq[0])], *features), seq[1:]
        return tape(concat, *features), seq

    def _chain(tape: Tape, seq: list[Layer], h: CachedArray) -> CachedArray:
        for layer in seq:
            h = tape(layer, h)
        return h

    return Model(f"densenet{depth}", b.layers, wiring, (image, image, in_channels), classes,
                 {"family": "densenet", "depth": depth, "growth": k, "blocks": blocks})


def build(family: str, m: Manager, **kwargs) -> Model:
    """`vgg`, `resnet` or `densenet` by name."""
    try:
        fn = {"vgg": vgg, "resnet": resnet, "densenet": densenet}[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}") from None
    return fn(m, **kwargs)
