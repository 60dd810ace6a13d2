"""Dispatcher regressions of the session-22 review, in-process with the scripted buffer and worker
links of test_dispatcher_faults (no gRPC, no model): the real Dispatcher and dispatch loop.

- a snapshot taken before one of our commits was acknowledged does not roll the request back (the
  committed chunk would run again and conflict);
- an abort the buffer refused is sent again by the snapshot its resync brings (it was skipped as
  "abort on its way", and the request stayed listed: its batch never completed);
- cancelling requests does not block the work feed on the workers' Abort calls;
- a chunk thread that starts after its dispatch ended sends nothing;
- the "worker removed" log line keeps its reason;
- a worker dropped for a failed weight load has its link closed, and one whose link was closed
  under the load does not count as loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from seer.v1 import buffer_pb2, worker_pb2

from services.common.errors import Aborted, DeadlineExceeded, FailedPrecondition, Unavailable

from .test_dispatcher_faults import ABORTED, CHUNK, FakeBuffer, FakeWorkerLink, Rig, chunk_events, item, wait_for


class SeqBuffer(FakeBuffer):
    """Checks seqs as the real buffer does: a seq already committed with other tokens is ABORTED, a
    gap FAILED_PRECONDITION, the same tokens again a duplicate."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: dict[str, list[list[int]]] = {}
        self.on_commit: Callable[[buffer_pb2.CommitChunkRequest], None] = lambda req: None

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        with self.lock:
            self.commits.append(req)
            got = self.chunks.setdefault(req.request_id, [])
            if req.seq < len(got):
                if got[req.seq] != list(req.token_ids):
                    raise Aborted(f"seq: chunk {req.seq} was already committed with other tokens")
                return buffer_pb2.CommitChunkResponse(accepted=True, duplicate=True, next_seq=len(got))
            if req.seq > len(got):
                raise FailedPrecondition(f"seq: expected chunk {len(got)}, got {req.seq}")
            got.append(list(req.token_ids))
        self.on_commit(req)
        return buffer_pb2.CommitChunkResponse(accepted=True, next_seq=len(got),
                                              request_finished=req.finish_reason != CHUNK)


def test_a_snapshot_older_than_an_acknowledged_commit_does_not_roll_the_request_back(
    make_rig: Callable[..., Rig],
) -> None:
    buf = SeqBuffer()
    t = make_rig(buf)
    resyncs: list[float] = []
    t.d._request_resync = lambda: resyncs.append(time.monotonic())  # type: ignore[method-assign]
    runs = {"n": 0}

    def sampled(wid: str, req: worker_pb2.RunChunkRequest) -> list[worker_pb2.RunChunkResponse]:
        # Another sample on every run (temperature > 0): a chunk run twice differs.
        runs["n"] += 1
        events = chunk_events(req)
        for ev in events:
            if ev.WhichOneof("event") == "tokens":
                ev.tokens.token_ids[:] = [tok + 1000 * runs["n"] for tok in ev.tokens.token_ids]
        return events

    t.workers.script = sampled

    def park(req: buffer_pb2.CommitChunkRequest) -> None:
        with t.d._cond:
            t.d._paused = True  # keep it queued at its chunk boundary (as in a KV-bound cluster)

    buf.on_commit = park
    t.register("w0")
    listed = item("a", max_tokens=24)  # what the buffer's snapshot says: nothing committed yet
    opened_at = time.monotonic()  # the watch opens; the buffer takes its snapshot then
    t.run()
    t.d._add_items([listed])
    wait_for(lambda: len(buf.of("a")) == 1)
    wait_for(lambda: t.d._requests["a"].dispatch_token is None)
    t.d._apply_snapshot([listed], opened_at)  # arrives after the commit's acknowledgement
    with t.d._cond:
        r = t.d._requests["a"]
        assert (r.next_seq, len(r.output)) == (1, 8)
        buf.on_commit = lambda req: None
        t.d._paused = False
        t.d._dirty = True
        t.d._cond.notify_all()
    wait_for(lambda: "a" not in t.d._requests)
    assert [c.seq for c in buf.of("a")] == [0, 1, 2]  # each chunk once, none refused
    assert resyncs == []
    # A snapshot taken after the acknowledgement is still the buffer's word (e.g. a chunk whose
    # commit we thought failed had landed): the state it carries is taken, newer or older.
    t2 = make_rig(SeqBuffer())
    t2.register("w0")
    t2.d._add_items([item("b", max_tokens=24, output=[5] * 8, next_seq=1)])
    with t2.d._cond:
        t2.d._requests["b"].acked_at = time.monotonic()
    t2.d._apply_snapshot([item("b", max_tokens=24)], time.monotonic())
    assert (t2.d._requests["b"].next_seq, t2.d._requests["b"].output) == (0, [])


