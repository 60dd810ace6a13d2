"""Buffer service configuration (flags, SEER_BUFFER_* env, or --config JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.buffer.events import default_watch_queue
from services.buffer.records import HISTORY_ITERATION_RESPONSES
from services.common.config import ServiceConfig
from services.common.streams import check_stream_limit, default_stream_limit

# The embedded SmolLM2 values, used when no model directory is configured.
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_MAX_CONTEXT = 8192
# StreamResults reads a batch's results a page at a time and holds the page while it sends it: the
# page is bounded by its stored bytes too (core.read_results), since a result of a 64K-token
# response is ~0.5 MB encoded (token ids, logprobs, text) and 256 of them were ~128 MB a stream.
DEFAULT_RESULTS_PAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class BufferConfig(ServiceConfig):
    port: int = field(default=50051, metadata={"help": "gRPC port (0 = pick a free one)"})
    data_dir: str = field(default="./data/buffer", metadata={"help": "RocksDB directory (persistent volume)"})
    model_dir: str = field(
        default="auto",
        metadata={"help": "model directory (tokenizer.json, config.json); 'auto' = the embedded model's cache "
                          "directory when it exists; '' = none (prompt_text refused, no result text)"},
    )
    vocab_size: int = field(default=0, metadata={"help": "vocabulary size (0 = model config.json, else 49152)"})
    max_context: int = field(
        default=0, metadata={"help": "max prompt + max_tokens (0 = model max_position_embeddings, else 8192)"}
    )
    max_requests_per_batch: int = field(default=65536, metadata={"help": "bound on sum of group sizes"})
    history_iterations: int = field(
        default=2, metadata={"help": "history iterations (policy versions) kept per prompt key"})
    history_iteration_responses: int = field(
        default=HISTORY_ITERATION_RESPONSES,
        metadata={"help": "responses one history iteration (a prompt key's policy version) keeps at most, the "
                          "oldest going first; a completing batch's own responses to the key are kept whole"},
    )
    retain_batches: int = field(
        default=1024,
        metadata={"help": "finished (completed/cancelled) batches kept with their results; older ones are "
                          "deleted, history stays (0 = keep all)"},
    )
    scheduler_address: str = field(
        default="", metadata={"help": "SchedulerService host:port for UpdateWeights ('' = record only)"}
    )
    switch_timeout_seconds: float = field(default=600.0, metadata={"help": "deadline of SwitchWeights"})
    max_streams: int = field(
        default=0,
        metadata={"help": "open StreamResults + WatchWork streams at most; more are RESOURCE_EXHAUSTED "
                          "(0 = max_workers - 8, or half of max_workers up to 16)"},
    )
    watch_queue_events: int = field(
        default=0,
        metadata={"help": "events queued for one WatchWork stream at most; a watcher further behind is dropped "
                          "(RESOURCE_EXHAUSTED; it watches again for a fresh snapshot) "
                          "(0 = 4 x max_requests_per_batch; at least max_requests_per_batch)"},
    )
    results_page_bytes: int = field(
        default=DEFAULT_RESULTS_PAGE_BYTES,
        metadata={"help": "stored bytes of results one StreamResults stream reads and holds at a time (a page of "
                          "at most 256 results; a single larger result still goes alone)"},
    )
    sync_writes: bool = field(
        default=False,
        metadata={"help": "fsync every commit (survives power loss; process crashes are safe without it)"},
    )
    port_file: str = field(default="", metadata={"help": "write the bound port here once serving"})

    def validate(self) -> None:
        super().validate()
        if not self.data_dir:
            raise ValueError("data_dir: required")
        if self.vocab_size < 0:
            raise ValueError("vocab_size: must be >= 0")
        if self.max_context < 0:
            raise ValueError("max_context: must be >= 0")
        if self.max_requests_per_batch < 1:
            raise ValueError("max_requests_per_batch: must be >= 1")
        if self.retain_batches < 0:
            raise ValueError("retain_batches: must be >= 0")
        if self.history_iterations < 1:
            raise ValueError("history_iterations: must be >= 1")
        if self.history_iteration_responses < 1:
            raise ValueError(f"history_iteration_responses: must be >= 1, got {self.history_iteration_responses}")
        if self.switch_timeout_seconds <= 0:
            raise ValueError("switch_timeout_seconds: must be > 0")
        check_stream_limit("max_streams", self.max_streams, self.max_workers, "unary calls (CommitChunk)")
        if self.watch_queue_events < 0:
            raise ValueError(f"watch_queue_events: must be >= 0 (0 = 4 x max_requests_per_batch), "
                             f"got {self.watch_queue_events}")
        if 0 < self.watch_queue_events < self.max_requests_per_batch:
            # One SubmitBatch publishes every request of the batch at once: a bound below the largest
            # batch would drop every watcher at each such batch, and again after each reconnect.
            raise ValueError(f"watch_queue_events: must be >= max_requests_per_batch "
                             f"({self.max_requests_per_batch}), got {self.watch_queue_events}")
        if self.results_page_bytes <= 0:
            raise ValueError(f"results_page_bytes: must be > 0, got {self.results_page_bytes}")

    def stream_limit(self) -> int:
        """The effective max_streams. Each open stream holds one handler thread while it waits, so
        the limit leaves threads free for the unary calls that produce what the streams wait for
        (CommitChunk, SubmitBatch): without one, enough waiting streams deadlock the buffer."""
        if self.max_streams:
            return self.max_streams
        return default_stream_limit(self.max_workers)

    def watch_queue_limit(self) -> int:
        """The effective watch_queue_events. Each WatchWork stream's queue is bounded so that a
        watcher that stops reading cannot grow the buffer's memory without bound (events.py); the
        default is events.default_watch_queue: room for 4 of the largest batches."""
        return self.watch_queue_events or default_watch_queue(self.max_requests_per_batch)
