"""gRPC glue of the buffer: RolloutService (trainer-facing) and BufferInternalService (scheduler).

Servicers only convert messages and call the core; `@rpc` maps the core's typed errors to codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import grpc
from seer.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from services.buffer import convert, metrics
from services.buffer.config import BufferConfig
from services.buffer.core import (
    BufferCore,
    SwitchFn,
    SwitchNotStarted,
    UnreadableRequest,
    UnreadableResult,
    VersionProbe,
)
from services.buffer.events import FEED_BATCH_ITEMS, Cancelled, WatcherDropped, batches, coalesce
from services.buffer.records import RolloutResult
from services.common import server as common_server
from services.common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    field_of,
)
from services.common.grpcutil import channel, rpc
from services.common.log import get_logger, kv, log_context
from services.common.streams import StreamSlots
from services.common.telemetry import current_trace_context

log = get_logger(__name__)

# How often a blocked stream re-checks that its client is still there.
POLL_SECONDS = 0.5
# Results over the message limit a StreamResults status names one by one (the rest are counted).
MAX_NAMED_TOO_LARGE = 20
# How long UpdateWeights waits to connect to the scheduler before it reports it unreachable.
SWITCH_CONNECT_SECONDS = 10.0


def stream_slots(limit: int, watch_reserve: int | None = None) -> StreamSlots:
    """Admission of StreamResults and WatchWork streams (services.common.streams). A stream waits on
    its thread for results or work, and the CommitChunk that would wake it needs a thread too. The
    last `watch_reserve` slots are WatchWork's alone: result streams filling every slot would
    otherwise lock out the scheduler whose commits they wait for (the same deadlock one level up)."""
    reserve = min(4, limit // 2) if watch_reserve is None else watch_reserve
    return StreamSlots(limit, "max_streams", reserve=reserve, reserved_for=frozenset({"WatchWork"}),
                       on_open=metrics.STREAMS.inc, on_refused=lambda m: metrics.STREAMS_REFUSED.labels(method=m).inc())


def end_stream(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """Ends a server stream with a status from a thread other than its handler's.

    context.abort works only on the handler's own thread, which may be blocked sending to a client
    that stopped reading (a full flow-control window), and context.cancel() ends the call CANCELLED,
    which does not say why. Cancelling the call with a status sends it at once (gRPC writes the
    trailers and RST_STREAM past flow control) and the blocked send returns, so the handler ends and
    frees its thread and stream slot. The call is a private attribute of grpc's ServicerContext (an
    OpenTelemetry wrapper forwards it); when it is missing, the stream still ends, CANCELLED."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            call.cancel(code.value[0], details)
            return
        except Exception as e:  # another grpc version: still end the stream
            log.warning("cannot end the stream with a status; cancelling it", extra=kv(
                code=code.name, error=f"{type(e).__name__}: {e}"))
    context.cancel()


def size_bound(r: RolloutResult) -> int:
    """An upper bound of a result's StreamResultsResponse size, without encoding it (ByteSize costs
    as much as the encoding gRPC does anyway): a token id is at most a 5-byte varint, a logprob a
    4-byte float, a character at most 4 bytes of UTF-8; 64 KiB for everything else."""
    labels = sum(4 * (len(k) + len(v)) + 16 for k, v in r.labels.items())
    return 9 * len(r.token_ids) + 4 * len(r.text) + labels + 4 * (len(r.request_id) + len(r.prompt_key)) + 65536


