"""A worker's stop is bounded when the scheduler takes its heartbeat and never answers.

Found by review: the stop (drain_before_stop, 1 s for the drain notice, then Registrar.stop) took
about 5 s against a hung scheduler, as stop() joined the registrar's thread while that thread sat
in its own Heartbeat RPC until the RPC's 5 s deadline. Real gRPC on loopback: a scheduler whose
RegisterWorker answers and whose Heartbeat takes the call and never answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import Registrar
from tests.common.grpc_server import loopback_server


class _HungScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Registers the worker (heartbeat every 50 ms) and then hangs every Heartbeat until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.hung = threading.Event()  # a Heartbeat is held

    def RegisterWorker(self, request: Any, context: Any) -> scheduler_pb2.RegisterWorkerResponse:
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=0.05)

    def Heartbeat(self, request: Any, context: Any) -> scheduler_pb2.HeartbeatResponse:
        self.hung.set()
        self.release.wait(30)
        return scheduler_pb2.HeartbeatResponse(known=True)


@pytest.fixture
def hung_scheduler() -> Iterator[tuple[_HungScheduler, str]]:
    sched = _HungScheduler()
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, sched, max_workers=8) as address:
        try:
            yield sched, address
        finally:
            sched.release.set()  # before the server stops: the held Heartbeat returns


def test_stop_is_bounded_while_a_heartbeat_hangs(hung_scheduler: tuple[_HungScheduler, str],
                                                  ref_engine: ReferenceEngine) -> None:
    sched, address = hung_scheduler
    reg = Registrar(Worker(ref_engine, worker_id="w-hung", speculation=False), address, "127.0.0.1:5558").start()
    try:
        assert reg.registered.wait(10)
        assert sched.hung.wait(10), "no heartbeat reached the scheduler"
        start = time.monotonic()
        reg.drain_before_stop()  # the drain notice: 1 s, undelivered
        reg.stop()
        took = time.monotonic() - start
    finally:
        reg.stop()
    # The drain notice's 1 s plus slack; the in-flight Heartbeat (5 s deadline) is cancelled.
    assert took < 1.6, f"stop took {took:.2f} s"
    assert reg._thread is not None and not reg._thread.is_alive()
