"""CommitChunk: idempotency by (request_id, seq), gaps, conflicts, validation, finishing."""

from __future__ import annotations

import grpc
from buffer_helpers import CHUNK, LENGTH, STOP, BufferHandle, commit, expect_error, group, snapshot, submit
from seer.v1 import buffer_pb2, common_pb2, rollout_pb2

FP = grpc.StatusCode.FAILED_PRECONDITION
IA = grpc.StatusCode.INVALID_ARGUMENT


def _one(buf: BufferHandle, max_tokens: int = 8) -> str:
    submit(buf.rollout, "c", [group(group_size=1, max_tokens=max_tokens)])
    return "c/0/0"


def test_commit_appends_and_retry_is_a_duplicate(buf: BufferHandle) -> None:
    rid = _one(buf)
    r0 = commit(buf.internal, rid, 0, [5, 6, 7])
    assert (r0.duplicate, r0.next_seq, r0.generated_tokens, r0.request_finished, r0.accepted) == (
        False, 1, 3, False, True)
    again = commit(buf.internal, rid, 0, [5, 6, 7])
    assert (again.duplicate, again.next_seq, again.generated_tokens, again.accepted) == (True, 1, 3, True)
    # The retry was not appended twice: the resume point holds the tokens once.
    item = snapshot(buf.internal)[0]
    assert (list(item.output_token_ids), item.next_seq) == ([5, 6, 7], 1)
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="c", include_requests=True))
    assert status.generated_tokens == 3 and status.requests[0].num_chunks == 1
    assert status.requests[0].state == rollout_pb2.REQUEST_STATE_RUNNING


def test_conflicting_duplicate_is_aborted_naming_seq(buf: BufferHandle) -> None:
    rid = _one(buf)
    commit(buf.internal, rid, 0, [5, 6])
    expect_error(lambda: commit(buf.internal, rid, 0, [5, 9]), grpc.StatusCode.ABORTED, "seq")
    # Same tokens but different logprobs is a different chunk too (another sampling run).
    expect_error(lambda: commit(buf.internal, rid, 0, [5, 6], logprobs=[-1.0, -1.0]), grpc.StatusCode.ABORTED, "seq")
    expect_error(lambda: commit(buf.internal, rid, 0, [5, 6], reason=STOP), grpc.StatusCode.ABORTED, "seq")


def test_gap_is_failed_precondition(buf: BufferHandle) -> None:
    rid = _one(buf)
    msg = expect_error(lambda: commit(buf.internal, rid, 1, [5]), FP, "seq")
    assert "expected chunk 0" in msg
    commit(buf.internal, rid, 0, [5])
    expect_error(lambda: commit(buf.internal, rid, 3, [5]), FP, "seq")
    assert commit(buf.internal, rid, 1, [6]).next_seq == 2


def test_policy_version_must_match_the_batch(buf: BufferHandle) -> None:
    rid = _one(buf)
    expect_error(lambda: commit(buf.internal, rid, 0, [5], version=1), FP, "policy_version")


def test_bad_chunks_name_the_field(buf: BufferHandle) -> None:
    rid = _one(buf, max_tokens=4)
    expect_error(lambda: commit(buf.internal, rid, 0, [5, 6], logprobs=[-1.0]), IA, "logprobs")
    expect_error(lambda: commit(buf.internal, rid, 0, [5, 64]), IA, "token_ids[1]")
    expect_error(lambda: commit(buf.internal, rid, 0, [1, 2, 3, 4, 5]), IA, "token_ids")
    expect_error(lambda: commit(buf.internal, rid, 0, []), IA, "token_ids")
    # ABORTED fails the request with what was committed before: it carries no tokens.
    expect_error(lambda: commit(buf.internal, rid, 0, [5], reason=common_pb2.FINISH_REASON_ABORTED), IA,
                 "token_ids")
    expect_error(lambda: commit(buf.internal, rid, 0, [5], reason=common_pb2.FINISH_REASON_UNSPECIFIED), IA,
                 "finish_reason")
    expect_error(lambda: commit(buf.internal, "nope/0/0", 0, [5]), grpc.StatusCode.NOT_FOUND, "request_id")
    expect_error(lambda: commit(buf.internal, "c/0/7", 0, [5]), grpc.StatusCode.NOT_FOUND, "request_id")
    expect_error(lambda: commit(buf.internal, "garbage", 0, [5]), IA, "request_id")
    # Only the canonical spelling names the request (review, session 17: "c/00/0" reached the
    # stored request but not the running one, which then answered "already finished").
    for alias in ("c/00/0", "c/+0/0", "c/0/ 0", "c/0/\u0660"):
        expect_error(lambda a=alias: commit(buf.internal, a, 0, [5]), IA, "request_id")  # type: ignore[misc]
    expect_error(lambda: commit(buf.internal, rid, 0, [5], stats=common_pb2.ChunkStats(steps=-1)), IA, "stats.steps")
    # None of that changed the request.
    assert commit(buf.internal, rid, 0, [5]).next_seq == 1


