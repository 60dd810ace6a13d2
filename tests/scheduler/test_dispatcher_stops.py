"""Dispatcher findings of the session-25 audit, driven in-process like test_dispatcher_faults: the
real Dispatcher and its dispatch loop. Scripted worker and buffer links (no gRPC, no model) only
where they inject what a real component does not do on cue: a worker breaking the chunk protocol,
a chunk held running until the scheduler stops it, a commit held mid-call. The history tests run
on the real buffer over loopback gRPC.

- a worker that ends chunks ABORTED nobody asked for, or ends the stream without a ChunkDone, costs
  the request an attempt and counts towards the worker's failure quarantine (it was retried free:
  the request looped on such a worker for ever);
- a batch id submitted again while the old request's chunk runs: the old chunk's stream is
  cancelled and the chunk aborted on the worker by its own epoch (it ran to its end);
- a request missing from a reconnect snapshot while its chunk runs is aborted (it ran to its end,
  for a commit the buffer refuses), unless its chunk is being committed;
- history priors are not fetched from the buffer under a policy that does not use them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc, worker_pb2

from services.buffer.app import start as start_buffer
from services.buffer.config import BufferConfig
from services.common.server import RunningServer
from services.scheduler.links import BufferLink, Cancelled
from services.scheduler.service import MAX_CHUNK_ATTEMPTS

from .test_dispatcher_faults import ABORTED, CHUNK, FakeBuffer, FakeWorkerLink, FakeWorkers, Rig, item, wait_for

# ---- a worker breaking the chunk protocol -----------------------------------------------------------


def _done(reason: int) -> worker_pb2.RunChunkResponse:
    return worker_pb2.RunChunkResponse(done=worker_pb2.ChunkDone(finish_reason=reason))


def _token() -> worker_pb2.RunChunkResponse:
    return worker_pb2.RunChunkResponse(tokens=worker_pb2.TokenDelta(token_ids=[7], logprobs=[-0.5]))


# Scripted: the real worker never breaks the protocol, which is the fault under test.
PROTOCOL_BREAKS: dict[str, list[worker_pb2.RunChunkResponse]] = {
    "aborted unasked": [_token(), _done(ABORTED)],
    "no ChunkDone": [_token()],
    "empty stream": [],
}


def _fails_after_its_attempts(make_rig: Callable[..., Rig], events: list[worker_pb2.RunChunkResponse]) -> None:
    t = make_rig()
    t.register("w0")
    t.workers.script = lambda wid, req: list(events)
    t.run()
    t.d._add_items([item("a")])
    # Failed in the buffer (an ABORTED commit) after its attempts; it looped for ever before.
    wait_for(lambda: [c.finish_reason for c in t.buffer.of("a")] == [ABORTED], timeout=5)
    assert len(t.workers.requests) == MAX_CHUNK_ATTEMPTS
    assert "a" not in t.d._requests


def test_a_worker_ending_chunks_aborted_unasked_costs_attempts(make_rig: Callable[..., Rig]) -> None:
    _fails_after_its_attempts(make_rig, PROTOCOL_BREAKS["aborted unasked"])


def test_a_worker_ending_streams_without_chunk_done_costs_attempts(make_rig: Callable[..., Rig]) -> None:
    _fails_after_its_attempts(make_rig, PROTOCOL_BREAKS["no ChunkDone"])
    _fails_after_its_attempts(make_rig, PROTOCOL_BREAKS["empty stream"])


def test_a_worker_breaking_the_protocol_is_quarantined_and_the_batch_completes(
        make_rig: Callable[..., Rig]) -> None:
    t = make_rig(worker_failure_limit=3)
    t.register("good")
    t.register("bad")
    t.workers.script = lambda wid, req: (list(PROTOCOL_BREAKS["aborted unasked"]) if wid == "bad"
                                         else FakeWorkers().script(wid, req))
    t.run()
    rids = [f"r{i}" for i in range(12)]
    t.d._add_items([item(rid) for rid in rids])  # 12 groups (item(): one group per request)
    wait_for(lambda: not t.d._requests)
    assert t.d.core.is_quarantined("bad")
    assert "the chunk ended FINISH_REASON_ABORTED unasked" in t.d.core.quarantine_reason("bad")
    for rid in rids:  # every request completed on the good worker, none given up on
        assert t.buffer.of(rid)[-1].finish_reason != ABORTED


def test_a_chunk_we_aborted_costs_no_attempt(make_rig: Callable[..., Rig]) -> None:
    """The other side: a cancelled request's chunk ending ABORTED (our own abort) counts nothing.
    Scripted: the chunk must still be running (gated) when the cancel comes."""
    t = make_rig()
    t.register("w0")
    t.workers.gate.clear()
    t.workers.script = lambda wid, req: list(PROTOCOL_BREAKS["aborted unasked"])
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: len(t.workers.requests) == 1)
    t.d._cancel_request("a")
    t.workers.gate.set()
    wait_for(lambda: t.d.stats().in_flight_chunks == 0)
    assert t.d.core.stats()["worker_fault_quarantines"] == 0
    assert t.buffer.of("a") == [] and len(t.workers.requests) == 1


# ---- stopping a chunk the scheduler no longer wants -------------------------------------------------


# Scripted: a real worker's chunk ends when its tokens are done; these tests need one that runs until
# the scheduler cancels or aborts it, at a moment the test picks.


class CancellableStream:
    """A RunChunk stream that waits for the workers' gate, or ends CANCELLED at cancel() (as
    links.Stream does: Cancelled, local)."""

    def __init__(self, workers: FakeWorkers, events: Iterable[worker_pb2.RunChunkResponse]) -> None:
        self.workers, self.events = workers, events
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[worker_pb2.RunChunkResponse]:
        while not self.workers.gate.wait(0.01):
            if self.cancelled.is_set():
                raise Cancelled("CANCELLED: Locally cancelled by application!", local=True)
        yield from self.events

    def cancel(self) -> None:
        self.cancelled.set()


class CancellableWorkers(FakeWorkers):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[CancellableStream] = []

    def __call__(self, address: str) -> FakeWorkerLink:
        return CancellableLink(self, address.split(":")[0])


class CancellableLink(FakeWorkerLink):
    workers: CancellableWorkers

    def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Any:
        self.workers.requests.append((self.worker_id, req))
        stream = CancellableStream(self.workers, self.workers.script(self.worker_id, req))
        self.workers.streams.append(stream)
        return stream


def _resubmitted(rid: str, submit_seq: int) -> buffer_pb2.WorkItem:
    it = item(rid)
    it.submit_seq = submit_seq
    return it


def test_a_batch_id_submitted_again_stops_the_old_requests_chunk(make_rig: Callable[..., Rig]) -> None:
    workers = CancellableWorkers()
    t = make_rig(workers=workers)
    t.register("w0")
    t.workers.gate.clear()  # chunks run until cancelled
    t.run()
    t.d._add_items([_resubmitted("a", 1)])
    wait_for(lambda: len(t.workers.requests) == 1)
    old_epoch = t.workers.requests[0][1].dispatch_epoch
    t.d._add_items([_resubmitted("a", 2)])  # the batch id again: a new request under the old id
    wait_for(lambda: len(t.workers.requests) == 2)  # the new request runs
    new_epoch = t.workers.requests[1][1].dispatch_epoch
    assert new_epoch > old_epoch
    # The old stream is cancelled, and the old attempt (only it: its own epoch) aborted on the worker.
    wait_for(lambda: workers.streams[0].cancelled.is_set() and workers.aborts == [("a", old_epoch)])
    assert not workers.streams[1].cancelled.is_set()
    wait_for(lambda: t.d.stats().in_flight_chunks == 1)  # the old dispatch settled, the new one runs
    t.workers.gate.set()
    wait_for(lambda: "a" not in t.d._requests)
    assert {c.submit_seq for c in t.buffer.of("a")} == {2}  # nothing of the old request committed
    assert t.d.stats().in_flight_chunks == 0


def test_a_request_missing_from_a_snapshot_has_its_chunk_aborted(make_rig: Callable[..., Rig]) -> None:
    workers = CancellableWorkers()
    t = make_rig(workers=workers)
    t.register("w0")
    t.workers.gate.clear()
    t.run()
    t.d._add_items([item("gone"), item("kept")])
    wait_for(lambda: len(t.workers.requests) == 2)
    epochs = {req.request_id: req.dispatch_epoch for _, req in t.workers.requests}
    streams = {req.request_id: s for (_, req), s in zip(t.workers.requests, workers.streams, strict=True)}
    t.d._apply_snapshot([item("kept")])  # "gone" was cancelled while the feed reconnected
    wait_for(lambda: streams["gone"].cancelled.is_set() and t.workers.aborts == [("gone", epochs["gone"])])
    assert "gone" not in t.d._requests and not streams["kept"].cancelled.is_set()
    wait_for(lambda: t.d.stats().in_flight_chunks == 1)
    t.workers.gate.set()
    wait_for(lambda: not t.d._requests)
    assert t.buffer.of("gone") == []
    assert [req.request_id for _, req in t.workers.requests].count("gone") == 1  # never run again


class HeldCommitBuffer(FakeBuffer):
    """Holds every commit until `release` is set (scripted: the real buffer answers a commit at once,
    and the test needs a snapshot to land while one is under way)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        self.entered.set()
        self.release.wait(10)
        return super().commit(req, timeout)


