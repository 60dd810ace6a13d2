"""A stored result over the server's send limit does not stop the results stream.

SubmitBatch bounds max_tokens so that every new result fits one StreamResults message
(test_result_message_bound.py), but a result stored before that bound (or under a higher one) may
not: gRPC refused to send it, the stream ended with an opaque RESOURCE_EXHAUSTED ("Sent message
larger than max"), and a reader resuming at its cursor hit it again, forever, never getting the
results after it. Now the stream leaves it out, delivers every other result (their cursors step
past it), and then ends RESOURCE_EXHAUSTED naming its request id, cursor and size."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from buffer_helpers import CHUNK, STOP, BufferHandle, commit, group, submit
from seer.v1 import rollout_pb2
from seer_client import SeerClient, SeerError

from services.buffer import convert, validation
from services.common import server as common_server

SEND_LIMIT = 256 * 1024  # the server's message limit in this test (64 MiB in production)
BIG_CHUNK = 8_000  # tokens a commit (~40 KB: under the limit)
BIG_TOKENS = 6 * BIG_CHUNK  # ~48K tokens with their text: ~0.3 MB, over SEND_LIMIT


def _read(buf: BufferHandle, cursor: int = 0) -> tuple[list[tuple[int, str]], grpc.RpcError | None]:
    got: list[tuple[int, str]] = []
    try:
        for r in buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="b", cursor=cursor),
                                           timeout=30):
            got.append((r.cursor, r.result.request_id))
    except grpc.RpcError as e:
        return got, e
    return got, None


def test_an_undeliverable_result_is_named_and_the_others_are_delivered(
        make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", SEND_LIMIT)  # read when the server starts
    # The submission bound as it was before it existed: a response this long is accepted.
    monkeypatch.setattr(validation, "MAX_RESULT_MESSAGE_BYTES", 64 * 1024 * 1024)
    buf = make_buffer(max_context=4 * BIG_TOKENS)
    submit(buf.rollout, "b", [group(group_size=3, max_tokens=2 * BIG_TOKENS)])
    commit(buf.internal, "b/0/0", 0, [5, 6, 7], STOP)  # result 0
    for seq in range(BIG_TOKENS // BIG_CHUNK):  # result 1: over the send limit
        last = seq == BIG_TOKENS // BIG_CHUNK - 1
        commit(buf.internal, "b/0/1", seq, [4 + (i % 14) for i in range(BIG_CHUNK)], STOP if last else CHUNK)
    commit(buf.internal, "b/0/2", 0, [8, 9], STOP)  # result 2
    assert buf.core.get_batch("b").num_finished == 3

    got, err = _read(buf)
    # Before: the stream ended at result 1 (gRPC's "Sent message larger than max"), result 2 never came.
    assert got == [(1, "b/0/0"), (3, "b/0/2")]
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    details = err.details() or ""
    assert "'b/0/1'" in details and "cursor 1" in details and f"{SEND_LIMIT}-byte" in details, details
    size = int(details.split(" bytes")[0].rsplit(" ", 1)[1])
    assert size > SEND_LIMIT
    # The end is marked, with the left-out cursors (a client sees no gap for a batch's last one).
    trailing = tuple(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert ("seer-results-left-out", "1") in trailing and ("seer-results-left-out-cursors", "1") in trailing, trailing
    # A reader resuming at its cursor: the same, from there on.
    assert _read(buf, cursor=1)[0] == [(3, "b/0/2")]
    got, err = _read(buf, cursor=2)
    assert got == [(3, "b/0/2")] and err is None  # past it: nothing more to report
    # The Python client: every other result, then the error (not retried: it would repeat).
    got_client: list[str] = []
    with SeerClient(buf.address, retry_seconds=0) as c, pytest.raises(SeerError) as info:
        for r in c.iter_results("b"):
            got_client.append(r.request_id)
    assert got_client == ["b/0/0", "b/0/2"]
    assert info.value.code == "RESOURCE_EXHAUSTED" and "'b/0/1'" in info.value.message
    # The batch's status is one small message, whatever its results' sizes.
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="b", include_requests=True), timeout=10)
    assert status.num_finished == 3


def _store_with_a_left_out_result(make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch
                                  ) -> BufferHandle:
    """Results 0, 2 and 3 small, result 1 over the send limit."""
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", SEND_LIMIT)
    monkeypatch.setattr(validation, "MAX_RESULT_MESSAGE_BYTES", 64 * 1024 * 1024)
    buf = make_buffer(max_context=4 * BIG_TOKENS)
    submit(buf.rollout, "b", [group(group_size=4, max_tokens=2 * BIG_TOKENS)])
    commit(buf.internal, "b/0/0", 0, [5, 6, 7], STOP)
    for seq in range(BIG_TOKENS // BIG_CHUNK):
        last = seq == BIG_TOKENS // BIG_CHUNK - 1
        commit(buf.internal, "b/0/1", seq, [4 + (i % 14) for i in range(BIG_CHUNK)], STOP if last else CHUNK)
    commit(buf.internal, "b/0/2", 0, [8, 9], STOP)
    commit(buf.internal, "b/0/3", 0, [8, 9], STOP)
    return buf


def test_the_client_reports_a_left_out_result_after_resuming_past_it(
        make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream drops (a buffer restart, a blip) after the result past the left-out one: the
    client resumes at its cursor, past it, and that stream ends OK. The client still knows from the
    cursors' gap (the review of session 26: it ended with 3 of 4 results and no error)."""
    from services.common.errors import Unavailable

    buf = _store_with_a_left_out_result(make_buffer, monkeypatch)
    real = buf.core.iter_results
    calls = {"n": 0}

    def flaky(batch_id: str, cursor: int, *a: object, **kw: object):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        first = calls["n"] == 1
        for idx, r in real(batch_id, cursor, *a, **kw):  # type: ignore[arg-type]
            yield idx, r
            if first and idx == 2:
                raise Unavailable("simulated: connection lost")

    monkeypatch.setattr(buf.core, "iter_results", flaky)
    got: list[str] = []
    with SeerClient(buf.address, retry_seconds=5) as c, pytest.raises(SeerError) as info:
        for r in c.iter_results("b"):
            got.append(r.request_id)
    assert calls["n"] == 2
    assert got == ["b/0/0", "b/0/2", "b/0/3"]
    assert info.value.code == "RESOURCE_EXHAUSTED" and "cursor(s) 1" in info.value.message, info.value.message


