"""SeerClient: the typed trainer facade over seer.v1.RolloutService.

Every call that is safe to repeat (SubmitBatch is idempotent by batch id; reads; cancel) is retried
on UNAVAILABLE with backoff, and iter_results resumes from its cursor after a dropped stream or a
buffer restart, so a trainer sees each result exactly once.
"""

from __future__ import annotations

import logging
import operator
import re
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from seer.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from seer_client.types import (
    BatchCancelled,
    BatchStatus,
    CancelOutcome,
    PromptGroup,
    RequestStatus,
    RolloutResult,
    Sampling,
    SeerError,
    SeerTimeout,
    SubmitResult,
    WeightsUpdate,
)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted buffer is back within a second or two; gRPC's default reconnect backoff (1 s
    # growing to 2 min) would keep failing calls fast with UNAVAILABLE long after it is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# run_batch's cancel after a Ctrl-C or a failure: a user who pressed it should not wait the client's
# full retry_seconds for a buffer that is down (a second Ctrl-C ends the wait too), nor the error
# that ended the run be held back that long.
_INTERRUPT_CANCEL_SECONDS = 5.0

log = logging.getLogger("seer_client")
# The buffer refuses submissions during a weight switch with UNAVAILABLE and this retry reason.
_SWITCHING = "weight-switch"
# UpdateWeights waits for the whole switch (the buffer's switch_timeout_seconds, 600 s by default,
# for the scheduler to drain chunks and the workers to load the weights), then records the version.
# A shorter deadline reports a failure for a switch that goes on and succeeds.
UPDATE_WEIGHTS_TIMEOUT = 660.0
_FINISH = {0: "unspecified", 1: "stop", 2: "length", 3: "aborted", 4: "chunk"}
_REQUEST_STATE = {0: "unspecified", 1: "pending", 2: "running", 3: "finished", 4: "cancelled"}
_BATCH_STATE = {0: "unspecified", 1: "running", 2: "completed", 3: "cancelled"}


# Ranges of the proto fields the client fills (protobuf would raise a bare ValueError for these).
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_UINT64 = (0, 2**64 - 1)
# services/common/sampling_limits.MIN_TEMPERATURE (this package does not depend on services): the
# buffer refuses 0 < temperature < this, but it only sees the float32 the proto carries, and a
# positive temperature below ~1.4e-45 rounds to 0.0 there, which the buffer runs as greedy.
_MIN_TEMPERATURE = 1e-5


def _keepalive(every: float, timeout: float) -> list[tuple[str, int]]:
    """Pings every `every` seconds on a connection, dropped when one is not acknowledged in `timeout`.

    The only way a client learns that a quiet connection died without a FIN or RST (a partition, a
    killed node, a lost NAT entry): a result stream sends nothing after its request, so TCP has no
    unacknowledged bytes to time out on. gRPC's defaults fall short twice: it stops pinging after two
    pings without data (max_pings_without_data), so a stream quiet for a minute, then cut, waited
    forever; and it times an unacknowledged ping out by ping_timeout_ms (default a minute), not by
    keepalive_timeout_ms alone. tests/client/test_client_keepalive.py fails without either option.
    The buffer's server accepts pings this often (services/common/server.py)."""
    return [("grpc.keepalive_time_ms", int(every * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0)]


def _positive(value: object, field: str) -> float:
    v = _float(value, field)
    if not v > 0 or v == float("inf"):
        raise _invalid(field, f"must be a positive number of seconds, got {value!r}")
    return v


def _seconds(value: object, field: str, *, allow_zero: bool) -> float:
    """A number of seconds for a retry window or a deadline. NaN is refused: every comparison with it
    is False, so a NaN retry_seconds retried a dead address forever and a NaN timeout timed out at
    once ("after nans"). inf is accepted (no bound; see _deadline)."""
    v = _float(value, field)
    if v != v or v < 0 or (v == 0 and not allow_zero):
        what = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise _invalid(field, f"must be {what}, got {value!r}")
    return v


# Longer than this is no deadline: gRPC's deadline arithmetic overflows from about 1e10 s on, and
# the call then fails at once (DEADLINE_EXCEEDED).
_NO_DEADLINE_S = 1e8


def _deadline(seconds: float | None) -> float | None:
    """A gRPC timeout: None, inf or more than _NO_DEADLINE_S (about 3 years) is None (no deadline)."""
    return None if seconds is None or seconds > _NO_DEADLINE_S else seconds


def _bool(value: object, field: str) -> bool:
    # protobuf would take 1 or "" silently as well, or raise a bare TypeError for "yes". numpy's
    # bool_ is a bool (protobuf took it).
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, bool):
        raise _invalid(field, f"must be a bool, got {value!r}")
    return value


