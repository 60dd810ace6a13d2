"""services.cli.signals: the stop request shared by `seer up` and `seer demo`."""

from __future__ import annotations

import os
import signal
import threading

from services.cli.signals import StopRequest, signals_to


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    # The Python handler runs on the main thread between bytecodes: give it a few.
    for _ in range(1000):
        pass


def test_the_first_signal_decides_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest()
    with signals_to(stop.handle):
        assert not stop.is_set()
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)  # a second signal changes nothing
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
