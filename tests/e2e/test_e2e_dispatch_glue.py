"""The scheduler's dispatch loop against the real buffer and scheduler processes, with scripted
workers (no model): chunking, worker death mid-chunk, a silent worker, buffer kill -9 and the
weight switch. The same paths with the real engine are in test_suite.py."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_fake_worker import FakeWorker, token_at
from e2e_helpers import collect, make_batch, scripted_suite, stopping_cleanly
from seer.v1 import common_pb2, rollout_pb2

from services.cli.up import Suite


@pytest.fixture
def suite(tmp_path) -> Iterator[Suite]:
    with scripted_suite(tmp_path, policy="divided") as s:
        yield s


@pytest.fixture
def workers(suite: Suite) -> Iterator[list[FakeWorker]]:
    made: list[FakeWorker] = []
    yield made
    for w in made:
        w.close()


def check_results(results: list[rollout_pb2.StreamResultsResponse], n: int, max_tokens: int | dict[int, int]) -> None:
    assert [r.cursor for r in results] == list(range(1, n + 1))
    ids = [r.result.request_id for r in results]
    assert len(set(ids)) == n, "a response was delivered twice"
    for r in results:
        m = max_tokens if isinstance(max_tokens, int) else max_tokens[r.result.group_index]
        expected = [token_at(r.result.request_id, p) for p in range(m)]
        assert list(r.result.token_ids) == expected, f"{r.result.request_id}: tokens lost or duplicated"
        assert r.result.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_chunks_across_two_workers(suite, workers, rollout_stub_factory):
    workers += [FakeWorker("w0", suite.scheduler_address), FakeWorker("w1", suite.scheduler_address)]
    suite.wait_workers(2, timeout=10)
    stub = rollout_stub_factory(suite.address)
    batch = make_batch(3, 2, max_tokens=20)
    stub.SubmitBatch(batch, timeout=10)
    check_results(collect(stub, batch.batch_id, timeout=60), 6, 20)
    ran = [c for w in workers for c in w.chunks]
    assert len(ran) == 6 * 3  # 20 tokens in chunks of 8: 8 + 8 + 4
    assert {w.worker_id for w in workers if w.chunks} == {"w0", "w1"}
    # The buffer commits a chunk's last tokens (and the results stream ends) before the scheduler's
    # dispatch thread hears the chunk end: in flight may read 1 for a moment (seen under CI load).
    deadline = time.monotonic() + 10
    while (stats := suite.scheduler_stats()).in_flight_chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.dispatched_chunks == 18 and stats.in_flight_chunks == 0 and stats.pending_requests == 0


def test_worker_dies_mid_chunk_is_redispatched(suite, workers, rollout_stub_factory):
    workers.append(FakeWorker("w0", suite.scheduler_address, stop_after=3))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    batch = make_batch(2, 2, max_tokens=12)
    stub.SubmitBatch(batch, timeout=10)
    check_results(collect(stub, batch.batch_id, timeout=60), 4, 12)
    assert suite.scheduler_stats().redispatched_chunks >= 1


def test_silent_worker_is_removed_and_its_chunks_move(suite, workers, rollout_stub_factory):
    slow = FakeWorker("slow", suite.scheduler_address, token_delay=0.2)
    workers.append(slow)
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    batch = make_batch(2, 2, max_tokens=16)
    stub.SubmitBatch(batch, timeout=10)
    time.sleep(0.5)
    slow.close()  # stops heartbeats and breaks its streams, like a crashed host
    workers.append(FakeWorker("fresh", suite.scheduler_address))
    check_results(collect(stub, batch.batch_id, timeout=60), 4, 16)
    stats = suite.scheduler_stats()
    assert [w.worker_id for w in stats.workers] == ["fresh"]


def test_buffer_kill9_mid_batch_completes(suite, workers, rollout_stub_factory):
    workers.append(FakeWorker("w0", suite.scheduler_address, token_delay=0.02))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    # Group 0 finishes early; the kill lands while groups 1-2 are mid-way (chunks in flight).
    batch = make_batch(3, 2, max_tokens=[4, 60, 60])
    stub.SubmitBatch(batch, timeout=10)
    first = []
    for r in stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch.batch_id), timeout=60):
        first.append(r)
        break
    suite.services["buffer"].signal(signal.SIGKILL)
    suite.services["buffer"].wait(10)
    time.sleep(0.5)
    suite.restart("buffer", timeout=60)
    rest = collect(stub, batch.batch_id, timeout=60, cursor=len(first))
    check_results(first + rest, 6, {0: 4, 1: 60, 2: 60})
    assert first[0].result.group_index == 0


def test_update_weights_flows_to_workers_and_results(suite, workers, rollout_stub_factory):
    workers += [FakeWorker("w0", suite.scheduler_address), FakeWorker("w1", suite.scheduler_address)]
    suite.wait_workers(2, timeout=10)
    stub = rollout_stub_factory(suite.address)
    b0 = make_batch(1, 2, max_tokens=8)
    stub.SubmitBatch(b0, timeout=10)
    assert {r.result.policy_version for r in collect(stub, b0.batch_id, timeout=30)} == {0}
    resp = stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=1), timeout=30)
    assert resp.version == 1 and resp.num_workers == 2
    assert all(w.loads == [1] for w in workers)
    b1 = make_batch(1, 2, max_tokens=8)
    assert stub.SubmitBatch(b1, timeout=10).policy_version == 1
    assert {r.result.policy_version for r in collect(stub, b1.batch_id, timeout=30)} == {1}
    # A worker that registers late (still on version 0) catches up before it serves.
    workers.append(FakeWorker("late", suite.scheduler_address))
    deadline = time.monotonic() + 10
    while workers[-1].loads != [1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers[-1].loads == [1]
    # One whose catch-up load fails stays registered and is retried in place with a backoff (it
    # was forgotten and had to register again: with a bad source, 217 times a minute for ever).
    flaky = FakeWorker("flaky", suite.scheduler_address, strict_version=True, failing_loads=1)
    workers.append(flaky)
    deadline = time.monotonic() + 15
    while flaky.loads != [1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert flaky.loads == [1] and flaky.registrations == 1


def test_bad_register_is_invalid_argument(suite):
    from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(suite.scheduler_address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
                worker_id="x", address="127.0.0.1:1", capacity=scheduler_pb2.WorkerCapacity(
                    total_kv_pages=0, page_size=16, max_batch_size=4)), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "capacity.total_kv_pages" in (e.value.details() or "")


def test_cancel_mid_batch_stops_dispatch(suite, workers, rollout_stub_factory):
    workers.append(FakeWorker("w0", suite.scheduler_address, token_delay=0.05))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    batch = make_batch(4, 2, max_tokens=[4, 200, 200, 200])
    stub.SubmitBatch(batch, timeout=10)
    first = next(iter(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch.batch_id), timeout=30)))
    resp = stub.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id=batch.batch_id), timeout=10)
    assert resp.num_cancelled >= 5
    rest = collect(stub, batch.batch_id, timeout=30, cursor=1)
    assert first.result.group_index == 0 and all(r.result.group_index == 0 for r in rest)
    deadline = time.monotonic() + 10
    while True:
        stats = suite.scheduler_stats()
        if stats.pending_requests == 0 and stats.in_flight_chunks == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    chunks_after = len(workers[0].chunks)
    time.sleep(1.0)
    assert len(workers[0].chunks) == chunks_after, "chunks still dispatched after the cancel"


def test_scheduler_kill9_mid_batch_completes(suite, workers, rollout_stub_factory):
    """A restarted scheduler rebuilds its state from the buffer's snapshot; workers re-register."""
    workers.append(FakeWorker("w0", suite.scheduler_address, token_delay=0.02))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    batch = make_batch(3, 2, max_tokens=[4, 60, 60])
    stub.SubmitBatch(batch, timeout=10)
    first = next(iter(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch.batch_id), timeout=30)))
    suite.services["scheduler"].signal(signal.SIGKILL)
    suite.services["scheduler"].wait(10)
    suite.restart("scheduler", timeout=60)
    rest = collect(stub, batch.batch_id, timeout=60, cursor=1)
    check_results([first, *rest], 6, {0: 4, 1: 60, 2: 60})