def _retry_reason(e: grpc.RpcError) -> str:
    """services.common.grpcutil RETRY_REASON_KEY from the error's trailing metadata ("" if none)."""
    trailing = getattr(e, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == "seer-retry-reason":
            return str(value)
    return ""


def _error(e: grpc.RpcError) -> SeerError:
    # A call past its deadline (the client's `timeout`, update_weights' `timeout`) is a SeerTimeout,
    # also a TimeoutError, as iter_results' is: a trainer catching TimeoutError around any call
    # missed these plain SeerErrors. Still a SeerError, so existing handlers keep working.
    cls = SeerTimeout if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else SeerError
    return cls(e.code().name, e.details() or "")


def _invalid(field: str, message: str) -> SeerError:
    # The buffer's own format ("groups[0].group_size: must be ..."), so a trainer handles both alike.
    return SeerError("INVALID_ARGUMENT", f"{field}: {message}")


def _int(value: object, field: str, bounds: tuple[int, int]) -> int:
    """An integer for a proto int field. operator.index, not int(): it accepts Python, numpy and
    torch integers but refuses floats (int(1.9) would silently send 1). bool is refused: it is an
    int subclass, and a True token id or group size is a mistake, not a 1."""
    if isinstance(value, bool):
        raise _invalid(field, f"must be an integer, got {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise _invalid(field, f"must be an integer, got {type(value).__name__} {value!r}") from None
    lo, hi = bounds
    if not lo <= n <= hi:
        raise _invalid(field, f"must be in [{lo}, {hi}], got {n}")
    return n


def _ints(values: object, field: str, bounds: tuple[int, int]) -> list[int]:
    # str/bytes are iterables of characters or byte values, never token ids.
    if isinstance(values, str | bytes | bytearray | memoryview):
        raise _invalid(field, f"must be a sequence of integer token ids, got {type(values).__name__}")
    try:
        # numpy arrays and torch tensors: tolist() gives Python numbers at C speed (iterating a
        # tensor makes one 0-d tensor per token); a float array gives floats, refused below.
        items = values.tolist() if hasattr(values, "tolist") else list(values)  # type: ignore[call-overload]
    except TypeError:
        items = None
    if not isinstance(items, list):
        raise _invalid(field, f"must be a sequence of integer token ids, got {type(values).__name__}")
    return [_int(t, f"{field}[{j}]", bounds) for j, t in enumerate(items)]


def _float(value: object, field: str) -> float:
    # float("1.0") would accept a string; the proto field is a number.
    if isinstance(value, bool | str | bytes):
        raise _invalid(field, f"must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _invalid(field, f"must be a number, got {type(value).__name__} {value!r}") from None


def _results_timeout(timeout: object) -> float | None:
    """A results wait (iter_results, collect, run_batch): None = no bound. timeout <= 0 stays a
    deadline already passed (SeerTimeout at the first next()); NaN is refused and inf is no bound
    (both timed out at once before)."""
    bound = None if timeout is None else _float(timeout, "timeout")
    if bound is not None and bound != bound:
        raise _invalid("timeout", f"must be a number of seconds or None, got {timeout!r}")
    return None if bound == float("inf") else bound


def _token(value: object) -> str:
    token = _str(value, "submission_token")
    if not token:
        # Sent empty, CancelBatch names no submission and cancels whatever batch the id names.
        raise _invalid("submission_token", "must not be empty (cancel_batch(batch_id) cancels whatever the id names)")
    return token


def _str(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise _invalid(field, f"must be a str, got {type(value).__name__} {value!r}")
    return value


def _sampling_pb(s: Sampling, field: str) -> common_pb2.SamplingParams:
    if not isinstance(s, Sampling):
        raise _invalid(field, f"must be a Sampling, got {type(s).__name__}")
    temperature = _float(s.temperature, f"{field}.temperature")
    # Range and finiteness are the buffer's to check; only what it cannot see is checked here: a
    # positive temperature that float32 turns into 0.0 (greedy) would be run greedy, silently.
    if 0.0 < temperature < _MIN_TEMPERATURE:
        raise _invalid(f"{field}.temperature", f"must be 0 (greedy) or >= {_MIN_TEMPERATURE}, got {temperature}")
    if not isinstance(s.ignore_eos, bool):
        raise _invalid(f"{field}.ignore_eos", f"must be a bool, got {s.ignore_eos!r}")
    # A value beyond float32 becomes inf in the proto, which the buffer refuses naming the field.
    msg = common_pb2.SamplingParams(temperature=temperature, top_p=_float(s.top_p, f"{field}.top_p"),
                                    top_k=_int(s.top_k, f"{field}.top_k", _INT32),
                                    stop_token_ids=_ints(s.stop_token_ids, f"{field}.stop_token_ids", _INT32),
                                    ignore_eos=s.ignore_eos)
    if s.seed is not None:
        msg.seed = _int(s.seed, f"{field}.seed", _UINT64)
    return msg


def _labels(labels: object, field: str) -> dict[str, str]:
    if not isinstance(labels, Mapping):
        raise _invalid(field, f"must be a mapping of str to str, got {type(labels).__name__}")
    out: dict[str, str] = {}
    for k, v in labels.items():
        # Not str(v): a label is echoed back as a string, and 5 coming back as "5" is a surprise
        # the trainer should decide on.
        out[_str(k, f"{field} key")] = _str(v, f"{field}[{k!r}]")
    return out


def _groups_pb(groups: object) -> list[rollout_pb2.PromptGroup]:
    # A single PromptGroup (a frozen dataclass, not iterable) raised a bare TypeError; a str or a
    # mapping would be iterated as characters or keys, each then refused as "groups[0]: must be a
    # PromptGroup", which hides the mistake.
    if isinstance(groups, PromptGroup | str | bytes | bytearray | Mapping) or not isinstance(groups, Iterable):
        hint = " (wrap a single group in a list: [group])" if isinstance(groups, PromptGroup) else ""
        raise _invalid("groups", f"must be a sequence of PromptGroup, got {type(groups).__name__}{hint}")
    return [_group_pb(i, g) for i, g in enumerate(groups)]


# The buffer's errors name SubmitBatchRequest's fields; a PromptGroup's one `prompt` is either of the
# proto's two (_group_pb fills prompt_text for a str, prompt_token_ids otherwise). Every other field
# a buffer error can name (group_size, max_tokens, prompt_key, sampling.*, labels, batch_id,
# seed_scope, submission_token, groups) has the client's name already.
_PROTO_PROMPT = re.compile(r"(groups\[\d+\])\.(?:prompt_token_ids|prompt_text)(?=[\[:])")


def _client_field_names(err: SeerError) -> SeerError:
    """A SubmitBatch error naming a proto prompt field, renamed to the client's `prompt` (the code,
    the class and the rest of the message kept): "groups[0].prompt_token_ids[3]: token id ..." is
    "groups[0].prompt[3]: token id ...", as the client's own checks name it."""
    m = _PROTO_PROMPT.match(err.message)
    if m is None:
        return err
    rest = err.message[m.end():].replace("send prompt_token_ids instead", "pass the prompt as token ids instead")
    renamed = type(err)(err.code, f"{m.group(1)}.prompt{rest}")
    renamed.__dict__.update({k: v for k, v in err.__dict__.items() if k not in ("code", "message")})
    return renamed


def _group_pb(i: int, g: PromptGroup) -> rollout_pb2.PromptGroup:
    f = f"groups[{i}]"
    if not isinstance(g, PromptGroup):
        raise _invalid(f, f"must be a PromptGroup, got {type(g).__name__}")
    msg = rollout_pb2.PromptGroup(prompt_key=_str(g.prompt_key, f"{f}.prompt_key"),
                                  group_size=_int(g.group_size, f"{f}.group_size", _INT32),
                                  max_tokens=_int(g.max_tokens, f"{f}.max_tokens", _INT32),
                                  sampling=_sampling_pb(g.sampling, f"{f}.sampling"),
                                  labels=_labels(g.labels, f"{f}.labels"))
    if isinstance(g.prompt, str):
        if not g.prompt:
            # Sent, it reached the buffer as no prompt at all, refused in the proto's terms ("empty
            # prompt: give prompt_token_ids or prompt_text").
            raise _invalid(f"{f}.prompt", "must not be empty (text, or a sequence of token ids)")
        msg.prompt_text = g.prompt
    else:
        ids = _ints(g.prompt, f"{f}.prompt", _INT32)
        if not ids:
            raise _invalid(f"{f}.prompt", "must not be empty (text, or a sequence of token ids)")
        msg.prompt_token_ids.extend(ids)
    return msg


def _result(resp: rollout_pb2.StreamResultsResponse) -> RolloutResult:
    r = resp.result
    s = r.stats
    return RolloutResult(
        request_id=r.request_id, batch_id=r.batch_id, group_index=r.group_index, sample_index=r.sample_index,
        prompt_key=r.prompt_key, token_ids=list(r.token_ids), logprobs=list(r.logprobs),
        finish_reason=_FINISH.get(r.finish_reason, str(r.finish_reason)), policy_version=r.policy_version,
        num_chunks=r.num_chunks, latency_seconds=r.latency_seconds, labels=dict(r.labels), text=r.text,
        stats={f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}, cursor=int(resp.cursor),
        submission_id=int(resp.submission_id),
    )


class _ResultsLeftOut(SeerError):
    """RESOURCE_EXHAUSTED (results over the buffer's message limit) or DATA_LOSS (stored results it
    cannot decode) naming results the buffer left out of the stream, raised once the batch is done
    and every other result was yielded: run_batch has nothing left to cancel."""


# Trailing metadata the buffer puts on StreamResults' end when it left results out (rollout.proto
# StreamResults; services/buffer/server.py RESULTS_LEFT_OUT_KEY): that end is the batch's, not a
# failed stream's. Its value: how many this stream left out; beside it, the first of their cursors
# (comma-separated), which name the last result of a batch too: no later message's cursor gap does.
_RESULTS_LEFT_OUT_KEY = "seer-results-left-out"
_RESULTS_LEFT_OUT_CURSORS_KEY = "seer-results-left-out-cursors"


@dataclass(frozen=True)
class _LeftOutMark:
    """The buffer's left-out end of one stream: `count` results left out by it, `cursors` the ones
    it named (all of them, or the first within its metadata bound; none from a buffer before it
    named them)."""

    count: int
    cursors: tuple[int, ...]


def _left_out_mark(err: grpc.RpcError) -> _LeftOutMark | None:
    """The buffer's mark on a results stream's error when it is the end naming left-out results
    (its trailing metadata says so), else None; also None for an error without trailing metadata
    (raised by the channel itself). A malformed value counts as the mark without numbers."""
    trailing = getattr(err, "trailing_metadata", None)
    if trailing is None:
        return None
    try:
        pairs = dict(trailing() or ())
    except Exception:  # an error raised before the call had a status has none to read
        return None
    if _RESULTS_LEFT_OUT_KEY not in pairs:
        return None
    count_text = pairs[_RESULTS_LEFT_OUT_KEY]
    count = int(count_text) if isinstance(count_text, str) and count_text.isdigit() else 0
    cursors_text = pairs.get(_RESULTS_LEFT_OUT_CURSORS_KEY, "")
    parts = cursors_text.split(",") if isinstance(cursors_text, str) and cursors_text else []
    cursors = tuple(int(c) for c in parts if c.isdigit())
    return _LeftOutMark(max(count, len(cursors)), cursors)


def _left_out_words(err: grpc.RpcError) -> bool:
    """Whether an unmarked end is the left-out end of a buffer before the mark, by its words (every
    version that leaves results out says "N result(s) of batch ... were left out of the stream
    (every other result was sent): request 'b/0/1' (cursor 1) ..."; its stream limit's refusal says
    "refused: N streams are open"). Without it, such an end that came before the stream's headers
    (a buffer before those too, or one racing _accepted's check on a stream resumed at the last
    cursor) was taken for the stream limit and retried until retry_seconds ran out, and DATA_LOSS
    for a failed stream (run_batch "cancelled" the complete batch)."""
    code = err.code()
    details = err.details() or ""
    return (code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS)
            and "were left out of the stream" in details)


def _submission_answer(batch_id: str, err: SeerError) -> CancelOutcome | None:
    """The buffer's final answer about a submission in a CancelBatch error naming submission_token
    (rollout.proto CancelBatchRequest.submission_token), None for any other error. The one place
    that reads it: cancel_submission, and through it run_batch and `seer rollout`."""
    if not err.message.startswith("submission_token:"):
        return None
    if err.code == "NOT_FOUND":  # none stored; the buffer refuses the token from now on
        return CancelOutcome(batch_id, "not_stored")
    if err.code == "FAILED_PRECONDITION":  # the id names another submission, left untouched
        return CancelOutcome(batch_id, "other_submission")
    return None  # INVALID_ARGUMENT (a malformed token) and the like: a plain failure


def _left_out_message(batch_id: str, cursors: Sequence[int], total: int = 0) -> str:
    """total: how many were left out in all when `cursors` does not name every one (the buffer names
    only the first ones in its trailing metadata)."""
    total = max(total, len(cursors))
    shown = cursors[:20]
    named = ", ".join(str(c) for c in shown) + (f" and {total - len(shown)} more" if total > len(shown) else "")
    return (f"batch {batch_id!r}: {total} result(s) were left out of the stream by the buffer (over its "
            f"message size limit, or stored results it cannot decode: its log names each; every other result was "
            f"delivered): cursor(s) {named}")


def _accepted(stream: Any) -> bool:
    """Whether the buffer accepted a result stream: it sends headers at once (a refused or failed
    call ends without them). A traced channel's plain generator cannot tell: False."""
    initial_metadata = getattr(stream, "initial_metadata", None)
    if initial_metadata is None:
        return False
    initial_metadata()  # blocks until headers arrive or the call ends
    return not bool(stream.done())


class SeerClient:
    """`with SeerClient("localhost:50051") as c: c.submit_batch(...); for r in c.iter_results(...)`."""

    def __init__(self, address: str, *, retry_seconds: float = 60.0, timeout: float | None = 60.0,
                 keepalive_seconds: float = 30.0, keepalive_timeout_seconds: float = 10.0,
                 channel: grpc.Channel | None = None) -> None:
        self.address = address
        # Checked here, naming the argument: the retry loops compare against them, and a NaN or a
        # string only showed at the first failure (a NaN window retried a dead address forever).
        self.retry_seconds = _seconds(retry_seconds, "retry_seconds", allow_zero=True)
        # None: no deadline per call (accepted before these checks), as inf.
        self.timeout = float("inf") if timeout is None else _seconds(timeout, "timeout", allow_zero=False)
        self._channel = channel or grpc.insecure_channel(
            address, options=_OPTIONS + _keepalive(_positive(keepalive_seconds, "keepalive_seconds"),
                                                   _positive(keepalive_timeout_seconds, "keepalive_timeout_seconds")))
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    def __enter__(self) -> SeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # ---- plumbing ------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T], retry: bool = True, switch_window: float = 0.0,
              retry_seconds: float | None = None) -> T:
        """fn(), retried on UNAVAILABLE for retry_seconds (the client's unless given); for
        `switch_window` seconds when the buffer says a weight switch is in progress (it ends within
        the buffer's switch timeout), unless retry_seconds is 0: no retries, the first failure is
        final (as the Node client's 0)."""
        window = self.retry_seconds if retry_seconds is None else retry_seconds
        start = time.monotonic()
        deadline = start + window
        delay = 0.05
        while True:
            try:
                return fn()
            except grpc.RpcError as e:
                if _retry_reason(e) == _SWITCHING and window > 0:
                    deadline = max(deadline, start + switch_window)
                if not retry or e.code() not in _RETRYABLE or time.monotonic() + delay > deadline:
                    raise _error(e) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the buffer reports SERVING for RolloutService; SeerTimeout when `timeout` runs out."""
        health = health_pb2_grpc.HealthStub(self._channel)
        service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
        # NaN compared False everywhere: "not ready after nans" at once.
        deadline = time.monotonic() + _seconds(timeout, "timeout", allow_zero=True)
        last = "not reached"
        while time.monotonic() < deadline:
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                last = e.code().name
            time.sleep(0.1)
        raise SeerTimeout("DEADLINE_EXCEEDED", f"buffer at {self.address} not ready after {timeout}s ({last})")

    # ---- API -----------------------------------------------------------------------------------

    def submit_batch(self, batch_id: str, groups: Iterable[PromptGroup], *, seed_scope: str = "",
                     submission_token: str = "") -> SubmitResult:
        """Idempotent: resubmitting the same batch is a no-op (already_submitted=True).

        seed_scope: request seeds are derived from it instead of the batch id, so two batches with
        the same scope, seeded groups and weights draw the same samples (reruns, A/B runs). Share
        one only with speculation off or between batches with other prompt keys, and never across
        RL iterations (see SubmitBatchRequest.seed_scope).

        submission_token: a name of this submission the caller chose (a random uuid hex); stored
        with the batch it creates, so that cancel_batch(batch_id, submission_token=...) cancels only
        that batch, even when this call was interrupted before its reply (never another run's batch
        under the same id). Not part of the content (a re-submit with another token is still
        already_submitted). [A-Za-z0-9._:-], 0..128 characters.

        During a weight switch (update_weights from another thread) it waits for the switch to end,
        up to update_weights' own default timeout, and the batch runs at the new version."""
        req = rollout_pb2.SubmitBatchRequest(batch_id=_str(batch_id, "batch_id"),
                                             groups=_groups_pb(groups),
                                             seed_scope=_str(seed_scope, "seed_scope"),
                                             submission_token=_str(submission_token, "submission_token"))
        # A weight switch (another thread's update_weights) refuses submissions until it ends, which
        # may take the buffer's whole switch timeout: waited out, so the batch runs at the new version.
        try:
            resp = self._call(lambda: self._stub.SubmitBatch(req, timeout=_deadline(self.timeout)),
                              switch_window=UPDATE_WEIGHTS_TIMEOUT)
        except SeerError as e:
            raise _client_field_names(e) from None
        return SubmitResult(resp.batch_id, resp.num_requests, resp.already_submitted, resp.policy_version,
                            int(resp.submission_id))

    def iter_results(self, batch_id: str, cursor: int = 0, *, timeout: float | None = None,
                     submission_id: int = 0) -> Generator[RolloutResult, None, None]:
        """Finished responses in completion order, from `cursor` on, until the batch is done.

        Survives dropped streams and buffer restarts: it reconnects and resumes from the cursor of the
        last result it yielded (each result exactly once). Gives up (SeerError with the last failure's
        code, naming the cursor) once the failures since the last new result add up to
        `retry_seconds`: the time from each failure until a stream is accepted again. Time in an
        accepted stream does not count (a long quiet generation between two restarts does not use
        the window up), but an accepted stream is not progress either: a buffer that accepts every
        stream and then fails it exhausts the window instead of being retried forever. A buffer at
        its stream limit (RESOURCE_EXHAUSTED before accepting the stream) is retried the same way.

        timeout: seconds for the whole iteration (None or inf = until the batch is done); when they run out
        SeerTimeout (a SeerError and a TimeoutError, code DEADLINE_EXCEEDED) is raised. The batch is
        not cancelled.

        submission_id: the batch's SubmitResult.submission_id (or a result's, with its cursor); 0 =
        whichever submission the batch id names when the first result arrives. Every reopened
        stream passes it: a batch id deleted by retention and submitted again in between is
        FAILED_PRECONDITION naming submission_id (a SeerError), never a resume into the other
        submission's results at this cursor.

        A batch cancelled (by anyone: another process, an operator, this client's cancel_batch)
        before it completed ends its stream without the rest: after yielding every result it got,
        BatchCancelled (a SeerError, code ABORTED, naming how many of how many responses
        finished) is raised, never a quiet end with part of the batch. One deleted by retention
        before that check (NOT_FOUND), or a check that cannot be made (the buffer gone right after
        the stream, the timeout running out), ends quietly, logged.

        A generator: close() it to end the stream at once when stopping before the batch is done
        (the buffer holds a stream slot and keeps the batch from retention while it is open).
        """
        # Checked here, not in the generator (its body runs only at the first next()): the call
        # with a bad argument is where the error belongs.
        return self._iter_results(_str(batch_id, "batch_id"), _int(cursor, "cursor", _UINT64),
                                  _results_timeout(timeout), _int(submission_id, "submission_id", _UINT64))

    def _iter_results(self, batch_id: str, cursor: int, timeout: float | None, submission_id: int,
                      num_requests: int = 0) -> Generator[RolloutResult, None, None]:
        """num_requests: the batch's size when known (run_batch, from cursor 0): a stream that ended
        with that many results is complete without asking the buffer (_cancelled_elsewhere)."""
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        # For the timeout's message: how many results this iteration yielded, and when the last one
        # came (its start before the first): "no new result for 60.0s" tells a stalled batch (no
        # worker serving it) from one that was still making progress when the time ran out.
        yielded = 0
        progress_at = started
        delay = 0.05
        # The retry window: seconds spent failing since the last new result (closed spells) plus
        # the spell in progress (from its first failure until a stream is accepted again). Only a
        # result resets it: an accepted stream that fails again without one is no progress.
        down = 0.0
        failing_since: float | None = None
        failures = 0
        # Cursors the buffer left out (a stored result over its message limit: the next message's
        # cursor steps past it). The stream's final status names them, but a stream resumed past
        # one (a reconnect, this client's own retry) no longer does: counted here from the cursor
        # gaps, and raised once every other result was yielded.
        left_out: list[int] = []
        while True:
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._timed_out(batch_id, timeout, cursor, yielded, num_requests, progress_at)
            stream_from = cursor  # the gaps below it were seen on earlier streams
            stream: Any = self._stub.StreamResults(
                rollout_pb2.StreamResultsRequest(batch_id=batch_id, cursor=cursor, submission_id=submission_id),
                timeout=_deadline(remaining))
            accepted = False
            received = False  # a result came on this stream
            try:
                accepted = _accepted(stream)
                if accepted and failing_since is not None:
                    down += time.monotonic() - failing_since
                    failing_since = None
                for resp in stream:
                    result = _result(resp)
                    received = True
                    if result.cursor - 1 > cursor:
                        left_out.extend(range(cursor, result.cursor - 1))
                    cursor = result.cursor
                    # Pinned at the first result (a buffer before submission ids sends 0: unpinned).
                    submission_id = submission_id or result.submission_id
                    delay, down, failing_since, failures = 0.05, 0.0, None, 0
                    yielded += 1
                    progress_at = time.monotonic()
                    yield result
                if left_out:
                    raise _ResultsLeftOut("RESOURCE_EXHAUSTED", _left_out_message(batch_id, left_out))
                if not (num_requests and cursor >= num_requests):
                    # Known short (run_batch knows the batch's size): a check that cannot be made
                    # is an error there, not a quiet end with part of the batch.
                    cancelled = self._cancelled_elsewhere(batch_id, submission_id, end,
                                                          short_of=num_requests, received=cursor)
                    if cancelled is not None:
                        raise cancelled
                return
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and end is not None:
                    raise self._timed_out(batch_id, timeout, cursor, yielded, num_requests, progress_at) from None
                # RESOURCE_EXHAUSTED before the buffer accepted the stream is its stream limit (a
                # transient state); after, it is a message over the size limit, which a retry repeats.
                # A result on this stream means it was accepted too, even where _accepted cannot
                # tell (a traced channel): its RESOURCE_EXHAUSTED names results left out, and a
                # retry from our cursor (past them) would end OK and lose them.
                mark = _left_out_mark(e)
                marked = mark is not None or _left_out_words(e)
                refused = code == grpc.StatusCode.RESOURCE_EXHAUSTED and not accepted and not received and not marked
                if marked or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and not refused):
                    # The buffer ends a stream so (RESOURCE_EXHAUSTED for results over its message
                    # limit, DATA_LOSS for stored ones it cannot decode; the trailing metadata
                    # marks both) only once the batch is done and every other result was sent:
                    # _ResultsLeftOut, so that run_batch does not take it for a failed stream (it
                    # cancelled the completed batch, and said so). Gaps seen on earlier streams
                    # (resumed past) are named beside the buffer's own list, merged with the
                    # cursors its trailing metadata names: the batch's last result, left out, has
                    # no later message whose cursor gap would have named it.
                    if mark is not None and mark.cursors:
                        # This stream's gaps are among the buffer's count; earlier streams' are not.
                        earlier = [c for c in left_out if c < stream_from]
                        merged = sorted(set(left_out) | set(mark.cursors))
                        listed = f"; {_left_out_message(batch_id, merged, len(earlier) + mark.count)}"
                    else:
                        listed = f"; {_left_out_message(batch_id, left_out)}" if left_out else ""
                    raise _ResultsLeftOut(code.name, f"{e.details() or ''}{listed}") from None
                if code not in _RETRYABLE and not refused:
                    raise _error(e) from None
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                failures += 1
                if down + (now - failing_since) + delay > self.retry_seconds:
                    raise SeerError(code.name, f"batch {batch_id!r}: no new result after {failures} failed "
                                               f"stream(s) over {down + now - failing_since:.1f}s of retries "
                                               f"(retry_seconds {self.retry_seconds}, cursor {cursor}): "
                                               f"{e.details() or ''}") from None
                time.sleep(delay if end is None else max(0.0, min(delay, end - now)))
                delay = min(delay * 2, 2.0)
            finally:
                # A traced channel returns a plain generator, which has no cancel().
                cancel = getattr(stream, "cancel", None)
                if cancel is not None:
                    cancel()

    def _cancelled_elsewhere(self, batch_id: str, submission_id: int, end: float | None, *, short_of: int = 0,
                             received: int = 0) -> BatchCancelled | None:
        """After a results stream ended OK: BatchCancelled when the batch it read was cancelled, so
        its other responses will never come, else None. The buffer ends the stream the same way for
        a completed batch and a cancelled one; without this check a trainer got 4 of 32 results as
        if they were all (the Node client's rollout() rejects ABORTED there too).

        A check that cannot be made (the batch deleted by retention: NOT_FOUND; the buffer gone
        after the stream ended; the caller's timeout running out) ends quietly, logged: every
        result was yielded by then, and an error here lost a complete batch's results (collect)
        over a question that is answered only in the rare cancelled case. Except when the batch is
        known to be short (short_of: its size, more than the `received` results: run_batch): then
        that failure is raised, naming both counts (run_batch returned part of the batch as whole).
        Bounded by the caller's timeout and by retry_seconds, whichever ends first."""
        remaining = None if end is None else end - time.monotonic()
        if remaining is not None and remaining <= 0:
            if short_of:
                raise SeerTimeout("DEADLINE_EXCEEDED", f"batch {batch_id!r}: its results stream ended after {received} "
                                                       f"of {short_of} results at the timeout")
            log.warning("results stream ended at the timeout; not checked for a cancel", extra={"batch_id": batch_id})
            return None
        call_timeout = self.timeout if remaining is None else max(0.1, min(self.timeout, remaining))
        window = self.retry_seconds if remaining is None else min(self.retry_seconds, remaining)
        req = rollout_pb2.GetBatchRequest(batch_id=batch_id)
        try:
            b = self._call(lambda: self._stub.GetBatch(req, timeout=_deadline(call_timeout)), retry_seconds=window)
        except SeerError as e:
            if short_of:
                raise type(e)(e.code, f"batch {batch_id!r}: its results stream ended after {received} of {short_of} "
                                      f"results, and whether the batch was cancelled could not be read: {e.message}"
                              ) from None
            log.warning("results stream ended, but whether the batch completed or was cancelled could not be read; "
                        "ended as complete", extra={"batch_id": batch_id, "code": e.code, "error": e.message})
            return None
        if b.state != rollout_pb2.BATCH_STATE_CANCELLED:
            return None
        if submission_id and b.submission_id and b.submission_id != submission_id:
            # The id was deleted and submitted again since: this is another submission's state.
            return None
        return BatchCancelled(
            f"batch {batch_id!r} was cancelled before it completed: {b.num_finished} of {b.num_requests} "
            f"responses finished, {b.num_cancelled} cancelled (the rest will not come)",
            batch_id=batch_id, num_finished=b.num_finished, num_requests=b.num_requests)

    def _timed_out(self, batch_id: str, timeout: float | None, cursor: int, received: int, num_requests: int,
                   progress_at: float) -> SeerTimeout:
        """The results wait's SeerTimeout, saying what the client knows: the results that came (of
        how many, when the batch's size is known: run_batch), and how long none came. Before, it
        said only "results not complete after 60s (cursor 1)": a batch no worker serves and one
        still progressing looked alike. run_batch and collect attach the results themselves."""
        if num_requests:
            got = f"{received} of {num_requests} results received, {max(0, num_requests - received)} missing"
        else:
            got = f"{received} result(s) received"
        quiet = time.monotonic() - progress_at
        return SeerTimeout("DEADLINE_EXCEEDED",
                           f"batch {batch_id!r}: results not complete after {timeout}s (cursor {cursor}): {got}; "
                           f"no new result for {quiet:.1f}s")

    def collect(self, batch_id: str, cursor: int = 0, *, timeout: float | None = None) -> list[RolloutResult]:
        """Every result from `cursor` on, once the batch is done. timeout: as iter_results' (None =
        until the batch is done, which a batch that never progresses never is); SeerTimeout when it
        runs out, its `results` the ones received so far (the batch keeps running).

        A batch cancelled by someone else before it completed: BatchCancelled (a SeerError, code
        ABORTED, naming how many of its responses finished), its `results` the ones received."""
        out: list[RolloutResult] = []
        try:
            out.extend(self.iter_results(batch_id, cursor, timeout=timeout))
        except (BatchCancelled, SeerTimeout) as e:
            e.results = out
            raise
        return out

    def run_batch(self, batch_id: str, groups: Sequence[PromptGroup],
                  on_result: Callable[[RolloutResult], None] | None = None, *,
                  seed_scope: str = "", timeout: float | None = None, submission_token: str | None = None,
                  cancel_on_interrupt: bool = True, cancel_on_error: bool = True) -> list[RolloutResult]:
        """Submits (idempotently) and returns every result; on_result sees each as it arrives.

        timeout: seconds to wait for the results once the batch is submitted, as iter_results'
        (None or inf = until the batch is done: a batch no worker serves would block for ever). When
        they run out SeerTimeout is raised, its `results` the ones received so far (with on_result
        they were also handed to it) and its message the counts (received, missing) and how long no
        new result came; the batch is not cancelled, and calling again with the
        same batch id waits on and returns every result (the submission is idempotent). The
        submission itself is bounded by the client's per-call `timeout`, like every call.

        submission_token: this submission's name (see submit_batch); None or "" = a fresh random one.
        cancel_on_interrupt: a KeyboardInterrupt (Ctrl-C in a notebook or a script) while the batch
        is submitted or its results awaited cancels this submission's batch (cancel_submission: never
        another run's batch under the same id; a submission still in flight when the buffer answers
        "not stored" is refused from then on), then propagates, with a note saying what the cancel
        did. Without it the rollout went on generating on the cluster with nobody reading it.
        False: the batch is left running (call run_batch again to collect it).
        cancel_on_error: the same once the batch is submitted, when on_result raises or the results
        stream fails for good (a SeerError after the client's retries): the batch is cancelled and
        the exception propagates unchanged, with a note saying what the cancel did. Not on the
        batch's SeerTimeout (the batch is left running, to be collected again; one on_result raises
        is on_result's error and cancels), nor for results the buffer
        left out of the stream (the batch is done then). False: the batch is left running.
        Both cancels are best effort and short (5 s of retries at most; a second Ctrl-C ends them).

        A batch cancelled by someone else before it completed (another process's cancel_batch, an
        operator): BatchCancelled (a SeerError, code ABORTED: "batch 'x' was cancelled before it
        completed: 4 of 32 responses finished, ..."), its `results` the ones received, nothing
        cancelled by this call. Before, run_batch returned the 4 as if they were the batch.

        Calling again after a SeerTimeout to collect the same batch: pass the first call's
        submission_token (the batch keeps its first submitter's token), or a Ctrl-C during the
        second call finds the id naming another submission and leaves the batch running."""
        # Before submitting: a bad timeout must not leave a submitted batch behind its error.
        bound = _results_timeout(timeout)
        # "" too is a fresh one: with an empty token the interrupt's cancel would name no submission
        # and cancel whatever batch the id names (another run's under the same id).
        token = (_str(submission_token, "submission_token") if submission_token is not None else "") or uuid.uuid4().hex
        out: list[RolloutResult] = []
        submitted = False
        in_callback = False  # an exception now is on_result's, not the stream's
        try:
            sub = self.submit_batch(batch_id, groups, seed_scope=seed_scope, submission_token=token)
            submitted = True
            for r in self._iter_results(batch_id, 0, bound, sub.submission_id, sub.num_requests):
                if on_result is not None:
                    in_callback = True
                    on_result(r)
                    in_callback = False
                out.append(r)
        except KeyboardInterrupt as e:
            if cancel_on_interrupt:
                e.add_note(f"seer_client: batch {batch_id}: {self._cancel_own(batch_id, token, 'interrupted')}")
            raise
        except SeerTimeout as e:
            if in_callback:
                # on_result's own timeout (another call it made), not this batch's: as any error of it.
                if cancel_on_error:
                    e.add_note(f"seer_client: batch {batch_id}: "
                               f"{self._cancel_own(batch_id, token, 'on_result raised')}")
                raise
            # The generated token is the caller's only way to collect the batch again with Ctrl-C
            # still cancelling it. The results received go with it: the batch is left running, and
            # a trainer may use them (or resubmit the rest) instead of waiting on it again.
            e.submission_token = token
            e.results = out
            e.add_note(f"seer_client: batch {batch_id} not cancelled; run_batch({batch_id!r}, ..., "
                       f"submission_token={token!r}) collects it")
            raise
        except BaseException as e:  # KeyboardInterrupt is above; SystemExit from on_result too
            if isinstance(e, BatchCancelled) and not in_callback:
                # Cancelled by someone else (its results stream ended short): nothing left to
                # cancel. (This call's own cancels are below and above, after its stream ended
                # otherwise; one on_result raised is on_result's error, cancelled as any.)
                e.results = out
                raise
            # Nobody will read the rest of the batch: without the cancel it went on generating on the
            # cluster (the Node client's rollout() cancels here too). A failed submission is not
            # cancelled (the CLI's REFUSED: it may have stored nothing of ours), nor a batch whose
            # stream ended, done, with results left out.
            stream_failed = isinstance(e, SeerError) and not isinstance(e, _ResultsLeftOut)
            if cancel_on_error and submitted and (in_callback or stream_failed):
                why = "on_result raised" if in_callback else "results stream failed"
                e.add_note(f"seer_client: batch {batch_id}: {self._cancel_own(batch_id, token, why)}")
            raise
        return out

    def _cancel_own(self, batch_id: str, token: str, why: str) -> str:
        """run_batch's cancel of its own submission (after a KeyboardInterrupt, an on_result error or
        a failed stream: `why`); returns (and logs) what it did. Best effort and short: UNAVAILABLE
        retried for _INTERRUPT_CANCEL_SECONDS, the call bounded as long; no error of its own
        replaces the one being raised (a second Ctrl-C does, with a note)."""
        try:
            outcome = self._cancel_submission(batch_id, token, _INTERRUPT_CANCEL_SECONDS,
                                              min(self.timeout, _INTERRUPT_CANCEL_SECONDS))
        except KeyboardInterrupt as again:
            what = "cancelling it was interrupted: it may still be running"
            log.warning("run_batch %s: %s", why, what, extra={"batch_id": batch_id})
            again.add_note(f"seer_client: batch {batch_id}: {what}")
            raise
        except Exception as err:  # best effort: the error being raised is what the caller must see
            what = f"cancelling it failed: {err}"
            log.warning("run_batch %s: %s", why, what, extra={"batch_id": batch_id})
            return what
        if outcome.cancelled:
            log.info("run_batch %s: %s", why, outcome.description, extra={"batch_id": batch_id})
        else:
            log.warning("run_batch %s: %s", why, outcome.description, extra={"batch_id": batch_id})
        return outcome.description

    def get_batch(self, batch_id: str, include_requests: bool = False) -> BatchStatus:
        req = rollout_pb2.GetBatchRequest(batch_id=_str(batch_id, "batch_id"),
                                          include_requests=_bool(include_requests, "include_requests"))
        b = self._call(lambda: self._stub.GetBatch(req, timeout=_deadline(self.timeout)))
        return BatchStatus(
            batch_id=b.batch_id, state=_BATCH_STATE.get(b.state, str(b.state)), num_requests=b.num_requests,
            num_finished=b.num_finished, num_cancelled=b.num_cancelled, generated_tokens=b.generated_tokens,
            policy_version=b.policy_version, submission_id=int(b.submission_id),
            requests=[RequestStatus(r.request_id, _REQUEST_STATE.get(r.state, str(r.state)), r.generated_tokens,
                                    r.num_chunks, _FINISH.get(r.finish_reason, str(r.finish_reason)))
                      for r in b.requests],
            unreadable_requests=b.unreadable_requests,
        )

    def cancel_batch(self, batch_id: str, *, submission_token: str = "") -> int:
        """Cancels the batch's unfinished requests; returns how many the cancellation cancelled (the
        same on a repeat, so a call retried after a lost reply reports it too; 0 if it completed).

        submission_token: cancel only the batch that submit_batch(submission_token=...) stored.
        None stored: SeerError NOT_FOUND; the id names another submission: FAILED_PRECONDITION
        (that batch untouched); both name submission_token, and the buffer refuses that
        submission from then on, so "not stored" is final. A buffer older than the field ignores
        it (and cancels the batch the id names)."""
        req = rollout_pb2.CancelBatchRequest(batch_id=_str(batch_id, "batch_id"),
                                             submission_token=_str(submission_token, "submission_token"))
        return int(self._call(lambda: self._stub.CancelBatch(req, timeout=_deadline(self.timeout))).num_cancelled)

    def cancel_submission(self, batch_id: str, submission_token: str) -> CancelOutcome:
        """Cancels the batch that submit_batch(batch_id, ..., submission_token=...) stored, and says
        what the buffer did: a CancelOutcome, the buffer's final answer about that submission.

        "cancelled" (with num_cancelled, the same on a repeat); "completed": the batch had
        completed, nothing was cancelled; "not_stored": none stored, and the
        buffer refuses that submission from now on (one still in flight too, across a restart),
        so nothing of it will run; "other_submission": the id names another submission's batch,
        left running. Never cancels another run's batch under the same id. Any other failure is a
        SeerError (NOT_FOUND naming batch_id: a batch deleted by retention; UNAVAILABLE after the
        client's retry_seconds...). submission_token must not be empty (cancel_batch(batch_id)
        cancels whatever the id names). A buffer older than submission tokens ignores the token:
        it cancels the batch the id names, and a batch it does not know is NOT_FOUND naming
        batch_id (an interrupted submission may still be stored then)."""
        return self._cancel_submission(_str(batch_id, "batch_id"), _token(submission_token),
                                       self.retry_seconds, _deadline(self.timeout))

    def _cancel_submission(self, batch_id: str, token: str, retry_seconds: float,
                           call_timeout: float | None) -> CancelOutcome:
        req = rollout_pb2.CancelBatchRequest(batch_id=batch_id, submission_token=token)
        try:
            resp = self._call(lambda: self._stub.CancelBatch(req, timeout=call_timeout),
                              retry_seconds=retry_seconds)
        except SeerError as err:
            outcome = _submission_answer(batch_id, err)
            if outcome is None:
                raise
            return outcome
        if resp.state == rollout_pb2.BATCH_STATE_COMPLETED:
            # The buffer answers a completed batch (COMPLETED, 0) and changes nothing.
            return CancelOutcome(batch_id, "completed")
        return CancelOutcome(batch_id, "cancelled", int(resp.num_cancelled))

    def update_weights(self, version: int, source: str = "", timeout: float | None = UPDATE_WEIGHTS_TIMEOUT
                       ) -> WeightsUpdate:
        """Moves the suite to policy `version`.

        Safe to call again after a failure or a timeout: the version that is already current with the
        same source (or source "") is success. Not retried automatically: a repeat during the switch
        is FAILED_PRECONDITION. `timeout` should exceed the buffer's switch_timeout_seconds."""
        req = rollout_pb2.UpdateWeightsRequest(version=_int(version, "version", _INT64),
                                               source=_str(source, "source"))
        rpc_timeout = None if timeout is None else _deadline(_seconds(timeout, "timeout", allow_zero=False))
        resp = self._call(lambda: self._stub.UpdateWeights(req, timeout=rpc_timeout), retry=False)
        return WeightsUpdate(resp.version, resp.num_workers, resp.seconds)