def test_a_traced_channel_does_not_retry_past_a_left_out_result(
        make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced channel's stream cannot say whether the buffer accepted it, so its final
    RESOURCE_EXHAUSTED read as the stream limit (retried from the cursor past the left-out result,
    which then ended OK: the loss unreported)."""
    from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

    buf = _store_with_a_left_out_result(make_buffer, monkeypatch)
    ch = grpcext.intercept_channel(grpc.insecure_channel(buf.address), client_interceptor())
    got: list[str] = []
    with SeerClient(buf.address, retry_seconds=5, channel=ch) as c, pytest.raises(SeerError) as info:
        for r in c.iter_results("b"):
            got.append(r.request_id)
    assert got == ["b/0/0", "b/0/2", "b/0/3"]
    assert info.value.code == "RESOURCE_EXHAUSTED" and "'b/0/1'" in info.value.message, info.value.message


@pytest.mark.parametrize("margin", [0, 1])
def test_a_result_exactly_at_the_send_limit_still_goes(make_buffer: Callable[..., BufferHandle],
                                                       monkeypatch: pytest.MonkeyPatch, margin: int) -> None:
    """StreamResults compares the message's encoded size with the limit, not a margin below it: a
    result whose message is exactly the limit is sent (gRPC sends it), one byte over is left out."""
    first = make_buffer()
    submit(first.rollout, "b", [group(group_size=1, max_tokens=8)])
    commit(first.internal, "b/0/0", 0, [5, 6, 7], STOP)
    sub = first.core.submission_of("b")
    [(idx, r)] = first.core.read_results("b", 0)[0]
    # The message exactly as the server builds it.
    size = rollout_pb2.StreamResultsResponse(cursor=idx + 1, result=convert.result_to_pb(r),
                                             submission_id=sub).ByteSize()
    first.stop()
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", size - margin)  # read when the server starts
    buf = make_buffer()
    got, err = _read(buf)
    if margin == 0:
        assert got == [(1, "b/0/0")] and err is None, err
    else:
        assert got == [] and err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "'b/0/0'" in (err.details() or "") and f"{size} bytes" in (err.details() or "")


def test_the_left_out_cursors_stay_within_the_metadata_bound() -> None:
    """The trailer must stay under gRPC's 8 KiB default metadata limit (a client's call fails
    RESOURCE_EXHAUSTED past it): the first cursors, ascending and whole, within the bound; the
    count beside them says how many in all."""
    from services.buffer import server

    assert server.left_out_cursors_value([7, 3, 3, 0]) == "0,3,7"
    assert server.left_out_cursors_value([]) == ""
    many = list(range(100_000, 200_000))
    value = server.left_out_cursors_value(many)
    assert len(value) <= server.MAX_LEFT_OUT_CURSORS_BYTES < 8192
    cursors = [int(c) for c in value.split(",")]
    assert cursors == many[:len(cursors)] and len(cursors) == server.MAX_LEFT_OUT_CURSORS_BYTES // 7