def test_a_request_missing_from_a_snapshot_while_its_chunk_commits_is_left_to_the_commit(
        make_rig: Callable[..., Rig]) -> None:
    """Its commit may be what finished it (the snapshot taken after): the commit settles it, and the
    core records it finished, not cancelled."""
    buf = HeldCommitBuffer()
    t = make_rig(buffer=buf, chunk_size=16)
    t.register("w0")
    t.run()
    t.d._add_items([item("a")])  # one chunk: its commit finishes the request
    wait_for(buf.entered.is_set)
    t.d._apply_snapshot([])
    assert "a" in t.d._requests and t.workers.aborts == []
    buf.release.set()
    wait_for(lambda: not t.d._requests)
    assert [c.finish_reason for c in buf.of("a")] != [CHUNK] and t.d.core.history("k-a") == [16]


# ---- history priors only for the policy that uses them ----------------------------------------------
# The real buffer (RocksDB in a temp dir, loopback gRPC) and the scheduler's real BufferLink, which
# counts its GetHistory calls.


class CountingBufferLink(BufferLink):
    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.calls = 0

    def history(self, prompt_keys: Sequence[str], timeout: float = 10.0) -> list[buffer_pb2.PromptHistory]:
        self.calls += 1
        return super().history(prompt_keys, timeout)


