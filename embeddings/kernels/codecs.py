"""Storage codecs: how a kernel turns a stored element into float32 and back.

Kernels accumulate in float32 whatever the storage type. The storage format is a compile-time
argument, a *codec marker* scalar whose numba type selects the conversion:

* ``NATIVE`` (a float32 scalar): storage is float32 or float64; plain casts.
* ``BF16`` (an int8 scalar): storage is uint16 holding bfloat16 bits (upper half of a float32).
* ``F16`` (an int16 scalar): storage is uint16 holding IEEE binary16 bits.

Only the marker's *type* matters, so numba compiles one specialisation per format and the
branch disappears from the hot loop.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .intrinsics import bits_f32, f32_bits, f32_to_half, half_to_f32

NATIVE = np.float32(0)
BF16 = np.int8(0)
F16 = np.int16(0)


def load(codec, x):  # pragma: no cover - replaced by the overload inside numba
    """Stored element -> float32 (numba only)."""
    raise NotImplementedError


def store(codec, x):  # pragma: no cover - replaced by the overload inside numba
    """float32 -> stored element (numba only)."""
    raise NotImplementedError


@overload(load, inline="always")
def _load(codec, x):
    if isinstance(codec, types.Float):
        return lambda codec, x: np.float32(x)
    if codec == types.int8:
        return lambda codec, x: bits_f32(np.uint32(x) << np.uint32(16))
    if codec == types.int16:
        return lambda codec, x: half_to_f32(x)
    return None


@overload(store, inline="always")
def _store(codec, x):
    if isinstance(codec, types.Float):
        return lambda codec, x: x
    if codec == types.int8:

        def impl(codec, x):
            u = f32_bits(np.float32(x))
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays NaN
                return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
            rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
            return np.uint16((u + rounding) >> np.uint32(16))

        return impl
    if codec == types.int16:
        return lambda codec, x: f32_to_half(np.float32(x))
    return None
