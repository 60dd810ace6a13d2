"""Dispatcher regressions from the code review, driven in-process: the real Dispatcher and its
dispatch loop, with a scripted buffer link and scripted worker links (no gRPC, no model).

- a request given up on, whose ABORTED commit did not get through, listed again by a snapshot: the
  abort is sent again (at the snapshot's next_seq), the request is not tracked (it would never run);
- a request that fits on no worker is failed in the buffer (ABORTED), the others run;
- a worker's re-registration with the same incarnation keeps its chunks running; no
  re-registration gets a worker out of quarantine;
- a chunk with impossible stats is not committed and its worker is quarantined;
- a chunk that says LENGTH before max_tokens is malformed;
- a snapshot that changes a queued request's output resyncs the core's generated count;
- RegisterWorker errors name the proto's field paths;
- every dispatch of a request carries a larger dispatch_epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import pytest
from seer.v1 import buffer_pb2, common_pb2, scheduler_pb2, worker_pb2

from services.common.errors import InvalidArgument, Unavailable
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import Dispatch
from services.scheduler.links import BufferLink, WorkerLink
from services.scheduler.service import MAX_CHUNK_ATTEMPTS, Dispatcher

CHUNK, LENGTH = common_pb2.FINISH_REASON_CHUNK, common_pb2.FINISH_REASON_LENGTH
ABORTED = common_pb2.FINISH_REASON_ABORTED

# A chunk's events: a list, or a generator (one that raises refuses the chunk mid-stream).
Script = Callable[[str, worker_pb2.RunChunkRequest], Iterable[worker_pb2.RunChunkResponse]]


def chunk_events(req: worker_pb2.RunChunkRequest, *, reason: int | None = None, n: int | None = None,
                 stats: common_pb2.ChunkStats | None = None) -> list[worker_pb2.RunChunkResponse]:
    """What an honest worker streams for the chunk (n tokens; LENGTH at max_tokens)."""
    start = len(req.output_token_ids)
    n = min(req.max_new_tokens, req.max_tokens - start) if n is None else n
    if reason is None:
        reason = LENGTH if start + n >= req.max_tokens else CHUNK
    toks = [worker_pb2.RunChunkResponse(tokens=worker_pb2.TokenDelta(token_ids=[7 + start + i], logprobs=[-0.5]))
            for i in range(n)]
    done = worker_pb2.ChunkDone(finish_reason=reason, policy_version=0,
                                stats=stats if stats is not None else common_pb2.ChunkStats(steps=n))
    return [*toks, worker_pb2.RunChunkResponse(done=done)]


class FakeBuffer:
    """A BufferLink that accepts every chunk in order; aborts can be made to fail (Unavailable)."""

    address = "fake-buffer:1"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.commits: list[buffer_pb2.CommitChunkRequest] = []
        self.aborts_unavailable = False

    def __call__(self, address: str) -> FakeBuffer:  # the Dispatcher's link factory
        return self

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        if req.finish_reason == ABORTED and self.aborts_unavailable:
            raise Unavailable("buffer briefly unreachable")
        with self.lock:
            self.commits.append(req)
        return buffer_pb2.CommitChunkResponse(accepted=True, next_seq=req.seq + 1,
                                              request_finished=req.finish_reason != CHUNK)

    def watch(self, watcher_id: str) -> Any:
        raise Unavailable("no work feed in these tests")

    def history(self, prompt_keys: Any, timeout: float = 10.0) -> list[buffer_pb2.PromptHistory]:
        return []

    def close(self) -> None:
        pass

    def of(self, rid: str) -> list[buffer_pb2.CommitChunkRequest]:
        with self.lock:
            return [c for c in self.commits if c.request_id == rid]


class FakeWorkers:
    """WorkerLinks by address ("<worker_id>:1"); each chunk's events come from `script`."""

    def __init__(self) -> None:
        self.script: Script = lambda wid, req: chunk_events(req)
        self.requests: list[tuple[str, worker_pb2.RunChunkRequest]] = []
        self.aborts: list[tuple[str, int]] = []  # (request_id, dispatch_epoch)
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, address: str) -> FakeWorkerLink:
        return FakeWorkerLink(self, address.split(":")[0])