@pytest.fixture
def real_buffer(tmp_path: Path) -> Iterator[RunningServer]:
    """A real buffer whose history holds prompt key "k-a" with lengths [5, 9] (a batch of one group of
    two, run to completion through CommitChunk)."""
    running, _core = start_buffer(BufferConfig(port=0, data_dir=str(tmp_path / "buffer"), model_dir="",
                                               grace_seconds=0.0))
    ch = grpc.insecure_channel(running.address)
    try:
        rollout_pb2_grpc.RolloutServiceStub(ch).SubmitBatch(rollout_pb2.SubmitBatchRequest(
            batch_id="b-history", groups=[rollout_pb2.PromptGroup(
                prompt_key="k-a", prompt_token_ids=[1, 2, 3], group_size=2, max_tokens=16)]), timeout=10)
        internal = buffer_pb2_grpc.BufferInternalServiceStub(ch)
        feed = internal.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="test"), timeout=10)
        items = [i for ev in itertools.takewhile(lambda ev: not ev.HasField("snapshot_done"), feed)
                 for i in ev.added.items]
        feed.cancel()
        for it, length in zip(sorted(items, key=lambda i: i.request_id), (5, 9), strict=True):
            internal.CommitChunk(buffer_pb2.CommitChunkRequest(
                request_id=it.request_id, seq=it.next_seq, token_ids=[7] * length, logprobs=[-0.5] * length,
                finish_reason=common_pb2.FINISH_REASON_STOP, worker_id="w0", submit_seq=it.submit_seq), timeout=10)
        yield running
    finally:
        ch.close()
        running.stop(0)


def _keyed(rid: str, key: str) -> buffer_pb2.WorkItem:
    it = item(rid)
    it.prompt_key = key
    return it


def test_no_history_is_fetched_under_a_policy_without_priors(
        make_rig: Callable[..., Rig], real_buffer: RunningServer) -> None:
    for policy in ("seer", "divided", "baseline"):
        link = CountingBufferLink(real_buffer.address)
        t = make_rig(buffer=link, policy=policy)
        t.d._apply_snapshot([_keyed("a1", "k-a"), _keyed("b1", "k-b")])
        t.d._add_items([_keyed("a2", "k-a"), _keyed("c1", "k-c")])
        assert link.calls == 0, policy
        assert t.d.core.history("k-a") is None, policy


def test_history_is_fetched_under_seer_history(make_rig: Callable[..., Rig], real_buffer: RunningServer) -> None:
    link = CountingBufferLink(real_buffer.address)
    t = make_rig(buffer=link, policy="seer_history")
    t.d._apply_snapshot([_keyed("a1", "k-a")])
    t.d._add_items([_keyed("c1", "k-c")])
    assert link.calls == 2 and t.d.core._groups["g-a1"].prior is not None
    assert t.d.core.history("k-a") == [5, 9]
