"""What the worker core needs from its collaborators, as Protocols (so the core never imports
grpc and tests can pass small fakes): the draft client (services/worker/draft_client.py), the
speculation planner (services/worker/adaptive.py) and the KV pool client (services/worker/kv_client.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from services.worker.engine import Draft, KVLayout, KVPages


class DraftSource(Protocol):
    def register_attempt(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int, ttl_seconds: int,
        *, request_id: str = "", epoch: int = 0, submit_seq: int = 0, policy_version: int | None = None,
    ) -> None:
        """A chunk of `request_id` at dispatch `epoch` (0 = unknown) of the batch submission
        `submit_seq` (RunChunkRequest.submit_seq; 0 = unknown) starts in the group: registers it
        (idempotent; local, the client registers on the server in the background). Called for
        every chunk: the submission (or, without it, the epoch) tells the draft server a new run
        under a reused group id from the completed old one. group_size as sent (0 = unknown: the
        group never completes on its own). policy_version: the chunk's (RunChunkRequest.policy_version;
        None = unknown), the group's history iteration on the draft server."""

    def append(
        self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int], finished: bool = False,
        *, epoch: int = 0, submit_seq: int = 0,
    ) -> None:
        """Tokens of the attempt named by (epoch, submit_seq) (0 = not named): an abandoned
        attempt's late tokens are dropped, never filed as its successor's."""

    def propose(
        self, group_id: str, request_id: str, context: Sequence[int], max_len: int, width: int = 1
    ) -> Draft | None: ...

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int],
               epoch: int = 0, *, submit_seq: int = 0) -> None:
        """A chunk starts: the request's response becomes exactly its committed output (tokens of a
        failed attempt beyond it are dropped; they must never be drafted from)."""

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        """The chunk of the attempt (epoch, submit_seq) ended (done or failed). Two attempts of a
        request may overlap (SGLang: an aborted rid still in the batch) and end in any order."""

    def release_group(self, group_id: str) -> None: ...

    def has_group(self, group_id: str) -> bool:
        """Whether a mirror of the group is kept (the client may release one on its own)."""

    def close(self) -> None: ...


class SpecPlanner(Protocol):
    """Sizes each step's drafts (services.worker.adaptive). Per step the worker calls plan(), then
    observe() with the verified draft positions (only when drafts were verified), then, if the
    planner has it, observe_step(batch, tokens, seconds) for a decode step (TimedSpecPlanner)."""

    def observe(self, proposed_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> None: ...

    def plan(self, requests: Sequence[tuple[str, bool]]) -> Mapping[str, int]: ...


class TimedSpecPlanner(SpecPlanner, Protocol):
    """A planner that closes its cost loop on measured step times (optional for a SpecPlanner)."""

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode step of `batch` requests (no prefill) emitted `tokens` tokens in `seconds`."""


@dataclass(frozen=True)
class PutResult:
    """What one put_pages / offload_async did with the pages it was given.

    first_unstored is what lets the worker resend exactly what is missing: the index (into the
    pages given) of the first page that is not in the store after this call (a replica that failed
    or stored less than it was sent), None when every page is stored. A caller that marked the pages
    as offloaded must restart from there, or the pages after a failed replica's first one would
    never be sent again, and every later fetch would stop at that gap."""

    stored: int = 0  # pages new to the store
    claimed: int = 0  # pages already stored: only ownership sent
    first_unstored: int | None = None
    dropped: bool = False  # offload_async only: the client's queue was full, nothing was sent


class KVPool(Protocol):
    def offload_async(self, pages: KVPages, request_id: str) -> Future[PutResult]: ...

    def fetch_prefix(
        self, token_ids: Sequence[int], model_version: str, layout: KVLayout, *, min_tokens: int = 0,
        cancelled: Callable[[], bool] | None = None,
    ) -> KVPages | None:
        """The longest stored prefix of token_ids beyond min_tokens, or None. `cancelled`: polled
        while the fetch runs; once true the fetch stops its reads and returns None (the chunk's
        caller went away)."""

    def release(self, model_version: str, request_id: str) -> Any: ...

    def close(self) -> None: ...
