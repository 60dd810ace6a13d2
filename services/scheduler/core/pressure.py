"""Which resource binds the cluster now, and whether the scheduler is still choosing which requests
to start (observed online, with hysteresis; no workload knowledge).

When a decision ends with requests still pending while some worker has a free batch slot, the
queued candidates did not fit the free KV (admission control refused them): the cluster is
KV-bound. When it ends because no worker has a free slot, it is batch-bound. An exponential average
of that indicator with separate enter/leave thresholds keeps the mode from flapping at every chunk
boundary.

Within the KV-bound mode, "contention among started requests" is latched when (nearly) every
waiting request has already started (paused at a chunk boundary, prefix paid): the order no longer
decides which requests start early (what longest-first is for, Seer section 4.2) but only which
started request waits for KV. It is left only when the cluster stops being KV-bound.

Also within the KV-bound mode, "bound by KV demand" is latched when the expected KV demand of the
requests known (from the previous iteration's lengths, seer_history) exceeds what the KV can serve
within the longest response: then the KV throughput, not the critical path, bounds the makespan,
and longest-first has nothing left to protect (scheduler.py serves FIFO, like divided). It is also
left only when the cluster stops being KV-bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BindingResource:
    # Weight of one decision's observation in the running average.
    alpha: float = 0.05
    # KV-bound mode starts when the average reaches `enter` and ends when it falls to `leave`.
    enter: float = 0.75
    leave: float = 0.25
    # Contention among started requests: at most this share of the waiting requests is fresh.
    fresh_share: float = 0.1
    level: float = 0.0
    kv_bound: bool = False
    started_contention: bool = False
    switches: int = 0
    demand_bound: bool = False

    def observe(self, kv_refused: bool, fresh: int, waiting: int) -> bool:
        """Record why one decision stopped (`kv_refused`: a slot was free but nothing fitted) and
        how many of the `waiting` requests are fresh; return whether `started_contention` changed."""
        self.level += self.alpha * (float(kv_refused) - self.level)
        if not self.kv_bound and self.level >= self.enter:
            self.kv_bound = True
            self.switches += 1
        elif self.kv_bound and self.level <= self.leave:
            self.kv_bound = False
            self.switches += 1
        before = self.started_contention
        if not self.kv_bound:
            self.started_contention = False
        elif fresh <= self.fresh_share * waiting:
            self.started_contention = True
        return self.started_contention != before

    def observe_demand(self, ratio: float | None) -> bool:
        """Record the expected KV demand over what the KV serves within the longest response
        (`ratio`; None: unknown, no history); return whether `demand_bound` changed. Call after
        `observe`, which decides whether the cluster is KV-bound."""
        before = self.demand_bound
        if not self.kv_bound:
            self.demand_bound = False
        elif ratio is not None and ratio > 1.0:
            self.demand_bound = True
        return self.demand_bound != before
