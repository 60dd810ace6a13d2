"""A stopping worker tells the scheduler it drains, and no new chunk is placed on it.

While the worker drained (its server refusing new RunChunk streams with UNAVAILABLE) its registrar
kept heartbeating as usual, so the scheduler kept placing chunks there: each came back UNAVAILABLE
and was retried elsewhere. Real gRPC on loopback: the scheduler's Dispatcher behind its
SchedulerService, two real workers (reference engine) behind their WorkerService, each with its
Registrar; only the buffer is a stub (tests.scheduler.test_dispatcher_faults.FakeBuffer)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from services.common.server import RunningServer, ServiceConfig, start_server
from services.scheduler.config import SchedulerConfig
from services.scheduler.links import BufferLink, Stream, WorkerLink
from services.scheduler.server import add_to_server
from services.scheduler.service import Dispatcher
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import INCARNATION, Registrar
from services.worker.server import add_servicer
from tests.common.grpc_server import loopback_server
from tests.scheduler.test_dispatcher_faults import CHUNK, FakeBuffer, item, wait_for

# Longer than the test: every heartbeat seen in it is one the drain sent at once.
HEARTBEAT_S = 60.0


class _Recorded:
    """WorkerLink factory that records which worker each RunChunk went to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chunks: list[tuple[str, str]] = []  # (address, request_id)

    def __call__(self, address: str) -> WorkerLink:
        rec = self

        class Link(WorkerLink):
            def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Stream:
                with rec.lock:
                    rec.chunks.append((address, req.request_id))
                return super().run_chunk(req, timeout)

        return Link(address)

    def to(self, address: str) -> list[str]:
        with self.lock:
            return [rid for a, rid in self.chunks if a == address]


@contextlib.contextmanager
def _dispatcher(chunk_size: int, commit_timeout: float) -> Iterator[tuple[Dispatcher, FakeBuffer, _Recorded, str]]:
    buffer, links = FakeBuffer(), _Recorded()
    d = Dispatcher(SchedulerConfig(port=0, buffer_address=FakeBuffer.address, policy="divided",
                                   chunk_size=chunk_size, heartbeat_interval=HEARTBEAT_S,
                                   commit_timeout=commit_timeout),
                   # FakeBuffer has BufferLink's surface but is no subclass, and the Dispatcher
                   # types its factory by the concrete class (a Protocol there would need no cast).
                   buffer_link=cast("Callable[[str], BufferLink]", buffer), worker_link=links)
    with loopback_server(add_to_server, d, max_workers=16) as address:
        loop = threading.Thread(target=d._dispatch_loop, daemon=True)  # no work feed: items are added below
        loop.start()
        try:
            yield d, buffer, links, address
        finally:
            d.stop()
            loop.join(5)


@pytest.fixture
def scheduler() -> Iterator[tuple[Dispatcher, FakeBuffer, _Recorded, str]]:
    with _dispatcher(chunk_size=4, commit_timeout=2.0) as s:
        yield s


@contextlib.contextmanager
def registered_with(servicer: scheduler_pb2_grpc.SchedulerServiceServicer, engine: ReferenceEngine,
                    worker_id: str) -> Iterator[Registrar]:
    """A Registrar of a worker on `engine`, registered with `servicer` served over real gRPC."""
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer) as address:
        reg = Registrar(Worker(engine, worker_id=worker_id, speculation=False), address, "127.0.0.1:5557").start()
        try:
            assert reg.registered.wait(10)
            yield reg
        finally:
            reg.stop()


def _serve(engine: ReferenceEngine, worker_id: str, grace: float = 1.0) -> tuple[Worker, RunningServer]:
    worker = Worker(engine, worker_id=worker_id, speculation=False).start()
    return worker, start_server("worker", ServiceConfig(port=0, grace_seconds=grace), add_servicer(worker),
                                on_stop=worker.close)


