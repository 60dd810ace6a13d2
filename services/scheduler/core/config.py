"""Policy configuration of the scheduler core (pure; the service maps its flags onto this)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument

# baseline: veRL-like, run to completion, engine preempts; divided: chunks, no length context;
# seer: Seer Algorithm 2 (probes + group estimates); seer_history: + RhymeRL history priors;
# oracle: longest-first by the true lengths (simulator only).
POLICIES = ("baseline", "divided", "seer", "seer_history", "oracle")


@dataclass(frozen=True)
class SchedulerPolicyConfig:
    policy: str = "seer"
    # Max new tokens per dispatched chunk (divided rollout, DESIGN.md section 4).
    chunk_size: int = 512
    # Cache-aware placement (Seer OSDI): go load-first when in-flight counts differ by more than this
    # (capped at max_batch_size // 8 of the cached worker, for small workers).
    load_imbalance_threshold: int = 32
    # ... and pull the KV from the pool when the move leaves a prefix gap over this many tokens.
    prefix_gap_margin: int = 512
    # Anti-starvation: a chunk postponed by newer work (a later submission's chunks dispatched while
    # it waits) for longer than this is served before any priority order (SchedulerCore._starving).
    starvation_seconds: float = 30.0
    # Anti-starvation of requests paused mid-response: resumed first after waiting this many times
    # the measured duration of a full chunk (0 = off).
    starvation_chunks: float = 0.0
    # Longest-first by the estimated "total" length (Seer Algorithm 2) or by "remaining" length.
    order: str = "total"
    # While the cluster is KV-bound and every waiting request has started (core/pressure.py), a
    # paused request's estimate grows by this many tokens per token-time it waits (0 = off).
    kv_aging: float = 12.0
    # Admission: how many queued candidates one decision may skip when the best does not fit.
    admission_lookahead: int = 16
    # Subtract KV usage the worker reports beyond our own reservations (e.g. another tenant).
    use_worker_free_pages: bool = True
    # seer_history: still give probe priority to groups that already have a history prior.
    history_probes: bool = False
    # Online-learned correction of group estimates (core/ratios.py): the finished maximum is
    # multiplied by this quantile of (group max / max of the first k finished) over completed
    # groups; 0 = the paper's plain maximum. Applies to seer and seer_history.
    estimate_quantile: float = 0.9
    # ... once at least this many completed groups of the same shape were observed.
    estimate_min_samples: int = 16
    # seer_history: "floor" (finished siblings can only raise the prior) or "scaled" (the prior is
    # rescaled by this iteration's finished siblings against the previous iteration's shortest) or
    # "posterior" (expected maximum of a log-normal group whose log-mean has the history's mean log
    # as prior, updated by finished and censored running siblings: groups.posterior_max).
    history_estimate: str = "scaled"
    # A quarantined worker is trusted again after this many consecutive sane reports (first
    # offence); each repeat offence doubles it, up to quarantine_max_reports; after
    # quarantine_decay_reports consecutive sane reports while trusted, one offence is forgiven.
    quarantine_clear_reports: int = 3
    quarantine_max_reports: int = 96
    quarantine_decay_reports: int = 900
    # A worker on which chunks of this many different groups failed in a row (errors of the
    # worker, not of the request: SchedulerCore.on_worker_fault) is quarantined like one that reports impossible
    # numbers, unless no other worker is trusted; 0 = off. Why: a worker whose engine is broken
    # (a CUDA fault, a hung device) fails every chunk at once, so it always looks free and
    # least-loaded placement sends it most chunks; each failure costs a request one of its
    # attempts, and the requests run out of attempts within a second.
    worker_failure_limit: int = 3
    # History priors kept (prompt keys, least recently used dropped first). Each costs about 0.5 KB
    # at G = 16; the default holds a million-prompt dataset in ~0.5 GB. A key dropped is fetched
    # again from the buffer (its durable copy) when the prompt comes back.
    history_max_prompts: int = 1_000_000

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument(f"{self.policy!r} is not one of {', '.join(POLICIES)}", field="policy")
        if self.chunk_size < 1:
            raise InvalidArgument(f"must be >= 1, got {self.chunk_size}", field="chunk_size")
        if self.load_imbalance_threshold < 0:
            raise InvalidArgument("must be >= 0", field="load_imbalance_threshold")
        if self.prefix_gap_margin < 0:
            raise InvalidArgument("must be >= 0", field="prefix_gap_margin")
        if not (self.starvation_seconds > 0) or math.isnan(self.starvation_seconds):
            raise InvalidArgument("must be > 0", field="starvation_seconds")
        if not self.starvation_chunks >= 0:
            raise InvalidArgument(f"must be >= 0, got {self.starvation_chunks}", field="starvation_chunks")
        if self.order not in ("total", "remaining"):
            raise InvalidArgument(f"{self.order!r} is not one of total, remaining", field="order")
        if not self.kv_aging >= 0 or math.isinf(self.kv_aging):
            raise InvalidArgument(f"must be a finite number >= 0, got {self.kv_aging}", field="kv_aging")
        if self.admission_lookahead < 1:
            raise InvalidArgument("must be >= 1", field="admission_lookahead")
        if not 0 <= self.estimate_quantile < 1:
            raise InvalidArgument(f"must be in [0, 1), got {self.estimate_quantile}", field="estimate_quantile")
        if self.estimate_min_samples < 1:
            raise InvalidArgument("must be >= 1", field="estimate_min_samples")
        if self.history_estimate not in ("floor", "scaled", "posterior"):
            raise InvalidArgument(
                f"{self.history_estimate!r} is not one of floor, scaled, posterior", field="history_estimate"
            )
        if self.quarantine_clear_reports < 1:
            raise InvalidArgument("must be >= 1", field="quarantine_clear_reports")
        if self.quarantine_max_reports < self.quarantine_clear_reports:
            raise InvalidArgument(
                f"must be >= quarantine_clear_reports ({self.quarantine_clear_reports}), got "
                f"{self.quarantine_max_reports}",
                field="quarantine_max_reports",
            )
        if self.quarantine_decay_reports < 1:
            raise InvalidArgument("must be >= 1", field="quarantine_decay_reports")
        if self.history_max_prompts < 1:
            raise InvalidArgument(f"must be >= 1, got {self.history_max_prompts}", field="history_max_prompts")
        if self.worker_failure_limit < 0:
            raise InvalidArgument(f"must be >= 0 (0 = off), got {self.worker_failure_limit}",
                                  field="worker_failure_limit")

    @property
    def chunked(self) -> bool:
        return self.policy != "baseline"

    @property
    def uses_history(self) -> bool:
        """Whether the previous iteration's lengths (set_history) change any decision: the priors,
        the posterior's spread and the KV demand are all seer_history's. Other policies only keep
        what their own completed groups record."""
        return self.policy == "seer_history"

    @property
    def context_aware(self) -> bool:
        return self.policy in ("seer", "seer_history", "oracle")
