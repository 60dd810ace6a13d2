"""WorkerService over real gRPC on loopback: the RunChunk stream bound and epoch-checked Abort.

  - A RunChunk stream holds a handler thread for its whole chunk. More chunks than the server has
    threads used to take every thread, so Abort, GetWorkerStats and LoadWeights queued behind
    them; the worker now refuses a stream over max_streams with RESOURCE_EXHAUSTED naming the limit,
    and the unary calls keep their threads.
  - An Abort carries the dispatch epoch of the attempt it means: a late one, for an abandoned
    attempt, does not kill the request's re-dispatch to the same worker.

The engine is the fake one (glue: chunks must stay open as long as the test wants)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from seer.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_fake_engine import FakeEngine

from services.common import errors
from services.common.grpcutil import channel
from services.common.server import RunningServer, start_server
from services.scheduler.links import WorkerLink
from services.worker.config import WorkerConfig
from services.worker.core import Worker
from services.worker.registration import register_request
from services.worker.server import add_servicer

THREADS = 6
LONG = 100_000  # tokens: a chunk that runs until the test ends it


@pytest.fixture
def served() -> Iterator[tuple[FakeEngine, Worker, RunningServer]]:
    eng = FakeEngine(max_context=1 << 20)
    eng.step_delay = 0.01  # chunks stay open; the loop lets handler threads in between steps
    worker = Worker(eng, worker_id="w-streams", speculation=False).start()
    cfg = WorkerConfig(port=0, grace_seconds=1.0, max_workers=THREADS)
    running = start_server("worker", cfg, add_servicer(worker, cfg.drain_timeout_seconds, cfg.stream_limit()),
                           on_stop=worker.close)
    try:
        yield eng, worker, running
    finally:
        running.stop(1.0)


def chunk(rid: str, max_new: int = LONG, epoch: int = 0) -> worker_pb2.RunChunkRequest:
    return worker_pb2.RunChunkRequest(request_id=rid, prompt_token_ids=[1, 2, 3], max_new_tokens=max_new,
                                      max_tokens=max_new,
                                      sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True),
                                      dispatch_epoch=epoch)


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def refusal(stream: Any) -> grpc.RpcError | None:
    """The error a stream ended with at once, or None while it runs (it produced a message)."""
    try:
        next(iter(stream))
    except grpc.RpcError as e:
        return e
    return None


def test_run_chunk_streams_are_bounded_below_the_threads(served: Any) -> None:
    _eng, worker, running = served
    limit = WorkerConfig(max_workers=THREADS).stream_limit()
    assert 1 <= limit < THREADS
    ch = channel(running.address)
    stub = worker_pb2_grpc.WorkerServiceStub(ch)
    streams = [stub.RunChunk(chunk(f"r{i}"), timeout=10) for i in range(THREADS + 2)]
    try:
        outcomes = [refusal(s) for s in streams]
        refused = [e for e in outcomes if e is not None]
        assert len(refused) == THREADS + 2 - limit and worker.in_flight == limit
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert (e.details() or "").startswith("max_streams: "), e.details()
        # Every thread a stream may take is taken; the unary calls still get theirs.
        stats = stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=3)
        assert stats.worker_id == "w-streams"
        running_ids = [f"r{i}" for i, e in enumerate(outcomes) if e is None]
        assert stub.Abort(worker_pb2.AbortRequest(request_id=running_ids[0]), timeout=3).found
        wait_for(lambda: worker.in_flight == limit - 1)
        # The aborted chunk's slot is free again once its stream ended.
        done = [m.done for m in streams[int(running_ids[0][1:])] if m.WhichOneof("event") == "done"]
        assert done[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
        toks = [t for m in stub.RunChunk(chunk("again", max_new=3), timeout=10)
                if m.WhichOneof("event") == "tokens" for t in m.tokens.token_ids]
        assert toks == [4, 5, 6]
    finally:
        for s in streams:
            s.cancel()
        ch.close()
    wait_for(lambda: worker.in_flight == 0)


def test_registration_advertises_at_most_the_stream_limit() -> None:
    worker = Worker(FakeEngine(), worker_id="w")  # the fake engine reports max_batch_size 8
    assert register_request(worker, "h:1").capacity.max_batch_size == 8
    assert register_request(worker, "h:1", max_streams=5).capacity.max_batch_size == 5
    assert register_request(worker, "h:1", max_streams=50).capacity.max_batch_size == 8


def test_stream_limit_config() -> None:
    assert WorkerConfig().stream_limit() == 56  # 64 threads, 8 kept for unary calls
    assert WorkerConfig(max_workers=8).stream_limit() == 4
    assert WorkerConfig(max_workers=8, max_streams=7).stream_limit() == 7
    with pytest.raises(ValueError, match="max_streams"):
        WorkerConfig(max_workers=8, max_streams=8).validate()


def test_late_abort_spares_a_newer_attempt(served: Any) -> None:
    """Attempt 1 (epoch 5) of r is abandoned (its stream cancelled) and r is dispatched here again
    (epoch 6); the abort the scheduler sent for attempt 1 arrives late: r keeps running."""
    _eng, worker, running = served
    link = WorkerLink(running.address)
    try:
        first = link.run_chunk(chunk("r", epoch=5), timeout=30)
        wait_for(lambda: worker.in_flight == 1)
        first.cancel()
        wait_for(lambda: worker.in_flight == 0)
        second = link.run_chunk(chunk("r", max_new=50, epoch=6), timeout=30)
        wait_for(lambda: worker.in_flight == 1)
        assert link.abort("r", dispatch_epoch=5) is False  # late: an older attempt
        events = list(second)
        toks = [t for m in events if m.WhichOneof("event") == "tokens" for t in m.tokens.token_ids]
        assert toks == [(4 + i) % 100 for i in range(50)]
        assert events[-1].done.finish_reason == common_pb2.FINISH_REASON_LENGTH

        # The attempt's own epoch, a newer one, or 0 (any attempt) aborts it.
        for epoch in (7, 8, 0):
            stream = link.run_chunk(chunk("r", epoch=7), timeout=30)
            wait_for(lambda: worker.in_flight == 1)
            assert link.abort("r", dispatch_epoch=epoch) is True
            done = [m.done for m in stream if m.WhichOneof("event") == "done"]
            assert done[-1].finish_reason == common_pb2.FINISH_REASON_ABORTED
        assert link.abort("r", dispatch_epoch=9) is False  # nothing runs
    finally:
        link.close()


def test_abort_of_unknown_request_is_not_an_error(served: Any) -> None:
    _eng, _worker, running = served
    link = WorkerLink(running.address)
    try:
        assert link.abort("nobody") is False
        with pytest.raises(errors.InvalidArgument):
            list(link.run_chunk(worker_pb2.RunChunkRequest(request_id=""), timeout=5))
    finally:
        link.close()


def test_a_large_batch_gets_the_threads_for_its_streams() -> None:
    # A derived stream limit (56 of 64 threads) below max_batch_size would cap a GPU engine's
    # concurrency silently: the server gets enough threads instead. An explicit limit is kept.
    big = WorkerConfig(max_batch_size=256).sized_for_batch()
    assert big.stream_limit() >= 256 and big.max_workers == 264
    assert WorkerConfig(max_batch_size=32).sized_for_batch() == WorkerConfig(max_batch_size=32)
    explicit = WorkerConfig(max_batch_size=256, max_streams=40)
    assert explicit.sized_for_batch() is explicit
    big.validate()


def test_a_stream_ending_does_not_stall_the_server_for_a_step(served: Any) -> None:
    """gRPC runs a call's done callbacks on the server's one polling thread, which also starts
    every other call. RunChunk's callback took the engine lock (to abort a chunk still running)
    for every stream that ended, normal ends too, so while a step ran no call on the worker could
    start: GetWorkerStats 20 ms after a chunk ended took a whole step (0.85 s here; a 1,024-token
    CPU prefill is ~5 s). Found by review, session 18."""
    eng, _worker, running = served
    ch = channel(running.address)
    stub = worker_pb2_grpc.WorkerServiceStub(ch)
    busy = stub.RunChunk(chunk("busy"), timeout=60)  # keeps the engine stepping
    try:
        assert refusal(busy) is None
        eng.step_delay = 0.8
        stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
        latencies = []
        for i in range(3):
            list(stub.RunChunk(chunk(f"short{i}", max_new=1), timeout=30))
            time.sleep(0.02)
            t = time.perf_counter()
            stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
            latencies.append(time.perf_counter() - t)
        assert sorted(latencies)[1] < 0.3, latencies
    finally:
        eng.step_delay = 0.01
        busy.cancel()
        ch.close()
