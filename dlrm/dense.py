"""The dense part of DLRM in jitted JAX: bottom MLP, interaction, top MLP, binary cross-entropy.

Why JAX and not numpy's BLAS: one training step of the dense part (forward, backward and the
embedding-output gradient; batch 2048) measured on this 2-core machine, median of 7, same run:

==========================================  ==========  ============
shape                                        jitted JAX  numpy + BLAS
==========================================  ==========  ============
Kaggle: 13-512-256-64-16 / 367-512-256-1     0.18 s      0.48 s
8 x 64, 512-512-64 / 100-1024-1024-1024-1    0.63 s      1.27 s
==========================================  ==========  ============

and the Kaggle-shape matmuls alone (forward and both backward products): numpy 230 ms, jitted
JAX 164 ms. A single 2048x1024x1024 sgemm runs at about the same rate in numpy (OpenBLAS), JAX
and PyTorch here (202, 207 and 197 GFLOP/s on a quiet machine; JAX's transposed forms of the
backward 183-213), so against PyTorch the dense part is at parity (0.9-1.1x in
``benchmarks/dlrm.py``): the gains come from the embedding work.
XLA fuses the bias, ReLU and masks into the matmuls and runs the batched ``(T+1) x F`` interaction
products far better than numpy's per-matrix loop, so the whole dense forward and backward is one
jitted function (:func:`make_grad_step`); the SGD update of the dense weights is a second small
jitted function (so that its time can be reported as its own phase), donating the old weights.

Parameters are a list of ``(W, b)`` pairs per MLP, ``W`` of shape ``(fan_in, fan_out)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class DLRMConfig:
    """Architecture: ``bottom`` = dense input size then layer sizes (last = ``featuresize``);
    ``top`` = top layer sizes after the interaction (last must be 1)."""

    table_sizes: tuple[int, ...]
    featuresize: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    interaction: str = "dot"

    def __post_init__(self) -> None:
        object.__setattr__(self, "table_sizes", tuple(int(n) for n in self.table_sizes))
        object.__setattr__(self, "bottom", tuple(int(n) for n in self.bottom))
        object.__setattr__(self, "top", tuple(int(n) for n in self.top))
        if self.interaction not in ("dot", "cat"):
            raise ValueError(f"interaction must be 'dot' or 'cat', got {self.interaction!r}")
        if len(self.bottom) < 2:
            raise ValueError(f"bottom MLP needs an input size and at least one layer, got {self.bottom}")
        if self.bottom[-1] != self.featuresize:
            raise ValueError(f"the bottom MLP must end in the sparse feature size {self.featuresize}, "
                             f"got {'-'.join(map(str, self.bottom))}")
        if not self.top or self.top[-1] != 1:
            raise ValueError(f"the top MLP must end in 1 (one logit), got {'-'.join(map(str, self.top))}")
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"need at least one embedding table of at least one row, got {self.table_sizes}")

    @property
    def dense_dim(self) -> int:
        return self.bottom[0]

    @property
    def ntables(self) -> int:
        return len(self.table_sizes)

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input."""
        T, F = self.ntables, self.featuresize
        if self.interaction == "dot":
            return F + (T + 1) * T // 2
        return F * (T + 1)

    @property
    def top_sizes(self) -> tuple[int, ...]:
        """Top MLP sizes including its input (as the reference DLRM prepends it)."""
        return (self.interaction_dim,) + self.top


