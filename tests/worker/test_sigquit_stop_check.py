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

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc
from test_worker_draining import registered_with

import services.worker.__main__ as worker_main
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


def test_an_ignored_sigint_is_not_the_stop(exits: list[int]) -> None:
    """A worker started in the background by a shell inherits SIGINT ignored. EarlyStop recorded
    such a SIGINT as the stop anyway, so a later real SGLang failure's SIGQUIT was taken for the
    stop and ignored: the worker kept running on a dead engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the fixture restores it
    early = worker_main.EarlyStop()
    os.kill(os.getpid(), signal.SIGINT)  # handled on this thread before the next line runs
    assert not early.requested
    worker_main.install_sglang_failure_handler(stopping=lambda: early.requested)
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
    with registered_with(sched, ref_engine, "w-quit") as reg:
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



def _sigquit_while_a_thread_starts(on_failure: Any) -> None:
    """A SIGQUIT handled while the main thread is inside Thread.start, holding threading's
    _active_limbo_lock (an RLock in CPython 3.11: the handler, on the same thread, may take it
    again, but a thread that starts meanwhile blocks in its bootstrap until the main thread
    releases it, which a handler that exits never does)."""
    lock = threading._active_limbo_lock  # type: ignore[attr-defined]
    worker_main.install_sglang_failure_handler(stopping=lambda: False, on_failure=on_failure)
    with lock, pytest.raises(_Exited):
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(5)


@pytest.fixture
def scheduled(ref_engine: ReferenceEngine) -> Iterator[tuple[_Scheduler, Registrar]]:
    sched = _Scheduler()
    with registered_with(sched, ref_engine, "w-limbo") as reg:
        yield sched, reg


def test_the_failure_notice_goes_out_from_inside_thread_start(
    exits: list[int], scheduled: tuple[_Scheduler, Registrar]
) -> None:
    """The handler's notice used to start its thread inside the handler. Landing inside a
    Thread.start of the main thread, that thread could not get past its bootstrap
    (_active_limbo_lock), the handler's bounded join gave up and the worker exited 3 without telling
    the scheduler (a non-reentrant lock there, as the review assumed, would have hung the handler).
    The notifier's thread is started up front; the handler takes no lock: it wakes it (a pipe) and
    polls a bool, for a bounded time."""
    sched, reg = scheduled
    notifier = worker_main.FailureNotifier(reg.drain_now)
    delivered: list[bool] = []
    try:
        _sigquit_while_a_thread_starts(lambda: delivered.append(notifier.fire()))
    finally:
        notifier.close()
    assert delivered == [True]
    assert exits == [worker_main.EXIT_SGLANG_FAILED]
    assert [h.worker_id for h in sched.heartbeats if h.draining] == ["w-limbo"]  # before the exit


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="relies on CPython 3.11's threading internals: Thread.start taking "
                           "_active_limbo_lock, an RLock, in the thread's bootstrap")
def test_control_a_thread_started_in_the_handler_sends_nothing(
    exits: list[int], scheduled: tuple[_Scheduler, Registrar]
) -> None:
    """The control: the previous handler's way (services/worker/__main__ at 6a7c69d)."""
    sched, reg = scheduled
    delivered: list[bool] = []

    def tell_scheduler() -> None:
        t = threading.Thread(target=reg.drain_now, name="drain-now", daemon=True)
        t.start()
        t.join(1.0)
        delivered.append(sched.draining.is_set())  # before the exit; the thread runs on after it

    _sigquit_while_a_thread_starts(tell_scheduler)
    assert exits == [worker_main.EXIT_SGLANG_FAILED]
    assert delivered == [False]


def test_the_notice_goes_out_while_another_thread_holds_the_logging_lock(
    scheduled: tuple[_Scheduler, Registrar]
) -> None:
    """On the SIGQUIT path the notice runs on the notifier's thread while the interrupted main
    thread may be inside a log call, holding its handler's lock: drain_now logged before its RPC
    and the notice waited for that lock until the exit (a review's reproduction)."""
    sched, reg = scheduled
    logger = logging.getLogger("services.worker.registration")
    handler = _DiscardingHandler()
    level = logger.level
    logger.setLevel(logging.INFO)  # the service's level: its info lines reach the handler
    logger.addHandler(handler)
    notifier = worker_main.FailureNotifier(reg.drain_now)
    try:
        with handler.lock:  # type: ignore[union-attr]
            # Its own log line after the RPC still waits for the lock, so fire() may time out;
            # the notice must be out by then.
            notifier.fire(timeout=1.0)
            assert sched.draining.is_set()
    finally:
        notifier.close()
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_notifier_that_never_fired_closes() -> None:
    fired: list[int] = []
    notifier = worker_main.FailureNotifier(lambda: fired.append(1))
    notifier.close()
    assert not notifier._thread.is_alive() and not fired


def test_a_fire_after_close_reports_false_and_writes_nothing() -> None:
    """close() ended the unfired thread through the same `finally` that marks a notice sent, so a
    fire() after it reported True, and wrote to the closed write end's fd number, which the
    process may have reused since (here: a new pipe takes the freed numbers)."""
    fired: list[int] = []
    notifier = worker_main.FailureNotifier(lambda: fired.append(1))
    notifier.close()
    read_fd, write_fd = os.pipe()
    try:
        assert notifier.fire(timeout=0.1) is False
        os.set_blocking(read_fd, False)
        with pytest.raises(BlockingIOError):  # nothing written to whatever took the old fd number
            os.read(read_fd, 1)
        assert not fired
    finally:
        os.close(read_fd)
        os.close(write_fd)


class _DiscardingHandler(logging.Handler):
    """A handler whose lock the test holds; its emit drops the record (a bare Handler's raises
    NotImplementedError once the lock is released)."""

    def emit(self, record: logging.LogRecord) -> None:
        pass
