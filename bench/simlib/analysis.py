"""Where a policy's tail comes from, measured on a simulated run (not guessed).

The tail is the last 10% of requests to finish (Seer's definition). For those requests this reports
whether they are their group's longest member (a group outlier the finished siblings under-state),
how long they sat queued between chunks (paused: KV full of requests ranked above them), the group
estimate the core held when their longest pause began against their true length, when they
started, and how unevenly the instances ran out of work. `longest_alone_s` is a floor no scheduler
beats: the longest response decoded alone at batch 1 from t = 0.
"""

from __future__ import annotations

import numpy as np

from .cluster import SimResult
from .model import InstanceModel
from .workload import Workload


def longest_alone_seconds(w: Workload, model: InstanceModel) -> float:
    """Decode time of the longest response alone (batch 1): sum over its steps of T(1, context)."""
    g, s = np.unravel_index(int(np.argmax(w.lengths)), w.lengths.shape)
    n, p = float(w.lengths[g, s]), float(w.prompt_len[g])
    # sum_{j < n} (a + b + c (p + j)) = n (a + b + c p) + c n (n - 1) / 2
    return n * (model.a + model.b + model.c * p) + model.c * n * (n - 1) / 2


def tail_report(w: Workload, model: InstanceModel, r: SimResult, baseline: SimResult) -> dict[str, float | None]:
    G = w.spec.group_size
    lengths = w.lengths.reshape(-1)  # [requests]
    t90 = r.makespan - r.tail_time
    tail = np.nonzero(r.finish_times > t90)[0]  # [tail requests]
    group_max = np.repeat(w.lengths.max(axis=1), G)  # [requests]
    waited = tail[r.max_wait[tail] > 0]
    # None where no tail request ever waited: there is no estimate to compare (0 would read as a
    # total under-shoot).
    undershoot = (
        round(float(np.median(r.est_at_max_wait[waited] / np.maximum(1, lengths[waited]))), 3) if waited.size else None
    )
    return {
        "tail_requests": int(tail.size),
        "tail_s": round(r.tail_time, 1),
        "tail_vs_baseline": round(r.tail_time / baseline.tail_time, 3),
        "tail_group_longest_frac": round(float(np.mean(lengths[tail] == group_max[tail])), 3),
        "tail_median_len": round(float(np.median(lengths[tail]))),
        "tail_median_queued_s": round(float(np.median(r.wait_times[tail])), 1),
        "tail_median_queued_frac_of_makespan": round(float(np.median(r.wait_times[tail])) / r.makespan, 3),
        # Group estimate when the request's longest pause began / its true length (< 1: under-shoot).
        "tail_median_estimate_over_true": undershoot,
        "tail_started_after_10pct_frac": round(float(np.mean(r.start_times[tail] > 0.1 * r.makespan)), 3),
        "instances_idle_spread_s": round(float(r.instance_idle_at.max() - r.instance_idle_at.min()), 1),
        "longest_alone_s": round(longest_alone_seconds(w, model), 1),
        "longest_alone_vs_baseline_tail": round(longest_alone_seconds(w, model) / baseline.tail_time, 3),
    }
