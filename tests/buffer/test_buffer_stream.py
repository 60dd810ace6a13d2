"""WatchWork feed, StreamResults (live, resumable), GetBatch and CancelBatch."""

from __future__ import annotations

import threading
from typing import Any

import grpc
from buffer_helpers import (
    STOP,
    BufferHandle,
    Watcher,
    commit,
    expect_error,
    finish_all,
    group,
    snapshot,
    submit,
    token_for,
)
from seer.v1 import buffer_pb2, rollout_pb2


def test_watch_snapshot_then_live_events(buf: BufferHandle) -> None:
    submit(buf.rollout, "w1", [group(group_size=2)])
    commit(buf.internal, "w1/0/1", 0, [9, 10])
    watchers = [Watcher(buf.internal, "a"), Watcher(buf.internal, "b")]
    try:
        for w in watchers:
            snap: dict[str, buffer_pb2.WorkItem] = {}
            ev = w.next()
            assert ev.HasField("policy") and ev.policy.version == 0  # the snapshot opens with it
            ev = w.next()
            while not ev.HasField("snapshot_done"):
                snap.update((it.request_id, it) for it in ev.added.items)
                ev = w.next()
            assert sorted(snap) == ["w1/0/0", "w1/0/1"]
            # The resume point of a partly generated request.
            assert (list(snap["w1/0/1"].output_token_ids), snap["w1/0/1"].next_seq) == ([9, 10], 1)
        submit(buf.rollout, "w2", [group(group_size=1)])
        buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="w1"))
        for w in watchers:
            added = list(w.next().added.items)
            assert [(it.request_id, it.next_seq) for it in added] == [("w2/0/0", 0)]
            cancelled = {w.next().cancelled_request_id for _ in range(2)}
            assert cancelled == {"w1/0/0", "w1/0/1"}
    finally:
        for w in watchers:
            w.close()
    assert [i.request_id for i in snapshot(buf.internal)] == ["w2/0/0"]


def _stream(buf: BufferHandle, batch_id: str, cursor: int = 0, timeout: float = 10) -> list[Any]:
    return list(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch_id, cursor=cursor),
                                          timeout=timeout))


def test_stream_delivers_results_as_they_finish_and_resumes(buf: BufferHandle) -> None:
    submit(buf.rollout, "s", [group(group_size=3, labels={"answer": "5"}, prompt_key="pk")])
    items = snapshot(buf.internal)
    got: list[Any] = []
    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="s"), timeout=20)
    reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
    reader.start()
    finish_all(buf.internal, items[:1], length=3)
    finish_all(buf.internal, items[1:], length=4)
    reader.join(10)
    assert not reader.is_alive(), "the stream must end when the batch is complete"
    assert [r.cursor for r in got] == [1, 2, 3]
    assert sorted(r.result.request_id for r in got) == ["s/0/0", "s/0/1", "s/0/2"]
    by_id = {r.result.request_id: r.result for r in got}
    assert list(by_id["s/0/0"].token_ids) == [token_for("s/0/0", p) for p in range(3)]
    assert by_id["s/0/1"].labels["answer"] == "5" and by_id["s/0/1"].prompt_key == "pk"
    assert all(r.result.policy_version == 0 and r.result.finish_reason == STOP for r in got)
    # Resume from any cursor gives exactly the rest, in the same order.
    for cursor in range(4):
        assert [r.result.request_id for r in _stream(buf, "s", cursor)] == [r.result.request_id for r in got[cursor:]]
    expect_error(lambda: _stream(buf, "s", 4), grpc.StatusCode.OUT_OF_RANGE, "cursor")
    expect_error(lambda: _stream(buf, "missing"), grpc.StatusCode.NOT_FOUND, "batch_id")


def test_result_text_is_detokenized(buf: BufferHandle) -> None:
    submit(buf.rollout, "t", [group(group_size=1)])
    commit(buf.internal, "t/0/0", 0, [13, 14, 15, 12, 16], reason=STOP)
    assert _stream(buf, "t")[0].result.text == "cat sat on the mat"


def test_cancel_ends_stream_and_keeps_finished_results(buf: BufferHandle) -> None:
    submit(buf.rollout, "x", [group(group_size=3)])
    commit(buf.internal, "x/0/0", 0, [5], reason=STOP)
    commit(buf.internal, "x/0/1", 0, [5, 6])
    got: list[Any] = []
    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="x"), timeout=20)
    reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
    reader.start()
    resp = buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="x"))
    assert (resp.state, resp.num_cancelled) == (rollout_pb2.BATCH_STATE_CANCELLED, 2)
    reader.join(10)
    assert not reader.is_alive() and [r.result.request_id for r in got] == ["x/0/0"]
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="x", include_requests=True))
    assert (status.state, status.num_finished, status.num_cancelled, status.generated_tokens) == (
        rollout_pb2.BATCH_STATE_CANCELLED, 1, 2, 3)
    states = {r.request_id: r.state for r in status.requests}
    assert states == {"x/0/0": rollout_pb2.REQUEST_STATE_FINISHED, "x/0/1": rollout_pb2.REQUEST_STATE_CANCELLED,
                      "x/0/2": rollout_pb2.REQUEST_STATE_CANCELLED}
    # Cancelling again changes nothing and answers as the first call did (a caller retrying after a
    # lost reply learns the same count); a completed batch cannot be cancelled.
    again = buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="x"))
    assert (again.state, again.num_cancelled) == (rollout_pb2.BATCH_STATE_CANCELLED, 2)
    assert buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="x")).num_cancelled == 2
    submit(buf.rollout, "y", [group(group_size=1)])
    commit(buf.internal, "y/0/0", 0, [5], reason=STOP)
    resp = buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="y"))
    assert (resp.state, resp.num_cancelled) == (rollout_pb2.BATCH_STATE_COMPLETED, 0)
    expect_error(lambda: buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="zz")),
                 grpc.StatusCode.NOT_FOUND, "batch_id")


def test_get_batch_counts(buf: BufferHandle) -> None:
    submit(buf.rollout, "g", [group(group_size=2), group(group_size=1)])
    commit(buf.internal, "g/1/0", 0, [5, 6], reason=STOP)
    commit(buf.internal, "g/0/0", 0, [5])
    s = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="g"))
    assert (s.state, s.num_requests, s.num_finished, s.generated_tokens, len(s.requests)) == (
        rollout_pb2.BATCH_STATE_RUNNING, 3, 1, 3, 0)
    full = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="g", include_requests=True))
    st = {r.request_id: (r.state, r.generated_tokens, r.num_chunks) for r in full.requests}
    assert st == {"g/0/0": (rollout_pb2.REQUEST_STATE_RUNNING, 1, 1),
                  "g/0/1": (rollout_pb2.REQUEST_STATE_PENDING, 0, 0),
                  "g/1/0": (rollout_pb2.REQUEST_STATE_FINISHED, 2, 1)}
