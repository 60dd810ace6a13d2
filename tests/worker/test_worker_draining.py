"""A stopping worker tells the scheduler it drains, and no new chunk is placed on it.

While the worker drained (its server refusing new RunChunk streams with UNAVAILABLE) its registrar
kept heartbeating as usual, so the scheduler kept placing chunks there: each came back UNAVAILABLE
and was retried elsewhere. Real gRPC on loopback: the scheduler's Dispatcher behind its
SchedulerService, two real workers (reference engine) behind their WorkerService, each with its
Registrar; only the buffer is a stub (tests.scheduler.test_dispatcher_faults.FakeBuffer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from services.common.server import RunningServer, ServiceConfig, start_server
from services.scheduler.config import SchedulerConfig
from services.scheduler.links import Stream, WorkerLink
from services.scheduler.server import add_to_server
from services.scheduler.service import Dispatcher
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import Registrar
from services.worker.server import add_servicer
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


@pytest.fixture
def scheduler() -> Iterator[tuple[Dispatcher, FakeBuffer, _Recorded, str]]:
    buffer, links = FakeBuffer(), _Recorded()
    d = Dispatcher(SchedulerConfig(port=0, buffer_address=FakeBuffer.address, policy="divided", chunk_size=4,
                                   heartbeat_interval=HEARTBEAT_S, commit_timeout=2.0),
                   buffer_link=buffer, worker_link=links)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_to_server(d, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    loop = threading.Thread(target=d._dispatch_loop, daemon=True)  # no work feed: items are added below
    loop.start()
    try:
        yield d, buffer, links, f"127.0.0.1:{port}"
    finally:
        d.stop()
        loop.join(5)
        server.stop(0)


def _serve(engine: ReferenceEngine, worker_id: str) -> tuple[Worker, RunningServer]:
    worker = Worker(engine, worker_id=worker_id, speculation=False).start()
    return worker, start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
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

        regs[0].drain()  # what the worker's main does when its stop (and drain) begins
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
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(sched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SEER_WORKER_NUM_KV_PAGES": "128"}
    log = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker", "--port", "0", "--model-dir", str(model_dir),
         "--worker-id", "proc-drain", "--speculation", "false", "--grace-seconds", "5", "--metrics-port", "0",
         "--scheduler-address", f"127.0.0.1:{port}"],
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
        server.stop(0)
