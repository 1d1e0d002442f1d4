"""Device performance model: read and write bandwidth, for *modeled* movement times.

A copy of ``n`` bytes from device S to device D is modeled as taking
``n / min(S.read, D.write)`` seconds: the slower side of the stream bounds it.
Telemetry always labels these figures "modeled", next to the measured times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

GB = 1e9


@dataclass(frozen=True)
class Bandwidth:
    """Sustained read and write bandwidth of a device in bytes per second."""

    read: float
    write: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not (self.read > 0 and self.write > 0):
            raise ValueError(f"bandwidths must be positive, got read={self.read}, write={self.write}")


def copy_seconds(nbytes: int, src: Bandwidth, dst: Bandwidth) -> float:
    """Modeled time to stream ``nbytes`` from a device with ``src`` to one with ``dst``."""
    return nbytes / min(src.read, dst.write)


# Published figures for six interleaved Optane DC PMM (first generation) DIMMs per socket.
PROFILES: dict[str, Bandwidth] = {
    "optane": Bandwidth(read=39 * GB, write=13 * GB, source="optane profile"),
    "ddr4": Bandwidth(read=110 * GB, write=80 * GB, source="ddr4 profile"),
    # H100 HBM3: a GPU->GPU copy measured 2.69 TB/s counting reads and writes.
    "h100": Bandwidth(read=1345 * GB, write=1345 * GB, source="h100 profile (measured copy)"),
}

_probed: Bandwidth | None = None


def probe_dram(nbytes: int = 64 << 20, repeats: int = 3) -> Bandwidth:
    """Measure this machine's DRAM copy bandwidth once (about 0.1 s) and remember it."""
    global _probed
    if _probed is None:
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        # A copy reads and writes nbytes each; report per-direction bandwidth.
        _probed = Bandwidth(read=nbytes / best, write=nbytes / best, source="measured probe")
    return _probed


def resolve(spec: "Bandwidth | str | tuple[float, float] | None", default: str) -> Bandwidth:
    """Turn a user's bandwidth setting into a `Bandwidth`.

    Accepts a `Bandwidth`, a profile name (``"optane"``, ``"ddr4"``, ``"probe"``),
    a ``(read, write)`` tuple in GB/s, or None for ``default``.
    """
    if spec is None:
        spec = default
    if isinstance(spec, Bandwidth):
        return spec
    if isinstance(spec, str):
        if spec == "probe":
            return probe_dram()
        if spec not in PROFILES:
            raise ValueError(f"unknown bandwidth profile {spec!r}; choose from {sorted(PROFILES) + ['probe']}")
        return PROFILES[spec]
    read, write = spec
    return Bandwidth(read=float(read) * GB, write=float(write) * GB, source="given")
