"""Worker configuration: one frozen dataclass -> CLI flags, SEER_WORKER_* env vars, --config JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.common.config import ServiceConfig
from services.common.streams import check_stream_limit, default_stream_limit

ENGINES = ("reference", "sglang")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig):
    worker_id: str = field(default="", metadata={"help": "stable worker id (empty = worker-<host>-<port>)"})
    advertise_address: str = field(
        default="", metadata={"help": "host:port the scheduler dials (empty = <host>:<bound port>)"}
    )
    scheduler_address: str = field(
        default="", metadata={"help": "SchedulerService host:port to register with (empty = standalone)"}
    )
    port_file: str = field(default="", metadata={"help": "write the bound gRPC port to this file"})

    engine: str = field(default="reference", metadata={"help": "engine backend: reference | sglang"})
    model_dir: str = field(default="", metadata={"help": "safetensors model dir (empty = embedded model)"})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu | cuda | cuda:N"})
    dtype: str = field(default="float32", metadata={"help": "weights/KV dtype: float32 | bfloat16 | float16"})
    page_size: int = field(default=16, metadata={"help": "KV page size in tokens"})
    num_kv_pages: int = field(default=0, metadata={"help": "KV pages (0 = derive from kv_memory_mb)"})
    kv_memory_mb: int = field(default=512, metadata={"help": "KV cache budget when num_kv_pages is 0"})
    max_batch_size: int = field(default=32, metadata={"help": "max requests decoded in one step"})
    policy_version: int = field(default=0, metadata={"help": "policy version of the weights at start"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    tune_malloc: bool = field(
        default=True,
        metadata={"help": "tune glibc malloc so per-step tensors reuse memory (services/common/memtune.py)"},
    )

    speculation: bool = field(default=True, metadata={"help": "grouped speculative decoding on/off"})
    draft_address: str = field(
        default="", metadata={"help": "DraftService host:port (empty = drafts from the request itself only)"}
    )
    gamma_max: int = field(default=8, metadata={"help": "max draft tokens per request per step"})
    draft_width: int = field(default=2, metadata={"help": "draft branches at forks (1 = chain, k = top-k tree)"})
    multipath_max_batch: int = field(
        default=4, metadata={"help": "use draft_width > 1 only while at most this many requests run"}
    )
    spec_table: str = field(
        default="", metadata={"help": "JSON step-time table T(B, gamma) from `seer profile` (empty = built-in)"}
    )
    group_ttl_seconds: float = field(default=3600.0, metadata={"help": "TTL of groups registered on the draft server"})
    draft_mirror_budget_mb: int = field(
        default=1024, metadata={"help": "memory for the local draft mirrors; least recently used idle groups go first"}
    )
    # Adaptive speculation (services/worker/adaptive.py, Seer Algorithm 1 with a closed cost loop).
    spec_min_gain: float = field(
        default=0.3, metadata={"help": "predicted speedup margin to draft while a batch size's costs are unmeasured"}
    )
    spec_calibrated_min_gain: float = field(
        default=0.05, metadata={"help": "the margin once drafting steps at that batch size are timed"}
    )
    spec_pad_cost: float = field(
        default=0.15, metadata={"help": "cost of a padded verify row (shorter draft) as a fraction of a draft token"}
    )
    spec_explore_budget: float = field(
        default=0.02, metadata={"help": "max share of step time spent exploring drafts while speculation is off"}
    )
    spec_guard_steps: int = field(
        default=16, metadata={"help": "drafting steps per guard verdict (measured speedup below 1 turns drafting off)"}
    )
    spec_guard_backoff: int = field(
        default=64, metadata={"help": "plans off after the guard's first failed verdict (doubles per failure)"}
    )
    spec_control_interval: int = field(
        default=32, metadata={"help": "one plain step per this many drafting plans (keeps the plain cost measured)"}
    )
    spec_step_clock: str = field(
        default="wall", metadata={"help": "step time the planner learns from: wall | thread (loop thread CPU time)"}
    )

    kv_addresses: tuple[str, ...] = field(
        default=(), metadata={"help": "comma-separated KVStoreService addresses (empty = no KV pool)"}
    )
    kv_offload: bool = field(default=True, metadata={"help": "offload a request's KV pages when a chunk ends"})

    drain_timeout_seconds: float = field(
        default=300.0, metadata={"help": "max wait for in-flight chunks before LoadWeights"}
    )
    max_streams: int = field(
        default=0,
        metadata={"help": "open RunChunk streams at most; more are RESOURCE_EXHAUSTED, and registration "
                          "advertises at most this many concurrent chunks (0 = max_workers - 8, or half of "
                          "max_workers up to 16; max_workers is then raised until every batch slot has one)"},
    )

    def stream_limit(self) -> int:
        """The effective max_streams. A RunChunk stream holds a handler thread for its whole chunk:
        unbounded, enough chunks take every thread, and the Abort, GetWorkerStats (heartbeats) and
        LoadWeights calls queue behind them (services.common.streams)."""
        if self.max_streams:
            return self.max_streams
        return default_stream_limit(self.max_workers)

    def sized_for_batch(self) -> WorkerConfig:
        """This config with enough handler threads for max_batch_size concurrent chunks when the
        stream limit is derived (max_streams 0): a GPU engine batching 256 requests must not be
        capped at the 56 streams of the default 64 threads. An explicit max_streams is kept."""
        if self.max_streams or self.stream_limit() >= self.max_batch_size:
            return self
        threads = self.max_workers
        while default_stream_limit(threads) < self.max_batch_size:
            threads += 1
        return dataclasses.replace(self, max_workers=threads)

    def validate(self) -> None:
        super().validate()
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.page_size < 1:
            raise ValueError("page_size: must be >= 1")
        if self.num_kv_pages < 0:
            raise ValueError("num_kv_pages: must be >= 0")
        if self.num_kv_pages == 0 and self.kv_memory_mb < 1:
            raise ValueError("kv_memory_mb: must be >= 1 when num_kv_pages is 0")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size: must be >= 1")
        if self.num_threads < 0:
            raise ValueError("num_threads: must be >= 0")
        if self.policy_version < 0:
            raise ValueError("policy_version: must be >= 0")
        if not 0 <= self.gamma_max <= 64:
            raise ValueError("gamma_max: must be in [0, 64]")
        if self.draft_width < 1:
            raise ValueError("draft_width: must be >= 1")
        if self.multipath_max_batch < 0:
            raise ValueError("multipath_max_batch: must be >= 0")
        if self.spec_min_gain < 0 or self.spec_calibrated_min_gain < 0:
            raise ValueError("spec_min_gain, spec_calibrated_min_gain: must be >= 0")
        if self.spec_pad_cost < 0:
            raise ValueError("spec_pad_cost: must be >= 0")
        if not 0 <= self.spec_explore_budget < 1:
            raise ValueError("spec_explore_budget: must be in [0, 1)")
        if self.spec_guard_steps < 1 or self.spec_guard_backoff < 1:
            raise ValueError("spec_guard_steps, spec_guard_backoff: must be >= 1")
        if self.spec_control_interval < 0:
            raise ValueError("spec_control_interval: must be >= 0")
        if self.spec_step_clock not in ("wall", "thread"):
            raise ValueError(f"spec_step_clock: {self.spec_step_clock!r} is not wall or thread")
        if self.group_ttl_seconds <= 0:
            raise ValueError("group_ttl_seconds: must be > 0")
        if self.draft_mirror_budget_mb < 1:
            raise ValueError("draft_mirror_budget_mb: must be >= 1")
        if self.drain_timeout_seconds <= 0:
            raise ValueError("drain_timeout_seconds: must be > 0")
        check_stream_limit("max_streams", self.max_streams, self.max_workers,
                           "Abort, GetWorkerStats and LoadWeights")
        for i, a in enumerate(self.kv_addresses):
            if ":" not in a:
                raise ValueError(f"kv_addresses[{i}]: {a!r} is not host:port")
        for name in ("scheduler_address", "draft_address", "advertise_address"):
            v = getattr(self, name)
            if v and ":" not in v:
                raise ValueError(f"{name}: {v!r} is not host:port")