class RefuseFirstAbort(FakeBuffer):
    def __init__(self) -> None:
        super().__init__()
        self.abort_calls = 0

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        if req.finish_reason == ABORTED:
            with self.lock:
                self.abort_calls += 1
                first = self.abort_calls == 1
            if first:
                raise FailedPrecondition("seq: expected chunk 1, got 0")
        return super().commit(req, timeout)


def test_an_abort_refused_is_sent_again_by_the_snapshot_its_resync_brings(make_rig: Callable[..., Rig]) -> None:
    buf = RefuseFirstAbort()
    t = make_rig(buf)
    t.register("w0", pages=4)  # 64 tokens of KV: a 100-token prompt fits nowhere and is failed
    listed = item("big", prompt_len=100, max_tokens=16)
    # The watch thread applies the snapshot the resync asks for at once: before the refused abort's
    # thread has finished with it.
    t.d._request_resync = lambda: t.d._apply_snapshot([listed])  # type: ignore[method-assign]
    t.run()
    t.d._add_items([listed])
    wait_for(lambda: [c.finish_reason for c in buf.of("big")] == [ABORTED])  # the second abort got through
    assert buf.abort_calls == 2


def test_cancelling_requests_does_not_block_the_work_feed_on_worker_aborts(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hung_abort(self: FakeWorkerLink, request_id: str, timeout: float = 5.0, *, dispatch_epoch: int = 0) -> bool:
        time.sleep(1.0)  # a worker whose server hangs while its heartbeats still come
        raise DeadlineExceeded("Abort timed out")

    monkeypatch.setattr(FakeWorkerLink, "abort", hung_abort)
    t = make_rig()
    t.workers.gate.clear()  # the chunks keep running
    t.register("w0")
    t.run()
    t.d._add_items([item(f"r{i}") for i in range(4)])
    wait_for(lambda: sum(r.dispatch_token is not None for r in t.d._requests.values()) == 4)
    t0 = time.monotonic()
    for i in range(4):  # the watch thread handling a batch's cancel events
        t.d._cancel_request(f"r{i}")
    assert time.monotonic() - t0 < 0.5  # was 4 x the Abort's time


def test_a_chunk_thread_that_starts_after_its_dispatch_ended_sends_nothing(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = make_rig()
    t.workers.gate.clear()
    t.register("w0", incarnation="a")
    release = threading.Event()
    first = threading.Event()
    submit = t.d._pool.submit

    def delayed_first(fn: Callable[..., object], *args: Any) -> Future[object]:
        if first.is_set():
            return submit(fn, *args)
        first.set()

        def after_release() -> object:
            release.wait(10)
            return fn(*args)

        return submit(after_release)

    monkeypatch.setattr(t.d._pool, "submit", delayed_first)
    t.run()
    t.d._add_items([item("a")])
    wait_for(first.is_set)
    t.register("w0", incarnation="b")  # restarted before the chunk's thread ran: the request moves on
    wait_for(lambda: len(t.workers.requests) == 1)  # the new attempt
    live_epoch = t.workers.requests[0][1].dispatch_epoch
    release.set()  # the first dispatch's thread runs now
    time.sleep(0.3)
    assert len(t.workers.requests) == 1
    with t.d._cond:
        assert t.d._requests["a"].last_epoch == live_epoch
        assert t.d._in_flight == 1
    t.workers.gate.set()
    wait_for(lambda: "a" not in t.d._requests)
    assert t.d._in_flight == 0


def test_the_worker_removed_line_keeps_its_reason(make_rig: Callable[..., Rig],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    t = make_rig()
    t.register("w0", incarnation="a")
    with caplog.at_level(logging.INFO):
        t.register("w0", incarnation="b")  # a restarted worker: the old registration is removed
    reasons = [r.fields["reason"] for r in caplog.records if r.getMessage() == "worker removed"]  # type: ignore[attr-defined]
    assert reasons and all(reasons), reasons


@pytest.mark.parametrize("failure", [Unavailable("connection reset"), ValueError("RPC on a closed channel")])
def test_a_worker_that_fails_its_weight_load_is_dropped_and_its_link_closed(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, failure: Exception,
) -> None:
    closed: list[str] = []

    def load(self: FakeWorkerLink, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        if self.worker_id == "w1":
            raise failure  # ValueError: its channel was closed under the load
        return worker_pb2.LoadWeightsResponse()

    monkeypatch.setattr(FakeWorkerLink, "load_weights", load)
    monkeypatch.setattr(FakeWorkerLink, "close", lambda self: closed.append(self.worker_id))
    t = make_rig()
    t.register("w0")
    t.register("w1")
    assert t.d.switch_weights(1, "/ckpt/1")[0] == 1  # w0 loaded it
    assert set(t.d._workers) == {"w0"}  # w1 did not confirm the version: not counted as loaded
    assert closed == ["w1"]