class FakeWorkerLink:
    def __init__(self, workers: FakeWorkers, worker_id: str) -> None:
        self.workers, self.worker_id = workers, worker_id
        self.ran: list[str] = []  # request ids of the chunks sent over this link (this process)
        self.aborted: list[str] = []
        self.closed = False

    def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Iterator[worker_pb2.RunChunkResponse]:
        self.workers.requests.append((self.worker_id, req))
        self.ran.append(req.request_id)
        events = self.workers.script(self.worker_id, req)

        def stream() -> Iterator[worker_pb2.RunChunkResponse]:
            self.workers.gate.wait(10)
            yield from events

        return stream()

    def load_weights(self, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        return worker_pb2.LoadWeightsResponse()

    def abort(self, request_id: str, timeout: float = 5.0, *, dispatch_epoch: int = 0) -> bool:
        self.workers.aborts.append((request_id, dispatch_epoch))
        self.aborted.append(request_id)
        return False

    def close(self) -> None:
        self.closed = True


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def capacity(pages: int = 4096) -> scheduler_pb2.WorkerCapacity:
    return scheduler_pb2.WorkerCapacity(total_kv_pages=pages, page_size=16, max_batch_size=8, max_context=8192)


def item(rid: str, *, prompt_len: int = 6, max_tokens: int = 16, output: list[int] | None = None,
         next_seq: int = 0) -> buffer_pb2.WorkItem:
    return buffer_pb2.WorkItem(
        request_id=rid, batch_id="b", group_id=f"g-{rid}", group_index=0, sample_index=0, group_size=1,
        prompt_key=f"k-{rid}", prompt_token_ids=[1] * prompt_len, output_token_ids=output or [],
        max_tokens=max_tokens, next_seq=next_seq,
    )


class Rig:
    def __init__(self, **cfg: Any) -> None:
        self.buffer = FakeBuffer()
        self.workers = FakeWorkers()
        values: dict[str, Any] = {"port": 0, "buffer_address": FakeBuffer.address, "policy": "divided",
                                  "chunk_size": 8, "heartbeat_interval": 30.0, "commit_timeout": 0.3}
        values.update(cfg)
        # The fakes stand in for the links at the Dispatcher's one seam: they implement what it
        # calls (duck-typed; a RunChunk stream here is any iterator of events).
        self.d = Dispatcher(SchedulerConfig(**values),
                            buffer_link=cast(Callable[[str], BufferLink], self.buffer),
                            worker_link=cast(Callable[[str], WorkerLink], self.workers))
        self._loop: threading.Thread | None = None

    def register(self, wid: str, incarnation: str = "", pages: int = 4096) -> None:
        self.d.register_worker(wid, f"{wid}:1", capacity(pages), "fake", 0, incarnation)

    def run(self) -> None:
        """Only the dispatch loop (no work feed, no liveness): the tests feed snapshots themselves."""
        self._loop = threading.Thread(target=self.d._dispatch_loop, daemon=True)
        self._loop.start()

    def close(self) -> None:
        self.workers.gate.set()
        self.d.stop()
        if self._loop is not None:
            self._loop.join(5)


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**cfg: Any) -> Rig:
        r = Rig(**cfg)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# ---- bug 1: a request given up on comes back in a snapshot ---------------------------------------


