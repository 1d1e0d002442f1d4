"""Byte sizes written the way people write them: ``"512MiB"``, ``"2GiB"``, ``4096``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Return ``size`` in bytes; accepts ints and strings such as ``"64KiB"`` or ``"1.5GB"``.

    Raises ``ValueError`` naming the input when it is not a positive size.
    """
    if isinstance(size, bool):
        raise ValueError(f"capacity must be a byte count or a string like '512MiB', got {size!r}")
    if isinstance(size, int):
        nbytes = size
    elif isinstance(size, str):
        match = _PATTERN.match(size)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot understand size {size!r}: use a byte count or a number with one of the units "
                "B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)"
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"capacity must be a byte count or a string like '512MiB', got {size!r}")
    if nbytes <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return nbytes


def format_size(nbytes: int | float) -> str:
    """Render a byte count compactly with a binary unit, e.g. ``format_size(3<<20) == '3.0 MiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
