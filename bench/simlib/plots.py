"""PNG plots of simulated runs: requests finished over time, and cluster utilization over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from .cluster import SimResult


def plot_runs(title: str, runs: Sequence[SimResult], path: Path, peak_tokens_per_s: float) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
    for r in runs:
        t = np.sort(r.finish_times)
        ax1.plot(t, np.arange(1, t.size + 1) / t.size, label=f"{r.label} ({r.makespan:.0f} s)")
        ts, thr = r.timeline.throughput(r.makespan)
        ax2.plot(ts, thr / peak_tokens_per_s, label=r.label, linewidth=1)
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("requests finished (fraction)")
    ax1.axhline(0.9, color="grey", linewidth=0.5, linestyle=":")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("utilization (decode tokens/s / cluster peak)")
    ax2.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