def test_no_new_chunk_goes_to_a_draining_worker(
    scheduler: tuple[Dispatcher, FakeBuffer, _Recorded, str], ref_engine: ReferenceEngine, model_dir: Path
) -> None:
    d, buffer, links, address = scheduler
    other_engine = ReferenceEngine.from_dir(model_dir, num_pages=512, max_batch_size=16, page_size=16)
    draining, draining_srv = _serve(ref_engine, "w-drain")
    other, other_srv = _serve(other_engine, "w-other")
    regs = [Registrar(w, address, srv.address).start() for w, srv in ((draining, draining_srv), (other, other_srv))]
    try:
        wait_for(lambda: len(d.core.stats()["workers"]) == 2)
        assert not d.core.is_draining("w-drain")

        regs[0].drain()  # the flag a stopping worker sets (drain_before_stop through drain_now)
        # At once, not after the heartbeat interval (longer than the test).
        wait_for(lambda: d.core.is_draining("w-drain"), timeout=5)
        assert [w.draining for w in d.stats().workers if w.worker_id == "w-drain"] == [True]

        rids = [f"r{i}" for i in range(6)]
        d._add_items([item(rid, max_tokens=8) for rid in rids])
        # Each response finished (a last commit that is not CHUNK), nothing left in flight.
        wait_for(lambda: all(buffer.of(rid) and buffer.of(rid)[-1].finish_reason != CHUNK for rid in rids)
                 and d.stats().in_flight_chunks == 0, timeout=60)
        assert links.to(draining_srv.address) == [], "a chunk was placed on the draining worker"
        assert set(links.to(other_srv.address)) == set(rids)
        assert d.stats().redispatched_chunks == 0
    finally:
        for r in regs:
            r.stop()
        draining_srv.stop(1.0)
        other_srv.stop(1.0)


class _RecordingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.registered = threading.Event()
        self.draining = threading.Event()

    def RegisterWorker(self, request: Any, context: Any) -> scheduler_pb2.RegisterWorkerResponse:
        self.registered.set()
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=HEARTBEAT_S)

    def Heartbeat(self, request: Any, context: Any) -> scheduler_pb2.HeartbeatResponse:
        if request.draining:
            self.draining.set()
        return scheduler_pb2.HeartbeatResponse(known=True)


def test_the_worker_process_says_it_drains_when_told_to_stop(model_dir: Path, tmp_path: Path) -> None:
    """`python -m services.worker`: SIGTERM starts the drain, and a draining heartbeat goes out at
    once (the interval is longer than the test), then the process exits 0."""
    sched = _RecordingScheduler()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SEER_WORKER_NUM_KV_PAGES": "128"}
    log = tmp_path / "log"
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, sched) as address:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker", "--port", "0", "--model-dir", str(model_dir),
             "--worker-id", "proc-drain", "--speculation", "false", "--grace-seconds", "5", "--metrics-port", "0",
             "--scheduler-address", address],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env,  # noqa: SIM115
        )
        try:
            assert sched.registered.wait(120), log.read_text()[-2000:]
            assert not sched.draining.is_set()
            proc.send_signal(signal.SIGTERM)
            assert sched.draining.wait(10), log.read_text()[-2000:]
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def long_chunks() -> Iterator[tuple[Dispatcher, FakeBuffer, _Recorded, str]]:
    """As `scheduler`, with chunks long enough to be in flight when a worker's stop begins."""
    with _dispatcher(chunk_size=32, commit_timeout=5.0) as s:
        yield s