def test_a_dropped_request_listed_again_gets_its_abort_again(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0")
    # Every attempt is malformed (two logprobs for one token) until the request is dropped.
    t.workers.script = lambda wid, req: [
        worker_pb2.RunChunkResponse(tokens=worker_pb2.TokenDelta(token_ids=[7], logprobs=[-0.5, -0.5])),
        worker_pb2.RunChunkResponse(done=worker_pb2.ChunkDone(finish_reason=CHUNK)),
    ]
    t.buffer.aborts_unavailable = True  # its ABORTED commit is abandoned
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: len(t.workers.requests) == MAX_CHUNK_ATTEMPTS)
    wait_for(lambda: "a" not in t.d._aborting)  # the abort retried until commit_timeout, then abandoned
    assert "a" not in t.d._requests and t.buffer.of("a") == []
    t.buffer.aborts_unavailable = False
    # The work feed reconnects; the buffer still lists the request, with its own next_seq.
    t.d._apply_snapshot([item("a", output=[3, 4], next_seq=1)])
    assert "a" not in t.d._requests  # not tracked: the core settled it and would never run it
    wait_for(lambda: len(t.buffer.of("a")) == 1)
    (abort,) = t.buffer.of("a")
    assert (abort.finish_reason, abort.seq, list(abort.token_ids)) == (ABORTED, 1, [])
    wait_for(lambda: "a" not in t.d._abandoned)
    t.d._apply_snapshot([])
    assert len(t.workers.requests) == MAX_CHUNK_ATTEMPTS  # never dispatched again


