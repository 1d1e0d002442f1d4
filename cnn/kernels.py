"""Jitted JAX kernels: one forward and one backward function per layer kind (NHWC activations, HWIO filters).

Every kernel is a pure function of the arrays it is given, so the caller can
hand it zero-copy views of CachedArrays and copy its outputs into regions the
policy chose.  Backward kernels take the saved activations explicitly (no
closures) and recompute only what is cheap: element-wise masks, window maxima,
softmax.  Convolution and dense backward kernels are written as ``jax.vjp`` of
the forward function inside ``jit``: XLA drops the unused forward product, so
they cost the two transposed products only.

NHWC because it is not slower here: on this machine (2 cores, XLA CPU) a 3x3
convolution of 16x16x16x64 activations took 3.3-5.0 ms forward in NHWC against
4.8-8.6 ms in NCHW, with backward times within noise of each other (10-13 ms
against 11.5-19.5 ms) over four runs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

_DN = ("NHWC", "HWIO", "NHWC")
EPS = 1e-5


# ---------------------------------------------------------------- convolution
def _conv(x, w, stride: int, pad: int):
    return lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)], dimension_numbers=_DN,
                                    precision=lax.Precision.HIGHEST)


@partial(jax.jit, static_argnames=("stride", "pad"))
def conv_fwd(x, w, *, stride: int, pad: int):
    return _conv(x, w, stride, pad)


@partial(jax.jit, static_argnames=("stride", "pad"))
def conv_bwd(dy, x, w, *, stride: int, pad: int):
    """(dx, dw) of the convolution."""
    _, pull = jax.vjp(lambda a, b: _conv(a, b, stride, pad), x, w)
    return pull(dy)


@partial(jax.jit, static_argnames=("stride", "pad"))
def conv_bwd_weights(dy, x, w, *, stride: int, pad: int):
    """dw only: for a convolution whose input needs no gradient (the network input)."""
    _, pull = jax.vjp(lambda b: _conv(x, b, stride, pad), w)
    return pull(dy)[0]


# ---------------------------------------------------------------- dense
@jax.jit
def dense_fwd(x, w, b):
    return jnp.dot(x, w, precision=lax.Precision.HIGHEST) + b


@jax.jit
def dense_bwd(dy, x, w):
    """(dx, dw, db)."""
    dx = jnp.dot(dy, w.T, precision=lax.Precision.HIGHEST)
    dw = jnp.dot(x.T, dy, precision=lax.Precision.HIGHEST)
    return dx, dw, dy.sum(axis=0)


# ---------------------------------------------------------------- batch normalisation (training statistics)
@jax.jit
def bn_fwd(x, gamma, beta):
    """(y, stats): normalise over N, H, W with batch statistics; ``stats`` (saved for backward) holds
    the mean and 1/std as its two rows, one object where two would each cost a store and a view."""
    mean = x.mean(axis=(0, 1, 2))
    var = jnp.square(x - mean).mean(axis=(0, 1, 2))
    rstd = lax.rsqrt(var + EPS)
    return (x - mean) * (rstd * gamma) + beta, jnp.stack([mean, rstd])


@jax.jit
def bn_bwd(dy, x, gamma, stats):
    """(dx, dgamma, dbeta); xhat is recomputed element-wise from the saved input and statistics."""
    n = x.shape[0] * x.shape[1] * x.shape[2]
    mean, rstd = stats[0], stats[1]
    xhat = (x - mean) * rstd
    dbeta = dy.sum(axis=(0, 1, 2))
    dgamma = (dy * xhat).sum(axis=(0, 1, 2))
    dx = (gamma * rstd / n) * (n * dy - dbeta - xhat * dgamma)
    return dx, dgamma, dbeta


# ---------------------------------------------------------------- batch norm then ReLU, and residual add then ReLU
@jax.jit
def bn_relu_fwd(x, gamma, beta):
    """(relu(bn(x)), stats): the batch norm's output never leaves the kernel."""
    y, stats = bn_fwd(x, gamma, beta)
    return jnp.maximum(y, 0), stats


@jax.jit
def bn_relu_bwd(dy, x, gamma, beta, stats):
    """(dx, dgamma, dbeta) through the ReLU and the batch norm; the ReLU's mask is recomputed from the
    saved input and statistics (element-wise), so the kernel reads two activations, as `bn_bwd` does."""
    mask = _bn_apply(x, gamma, beta, stats) > 0
    return bn_bwd(jnp.where(mask, dy, 0), x, gamma, stats)


@jax.jit
def add_relu_fwd(a, b):
    return jnp.maximum(a + b, 0)