def test_summed_stats_saturate_instead_of_failing_every_commit(buf: BufferHandle) -> None:
    """A response's summed ChunkStats are stored as int32: past 2**31 - 1 every later commit of it
    failed with INTERNAL (review, session 17). They saturate now."""
    rid = _one(buf, max_tokens=4)
    big = common_pb2.ChunkStats(prefill_tokens=2**31 - 10)
    assert commit(buf.internal, rid, 0, [5], stats=big).next_seq == 1
    assert commit(buf.internal, rid, 1, [6], stats=big).next_seq == 2
    assert commit(buf.internal, rid, 2, [7, 8], reason=STOP, stats=big).request_finished


def test_finishing_chunk_and_commits_after_finish(buf: BufferHandle) -> None:
    rid = _one(buf, max_tokens=4)
    commit(buf.internal, rid, 0, [5, 6])
    # A CHUNK that reaches max_tokens finishes the request as LENGTH.
    done = commit(buf.internal, rid, 1, [7, 8])
    assert done.request_finished and done.generated_tokens == 4
    results = list(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="c"), timeout=10))
    assert len(results) == 1
    r = results[0].result
    assert (list(r.token_ids), r.finish_reason, r.num_chunks) == ([5, 6, 7, 8], LENGTH, 2)
    assert [round(x, 4) for x in r.logprobs] == [round(-0.5 - 0.01 * t, 4) for t in (5, 6, 7, 8)]
    # A retried finishing commit is still a duplicate; anything new is refused.
    assert commit(buf.internal, rid, 1, [7, 8]).duplicate
    expect_error(lambda: commit(buf.internal, rid, 2, [9]), FP, "seq")
    assert snapshot(buf.internal) == []


def test_commit_to_cancelled_request_is_not_accepted(buf: BufferHandle) -> None:
    rid = _one(buf)
    commit(buf.internal, rid, 0, [5])
    buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="c"))
    resp = commit(buf.internal, rid, 1, [6])
    assert (resp.accepted, resp.duplicate, resp.next_seq) == (False, False, 1)
    assert commit(buf.internal, rid, 0, [5]).accepted is False


def test_stats_are_summed_into_the_result(buf: BufferHandle) -> None:
    rid = _one(buf)
    for seq, (toks, reason) in enumerate([([5, 6], CHUNK), ([7], STOP)]):
        stats = common_pb2.ChunkStats(prefill_tokens=3 - 3 * seq, draft_tokens=4, accepted_tokens=2, steps=2,
                                      wall_seconds=0.25)
        buf.internal.CommitChunk(buffer_pb2.CommitChunkRequest(request_id=rid, seq=seq, token_ids=toks,
                                                               logprobs=[-0.1] * len(toks), finish_reason=reason,
                                                               stats=stats))
    r = next(iter(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="c"), timeout=10))).result
    assert (r.stats.prefill_tokens, r.stats.draft_tokens, r.stats.accepted_tokens, r.stats.steps) == (3, 8, 4, 4)
    assert abs(r.stats.wall_seconds - 0.5) < 1e-9 and r.finish_reason == STOP and r.latency_seconds >= 0


def test_finished_request_keeps_duplicate_detection_without_chunk_records(buf: BufferHandle) -> None:
    rid = _one(buf, max_tokens=8)
    commit(buf.internal, rid, 0, [5, 6])
    commit(buf.internal, rid, 1, [7])
    commit(buf.internal, rid, 2, [8, 9], reason=STOP)
    # The chunks were folded into the result (one copy of the tokens on disk)...
    assert list(buf.core._store.scan(b"c/c/")) == []
    # ...and retries of any chunk are still recognized, or refused when they differ.
    assert [commit(buf.internal, rid, s, t, reason=r).duplicate
            for s, t, r in [(0, [5, 6], CHUNK), (1, [7], CHUNK), (2, [8, 9], STOP)]] == [True] * 3
    expect_error(lambda: commit(buf.internal, rid, 1, [6]), grpc.StatusCode.ABORTED, "seq")
    expect_error(lambda: commit(buf.internal, rid, 2, [8, 9], reason=CHUNK), grpc.StatusCode.ABORTED, "seq")


def test_non_finite_stats_and_impossible_logprobs_are_refused(buf: BufferHandle) -> None:
    """Review, session 18: a NaN or infinite wall_seconds passed the negative check (every comparison
    with NaN is false), and NaN or positive logprobs were stored as the response's."""
    rid = _one(buf, max_tokens=4)
    for bad in (float("nan"), float("inf"), float("-inf")):
        stats = common_pb2.ChunkStats(wall_seconds=bad)
        expect_error(lambda st=stats: commit(buf.internal, rid, 0, [5], stats=st), IA,  # type: ignore[misc]
                     "stats.wall_seconds")
    for lps, field in (([-0.5, float("nan"), -0.1], "logprobs[1]"), ([-0.5, 0.01, -0.1], "logprobs[1]"),
                       ([float("inf"), -0.5, -0.1], "logprobs[0]"), ([-0.5, -0.1, 2.0], "logprobs[2]")):
        expect_error(lambda lp=lps: commit(buf.internal, rid, 0, [5, 6, 7], logprobs=lp), IA, field)  # type: ignore[misc]
    # None of that changed the request. A float32 log-softmax a hair above 0 is rounding, and -inf
    # (probability 0) is a log-probability: both are taken.
    assert commit(buf.internal, rid, 0, [5, 6, 7], logprobs=[0.0, 5e-5, float("-inf")]).next_seq == 1
