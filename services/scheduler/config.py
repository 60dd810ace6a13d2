"""Scheduler service configuration (flags --kebab-case, env SEER_SCHEDULER_<FIELD>)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ServiceConfig
from services.scheduler.core.config import POLICIES, SchedulerPolicyConfig


@dataclass(frozen=True)
class SchedulerConfig(ServiceConfig):
    buffer_address: str = field(default="", metadata={"help": "host:port of the buffer (work feed, commits)"})
    policy: str = field(
        default="seer",
        metadata={"help": "scheduling policy: " + ", ".join(p for p in POLICIES if p != "oracle")},
    )
    chunk_size: int = field(default=512, metadata={"help": "max new tokens per dispatched chunk"})
    load_imbalance_threshold: int = field(
        default=32, metadata={"help": "go load-first when in-flight counts differ by more than this"}
    )
    prefix_gap_margin: int = field(
        default=512, metadata={"help": "pull KV from the pool when a move leaves a prefix gap over this"}
    )
    starvation_seconds: float = field(
        default=30.0, metadata={"help": "serve a request first once a later submission postponed it this long"}
    )
    starvation_chunks: float = field(
        default=0.0,
        metadata={"help": "resume a request paused mid-response after this many chunk durations (0 = off)"},
    )
    order: str = field(default="total", metadata={"help": "longest-first by estimated 'total' or 'remaining'"})
    estimate_quantile: float = field(
        default=0.9,
        metadata={"help": "learned correction of group estimates: quantile of sibling ratios (0 = plain max)"},
    )
    estimate_min_samples: int = field(
        default=16, metadata={"help": "completed groups of a shape needed before the correction applies"}
    )
    history_estimate: str = field(
        default="scaled",
        metadata={
            "help": "seer_history: 'scaled' (prior follows this iteration's finished siblings), 'floor' or "
            "'posterior' (expected maximum from the history's mean log length and this iteration's siblings)"
        },
    )
    kv_aging: float = field(
        default=12.0,
        metadata={
            "help": "KV-bound with every waiting request started: estimate tokens a paused request gains "
            "per token-time it waits (0 = off)"
        },
    )
    admission_lookahead: int = field(
        default=16, metadata={"help": "queued candidates one decision may skip when the best does not fit"}
    )
    use_worker_free_pages: bool = field(
        default=True, metadata={"help": "also subtract KV usage workers report beyond our reservations"}
    )
    history_probes: bool = field(
        default=False, metadata={"help": "seer_history: still give probe priority to groups with a history prior"}
    )
    quarantine_clear_reports: int = field(
        default=3,
        metadata={"help": "consecutive sane reports before a quarantined worker is trusted again (first offence)"},
    )
    quarantine_max_reports: int = field(
        default=96, metadata={"help": "cap of the sane period, which doubles with each repeat quarantine offence"}
    )
    quarantine_decay_reports: int = field(
        default=900, metadata={"help": "consecutive sane reports while trusted that forgive one quarantine offence"}
    )
    worker_failure_limit: int = field(
        default=3,
        metadata={"help": "quarantine a worker on which chunks of this many prompt groups failed in a row by its "
                          "fault (not the last trusted one; 0 = off)"},
    )
    history_max_prompts: int = field(
        default=1_000_000,
        metadata={"help": "history priors kept, by prompt key (least recently used dropped; refetched from the "
                          "buffer when the prompt comes back)"},
    )
    # 2 s (3 missed = 6 s): a busy CPU worker can miss a 1 s beat and be dropped mid-chunk.
    heartbeat_interval: float = field(
        default=2.0, metadata={"help": "seconds between worker heartbeats; 3 missed = worker removed"}
    )
    # 0 by default: a fixed pool (it was 64) capped the whole cluster's batch, since each running
    # chunk holds a thread for its stream (8 GPU workers x 256 slots ran 64 chunks), and the
    # chunks queued behind it counted as in flight.
    dispatch_threads: int = field(
        default=0,
        metadata={"help": "chunks that may run at once over all workers (0 = as many as the workers' batch slots)"},
    )
    commit_timeout: float = field(
        default=120.0, metadata={"help": "seconds to keep retrying a chunk commit while the buffer is down"}
    )
    chunk_timeout: float = field(default=600.0, metadata={"help": "deadline of one RunChunk call (seconds)"})
    drain_timeout: float = field(
        default=300.0, metadata={"help": "SwitchWeights: seconds to wait for in-flight chunks to finish"}
    )
    # A failed catch-up load is retried in place (the worker stays registered, listed unhealthy)
    # after these delays, doubling: it used to drop the worker, which registered again at once and
    # failed again, hundreds of times a minute for as long as the source was bad.
    catch_up_retry_initial: float = field(
        default=1.0, metadata={"help": "seconds before the first retry of a failed catch-up weight load"}
    )
    catch_up_retry_max: float = field(
        default=30.0, metadata={"help": "cap of the doubling delay between retries of a failed catch-up weight load"}
    )
    port_file: str = field(default="", metadata={"help": "write the bound port to this file"})
    epoch_file: str = field(
        default="",
        metadata={"help": "file keeping dispatch epochs increasing across restarts even if the wall clock goes "
                          "back (services/scheduler/epochs.py; empty = the wall clock at start)"},
    )

    def policy_config(self) -> SchedulerPolicyConfig:
        return SchedulerPolicyConfig(
            policy=self.policy,
            chunk_size=self.chunk_size,
            load_imbalance_threshold=self.load_imbalance_threshold,
            prefix_gap_margin=self.prefix_gap_margin,
            starvation_seconds=self.starvation_seconds,
            starvation_chunks=self.starvation_chunks,
            order=self.order,
            estimate_quantile=self.estimate_quantile,
            estimate_min_samples=self.estimate_min_samples,
            history_estimate=self.history_estimate,
            admission_lookahead=self.admission_lookahead,
            kv_aging=self.kv_aging,
            use_worker_free_pages=self.use_worker_free_pages,
            history_probes=self.history_probes,
            quarantine_clear_reports=self.quarantine_clear_reports,
            quarantine_max_reports=self.quarantine_max_reports,
            quarantine_decay_reports=self.quarantine_decay_reports,
            worker_failure_limit=self.worker_failure_limit,
            history_max_prompts=self.history_max_prompts,
        )

    def validate(self) -> None:
        super().validate()
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.policy == "oracle":
            # The oracle knows every response's true length: only the simulator has that. Over
            # real workers it would silently schedule by max_tokens.
            raise ValueError("policy: 'oracle' needs true lengths and runs only in the simulator (bench.sim)")
        self.policy_config().validate()
        if self.heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval: must be > 0, got {self.heartbeat_interval}")
        if self.dispatch_threads < 0:
            raise ValueError(f"dispatch_threads: must be >= 0 (0 = no limit but the workers' batch slots), "
                             f"got {self.dispatch_threads}")
        for name in ("commit_timeout", "chunk_timeout", "drain_timeout", "catch_up_retry_initial"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.catch_up_retry_max < self.catch_up_retry_initial:
            raise ValueError(f"catch_up_retry_max: must be >= catch_up_retry_initial ({self.catch_up_retry_initial}), "
                             f"got {self.catch_up_retry_max}")