# Trailing metadata of StreamResults' end when results were left out of the stream (rollout.proto
# StreamResults): the number left out by this stream. The clients read it (seer_client,
# clients/node) to tell that end from a failed stream.
RESULTS_LEFT_OUT_KEY = "seer-results-left-out"
# Beside it: the left-out cursors, ascending, comma-separated. A client counts a left-out result from
# the gap before the next message's cursor, and the last result of a batch has no next message: its
# cursor was missing from the client's list. Only the first ones that fit in
# MAX_LEFT_OUT_CURSORS_BYTES (the count above says how many in all): the whole trailer (this, the
# count, the status message naming up to 2 x MAX_NAMED_TOO_LARGE results) must stay under gRPC's 8 KiB
# default metadata limit, past which the client's call fails RESOURCE_EXHAUSTED instead.
RESULTS_LEFT_OUT_CURSORS_KEY = "seer-results-left-out-cursors"
MAX_LEFT_OUT_CURSORS_BYTES = 2048
# The status message (grpc-message, as sent: percent-encoded) and the cursor list together, at most:
# the rest of the 8 KiB is the keys, the count, grpc-status and HPACK's 32 bytes an entry. The
# message gets what the cursors leave (at least 4,952 bytes: ~20 results named) and is cut to fit.
# Both kinds of left-out results named with a 128-character batch id made an ~8.4 KB message; with
# 2 KiB of cursors the trailer went over the limit, and gRPC failed 3 calls in 10 RESOURCE_EXHAUSTED
# ("received metadata size exceeds soft limit"), losing DATA_LOSS and the left-out mark (review 4417).
MAX_LEFT_OUT_TRAILER_TEXT_BYTES = 7000
_CUT = " ... (cut to fit gRPC's metadata limit)"


def left_out_cursors_value(cursors: Sequence[int]) -> str:
    """RESULTS_LEFT_OUT_CURSORS_KEY's value: the smallest cursors, ascending, whole ones only, within
    MAX_LEFT_OUT_CURSORS_BYTES."""
    out: list[str] = []
    size = 0
    for c in sorted(set(cursors)):
        item = str(c)
        size += len(item) + (1 if out else 0)
        if size > MAX_LEFT_OUT_CURSORS_BYTES:
            break
        out.append(item)
    return ",".join(out)


