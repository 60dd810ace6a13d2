"""Plain dataclasses of the trainer-facing API (no protobuf or gRPC types leak to callers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of a group. Note the RL default: temperature 1.0 (0 = greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # base seed of the group; each sample derives its own from it
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class PromptGroup:
    """One prompt sampled `group_size` times. `prompt` is text (tokenized by the buffer) or token ids."""

    prompt: str | Sequence[int]
    group_size: int
    max_tokens: int
    prompt_key: str = ""  # stable across iterations (history drafts and length priors); "" = hash
    sampling: Sampling = field(default_factory=Sampling)
    labels: Mapping[str, str] = field(default_factory=dict)  # echoed into every result


@dataclass(frozen=True)
class SubmitResult:
    batch_id: str
    num_requests: int
    already_submitted: bool
    policy_version: int
    # This submission of the batch id (the same for an idempotent re-submit): pass it to
    # iter_results(submission_id=...) so a resumed cursor never reads another submission's results.
    submission_id: int = 0


@dataclass(frozen=True)
class RolloutResult:
    request_id: str
    batch_id: str
    group_index: int
    sample_index: int
    prompt_key: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    policy_version: int
    num_chunks: int
    latency_seconds: float
    labels: dict[str, str]
    text: str
    stats: dict[str, float]
    cursor: int  # pass to iter_results(cursor=...) to resume after this result
    submission_id: int = 0  # ... with iter_results(submission_id=...): the submission it is from


@dataclass(frozen=True)
class RequestStatus:
    request_id: str
    state: str  # "pending" | "running" | "finished" | "cancelled"
    generated_tokens: int
    num_chunks: int
    finish_reason: str


@dataclass(frozen=True)
class BatchStatus:
    batch_id: str
    state: str  # "running" | "completed" | "cancelled"
    num_requests: int
    num_finished: int
    num_cancelled: int
    generated_tokens: int
    policy_version: int
    requests: list[RequestStatus]
    submission_id: int = 0  # the batch id's current submission (SubmitResult.submission_id)
    # With include_requests: "" when every stored request record was read; else the buffer's
    # account of those it could not decode (listed in `requests` as state "unspecified").
    unreadable_requests: str = ""

    @property
    def done(self) -> bool:
        return self.state != "running"


@dataclass(frozen=True)
class WeightsUpdate:
    """update_weights' answer. num_workers: the workers that loaded `version`. 0 means none was
    registered: the version is recorded and in force all the same, but no worker has loaded it yet
    (nothing has checked `source` either); a worker that registers later loads it before it serves,
    and batches wait until one does."""

    version: int
    num_workers: int
    seconds: float


@dataclass(frozen=True)
class CancelOutcome:
    """The buffer's final answer to SeerClient.cancel_submission(batch_id, submission_token).

    kind:
      "cancelled": the batch this submission stored was cancelled; num_cancelled is how many
        responses the cancellation cancelled (the same on a repeat).
      "completed": the batch had completed before the cancel: nothing changed.
      "not_stored": the buffer holds no batch of this submission, and refuses the submission from
        now on (also one still in flight, across a buffer restart too): nothing of it will run.
      "other_submission": the id names another submission's batch (another run's, or one stored
        without a token): left running, untouched.
    """

    batch_id: str
    kind: Literal["cancelled", "completed", "not_stored", "other_submission"]
    num_cancelled: int = 0

    @property
    def cancelled(self) -> bool:
        return self.kind == "cancelled"

    @property
    def description(self) -> str:
        """One line saying what happened to the batch (run_batch's notes and logs use it)."""
        if self.kind == "cancelled":
            return f"cancelled ({self.num_cancelled} unfinished responses)"
        if self.kind == "completed":
            return "nothing to cancel: the batch had completed"
        if self.kind == "not_stored":
            return "nothing to cancel: this submission was not stored, and the buffer refuses it from now on"
        return (f"not cancelled: the batch id names another submission than this one (left running; "
                f"cancel_batch({self.batch_id!r}) cancels it)")


class SeerError(Exception):
    """A call failed; `code` is the gRPC status name (e.g. "INVALID_ARGUMENT"), `message` names the field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[SeerError], tuple[str, str]]:
        # Exception pickles its args (the one formatted string), which __init__ does not take: an
        # error crossing a process boundary (multiprocessing) failed to unpickle.
        return type(self), (self.code, self.message)


class SeerTimeout(SeerError, TimeoutError):
    """A time limit given to the client ran out (code "DEADLINE_EXCEEDED"); also a TimeoutError.

    submission_token: from run_batch, the token its submission carried (the one it generated when
    given none): pass it to run_batch again to collect the same batch with Ctrl-C still cancelling
    it (the batch keeps its first submitter's token). "" elsewhere.

    results: from run_batch and collect, the results received before the time ran out (the batch
    is left running: use them, or collect the rest later); [] elsewhere (iter_results yielded its
    own). The message says how many came, how many are missing where the batch's size is known,
    and for how long no new result came."""

    submission_token: str = ""

    def __init__(self, code: str, message: str, *, results: list[RolloutResult] | None = None) -> None:
        super().__init__(code, message)
        self.results: list[RolloutResult] = [] if results is None else results

    def __reduce__(self) -> tuple[Any, ...]:  # type: ignore[override]
        # SeerError's (code, message) drops the attributes (results, submission_token, notes): they
        # travel as the instance's state.
        return type(self), (self.code, self.message), dict(self.__dict__)


class BatchCancelled(SeerError):
    """code "ABORTED": the batch whose results were awaited was cancelled by someone else (another
    process's cancel_batch, `seer` on the command line, an operator) before every response
    finished; its results stream ended without the rest, which will never come. Raised by
    iter_results after it yielded every result it got, and so by collect and run_batch (whose own
    cancels, cancel_on_interrupt / cancel_on_error, raise the error that caused them instead).

    results: the results collect or run_batch received before it (iter_results yielded its own:
    [] there). num_finished / num_requests: the buffer's count of the batch's finished responses
    and its size."""

    def __init__(self, message: str, *, batch_id: str = "", num_finished: int = 0, num_requests: int = 0,
                 results: list[RolloutResult] | None = None) -> None:
        super().__init__("ABORTED", message)
        self.batch_id = batch_id
        self.num_finished = num_finished
        self.num_requests = num_requests
        self.results: list[RolloutResult] = [] if results is None else results

    def __reduce__(self) -> tuple[Any, ...]:  # type: ignore[override]
        # SeerError's (code, message) does not fit this __init__; the attributes (notes too) travel
        # as the instance's state.
        return type(self), (self.message,), dict(self.__dict__)