def test_the_scheduler_hears_the_drain_before_the_server_refuses(
    long_chunks: tuple[Dispatcher, FakeBuffer, _Recorded, str], ref_engine: ReferenceEngine, model_dir: Path
) -> None:
    """The worker's stop as its main wires it (RunningServer.stop with before_stop =
    Registrar.drain_before_stop) while it runs chunks and the scheduler keeps getting new work.

    The drain notice used to come from a thread polling the stop flag on its own, racing the
    server's stop: a chunk placed after the server began refusing came back UNAVAILABLE, the
    scheduler removed the worker and its chunks in flight were cancelled and run again elsewhere
    (8 re-dispatched in the review's run). Now none is re-dispatched, the worker's chunks in flight
    end there, and every response finishes."""
    d, buffer, links, address = long_chunks
    other_engine = ReferenceEngine.from_dir(model_dir, num_pages=512, max_batch_size=16, page_size=16)
    draining, draining_srv = _serve(ref_engine, "w-drain", grace=30.0)
    other, other_srv = _serve(other_engine, "w-other", grace=30.0)
    regs = [Registrar(w, address, srv.address).start() for w, srv in ((draining, draining_srv), (other, other_srv))]
    # What services/worker/__main__ does, with a longer settle: on this shared 2-core machine a
    # placement the dispatcher decided just before the drain notice can take longer than the
    # default 0.1 s to reach the server, and then it is refused as the drain begins (a slow run,
    # not the race this test is about).
    draining_srv.before_stop = functools.partial(regs[0].drain_before_stop, settle=1.0)
    stop_feed = threading.Event()
    fed: list[str] = []

    def feed() -> None:  # new work all along the stop: the scheduler places chunks every few ms
        i = 0
        while not stop_feed.is_set():
            fed.append(f"n{i}")
            d._add_items([item(f"n{i}", max_tokens=8)])
            i += 1
            stop_feed.wait(0.005)

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        wait_for(lambda: len(d.core.stats()["workers"]) == 2)
        rids = [f"r{i}" for i in range(4)]
        d._add_items([item(rid, max_tokens=64) for rid in rids])
        wait_for(lambda: len(links.to(draining_srv.address)) >= 2, timeout=30)
        feeder.start()
        stopper = threading.Thread(target=draining_srv.stop)
        stopper.start()
        stop_feed.wait(0.5)  # the stop and the placements overlap
        stop_feed.set()
        feeder.join(5)
        all_rids = rids + fed
        wait_for(lambda: all(buffer.of(r) and buffer.of(r)[-1].finish_reason != CHUNK for r in all_rids)
                 and d.stats().in_flight_chunks == 0, timeout=120)
        stopper.join(60)
        assert not stopper.is_alive()
        stats = d.stats()
        assert stats.redispatched_chunks == 0, "a chunk on the stopping worker was refused or cancelled"
        # Still registered (as draining), not removed for a refused chunk.
        assert [w.draining for w in stats.workers if w.worker_id == "w-drain"] == [True]
        # Each response committed once per sequence number: nothing ran twice, nothing is missing.
        for rid in all_rids:
            seqs = [c.seq for c in buffer.of(rid)]
            assert seqs == list(range(len(seqs))), (rid, seqs)
    finally:
        stop_feed.set()
        for r in regs:
            r.stop()
        draining_srv.stop(1.0)
        other_srv.stop(1.0)


class _HeartbeatLog(_RecordingScheduler):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[scheduler_pb2.HeartbeatRequest] = []
        self.incarnations: list[str] = []

    def RegisterWorker(self, request: Any, context: Any) -> scheduler_pb2.RegisterWorkerResponse:
        self.incarnations.append(request.incarnation)
        return super().RegisterWorker(request, context)

    def Heartbeat(self, request: Any, context: Any) -> scheduler_pb2.HeartbeatResponse:
        self.requests.append(request)
        return super().Heartbeat(request, context)


def test_heartbeats_carry_the_incarnation_and_drain_now_no_telemetry(ref_engine: ReferenceEngine) -> None:
    """Every heartbeat names the process's incarnation (the scheduler ignores an old process's
    draining heartbeats after a new one registered under its id), and drain_now leaves the
    telemetry unset: an empty one read as "0 free KV pages"."""
    sched = _HeartbeatLog()
    with registered_with(sched, ref_engine, "w-inc") as reg:
        assert reg.drain_now()
        reg.drain()  # the registrar's own heartbeat, at once
        wait_for(lambda: len(sched.requests) >= 2, timeout=10)
    now, periodic = sched.requests[:2]
    assert sched.incarnations == [INCARNATION] and INCARNATION
    assert [now.incarnation, periodic.incarnation] == [INCARNATION, INCARNATION]
    assert now.draining and not now.HasField("telemetry")
    assert periodic.draining and periodic.HasField("telemetry")