def init_mlp(sizes: tuple[int, ...], rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Reference-DLRM initialisation: W ~ N(0, 2/(fan_in+fan_out)), b ~ N(0, 1/fan_out)."""
    layers = []
    for n, m in zip(sizes[:-1], sizes[1:]):
        W = rng.normal(0.0, np.sqrt(2.0 / (n + m)), size=(n, m)).astype(np.float32)
        b = rng.normal(0.0, np.sqrt(1.0 / m), size=m).astype(np.float32)
        layers.append((W, b))
    return layers


def init_dense(config: DLRMConfig, seed: int) -> dict:
    """Initial dense weights ``{"bot": [...], "top": [...]}`` as numpy arrays."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xD1]))
    return {"bot": init_mlp(config.bottom, rng), "top": init_mlp(config.top_sizes, rng)}


PRECISIONS = ("f32", "bf16")
_BF16_MIN_DIM = 32  # smaller products stay float32 (XLA:CPU runs bf16 x bf16 -> f32 only in its library dots)


def _dot(a, b, low: bool):
    """``a @ b`` with float32 result; bfloat16 operands when ``low`` and every dimension is large."""
    if low and min(a.shape[0], a.shape[1], b.shape[1]) >= _BF16_MIN_DIM:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


@lru_cache(maxsize=None)
def _bf16_mlp(last_linear: bool):
    """An MLP with bfloat16 matmul operands, float32 accumulation and a hand-written backward
    that runs in the transposed space: with ``D`` the gradient at a layer's pre-activation, it
    computes ``D^T`` (features x batch), ``dW^T = D^T H`` and the next ``D^T = W D^T``. Every
    product then reads both operands row-major, the only form in which XLA:CPU's bf16 kernels
    run at full speed here (autodiff's ``H^T D`` and ``D W^T`` ran at the float32 rate or below).
    The optimization barriers keep XLA from folding the transposes back into the products."""

    def forward(layers, x):
        hs = [x]
        h = x
        for i, (W, b) in enumerate(layers):
            h = _dot(h, W, True) + b
            if not (last_linear and i == len(layers) - 1):
                h = jax.nn.relu(h)
            hs.append(h)
        return h, (layers, hs)

    @jax.custom_vjp
    def mlp(layers, x):
        return forward(layers, x)[0]

    def backward(res, g):
        layers, hs = res
        n = len(layers)
        Dt = jax.lax.optimization_barrier(g.T)
        grads = [None] * n
        for i in range(n - 1, -1, -1):
            W, _ = layers[i]
            if not (last_linear and i == n - 1):
                Dt = jnp.where(hs[i + 1].T > 0, Dt, 0)
            grads[i] = (jax.lax.optimization_barrier(_dot(Dt, hs[i], True)).T, jnp.sum(Dt, axis=1))
            Dt = _dot(W, Dt, True)
        return grads, jax.lax.optimization_barrier(Dt).T

    mlp.defvjp(forward, backward)
    return mlp


def _mlp(layers, h, last_linear: bool, precision: str = "f32"):
    """Linear layers with ReLU between them (and after the last unless ``last_linear``).
    ``precision="bf16"``: matmul operands rounded to bfloat16, accumulated in float32; weights,
    biases, gradients and the SGD update stay float32, which is what the split-SGD trick of
    dissertation section 5.5.2 reconstructs from two 16-bit halves."""
    if precision == "bf16":
        return _bf16_mlp(last_linear)(layers, h)
    n = len(layers)
    for i, (W, b) in enumerate(layers):
        h = h @ W + b
        if not (last_linear and i == n - 1):
            h = jax.nn.relu(h)
    return h


def _pair_maps(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``n`` vectors: the flat positions ``i * n + j`` of the strictly lower triangle
    (row-major, the reference DLRM's pair order), and for every entry of the ``n x n`` matrix
    and of its transpose, 1 + its pair number (0 off the triangle)."""
    li, lj = np.tril_indices(n, -1)
    flat = (li * n + lj).astype(np.int32)
    pos = np.zeros(n * n, np.int32)
    pos[flat] = np.arange(1, flat.size + 1, dtype=np.int32)
    return flat, pos, np.ascontiguousarray(pos.reshape(n, n).T).reshape(-1)


def _dot_forward(h, emb):
    z = jnp.concatenate([h[:, None, :], emb], axis=1)
    flat, _, _ = _pair_maps(z.shape[1])
    Z = jnp.einsum("bif,bjf->bij", z, z).reshape(z.shape[0], -1)
    return jnp.concatenate([h, jnp.take(Z, flat, axis=1)], axis=1), z


def _dot_backward(z, d):
    # The pair gradients are *gathered* into the symmetric n x n matrix (two static-index takes
    # from the pair vector padded with one zero), where autodiff of the forward's gather would
    # scatter; scatters are slow on XLA:CPU (the interaction gradient at the Kaggle shape took
    # about 2.5x longer).
    B, n, F = z.shape
    _, pos, posT = _pair_maps(n)
    dpad = jnp.concatenate([jnp.zeros((B, 1), d.dtype), d[:, F:]], axis=1)
    dZ = (jnp.take(dpad, pos, axis=1) + jnp.take(dpad, posT, axis=1)).reshape(B, n, n)
    dz = jnp.einsum("bij,bjf->bif", dZ, z)
    return d[:, :F] + dz[:, 0], dz[:, 1:]


@jax.custom_vjp
def dot_interaction(h, emb):
    """``[h, strictly lower triangle of z z^T]`` per sample, ``z = [h; emb]`` of (B, T+1, F)."""
    return _dot_forward(h, emb)[0]


dot_interaction.defvjp(_dot_forward, _dot_backward)


def interact(h, emb, interaction: str):
    """``h`` (B, F) bottom output, ``emb`` (B, T, F) lookups -> top MLP input."""
    if interaction == "cat":
        return jnp.concatenate([h, emb.reshape(emb.shape[0], -1)], axis=1)
    return dot_interaction(h, emb)


def logits_fn(params, x, emb, interaction: str, precision: str = "f32"):
    """The model up to the logit (the sigmoid is folded into the loss for stability)."""
    h = _mlp(params["bot"], x, False, precision)
    return _mlp(params["top"], interact(h, emb, interaction), True, precision)[:, 0]


def bce_with_logits(p, y):
    """Mean binary cross-entropy of sigmoid(p) against labels y, computed stably."""
    return jnp.mean(jnp.maximum(p, 0) - p * y + jnp.log1p(jnp.exp(-jnp.abs(p))))


def _loss(params, x, emb, y, interaction, precision):
    p = logits_fn(params, x, emb, interaction, precision)
    return bce_with_logits(p, y), p


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a ValueError naming them."""
    if precision not in PRECISIONS:
        raise ValueError(f"dense precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def make_grad_step(interaction: str, precision: str = "f32"):
    """jitted ``(params, x, emb, y) -> (loss, logits, dense grads, d emb)``."""
    check_precision(precision)

    @jax.jit
    def step(params, x, emb, y):
        (loss, p), (g, gemb) = jax.value_and_grad(_loss, argnums=(0, 2), has_aux=True)(
            params, x, emb, y, interaction, precision)
        return loss, p, g, gemb

    return step


def make_predict(interaction: str, precision: str = "f32"):
    """jitted ``(params, x, emb) -> logits``."""
    return jax.jit(partial(logits_fn, interaction=interaction, precision=check_precision(precision)))


@partial(jax.jit, donate_argnums=(0,))
def sgd_update(params, grads, lr):
    """Dense SGD step (the old weights are donated)."""
    return jax.tree.map(lambda w, g: w - lr * g, params, grads)


def to_device(params) -> dict:
    return jax.tree.map(jnp.asarray, params)


def to_numpy(params) -> dict:
    return jax.tree.map(lambda a: np.array(a, dtype=np.float32), params)
