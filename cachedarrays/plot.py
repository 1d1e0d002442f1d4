"""Plots of telemetry: device occupancy over time and bytes moved per direction (needs matplotlib).

``pip install cachedarrays[plot]`` brings matplotlib; nothing else in the
library imports it.
"""

from __future__ import annotations

from typing import Mapping


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'cachedarrays[plot]'") from e
    return plt


def plot_occupancy(telemetry: Mapping, path: str, title: str = "device occupancy") -> str:
    """Draw used bytes of each device against time from ``manager.telemetry()``; returns ``path``."""
    plt = _pyplot()
    timeline = telemetry["timeline"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in telemetry["occupancy"]:
        ax.step([t for t, _ in timeline], [u[name] / 2**20 for _, u in timeline], where="post", label=name)
        ax.axhline(telemetry["occupancy"][name]["capacity"] / 2**20, ls=":", lw=0.8, color="grey")
    ax.set_xlabel("time (s)")
    return _finish(plt, fig, ax, path, title, "used (MiB)")


def plot_bytes_moved(runs: Mapping[str, Mapping], path: str, title: str = "bytes moved") -> str:
    """Grouped bars of bytes per direction for several labelled telemetry snapshots; returns ``path``."""
    plt = _pyplot()
    directions = sorted({d for tele in runs.values() for d in tele["bytes_moved"]})
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs)), 3.5))
    width = 0.8 / max(1, len(directions))
    for k, direction in enumerate(directions):
        xs = [i + k * width for i in range(len(runs))]
        ax.bar(xs, [tele["bytes_moved"].get(direction, 0) / 2**20 for tele in runs.values()], width, label=direction)
    ax.set_xticks([i + width * (len(directions) - 1) / 2 for i in range(len(runs))], list(runs), rotation=20)
    return _finish(plt, fig, ax, path, title, "MiB")


def _finish(plt, fig, ax, path: str, title: str, ylabel: str) -> str:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
