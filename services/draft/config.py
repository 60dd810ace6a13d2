"""Draft service configuration (flags, SEER_DRAFT_* env, or --config JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ServiceConfig
from services.draft.history import HISTORY_ITERATION_RESPONSES
from services.draft.index import DEFAULT_LEVELS
from services.draft.store import StoreLimits


@dataclass(frozen=True)
class DraftConfig(ServiceConfig):
    port: int = field(default=50053, metadata={"help": "gRPC port (0 = pick a free one)"})
    memory_budget_mb: int = field(
        default=2048, metadata={"help": "bound on index + log + history memory (and ~1.4 KB per group); oldest history "
                                    "is evicted first"}
    )
    history_iterations: int = field(
        default=2, metadata={"help": "earlier iterations (policy versions) kept per prompt key"}
    )
    history_iteration_responses: int = field(
        default=HISTORY_ITERATION_RESPONSES,
        metadata={"help": "responses one iteration of a prompt key keeps at most (its groups merge into it; the "
                          "oldest go first; one group's are kept whole)"},
    )
    default_ttl_seconds: int = field(default=3600, metadata={"help": "group TTL when RegisterGroup gives 0"})
    max_ttl_seconds: int = field(default=7 * 86400, metadata={"help": "largest TTL RegisterGroup may ask for"})
    max_append_tokens: int = field(default=65536, metadata={"help": "tokens per Append message"})
    max_response_tokens: int = field(default=1 << 20, metadata={"help": "tokens per response"})
    levels: tuple[int, ...] = field(
        default=DEFAULT_LEVELS, metadata={"help": "n-gram lengths of the suffix index (comma-separated)"}
    )
    port_file: str = field(default="", metadata={"help": "write the bound port to this file"})
    buffer_address: str = field(
        default="",
        metadata={"help": "buffer host:port: refill a prompt key's history from it when a group registers without "
                          "any (after a restart of this server); empty = off"},
    )
    history_refill_retry_seconds: float = field(
        default=60.0, metadata={"help": "ask the buffer again for a key with no history after this long"}
    )

    def validate(self) -> None:
        super().validate()
        if self.memory_budget_mb < 1:
            raise ValueError("memory_budget_mb: must be >= 1")
        if self.history_iterations < 1:
            raise ValueError("history_iterations: must be >= 1")
        if self.history_iteration_responses < 1:
            raise ValueError("history_iteration_responses: must be >= 1")
        if not 1 <= self.default_ttl_seconds <= self.max_ttl_seconds:
            raise ValueError("default_ttl_seconds: must be in [1, max_ttl_seconds]")
        if self.max_append_tokens < 1:
            raise ValueError("max_append_tokens: must be >= 1")
        if self.max_response_tokens < 1:
            raise ValueError("max_response_tokens: must be >= 1")
        if self.history_refill_retry_seconds < 0:
            raise ValueError("history_refill_retry_seconds: must be >= 0")
        if not self.levels or any(k < 1 or k > 64 for k in self.levels):
            raise ValueError("levels: n-gram lengths must be in [1, 64]")

    def limits(self) -> StoreLimits:
        return StoreLimits(
            memory_budget_bytes=self.memory_budget_mb << 20,
            history_iterations=self.history_iterations,
            history_iteration_responses=self.history_iteration_responses,
            default_ttl_seconds=self.default_ttl_seconds,
            max_ttl_seconds=self.max_ttl_seconds,
            max_append_tokens=self.max_append_tokens,
            max_response_tokens=self.max_response_tokens,
            levels=tuple(self.levels),
        )
