"""The stop request of `seer up` and `seer demo`: SIGINT and SIGTERM only record which signal came
first, and the command's own loop (Suite.start's polling, the supervisor loop) acts on it, so the
suite is stopped in order and its temporary data removed, whatever the signal. (`seer rollout`
uses StopRequest and signals_to with a handler of its own that also raises KeyboardInterrupt, each
signal: a second one ends a slow cancel.)

Not services.common.server.StopSignal: a service's second signal while starting exits at once
(os._exit), which for `seer up` would leave its temporary data directory behind; here a second
signal changes nothing (the stop under way is bounded by its SIGKILL timeout).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType


class StopRequest:
    """A stop request set by a signal handler. Not a threading.Event: Event.set() takes a lock that
    the interrupted main thread may be holding (inside Event.wait), which would deadlock; the
    handler only assigns an int."""

    def __init__(self) -> None:
        self.signum = 0

    def is_set(self) -> bool:
        return self.signum != 0

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        # The first signal decides the exit status; later ones (a second Ctrl-C) change nothing.
        self.signum = self.signum or signum

    def describe(self) -> str:
        """The first signal's name (SIGINT, SIGTERM), for the line that says why the command stopped."""
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def signals_to(handler: Callable[[int, FrameType | None], None],
               signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[bool]:
    """`signals` (SIGINT and SIGTERM unless told) go to `handler` inside the block; the previous
    handlers come back after it (a command's main() also runs inside other programs and tests).
    Yields whether the handler was installed.

    On a thread other than the main one nothing is installed (signal.signal works on the main thread
    only): a caller that runs the command on a thread keeps its own handling."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield True
    finally:
        for sig, previous in old.items():
            # None: a handler installed from C, which Python cannot put back; the default then.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