# ---------------------------------------------------------------- batch norm, ReLU and convolution, recomputed
def _bn_apply(x, gamma, beta, stats):
    return (x - stats[0]) * (stats[1] * gamma) + beta  # bn_fwd's output, operation for operation


@partial(jax.jit, static_argnames=("stride", "pad"))
def bn_relu_conv_fwd(x, gamma, beta, w, *, stride: int, pad: int):
    """(conv(relu(bn(x))), stats): the normalised activations never leave the kernel."""
    y, stats = bn_fwd(x, gamma, beta)
    return _conv(jnp.maximum(y, 0), w, stride, pad), stats


@partial(jax.jit, static_argnames=("stride", "pad"))
def bn_relu_conv_bwd(dz, x, gamma, beta, w, stats, *, stride: int, pad: int):
    """(dx, dgamma, dbeta, dw), recomputing relu(bn(x)) from the saved input and statistics (the same
    values the forward pass made) instead of reading them back."""
    h = jnp.maximum(_bn_apply(x, gamma, beta, stats), 0)
    _, pull = jax.vjp(lambda a, b: _conv(a, b, stride, pad), h, w)
    dh, dw = pull(dz)
    dx, dgamma, dbeta = bn_bwd(jnp.where(h > 0, dh, 0), x, gamma, stats)
    return dx, dgamma, dbeta, dw


# ---------------------------------------------------------------- convolution, then batch norm (and ReLU)
@partial(jax.jit, static_argnames=("stride", "pad", "relu"))
def conv_bn_fwd(x, w, gamma, beta, *, stride: int, pad: int, relu: bool):
    """(z, y, stats): the convolution's output z (the batch norm's saved input) and
    `bn_relu_fwd` (``relu``) or `bn_fwd` of it."""
    z = _conv(x, w, stride, pad)
    return (z, *(bn_relu_fwd if relu else bn_fwd)(z, gamma, beta))


def _bn_part_bwd(dy, z, gamma, beta, stats, relu: bool):
    """(dz, dgamma, dbeta) of `conv_bn_fwd`'s batch norm (+ ReLU)."""
    return bn_relu_bwd(dy, z, gamma, beta, stats) if relu else bn_bwd(dy, z, gamma, stats)


@partial(jax.jit, static_argnames=("stride", "pad", "relu"))
def conv_bn_bwd(dy, x, z, w, gamma, beta, stats, *, stride: int, pad: int, relu: bool):
    """(dx, dw, dgamma, dbeta) of `conv_bn_fwd`: the convolution's output gradient never leaves the kernel."""
    dz, dgamma, dbeta = _bn_part_bwd(dy, z, gamma, beta, stats, relu)
    _, pull = jax.vjp(lambda a, b: _conv(a, b, stride, pad), x, w)
    dx, dw = pull(dz)
    return dx, dw, dgamma, dbeta


@partial(jax.jit, static_argnames=("stride", "pad", "relu"))
def conv_bn_bwd_weights(dy, x, z, w, gamma, beta, stats, *, stride: int, pad: int, relu: bool):
    """(dw, dgamma, dbeta): `conv_bn_bwd` for a convolution whose input needs no gradient."""
    dz, dgamma, dbeta = _bn_part_bwd(dy, z, gamma, beta, stats, relu)
    _, pull = jax.vjp(lambda b: _conv(x, b, stride, pad), w)
    return pull(dz)[0], dgamma, dbeta


# ---------------------------------------------------------------- chains of one-input layers
# A member of a chain by its signature: ("conv", stride, pad), ("conv_bn", stride, pad, relu),
# ("bn",), ("bn_relu",) or ("bn_relu_conv", stride, pad); how many parameters it takes and tensors
# it saves (its input first).
_COUNTS = {"conv": (1, 1), "conv_bn": (3, 3), "bn": (2, 2), "bn_relu": (2, 2), "bn_relu_conv": (3, 2)}


def _member_fwd(sig: tuple, x, params):
    """(y, saved) of one member: what `layers.Conv2D`, `layers.ConvBN`, `layers.BatchNorm`,
    `layers.BNReLU` or `layers.BNReLUConv` compute and save."""
    kind = sig[0]
    if kind == "conv":
        return _conv(x, params[0], sig[1], sig[2]), (x,)
    if kind == "conv_bn":
        z, y, stats = conv_bn_fwd(x, *params, stride=sig[1], pad=sig[2], relu=sig[3])
        return y, (x, z, stats)
    if kind == "bn_relu_conv":
        y, stats = bn_relu_conv_fwd(x, *params, stride=sig[1], pad=sig[2])
    else:
        y, stats = (bn_relu_fwd if kind == "bn_relu" else bn_fwd)(x, *params)
    return y, (x, stats)