def _status_bytes(text: str) -> int:
    """Bytes of `text` as grpc-message carries it: percent-encoded, so a byte outside printable
    ASCII, or '%', takes three."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


def fit_status(text: str, field: str, max_bytes: int) -> str:
    """`text` cut (marked _CUT) so that the status message SeerError makes of it ("field: text")
    takes at most `max_bytes` as sent."""
    room = max_bytes - _status_bytes(f"{field}: ")
    if _status_bytes(text) <= room:
        return text
    room -= len(_CUT)
    used = 0
    for i, ch in enumerate(text):
        used += _status_bytes(ch)
        if used > room:
            return text[:i] + _CUT
    return text  # not reached: the whole text did not fit


def named_and_more(named: Sequence[str], total: int) -> str:
    """`named` joined with "; ", then " and N more" for the `total - len(named)` left unnamed (the
    error texts name the first MAX_NAMED_TOO_LARGE of a list and count the rest)."""
    rest = total - len(named)
    return "; ".join(named) + (f" and {rest} more" if rest > 0 else "")


def _unreadable_error(batch_id: str, unreadable: Sequence[UnreadableResult], too_large: Sequence[str],
                      too_large_count: int, limit: int,
                      max_bytes: int = MAX_LEFT_OUT_TRAILER_TEXT_BYTES - MAX_LEFT_OUT_CURSORS_BYTES) -> DataLoss:
    """StreamResults' end when stored results could not be decoded: DATA_LOSS (the worse of the two
    ways a result is left out) naming each one's cursor, RocksDB key and field (the first
    MAX_NAMED_TOO_LARGE; the rest counted), and results over the message limit beside them; the
    message at most `max_bytes` as sent (fit_status: the trailer's room beside the cursors)."""
    named = named_and_more([f"cursor {u.cursor}: {u.error}" for u in unreadable[:MAX_NAMED_TOO_LARGE]],
                           len(unreadable))
    also = ""
    if too_large_count:
        also = (f"; also {too_large_count} result(s) over the {limit}-byte message limit were left out: "
                f"{named_and_more(too_large, too_large_count)}")
    text = (f"{len(unreadable)} stored result(s) of batch {batch_id!r} cannot be decoded and were left out of "
            f"the stream (every other result was sent): {named}{also}")
    return DataLoss(fit_status(text, "cursor", max_bytes), field="cursor")


def unreadable_requests_text(batch_id: str, unreadable: Sequence[UnreadableRequest]) -> str:
    """GetBatchResponse.unreadable_requests: how many request records could not be decoded and each
    one's request id, RocksDB key and field (the first MAX_NAMED_TOO_LARGE; the rest counted)."""
    named = named_and_more([f"request {u.request_id!r}: {u.error}" for u in unreadable[:MAX_NAMED_TOO_LARGE]],
                           len(unreadable))
    return (f"{len(unreadable)} stored request record(s) of batch {batch_id!r} cannot be decoded and are listed "
            f"as unknown (state UNSPECIFIED; every other request is as stored): {named}")


def scheduler_switch(address: str, timeout: float) -> SwitchFn:
    """SwitchFn calling SchedulerService.SwitchWeights; scheduler errors become typed errors.

    The core needs to know whether a failed call may have switched the workers (core.SwitchFn):
    INVALID_ARGUMENT and FAILED_PRECONDITION are the scheduler's refusals before any load, ABORTED
    is its "another switch is in progress", and a scheduler the buffer cannot connect to was never
    asked (SwitchNotStarted). Anything else (the deadline, a connection lost during the call,
    INTERNAL, the scheduler's UNAVAILABLE) leaves the outcome unknown."""

    def switch(version: int, source: str) -> int:
        deadline = time.monotonic() + timeout
        # Connect first on a plain channel: a call that fails before the connection exists was
        # never sent, which UNAVAILABLE alone cannot tell from a connection lost during the switch.
        # Bounded apart from the switch's deadline: a scheduler that is down is reported in
        # seconds (the trainer retries), not after the whole switch timeout.
        wait = min(timeout, SWITCH_CONNECT_SECONDS)
        probe = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(probe).result(timeout=wait)
        except grpc.FutureTimeoutError:
            raise SwitchNotStarted(f"scheduler SwitchWeights failed: the scheduler at {address} was not "
                                   f"reached in {wait}s; nothing was switched") from None
        finally:
            probe.close()
        ch = channel(address)
        try:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            resp = stub.SwitchWeights(scheduler_pb2.SwitchWeightsRequest(version=version, source=source),
                                      timeout=max(0.001, deadline - time.monotonic()))
            return int(resp.num_workers)
        except grpc.RpcError as e:
            code, detail = e.code(), e.details() or ""
            msg = f"scheduler SwitchWeights failed: {code.name}: {detail}"
            # The scheduler's details start with the field they name ("version: ...", "source: ...");
            # passed on as that field (every INVALID_ARGUMENT was reported as naming `source`).
            field = field_of(detail)
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                # The scheduler's refusal of the caller's argument, passed on as it reads: the code
                # and field it carries are this error's own, and re-wrapped in "scheduler
                # SwitchWeights failed: INVALID_ARGUMENT: source: ..." the user read them twice.
                refusal = detail[len(field) + 2:] if field else f"scheduler SwitchWeights failed: {detail}"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(refusal, field=field or "source") from None
                raise FailedPrecondition(refusal, field=field) from None
            if code == grpc.StatusCode.ABORTED:
                raise SwitchNotStarted(msg) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                msg = f"scheduler SwitchWeights failed: {detail}"  # the code is this error's own
            raise Unavailable(msg) from None
        finally:
            ch.close()

    return switch


def scheduler_version(address: str, timeout: float) -> VersionProbe:
    """VersionProbe reading GetSchedulerStats.policy_version (None when unset)."""

    def probe() -> int | None:
        ch = channel(address)
        try:
            resp = scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                scheduler_pb2.GetSchedulerStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise Unavailable(f"scheduler GetSchedulerStats failed: {e.code().name}: {e.details()}") from None
        finally:
            ch.close()
        return int(resp.policy_version) if resp.HasField("policy_version") else None

    return probe


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, core: BufferCore, switch: SwitchFn | None, streams: StreamSlots | None = None,
                 version_probe: VersionProbe | None = None) -> None:
        self.core = core
        self.switch = switch
        self.streams = streams or stream_slots(BufferConfig().stream_limit())
        self.version_probe = version_probe

    @rpc
    def SubmitBatch(self, request: rollout_pb2.SubmitBatchRequest, context: grpc.ServicerContext
                    ) -> rollout_pb2.SubmitBatchResponse:
        with log_context(batch_id=request.batch_id):
            if self.version_probe is not None and self.core.pending_intent() is not None:
                # An update of unknown outcome refuses submissions; the scheduler may know it.
                self.core.reconcile_intent(self.version_probe)
            out = self.core.submit_batch(request.batch_id, [convert.group_from_pb(g) for g in request.groups],
                                         trace_context=current_trace_context(), seed_scope=request.seed_scope,
                                         is_active=lambda: _still_wanted(context),
                                         submission_token=request.submission_token)
        return rollout_pb2.SubmitBatchResponse(batch_id=out.batch_id, num_requests=out.num_requests,
                                               already_submitted=out.already_submitted,
                                               policy_version=out.policy_version,
                                               submission_id=out.submission_id)

    @rpc
    def StreamResults(self, request: rollout_pb2.StreamResultsRequest, context: grpc.ServicerContext
                      ) -> Iterator[rollout_pb2.StreamResultsResponse]:
        with self.streams.hold("StreamResults"):
            # Headers now, not with the first result: they tell a client that the stream was
            # accepted (SeerClient stops counting its retry window then), which may be long before a result.
            context.send_initial_metadata(())
            # Pinned here (not only in the core) so that every message can say which submission it
            # is from: a reader that did not submit the batch resumes with it.
            sub = int(request.submission_id) or self.core.submission_of(request.batch_id)
            # The server's send limit (read at call time, as the server read it when it started).
            limit = common_server.MAX_MESSAGE_BYTES
            # Results too large for one message: SubmitBatch bounds max_tokens so that new ones fit
            # (validation.max_response_tokens), but one stored before that bound may not. gRPC would
            # fail the stream at it with an opaque RESOURCE_EXHAUSTED, and a reader resuming at its
            # cursor would fail there forever; so it is left out (the next message's cursor steps
            # past it), the stream goes on, and its end names what was left out.
            too_large: list[str] = []  # the first MAX_NAMED_TOO_LARGE, named in the status
            left_out = 0
            # Their cursors, for the trailing metadata (bounded there, not here: ints are small and
            # the results' own size bounds how many a stream can meet).
            too_large_cursors: list[int] = []
            # Stored results that cannot be decoded (RecordError): left out the same way, so one
            # bad record does not cost the reader every other result of its page (it did: the page
            # was DATA_LOSS, and a reader resuming at its cursor failed there forever); the stream
            # ends DATA_LOSS naming each one's key and field (the core logs and counts them).
            unreadable: list[UnreadableResult] = []
            for idx, r in self.core.iter_results(request.batch_id, int(request.cursor), context.is_active,
                                                 POLL_SECONDS, submission_id=sub, unreadable=unreadable):
                msg = rollout_pb2.StreamResultsResponse(cursor=idx + 1, result=convert.result_to_pb(r),
                                                        submission_id=sub)
                if size_bound(r) <= limit:
                    yield msg  # the common case: fits for certain, not encoded twice
                    continue
                size = msg.ByteSize()
                if size <= limit:
                    yield msg
                    continue
                log.error("result over the message limit left out of the stream", extra=kv(
                    batch_id=request.batch_id, request_id=r.request_id, cursor=idx, bytes=size, limit=limit))
                left_out += 1
                too_large_cursors.append(idx)
                if len(too_large) < MAX_NAMED_TOO_LARGE:
                    too_large.append(f"request {r.request_id!r} (cursor {idx}): {size} bytes")
            room = MAX_LEFT_OUT_TRAILER_TEXT_BYTES  # for the status message: the cursors take theirs below
            if unreadable or left_out:
                # Marks this end (either status) as "the batch is done, every other result was
                # sent": a client cannot tell it by the code (DATA_LOSS is also a read failing
                # mid-stream, RESOURCE_EXHAUSTED also the stream limit), and took it for a failed
                # stream (run_batch cancelled the completed batch and dropped the gaps it had seen).
                # The cursors too: the last result of a batch left out has no later message whose
                # cursor gap would name it to the client.
                cursors = left_out_cursors_value([u.cursor for u in unreadable] + too_large_cursors)
                context.set_trailing_metadata(((RESULTS_LEFT_OUT_KEY, str(len(unreadable) + left_out)),
                                               (RESULTS_LEFT_OUT_CURSORS_KEY, cursors)))
                # The status message travels in the same trailer: it gets what the cursors leave.
                room -= len(cursors)
            if unreadable:
                raise _unreadable_error(request.batch_id, unreadable, too_large, left_out, limit, room)
            if left_out:
                raise ResourceExhausted(fit_status(
                    f"{left_out} result(s) of batch {request.batch_id!r} are over the {limit}-byte message "
                    f"limit and were left out of the stream (every other result was sent): "
                    f"{named_and_more(too_large, left_out)}. They cannot be delivered whole (stored before "
                    "SubmitBatch bounded max_tokens to fit one message)", "cursor", room), field="cursor")

    @rpc
    def GetBatch(self, request: rollout_pb2.GetBatchRequest, context: grpc.ServicerContext
                 ) -> rollout_pb2.GetBatchResponse:
        with log_context(batch_id=request.batch_id):
            # A stored request record that cannot be decoded costs the caller that request's status,
            # not every other one's (as StreamResults leaves an undecodable result out): it is
            # listed as unknown (state UNSPECIFIED) in its place, and named, with its RocksDB key and
            # field, in GetBatchResponse.unreadable_requests (a unary call's status cannot come with
            # its reply).
            unreadable: list[UnreadableRequest] = []
            reply = convert.batch_to_pb(self.core.get_batch(request.batch_id, request.include_requests,
                                                            unreadable=unreadable))
            if unreadable:
                reply.unreadable_requests = unreadable_requests_text(request.batch_id, unreadable)
            return reply

    @rpc
    def CancelBatch(self, request: rollout_pb2.CancelBatchRequest, context: grpc.ServicerContext
                    ) -> rollout_pb2.CancelBatchResponse:
        with log_context(batch_id=request.batch_id):
            state, n = self.core.cancel_batch(request.batch_id, request.submission_token)
        return rollout_pb2.CancelBatchResponse(state=int(state), num_cancelled=n)

    @rpc
    def UpdateWeights(self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.ServicerContext
                      ) -> rollout_pb2.UpdateWeightsResponse:
        with log_context(policy_version=int(request.version)):
            out = self.core.update_weights(int(request.version), request.source, self.switch)
        return rollout_pb2.UpdateWeightsResponse(version=out.version, num_workers=out.num_workers,
                                                 seconds=out.seconds)


