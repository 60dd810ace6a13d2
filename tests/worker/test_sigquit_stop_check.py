"""The worker's SIGQUIT handler (services/worker/__main__.py), in process: SGLang's subprocesses
SIGQUIT the worker when they fail, and also when a Ctrl-C or cgroup SIGTERM reached them while
the worker stops.

- The handler asked "was the stop requested?" of the StopSignal, which exists only once the
  engine is built: a Ctrl-C during an SGLang model load (its children die of the SIGINT, its
  watchdog SIGQUITs the worker) exited 3, a failure, instead of 0.
- A real failure exited 3 without telling the scheduler, which kept placing chunks on the dead
  worker until it missed 3 heartbeats: now one draining heartbeat goes first (best effort).

No SGLang: build_worker is replaced by a load that the signals interrupt, and os._exit by a
recorder (the handler's exit would end the test process)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

import services.worker.__main__ as worker_main
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import Registrar

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)


class _Exited(BaseException):
    """What the recorded os._exit raises: the handler's code after it must not run."""


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """os._exit recorded (it raises _Exited), the process tree not killed; the signal handlers
    restored after the test."""
    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    codes: list[int] = []

    def _exit(code: int) -> None:
        codes.append(code)
        raise _Exited

    monkeypatch.setattr(os, "_exit", _exit)
    monkeypatch.setattr(worker_main, "_descendants", lambda pid: [])
    try:
        yield codes
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_ctrl_c_during_the_model_load_is_the_stop_not_a_failure(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []

    def load(cfg: Any, worker_id: str) -> Any:
        loads.append(worker_id)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: to the worker and its SGLang children
            time.sleep(5)  # the model load, interrupted
        except KeyboardInterrupt:
            # The children died of it: SGLang's watchdog SIGQUITs the worker as it unwinds.
            os.kill(os.getpid(), signal.SIGQUIT)
            raise
        raise AssertionError("the SIGINT did not interrupt the load")

    monkeypatch.setattr(worker_main, "build_worker", load)
    assert worker_main.main(["--engine", "sglang", "--port", "0"]) == 0
    assert loads and exits == []


def test_a_sigquit_without_a_stop_is_still_a_failure(exits: list[int]) -> None:
    stop_requested = worker_main.EarlyStop()
    worker_main.install_sglang_failure_handler(stopping=lambda: stop_requested.requested)
    with pytest.raises(_Exited):
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(5)
    assert exits == [worker_main.EXIT_SGLANG_FAILED]


class _Scheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.heartbeats: list[scheduler_pb2.HeartbeatRequest] = []
        self.draining = threading.Event()

    def RegisterWorker(self, request: Any, context: Any) -> scheduler_pb2.RegisterWorkerResponse:
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=60.0)

    def Heartbeat(self, request: Any, context: Any) -> scheduler_pb2.HeartbeatResponse:
        self.heartbeats.append(request)
        if request.draining:
            self.draining.set()
        return scheduler_pb2.HeartbeatResponse(known=True)


def test_a_failure_tells_the_scheduler_before_exiting(exits: list[int], ref_engine: ReferenceEngine) -> None:
    sched = _Scheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(sched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    reg = Registrar(Worker(ref_engine, worker_id="w-quit", speculation=False), f"127.0.0.1:{port}",
                    "127.0.0.1:5557").start()
    try:
        assert reg.registered.wait(10)
        order: list[str] = []

        def tell() -> None:
            reg.drain_now()
            order.append("drained" if sched.draining.is_set() else "not delivered")

        worker_main.install_sglang_failure_handler(stopping=lambda: False, on_failure=tell)
        with pytest.raises(_Exited):
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(5)
        assert order == ["drained"]  # delivered before the exit
        assert exits == [worker_main.EXIT_SGLANG_FAILED]
        assert [h.worker_id for h in sched.heartbeats if h.draining] == ["w-quit"]
    finally:
        reg.stop()
        server.stop(0)