def _member_bwd(sig: tuple, dy, saved, params, need_dx: bool):
    """(dx or None, dparams) of one member."""
    kind = sig[0]
    if kind == "conv":
        (x,), (w,) = saved, params
        if need_dx:
            dx, dw = conv_bwd(dy, x, w, stride=sig[1], pad=sig[2])
            return dx, (dw,)
        return None, (conv_bwd_weights(dy, x, w, stride=sig[1], pad=sig[2]),)
    if kind == "conv_bn":
        static = dict(stride=sig[1], pad=sig[2], relu=sig[3])
        if need_dx:
            dx, *dps = conv_bn_bwd(dy, *saved[:2], *params, *saved[2:], **static)
            return dx, tuple(dps)
        return None, tuple(conv_bn_bwd_weights(dy, *saved[:2], *params, *saved[2:], **static))
    x, stats = saved
    if kind == "bn_relu_conv":
        dx, *dps = bn_relu_conv_bwd(dy, x, *params, stats, stride=sig[1], pad=sig[2])
    elif kind == "bn_relu":
        dx, *dps = bn_relu_bwd(dy, x, *params, stats)
    else:
        dx, *dps = bn_bwd(dy, x, params[0], stats)
    return (dx if need_dx else None), tuple(dps)


def _cut(flat: tuple, sizes: list[int]) -> list[tuple]:
    """``flat`` cut into consecutive pieces of ``sizes``."""
    out, i = [], 0
    for n in sizes:
        out.append(flat[i:i + n])
        i += n
    return out


_CHAINS: dict = {}


def chain_kernels(sigs: tuple, residual: str | None = None, concat: tuple = ()) -> tuple:
    """Jitted (forward, backward, backward without the input's gradient) of a chain of members:

    forward(x, *params) = (y, *saved): every tensor the members save but the chain's input x;
    backward(dy, x, *saved, *params) = (dx, *dparams); the third returns dparams only.

    ``residual`` ("identity" or "projection"): the chain is a residual block's main path, and its
    kernels also add the shortcut and apply the ReLU after the sum (`layers.ResidualChain`), so
    the main path's output never leaves the kernel.  forward(x[, s], *params) =
    (relu(chain(x) + shortcut), *saved), the shortcut being x itself or the projected s;
    backward(dy, y, x, *saved, *params) = (dx[, ds], *dparams), the ReLU's mask taken from the
    saved output y as `relu_bwd` does, and for "identity" dx holding both paths' gradients; the
    third returns ([ds,] *dparams).

    ``concat`` (the channel counts of several inputs): the chain reads their concatenation
    (`layers.ConcatChain`), made inside its forward kernel and returned as the first saved tensor
    (its first member's input): forward(x1..xn, *params) = (y, h, *saved); backward(dy, h, *saved,
    *params) = (dx1..dxn, *dparams), the concatenation's gradient split per input."""
    key = (sigs, residual, concat)
    if key in _CHAINS:
        return _CHAINS[key]
    if residual not in (None, "identity", "projection"):
        raise ValueError(f"residual must be None, 'identity' or 'projection', got {residual!r}")
    if residual is not None and concat:
        raise ValueError("a chain reads a concatenation or joins a residual block, not both")
    nparams = [_COUNTS[sig[0]][0] for sig in sigs]
    nsaved = [_COUNTS[sig[0]][1] for sig in sigs]
    extra = int(residual == "projection")  # the projected shortcut, an input of its own
    inputs = max(len(concat), 1)

    def forward(*args):
        x = concat_fwd(*args[:inputs]) if concat else args[0]
        rest = args[inputs:]
        shortcut, params = (rest[0] if extra else x), rest[extra:]
        h, saved = x, []
        for sig, ps in zip(sigs, _cut(params, nparams)):
            h, s = _member_fwd(sig, h, ps)
            saved.extend(s)
        if residual is not None:
            h = add_relu_fwd(h, shortcut)
        return (h, *(saved if concat else saved[1:]))

    def backward(need_dx, dy, *rest):
        if residual is not None:
            dy = relu_bwd(dy, rest[0])  # the mask from the saved output
            rest = rest[1:]
        dshort = dy
        saved = _cut(rest[:sum(nsaved)], nsaved)
        params = _cut(rest[sum(nsaved):], nparams)
        dps = []
        for k in range(len(sigs) - 1, -1, -1):
            dy, d = _member_bwd(sigs[k], dy, saved[k], params[k], need_dx or k > 0)
            dps.append(d)
        if residual == "identity" and need_dx:
            dy = add_fwd(dshort, dy)
        dxs = (_split(dy, concat) if concat else (dy,)) if need_dx else ()
        return (*dxs, *((dshort,) if extra else ()), *[t for d in reversed(dps) for t in d])

    kernels = (jax.jit(forward), jax.jit(partial(backward, True)), jax.jit(partial(backward, False)))
    prefix = "residual" if residual is not None else "concat_chain" if concat else "chain"
    for k, name in zip(kernels, ("fwd", "bwd", "bwd_weights")):
        k.__name__ = f"{prefix}_{name}"
    _CHAINS[key] = kernels
    return kernels