class BufferInternalServicer(buffer_pb2_grpc.BufferInternalServiceServicer):
    def __init__(self, core: BufferCore, streams: StreamSlots | None = None) -> None:
        self.core = core
        self.streams = streams or stream_slots(BufferConfig().stream_limit())

    @rpc
    def WatchWork(self, request: buffer_pb2.WatchWorkRequest, context: grpc.ServicerContext
                  ) -> Iterator[buffer_pb2.WatchWorkResponse]:
        with self.streams.hold("WatchWork"):
            yield from self._watch(request, context)

    def _watch(self, request: buffer_pb2.WatchWorkRequest, context: grpc.ServicerContext
               ) -> Iterator[buffer_pb2.WatchWorkResponse]:
        snapshot, sub = self.core.watch(request.watcher_id, context.peer())
        try:
            # A watcher that falls watch_queue_events behind is dropped by the publishing thread
            # (events.py). This thread sees it in sub.take, unless it is blocked sending to the
            # client that stopped reading: then the stream is ended from there, with the same status.
            sub.on_drop(lambda reason: end_stream(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  str(WatcherDropped(reason, field="watch_queue_events"))))
            encoder = convert.WorkItemEncoder()
            version, source = self.core.policy()
            yield buffer_pb2.WatchWorkResponse(policy=buffer_pb2.PolicyState(version=version, source=source))
            for items in batches(snapshot):
                yield encoder.added(items)
            del snapshot  # sent: not kept alive for the life of the stream
            yield buffer_pb2.WatchWorkResponse(snapshot_done=True)
            while context.is_active():
                # What is already queued goes in the same messages (a submitted batch arrives as one
                # burst of events). Raises WatcherDropped (RESOURCE_EXHAUSTED) once dropped.
                queued = sub.take(FEED_BATCH_ITEMS, POLL_SECONDS)
                if not queued:
                    continue
                for msg in coalesce(queued):
                    if isinstance(msg, Cancelled):
                        yield buffer_pb2.WatchWorkResponse(cancelled_request_id=msg.request_id)
                    else:
                        yield encoder.added(msg)
        finally:
            self.core.unwatch(sub)

    @rpc
    def CommitChunk(self, request: buffer_pb2.CommitChunkRequest, context: grpc.ServicerContext
                    ) -> buffer_pb2.CommitChunkResponse:
        try:
            out = self.core.commit_chunk(convert.commit_from_pb(request))
        except InvalidArgument:
            # Malformed (bad tokens, logprobs, stats, finish reason), from the conversion or the core:
            # counted here as "invalid"; the core counts its other refusals by reason.
            metrics.REJECTED.labels("invalid").inc()
            raise
        return buffer_pb2.CommitChunkResponse(duplicate=out.duplicate, next_seq=out.next_seq,
                                              generated_tokens=out.generated_tokens,
                                              request_finished=out.request_finished, accepted=out.accepted)

    @rpc
    def GetHistory(self, request: buffer_pb2.GetHistoryRequest, context: grpc.ServicerContext
                   ) -> buffer_pb2.GetHistoryResponse:
        tokens = request.include_tokens
        reply = self.core.newest_history(list(request.prompt_keys), with_tokens=tokens)
        return buffer_pb2.GetHistoryResponse(histories=[
            buffer_pb2.PromptHistory(
                prompt_key=k, lengths=it.lengths, policy_version=it.policy_version,
                responses=[buffer_pb2.TokenIds(token_ids=t) for t in it.token_ids] if tokens else [])
            for k, it in reply.histories
        ], omitted_prompt_keys=reply.omitted)


