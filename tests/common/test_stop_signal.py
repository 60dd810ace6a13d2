"""A SIGTERM that arrives while a service starts is kept and acted on once the server is up.

Until session 24 the handlers were installed by serve_until_signal, after the port was open (and,
in the worker, after it registered with its scheduler): a signal in that gap took the default
action, killing the process without draining or running on_stop (RocksDB close, deregistration).
Each case runs in its own process, since signal handlers belong to the main thread."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]

_PROLOGUE = """
import os, signal, sys, time
from services.common.log import setup_logging
from services.common.server import ServiceConfig, StopSignal, serve_until_signal, start_server
setup_logging("stop-test")

def on_stop() -> None:
    print("on_stop ran", flush=True)

def server():
    return start_server("stop-test", ServiceConfig(grace_seconds=0.0), lambda s: [], on_stop=on_stop)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROLOGUE + body], cwd=_REPO, capture_output=True, text=True,
                          timeout=60)


def test_a_signal_before_the_server_is_up_stops_it_gracefully_once_it_is() -> None:
    done = _run("""
stop = StopSignal()
os.kill(os.getpid(), signal.SIGTERM)  # while "starting"
time.sleep(0.2)
running = server()
sys.exit(serve_until_signal(running, stop))
""")
    assert done.returncode == 0, done.stderr
    assert "on_stop ran" in done.stdout
    assert "stop was requested while starting" in done.stderr


def test_without_early_handlers_the_same_signal_kills_the_process() -> None:
    """The control: the previous order (handlers installed by serve_until_signal) dies by the signal,
    so the case above does deliver it before the server is up."""
    done = _run("""
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
running = server()
sys.exit(serve_until_signal(running))
""")
    assert done.returncode == -signal.SIGTERM
    assert "on_stop ran" not in done.stdout


def test_a_signal_while_serving_drains_and_exits_zero() -> None:
    done = _run("""
import threading
stop = StopSignal()
running = server()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
sys.exit(serve_until_signal(running, stop))
""")
    assert done.returncode == 0, done.stderr
    assert "on_stop ran" in done.stdout
    assert "stop was requested while starting" not in done.stderr


def test_a_second_signal_while_starting_exits_at_once() -> None:
    """A start can take long (RocksDB recovery, a model load): the first Ctrl-C is kept for when the
    server is up; a second one exits now (before: it was kept too, and the process went on starting
    until it was up, then drained)."""
    done = _run("""
stop = StopSignal()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)  # a long start: never finishes within the test
print("still starting", flush=True)
""")
    assert done.returncode == 128 + signal.SIGINT, (done.returncode, done.stderr)
    assert "still starting" not in done.stdout
    assert "again while starting" in done.stderr


def test_a_second_signal_once_serving_still_drains() -> None:
    done = _run("""
stop = StopSignal()
running = server()
def twice():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
import threading
threading.Thread(target=twice).start()
sys.exit(serve_until_signal(running, stop))
""")
    assert done.returncode == 0, done.stderr
    assert "on_stop ran" in done.stdout


def test_the_handler_takes_no_lock() -> None:
    """The handler must not call into threading (an Event's set() takes the lock the interrupted main
    thread may hold inside Event.wait): it only records the signal number."""
    import inspect

    from services.common.server import StopSignal

    src = inspect.getsource(StopSignal._handler)
    assert ".set()" not in src and "log." not in src, src


def test_a_second_signal_exits_even_when_stderr_is_a_broken_pipe() -> None:
    """`python -m services.buffer 2>&1 | tee log`, Ctrl-C twice: the first kills tee, so the second's
    message fails with EPIPE; that error escaped into the start code instead of the exit."""
    import os

    r, w = os.pipe()
    os.close(r)  # the reader is gone: writes fail with EPIPE (Python ignores SIGPIPE)
    try:
        done = subprocess.run([sys.executable, "-c", _PROLOGUE + """
stop = StopSignal()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("still starting", flush=True)
"""], cwd=_REPO, stdout=subprocess.PIPE, stderr=w, text=True, timeout=60)
    finally:
        os.close(w)
    assert done.returncode == 128 + signal.SIGINT, done.returncode
    assert "still starting" not in done.stdout