# ---------------------------------------------------------------- element-wise
@jax.jit
def relu_fwd(x):
    return jnp.maximum(x, 0)


@jax.jit
def relu_bwd(dy, y):
    return jnp.where(y > 0, dy, 0)


@jax.jit
def add_fwd(a, b):
    return a + b


# ---------------------------------------------------------------- pooling
def _maxpool(x, k: int, s: int):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, k, k, 1), (1, s, s, 1), "VALID")


@partial(jax.jit, static_argnames=("k", "s"))
def maxpool_fwd(x, *, k: int, s: int):
    return _maxpool(x, k, s)


@partial(jax.jit, static_argnames=("k", "s"))
def maxpool_bwd(dy, x, *, k: int, s: int):
    """Routes dy to the window maxima (the window maximum is recomputed from x: a cheap window op)."""
    _, pull = jax.vjp(lambda a: _maxpool(a, k, s), x)
    return pull(dy)[0]


def _avgpool(x, k: int, s: int):
    return lax.reduce_window(x, 0.0, lax.add, (1, k, k, 1), (1, s, s, 1), "VALID") / (k * k)


@partial(jax.jit, static_argnames=("k", "s"))
def avgpool_fwd(x, *, k: int, s: int):
    return _avgpool(x, k, s)


@partial(jax.jit, static_argnames=("k", "s", "shape"))
def avgpool_bwd(dy, *, k: int, s: int, shape: tuple):
    _, pull = jax.vjp(lambda a: _avgpool(a, k, s), jnp.zeros(shape, dy.dtype))
    return pull(dy)[0]


@jax.jit
def gap_fwd(x):
    """Global average pooling: (N, H, W, C) -> (N, C)."""
    return x.mean(axis=(1, 2))


@partial(jax.jit, static_argnames=("hw",))
def gap_bwd(dy, *, hw: tuple):
    h, w = hw
    return jnp.broadcast_to(dy[:, None, None, :] / (h * w), (dy.shape[0], h, w, dy.shape[1]))


# ---------------------------------------------------------------- concatenation (channels)
@jax.jit
def concat_fwd(*xs):
    return jnp.concatenate(xs, axis=-1)


@partial(jax.jit, static_argnames=("sizes",))
def concat_bwd(dy, *, sizes: tuple):
    return _split(dy, sizes)


def _split(dy, sizes: tuple) -> tuple:
    bounds, start = [], 0
    for c in sizes:
        bounds.append((start, start + c))
        start += c
    return tuple(dy[..., a:b] for a, b in bounds)


# ---------------------------------------------------------------- loss
@jax.jit
def xent_fwd(logits, labels):
    """Mean softmax cross-entropy; labels are int32 class indices."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


@jax.jit
def xent_bwd(logits, labels):
    """d(loss)/d(logits) = (softmax - onehot) / N, with the softmax recomputed from the saved logits."""
    p = jax.nn.softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return (p - onehot) / logits.shape[0]


# ---------------------------------------------------------------- optimiser and gradient accumulation
@jax.jit
def sgd_step(w, g, lr):
    return w - lr * g


@jax.jit
def sgd_momentum_step(w, g, v, lr, mu):
    """(w', v') with v' = mu v + g and w' = w - lr v' (PyTorch's formulation)."""
    v = mu * v + g
    return w - lr * v, v


@jax.jit
def sgd_steps(*xs):
    """`sgd_step` on n parameters in one dispatch: ``xs`` is (w1..wn, g1..gn, lr); returns (w1'..wn')."""
    *arrays, lr = xs
    n = len(arrays) // 2
    return tuple(sgd_step(w, g, lr) for w, g in zip(arrays[:n], arrays[n:]))


@jax.jit
def sgd_momentum_steps(*xs):
    """`sgd_momentum_step` on n parameters in one dispatch (a per-kernel host cost paid once for many
    small tensors): ``xs`` is (w1..wn, g1..gn, v1..vn, lr, mu); returns (w1'..wn', v1'..vn')."""
    *arrays, lr, mu = xs
    n = len(arrays) // 3
    outs = [sgd_momentum_step(w, g, v, lr, mu) for w, g, v in zip(arrays[:n], arrays[n:2 * n], arrays[2 * n:])]
    return tuple(w for w, _ in outs) + tuple(v for _, v in outs)
