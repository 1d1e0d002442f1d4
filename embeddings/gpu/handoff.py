"""A lookup's CuPy output as a JAX array without a copy, at a small host cost
(:func:`cachedarrays.jaxdlpack.from_dlpack`: JAX's own import without its per-call wrapper, which
was of the order of a whole small lookup). Where JAX has no GPU, the CuPy array is returned as it is.
"""

from __future__ import annotations

from typing import Any

_jax_gpu: bool | None = None  # whether JAX has a GPU backend (looked up once)


def to_jax(out: Any, ordered: bool = True) -> Any:
    """``out`` (a CuPy array) as a JAX array over the same memory; CuPy where JAX has no GPU.
    ``ordered=False``: the caller waits for CuPy's stream before the result is used, so JAX
    need not (:func:`cachedarrays.jaxdlpack.from_dlpack`)."""
    global _jax_gpu
    if _jax_gpu is None:
        import jax
        try:
            _jax_gpu = bool(jax.devices("gpu"))
        except Exception:  # JAX without a GPU backend
            _jax_gpu = False
    if not _jax_gpu:
        return out
    from cachedarrays.jaxdlpack import from_dlpack
    return from_dlpack(out, ordered=ordered)
