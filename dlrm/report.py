"""The end-of-run summary (time per phase, cache hit rates, bytes moved, peak memory) and plots."""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping, Sequence

from cachedarrays import format_size

from .metrics import PHASES


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def summarize(phases: Mapping[str, float], steps: int, samples: int, wall: float, telemetry: Mapping,
              tables: Sequence[dict]) -> dict:
    """A JSON-able summary; ``tables`` holds per-table dicts (name, rows, device, hitrate)."""
    return {
        "steps": int(steps), "samples": int(samples), "wall_seconds": wall,
        "samples_per_second": samples / wall if wall > 0 else 0.0,
        "phases_seconds": {k: float(v) for k, v in phases.items()},
        "bytes_moved": dict(telemetry.get("bytes_moved", {})),
        "peak_memory": {name: int(o["high_water"]) for name, o in telemetry.get("occupancy", {}).items()},
        "capacity": {name: int(o["capacity"]) for name, o in telemetry.get("occupancy", {}).items()},
        "peak_rss": peak_rss_bytes(),
        "tables": list(tables),
    }


def format_summary(s: Mapping) -> str:
    out = []
    total = sum(s["phases_seconds"].values()) or 1.0
    steps = max(1, s["steps"])
    out.append(f"{s['steps']} steps, {s['samples']} samples in {s['wall_seconds']:.2f} s: "
               f"{s['samples_per_second']:.0f} samples/s")
    out.append(f"{'phase':<20}{'total s':>10}{'ms/step':>10}{'share':>8}")
    names = list(PHASES) + [p for p in s["phases_seconds"] if p not in PHASES]
    for p in names:
        v = s["phases_seconds"].get(p, 0.0)
        out.append(f"{p:<20}{v:>10.3f}{1e3 * v / steps:>10.2f}{100 * v / total:>7.1f}%")
    rates = [t for t in s["tables"] if t.get("hitrate") is not None]
    if rates:
        out.append("cache hit rate per table: " + ", ".join(f"{t['name']} {100 * t['hitrate']:.1f}%" for t in rates))
    else:
        devs = sorted({t["device"] for t in s["tables"]})
        out.append(f"cache hit rates: none (plain tables, rows in {', '.join(devs)})")
    moved = s["bytes_moved"]
    out.append("bytes moved between devices: " + (", ".join(f"{k} {format_size(v)}" for k, v in moved.items())
                                                  if moved else "none"))
    out.append("peak memory per device: " + ", ".join(
        f"{k} {format_size(v)} of {format_size(s['capacity'][k])}" for k, v in s["peak_memory"].items())
        + f"; process peak RSS {format_size(s['peak_rss'])}")
    return "\n".join(out)


def plot_run(prefix: str, losses: Sequence[tuple[int, float]], evals: Sequence[dict], phases: Mapping[str, float],
             steps: int, title: str = "DLRM") -> list[str]:
    """``prefix_loss.png`` (training loss, smoothed, and test loss) and ``prefix_phases.png``."""
    from cachedarrays.plot import _pyplot

    import numpy as np

    plt = _pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if losses:
        x = np.array([s for s, _ in losses])
        y = np.array([v for _, v in losses])
        ax.plot(x, y, lw=0.5, alpha=0.4, label="train (per step)")
        w = max(1, len(y) // 50)
        if w > 1:
            ax.plot(x[w - 1:], np.convolve(y, np.ones(w) / w, mode="valid"), label=f"train ({w}-step mean)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="test")
    ax.set_xlabel("step")
    ax.set_ylabel("binary cross-entropy")
    ax.set_title(f"{title}: loss")
    ax.legend()
    fig.tight_layout()
    paths.append(f"{prefix}_loss.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.0))
    left = 0.0
    for p, v in phases.items():
        ms = 1e3 * v / max(1, steps)
        ax.barh([0], [ms], left=left, label=p)
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("ms per step")
    ax.set_title(f"{title}: time per phase")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    paths.append(f"{prefix}_phases.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths
