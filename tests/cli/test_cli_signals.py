"""services.cli.signals: the stop request shared by `seer up` and `seer demo`."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from services.cli.signals import StopRequest, signals_to


class _Recorder:
    """Wraps a handler and notes each delivery under a Condition, so a test waits for the handler
    (run on the main thread between bytecodes, some time after os.kill) with a timeout instead of
    spinning. An RLock: the handler may interrupt the main thread while it holds the lock."""

    def __init__(self, handler: Callable[[int, FrameType | None], None]) -> None:
        self._handler = handler
        self._cond = threading.Condition(threading.RLock())
        self.delivered = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self._handler(signum, frame)
        with self._cond:
            self.delivered += 1
            self._cond.notify_all()

    def deliver(self, sig: signal.Signals) -> None:
        with self._cond:
            before = self.delivered
            os.kill(os.getpid(), sig)
            assert self._cond.wait_for(lambda: self.delivered > before, timeout=5.0), f"{sig.name} never handled"


def test_the_first_signal_decides_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest()
    recorder = _Recorder(stop.handle)
    with signals_to(recorder):
        assert not stop.is_set()
        recorder.deliver(signal.SIGTERM)
        recorder.deliver(signal.SIGINT)  # a second signal changes nothing
    assert stop.is_set() and stop.signum == signal.SIGTERM and stop.describe() == "SIGTERM"
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_off_the_main_thread_nothing_is_installed() -> None:
    """signal.signal raises ValueError off the main thread: a command run on a thread (a test, a
    program embedding it) keeps its caller's handlers instead of failing."""
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def run() -> None:
        with signals_to(StopRequest().handle):
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [before]
