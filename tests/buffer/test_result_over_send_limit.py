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

from services.buffer import validation
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


def test_a_result_at_the_limit_still_goes() -> None:
    """The check is the message's size against the limit, not a margin below it."""
    from services.buffer.server import fits_message

    msg = rollout_pb2.StreamResultsResponse(cursor=1, result=rollout_pb2.RolloutResult(token_ids=list(range(1000))))
    assert fits_message(msg, msg.ByteSize()) and not fits_message(msg, msg.ByteSize() - 1)