def test_restarted_scheduler_catches_up_workers_with_the_policys_weights(suite, workers, rollout_stub_factory):
    """The buffer tells a restarted scheduler the policy (version and weights directory) on its work
    feed: a worker that registers on version 0 loads version 1 from the right source before it
    serves, and a strict worker never refuses a chunk for its version."""
    workers.append(FakeWorker("w0", suite.scheduler_address, strict_version=True))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=1, source="/ckpt/1"), timeout=30)
    stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=2), timeout=30)  # relabel: same weights
    assert workers[0].sources == ["/ckpt/1", ""]
    suite.services["scheduler"].signal(signal.SIGKILL)
    suite.services["scheduler"].wait(10)
    suite.restart("scheduler", timeout=60)
    late = FakeWorker("late", suite.scheduler_address, strict_version=True)  # still on version 0
    workers.append(late)
    suite.wait_workers(2, timeout=10)
    deadline = time.monotonic() + 10
    while late.loads != [2] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (late.loads, late.sources) == ([2], ["/ckpt/1"])
    batch = make_batch(2, 2, max_tokens=8)
    stub.SubmitBatch(batch, timeout=10)
    results = collect(stub, batch.batch_id, timeout=60)
    check_results(results, 4, 8)
    assert {r.result.policy_version for r in results} == {2}


def test_stale_worker_after_scheduler_restart_catches_up(suite, workers, rollout_stub_factory):
    """A scheduler restarted after a weight switch does not know the version; a worker still on the
    old one must not serve the new batch: its chunk is dropped and it loads the batch's version."""
    workers.append(FakeWorker("w0", suite.scheduler_address))
    suite.wait_workers(1, timeout=10)
    stub = rollout_stub_factory(suite.address)
    assert stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=1), timeout=30).num_workers == 1
    suite.services["scheduler"].signal(signal.SIGKILL)
    suite.services["scheduler"].wait(10)
    suite.restart("scheduler", timeout=60)
    late = FakeWorker("late", suite.scheduler_address)  # still on version 0
    workers.append(late)
    suite.wait_workers(2, timeout=10)
    batch = make_batch(4, 2, max_tokens=16)
    stub.SubmitBatch(batch, timeout=10)
    results = collect(stub, batch.batch_id, timeout=60)
    check_results(results, 8, 16)
    assert {r.result.policy_version for r in results} == {1}
    assert late.loads == [1]


def test_a_service_whose_picked_port_was_taken_starts_again(tmp_path: Path) -> None:
    """Suite picks free ports (bind port 0, close) and the child binds them seconds later; under
    load the kernel handed one to another socket meanwhile and the suite failed to start ("Address
    already in use" for the buffer's metrics port, about 1 start in 50 under stress). The service
    is started again, with a new metrics port."""
    s = Suite(workers=0, draft=False, kvstore=False, data_dir=tmp_path, policy="divided", model_dir="")
    taken = s.services["buffer"].metrics_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        s.start(timeout=60)
    with stopping_cleanly(s):
        assert s.services["buffer"].metrics_port != taken
        assert "could not bind" not in s.services["buffer"].tail()  # the suite logs it, not the service
