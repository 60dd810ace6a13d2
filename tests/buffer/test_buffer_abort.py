"""An ABORTED commit (the scheduler gave up on a request): the request ends with the tokens committed
so far, its result says ABORTED, the batch completes, and none of it is lost in a restart."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from buffer_helpers import CHUNK, STOP, BufferHandle, commit, expect_error, group, snapshot, submit
from seer.v1 import buffer_pb2, common_pb2, rollout_pb2

ABORTED = common_pb2.FINISH_REASON_ABORTED


def _results(buf: BufferHandle, batch_id: str) -> list[rollout_pb2.RolloutResult]:
    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch_id), timeout=10)
    return [r.result for r in stream]


def test_aborted_commit_fails_the_request_and_completes_the_batch(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer()
    submit(buf.rollout, "a", [group(prompt_key="p", group_size=2, max_tokens=8)])
    commit(buf.internal, "a/0/0", 0, [5, 6, 7], CHUNK)
    resp = commit(buf.internal, "a/0/0", 1, [], ABORTED)
    assert (resp.duplicate, resp.accepted, resp.request_finished, resp.next_seq, resp.generated_tokens) == (
        False, True, True, 2, 3)
    # The failed request leaves the work feed; the batch is still running for its sibling.
    assert [i.request_id for i in snapshot(buf.internal)] == ["a/0/1"]
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="a"), timeout=10)
    assert status.state == rollout_pb2.BATCH_STATE_RUNNING and status.num_finished == 1
    # A retried abort is a duplicate, not a second result; an abort after it is refused.
    again = commit(buf.internal, "a/0/0", 1, [], ABORTED)
    assert (again.duplicate, again.request_finished) == (True, True)
    expect_error(lambda: commit(buf.internal, "a/0/0", 2, [], ABORTED), grpc.StatusCode.FAILED_PRECONDITION, "seq")
    commit(buf.internal, "a/0/1", 0, [8, 9], STOP)
    results = {r.request_id: r for r in _results(buf, "a")}
    assert set(results) == {"a/0/0", "a/0/1"}
    failed = results["a/0/0"]
    assert (list(failed.token_ids), failed.finish_reason, failed.num_chunks) == ([5, 6, 7], ABORTED, 2)
    assert len(failed.logprobs) == 3
    assert results["a/0/1"].finish_reason == STOP
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="a"), timeout=10)
    assert status.state == rollout_pb2.BATCH_STATE_COMPLETED and status.num_finished == 2
    # The cut-short response is no length prior for the next iteration.
    hist = buf.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=["p"]), timeout=10)
    assert [list(h.lengths) for h in hist.histories] == [[2]]
    # Durable: a restarted buffer serves the same results.
    buf.stop()
    again_buf = make_buffer()
    after = {r.request_id: (list(r.token_ids), r.finish_reason) for r in _results(again_buf, "a")}
    assert after == {"a/0/0": ([5, 6, 7], ABORTED), "a/0/1": ([8, 9], STOP)}


def test_abort_before_any_token_and_bad_aborts(buf: BufferHandle) -> None:
    submit(buf.rollout, "z", [group(group_size=1, max_tokens=4)])
    expect_error(lambda: commit(buf.internal, "z/0/0", 0, [5], ABORTED), grpc.StatusCode.INVALID_ARGUMENT,
                 "token_ids")
    expect_error(lambda: commit(buf.internal, "z/0/0", 1, [], ABORTED), grpc.StatusCode.FAILED_PRECONDITION, "seq")
    expect_error(lambda: commit(buf.internal, "z/0/0", 0, [], ABORTED, version=3),
                 grpc.StatusCode.FAILED_PRECONDITION, "policy_version")
    assert commit(buf.internal, "z/0/0", 0, [], ABORTED).request_finished
    (r,) = _results(buf, "z")
    assert (list(r.token_ids), r.finish_reason, r.num_chunks) == ([], ABORTED, 1)