def add_servicers(core: BufferCore, cfg: BufferConfig) -> Callable[[grpc.Server], Sequence[str]]:
    """Returns the `add_servicers` callback for services.common.server.start_server."""
    switch = scheduler_switch(cfg.scheduler_address, cfg.switch_timeout_seconds) if cfg.scheduler_address else None
    probe = scheduler_version(cfg.scheduler_address, SWITCH_CONNECT_SECONDS) if cfg.scheduler_address else None

    # One limit for both services: they share the server's thread pool.
    streams = stream_slots(cfg.stream_limit())

    def add(server: grpc.Server) -> Sequence[str]:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(core, switch, streams, probe), server)
        buffer_pb2_grpc.add_BufferInternalServiceServicer_to_server(BufferInternalServicer(core, streams), server)
        return [
            rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
            buffer_pb2.DESCRIPTOR.services_by_name["BufferInternalService"].full_name,
        ]

    return add


def _still_wanted(context: grpc.ServicerContext) -> bool:
    """Whether a SubmitBatch call is still wanted by its caller: active, or ended only by its own
    deadline. A cancelled call (a Ctrl-C, a closed channel) is not: its caller may have cancelled
    the batch already and finds nothing (BufferCore.submit_batch). An expired deadline is: the
    caller's idempotent retry then finds the batch stored (already_submitted); refusing it too made
    a submission that outlasts the caller's timeout fail on every retry (review)."""
    if context.is_active():
        return True
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
