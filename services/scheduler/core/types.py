"""The values exchanged between the scheduler core and its driver (service or simulator)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class RequestInfo:
    """One response to generate (one sample of a group)."""

    request_id: str
    group_id: str
    prompt_key: str
    sample_index: int
    group_size: int
    prompt_len: int
    max_tokens: int
    # Tokens already generated (a request resumed after a scheduler restart).
    generated: int = 0
    # The length the response will have; only the oracle policy (simulator) reads it.
    true_length: int | None = None
    # Which submission of its batch this request belongs to (the buffer's submit_seq). A batch id
    # used again after retention deleted the batch brings the same request ids back as new
    # requests; without this they would look like re-deliveries of the settled ones. It is also
    # the submission order anti-starvation counts newer work by (starvation.Starvation), compared
    # numerically: it must increase with each submission, as the buffer's submit_seq does.
    incarnation: int = 0

    def validate(self) -> None:
        if not self.request_id:
            raise InvalidArgument("must not be empty", field="request_id")
        if not self.group_id:
            raise InvalidArgument("must not be empty", field="group_id")
        if self.group_size < 1:
            raise InvalidArgument(f"must be >= 1, got {self.group_size}", field="group_size")
        if not 0 <= self.sample_index < self.group_size:
            raise InvalidArgument(f"must be in [0, {self.group_size}), got {self.sample_index}", field="sample_index")
        if self.prompt_len < 1:
            raise InvalidArgument(f"must be >= 1, got {self.prompt_len}", field="prompt_len")
        if self.max_tokens < 1:
            raise InvalidArgument(f"must be >= 1, got {self.max_tokens}", field="max_tokens")
        if not 0 <= self.generated <= self.max_tokens:
            raise InvalidArgument(f"must be in [0, max_tokens], got {self.generated}", field="generated")
        if self.true_length is not None and not 0 <= self.true_length <= self.max_tokens:
            raise InvalidArgument(f"must be in [0, max_tokens], got {self.true_length}", field="true_length")


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    total_pages: int
    page_size: int
    max_batch_size: int
    # The longest context (prompt + output + chunk) the worker's engine accepts; 0 = unknown (no
    # limit assumed). A chunk past it is refused by the worker (INVALID_ARGUMENT), so placement
    # skips such workers.
    max_context: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.total_pages * self.page_size

    def room_tokens(self) -> int:
        """The longest context + chunk this worker can ever run: its whole KV, capped by its
        max_context when it has one."""
        return min(self.kv_tokens, self.max_context) if self.max_context else self.kv_tokens

    def validate(self) -> None:
        if not self.worker_id:
            raise InvalidArgument("must not be empty", field="worker_id")
        if self.total_pages < 1:
            raise InvalidArgument(f"must be >= 1, got {self.total_pages}", field="total_pages")
        if self.page_size < 1:
            raise InvalidArgument(f"must be >= 1, got {self.page_size}", field="page_size")
        if self.max_batch_size < 1:
            raise InvalidArgument(f"must be >= 1, got {self.max_batch_size}", field="max_batch_size")
        if self.max_context < 0:
            raise InvalidArgument(f"must be >= 0 (0 = unknown), got {self.max_context}", field="max_context")


@dataclass(frozen=True)
class Dispatch:
    """Run one chunk of `request_id` on `worker_id`."""

    request_id: str
    worker_id: str
    max_new_tokens: int
    # A group's probe request (Seer Algorithm 2); workers may give it more speculation budget.
    is_probe: bool
    # The worker should pull the request's KV prefix from the KV store (the request moved and the
    # prefix gap exceeds the margin) instead of re-prefilling it from tokens.
    fetch_kv: bool


@dataclass(frozen=True)
class Unschedulable:
    """A request no worker can ever hold: its context plus its next chunk exceeds, on every worker
    registered so far (now or before), the whole KV or the max_context. The core drops it; the
    driver fails it (it would wait forever, or be refused by the worker on every attempt)."""

    request_id: str
    need_tokens: int  # context + next chunk
    largest_kv_tokens: int  # the largest worker's whole KV seen (total_pages * page_size)
    # The largest max_context any worker declared (0: none declared one).
    largest_context_tokens: int = 0
    # The most any worker seen could hold (its KV capped by its max_context): need_tokens is over it.
    largest_room_tokens: int = 0

    @property
    def reason(self) -> str:
        """Which limit it is past, said."""
        if self.need_tokens > self.largest_kv_tokens:
            return f"context + next chunk ({self.need_tokens} tokens) exceeds the KV of every worker"
        return (
            f"context + next chunk ({self.need_tokens} tokens) exceeds what every worker holds"
            f" (KV capped by max_context: at most {self.largest_room_tokens} tokens)"
        )