def test_a_work_item_the_core_settled_is_failed_not_tracked(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.d.core.add_request(t.d._info(item("a"), 0))
    t.d.core.cancel_request("a")  # the core settled it; the service does not know it
    t.d._apply_snapshot([item("a", output=[3], next_seq=1)])
    assert "a" not in t.d._requests
    wait_for(lambda: len(t.buffer.of("a")) == 1)
    assert (t.buffer.of("a")[0].finish_reason, t.buffer.of("a")[0].seq) == (ABORTED, 1)


# ---- bug 2: a request that fits on no worker -----------------------------------------------------


def test_a_request_that_fits_on_no_worker_is_failed_and_the_rest_run(
    rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    t = rig()
    t.register("w0", pages=100)  # 1600 tokens of KV
    t.run()
    with caplog.at_level(logging.ERROR, logger="services.scheduler.service"):
        t.d._add_items([item(f"big{i}", prompt_len=2000) for i in range(16)] + [item("small")])
        wait_for(lambda: all(len(t.buffer.of(f"big{i}")) == 1 for i in range(16)))
        wait_for(lambda: sum(len(c.token_ids) for c in t.buffer.of("small")) == 16)
    for i in range(16):
        (c,) = t.buffer.of(f"big{i}")
        assert (c.finish_reason, c.seq) == (ABORTED, 0)
    assert t.buffer.of("small")[-1].finish_reason == LENGTH
    assert not t.d._requests
    logged = [r for r in caplog.records if r.getMessage() == "request fits on no worker; failing it"]
    assert len(logged) == 16


def test_no_worker_is_no_reason_to_fail_a_request(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.run()
    t.d._add_items([item("big", prompt_len=100_000)])
    time.sleep(0.3)
    assert "big" in t.d._requests and t.buffer.of("big") == []


# ---- bug 4: re-registration ----------------------------------------------------------------------


def test_same_incarnation_reconnects_and_a_new_one_cuts_off(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0", incarnation="inc-1")
    t.workers.gate.clear()  # chunks stay in flight
    t.run()
    t.d._add_items([item("a"), item("b")])
    wait_for(lambda: t.d.stats().in_flight_chunks == 2)
    tokens = {rid: t.d._requests[rid].dispatch_token for rid in ("a", "b")}
    t.register("w0", incarnation="inc-1")  # e.g. after one failed Heartbeat RPC
    assert t.d.stats().redispatched_chunks == 0
    assert {rid: t.d._requests[rid].dispatch_token for rid in ("a", "b")} == tokens
    t.register("w0", incarnation="inc-2")  # a restarted process: what ran on the old one is gone
    assert t.d.stats().redispatched_chunks == 2
    t.workers.gate.set()
    wait_for(lambda: not t.d._requests)


def test_unknown_incarnation_keeps_cutting_off(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0")
    t.workers.gate.clear()
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: t.d.stats().in_flight_chunks == 1)
    t.register("w0")  # "" twice: it cannot be told from a restart
    assert t.d.stats().redispatched_chunks == 1


@pytest.mark.parametrize("incarnation", ["inc-1", "inc-2", ""])
def test_registering_again_is_no_way_out_of_quarantine(rig: Callable[..., Rig], incarnation: str) -> None:
    t = rig()
    t.register("w0", incarnation="inc-1")
    bad = scheduler_pb2.WorkerTelemetry(free_kv_pages=999_999)  # more than its total_kv_pages
    assert t.d.heartbeat("w0", bad)
    assert t.d.core.is_quarantined("w0")
    t.register("w0", incarnation=incarnation)
    assert t.d.core.is_quarantined("w0")
    assert t.d.stats().workers[0].quarantined


def test_quarantine_survives_removal_for_missed_heartbeats(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0", incarnation="inc-1")
    t.d.heartbeat("w0", scheduler_pb2.WorkerTelemetry(free_kv_pages=999_999))
    with t.d._cond:
        t.d._remove_worker_locked("w0", reason="missed heartbeats")
    t.register("w0", incarnation="inc-1")
    assert t.d.core.is_quarantined("w0")


# ---- bug 5: impossible chunk stats ---------------------------------------------------------------


def test_impossible_chunk_stats_fail_the_chunk_and_quarantine_the_worker(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("liar")
    t.workers.script = lambda wid, req: chunk_events(
        req, stats=common_pb2.ChunkStats(steps=-5, draft_tokens=0, accepted_tokens=100, wall_seconds=float("nan")))
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: t.d.core.is_quarantined("liar"))
    wait_for(lambda: t.d.stats().in_flight_chunks == 0)
    assert "impossible chunk stats" in t.d.core.quarantine_reason("liar")
    assert t.buffer.of("a") == []  # nothing committed
    r = t.d._requests["a"]
    assert r.attempts == 1 and r.dispatch_token is None  # counted, queued again
    assert t.d.stats().pending_requests == 1 and len(t.workers.requests) == 1  # not placed on the liar again


@pytest.mark.parametrize("stats", [
    common_pb2.ChunkStats(steps=0),  # 8 tokens from no engine step
    common_pb2.ChunkStats(steps=8, prefill_tokens=6, cached_tokens=64),  # a 6-token prompt
    common_pb2.ChunkStats(steps=8, kv_loaded_tokens=1 << 30),
])
def test_chunk_stats_beyond_the_chunk_quarantine_the_worker(rig: Callable[..., Rig],
                                                            stats: common_pb2.ChunkStats) -> None:
    """Stats that are each a sane count but impossible for the chunk they came with (tokens from no
    step, a prefix larger than the chunk's context) were committed, and the buffer summed them into
    the response's stats: they now fail the chunk like any impossible stats. The request still
    completes on the honest worker, every token once."""
    t = rig()
    t.register("liar")
    t.workers.script = lambda wid, req: chunk_events(req, stats=stats if wid == "liar" else None)
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: t.d.core.is_quarantined("liar"))
    assert "impossible chunk stats" in t.d.core.quarantine_reason("liar")
    assert t.buffer.of("a") == []  # nothing committed from the liar
    t.register("honest")
    wait_for(lambda: "a" not in t.d._requests)
    assert [c.worker_id for c in t.buffer.of("a")] == ["honest", "honest"]
    assert sum(len(c.token_ids) for c in t.buffer.of("a")) == 16


def test_healthy_chunk_stats_are_committed(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0")
    t.workers.script = lambda wid, req: chunk_events(req, stats=common_pb2.ChunkStats(
        prefill_tokens=6, draft_tokens=10, accepted_tokens=4, steps=9, wall_seconds=0.1))  # 8 tokens + 1 step
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: "a" not in t.d._requests)
    assert not t.d.core.is_quarantined("w0")
    assert sum(len(c.token_ids) for c in t.buffer.of("a")) == 16


# ---- bug 6: LENGTH before max_tokens -------------------------------------------------------------


def test_length_before_max_tokens_is_a_malformed_chunk(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0")
    first = threading.Event()

    def script(wid: str, req: worker_pb2.RunChunkRequest) -> list[worker_pb2.RunChunkResponse]:
        if not first.is_set():
            first.set()
            return chunk_events(req, reason=LENGTH, n=3)  # would end the response at 3 of 16 tokens
        return chunk_events(req)

    t.workers.script = script
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: "a" not in t.d._requests)
    commits = t.buffer.of("a")
    assert [(c.seq, len(c.token_ids), c.finish_reason) for c in commits] == [(0, 8, CHUNK), (1, 8, LENGTH)]
    assert len(t.workers.requests) == 3


# ---- bug 7: a snapshot changes a queued request's output ----------------------------------------


def test_a_snapshot_resyncs_the_cores_generated_count(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.d._add_items([item("a", max_tokens=24)])
    # A late commit of a chunk the core had re-queued landed in the buffer.
    t.d._apply_snapshot([item("a", max_tokens=24, output=list(range(8)), next_seq=1)])
    assert t.d._requests["a"].output == list(range(8))
    assert t.d.core._requests["a"].generated == 8
    t.register("w0")
    t.run()
    wait_for(lambda: "a" not in t.d._requests)
    assert [len(c.token_ids) for c in t.buffer.of("a")] == [8, 8]
    assert t.d.core.history("k-a") == [24]


# ---- bug 8: RegisterWorker field paths -----------------------------------------------------------


@pytest.mark.parametrize(
    ("cap", "path"),
    [
        ({"total_kv_pages": 0, "page_size": 16, "max_batch_size": 8}, "capacity.total_kv_pages"),
        ({"total_kv_pages": 10, "page_size": 0, "max_batch_size": 8}, "capacity.page_size"),
        ({"total_kv_pages": 10, "page_size": 16, "max_batch_size": 0}, "capacity.max_batch_size"),
        ({"total_kv_pages": 10, "page_size": 16, "max_batch_size": 8, "max_context": -5}, "capacity.max_context"),
    ],
)
def test_register_worker_errors_name_the_proto_field_paths(
    rig: Callable[..., Rig], cap: dict[str, int], path: str
) -> None:
    t = rig()
    with pytest.raises(InvalidArgument) as info:
        t.d.register_worker("x", "x:1", scheduler_pb2.WorkerCapacity(**cap), "fake", 0)
    assert info.value.field == path
    assert not t.d.stats().workers


def test_max_context_zero_is_unknown_and_accepted(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.d.register_worker("x", "x:1", scheduler_pb2.WorkerCapacity(total_kv_pages=10, page_size=16,
                                                                 max_batch_size=8), "fake", 0)
    assert [w.worker_id for w in t.d.stats().workers] == ["x"]


# ---- dispatch_epoch ------------------------------------------------------------------------------


def test_every_dispatch_of_a_request_carries_a_larger_epoch(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.d._add_items([item("a")])
    r = t.d._requests["a"]
    d = Dispatch("a", "w0", 8, is_probe=False, fetch_kv=False)
    epochs = [t.d._chunk_request(d, r).dispatch_epoch for _ in range(3)]
    assert 0 < epochs[0] < epochs[1] < epochs[2]
    assert epochs[0] >= time.time_ns() // 1000 - 60_000_000  # clock based: survives a restart
    r.last_epoch = 2**63  # a clock that went backwards does not make it decrease
    assert t.d._chunk_request(d, r).dispatch_epoch == 2**63 + 1


def test_dispatches_through_the_loop_carry_increasing_epochs(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0")
    t.run()
    t.d._add_items([item("a", max_tokens=24)])
    wait_for(lambda: "a" not in t.d._requests)
    epochs = [req.dispatch_epoch for _wid, req in t.workers.requests]
    assert len(epochs) == 3 and epochs == sorted(set(epochs)) and epochs[0] > 0


def test_the_worker_sends_one_incarnation_per_process() -> None:
    from types import SimpleNamespace

    from services.worker import registration
    from services.worker.core import EngineHealth

    engine = SimpleNamespace(total_pages=64, page_size=16, max_batch_size=4, max_context=512)
    worker = SimpleNamespace(worker_id="w", engine_name="reference", policy_version=0,
                             engine=SimpleNamespace(max_context=512), stats=lambda: SimpleNamespace(engine=engine),
                             engine_health=EngineHealth)
    first = registration.register_request(worker, "w:1")  # type: ignore[arg-type]
    again = registration.register_request(worker, "w:1")  # type: ignore[arg-type]
    assert len(first.incarnation) == 16 and first.incarnation == again.incarnation == registration.INCARNATION


def test_a_cancelled_request_aborts_its_own_attempt(rig: Callable[..., Rig]) -> None:
    # By the running attempt's epoch (read under the lock that set it with the stream), not epoch 0
    # (any attempt): the batch id may be submitted again, and an abort still queued would end the
    # new request's attempt under the same id, now counted against it and its worker (review,
    # session 25).
    t = rig()
    t.register("w0")
    t.workers.gate.clear()  # the chunk stays running
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: len(t.workers.requests) == 1)
    epoch = t.workers.requests[0][1].dispatch_epoch
    assert epoch > 0
    t.d._cancel_request("a")
    wait_for(lambda: t.workers.aborts == [("a", epoch)])


def test_a_full_worker_is_busy_not_broken(rig: Callable[..., Rig]) -> None:
    # RESOURCE_EXHAUSTED (no stream slot on the worker) more often than MAX_CHUNK_ATTEMPTS must not
    # abort the request: the refusals are not counted as attempts.
    from services.common.errors import ResourceExhausted

    t = rig()
    t.register("w0")
    refusals = MAX_CHUNK_ATTEMPTS + 1

    def script(wid: str, req: worker_pb2.RunChunkRequest) -> Iterator[worker_pb2.RunChunkResponse]:
        if len(t.workers.requests) <= refusals:
            raise ResourceExhausted("56 RunChunk streams are open", field="max_streams")
        yield from chunk_events(req)

    t.workers.script = script
    t.run()
    t.d._add_items([item("a", max_tokens=8)])
    wait_for(lambda: [c.finish_reason for c in t.buffer.of("a")] == [LENGTH], timeout=15)
    assert len(t.workers.requests) == refusals + 1


def test_a_switch_no_worker_took_is_a_refusal_not_an_outage(rig: Callable[..., Rig]) -> None:
    # Nothing switched, so the caller (the buffer) must keep the old version in force: a refusal
    # naming `version`. UNAVAILABLE would read as "outcome unknown" and hold every submission.
    from services.common.errors import FailedPrecondition

    t = rig()
    t.register("w0")

    def refuse(self: FakeWorkerLink, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        raise FailedPrecondition("another LoadWeights is in progress", field="version")

    def bad_source(self: FakeWorkerLink, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        raise InvalidArgument("no such checkpoint on this node", field="source")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeWorkerLink, "load_weights", refuse)
        with pytest.raises(FailedPrecondition) as e:
            t.d.switch_weights(3, "/missing")
        assert e.value.field == "version" and "no worker loaded version 3" in str(e.value)
        # Every worker found the source itself bad: the caller's argument, named `source`.
        mp.setattr(FakeWorkerLink, "load_weights", bad_source)
        with pytest.raises(InvalidArgument) as bad:
            t.d.switch_weights(3, "/missing")
        assert bad.value.field == "source" and "no worker could load version 3" in str(bad.value)
    assert t.d._version is None  # no version was ever put in force


def test_a_switch_whose_loads_were_lost_is_an_unknown_outcome(rig: Callable[..., Rig]) -> None:
    # A deadline or a dropped connection: the worker may still finish loading the new version, so
    # the buffer must hold submissions (UNAVAILABLE), not keep the old version in force.
    t = rig()
    t.register("w0")

    def lost(self: FakeWorkerLink, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        raise Unavailable("connection reset")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeWorkerLink, "load_weights", lost)
        with pytest.raises(Unavailable):
            t.d.switch_weights(3, "/ckpt/3")
