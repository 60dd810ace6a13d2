"""A failed SGLang subprocess SIGQUITs the worker process (managers/scheduler.py:6361-6370,
utils/watchdog.py:211-222). SGLang 0.5.23 installs its SIGQUIT handler only when its Engine is
built on the main thread (entrypoints/engine.py:1968-1993); the worker builds it on its
sglang-loop thread, so SIGQUIT's default action killed the worker with a core dump, no log line,
and its SGLang children left running (MEDIUM, review 3). The worker's main installs its own
handler now; here a real process installs it, starts a child and gets SIGQUIT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, signal, subprocess, sys, time
from services.common.log import setup_logging, get_logger
from services.worker.__main__ import install_sglang_failure_handler
setup_logging("worker")
install_sglang_failure_handler(get_logger("services.worker"))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGQUIT)  # what SGLang's watchdog sends
time.sleep(30)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"  # a zombie is dead, only not reaped yet


def test_a_sigquit_from_an_sglang_child_logs_kills_the_tree_and_exits() -> None:
    from services.worker.__main__ import EXIT_SGLANG_FAILED

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=env)
    assert proc.returncode == EXIT_SGLANG_FAILED != -signal.SIGQUIT, (proc.returncode, proc.stderr[-2000:])
    assert "SGLang subprocess failed" in proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


_STOPPING_CHILD = """
import os, signal, sys, time
from services.common.log import setup_logging, get_logger
from services.common.server import StopSignal
from services.worker.__main__ import install_sglang_failure_handler
setup_logging("worker")
stop = None
install_sglang_failure_handler(get_logger("services.worker"), stopping=lambda: stop is not None and stop.requested)
stop = StopSignal()
os.kill(os.getpid(), signal.SIGTERM)  # Ctrl-C / a cgroup SIGTERM: SGLang's children get it too...
time.sleep(0.1)
os.kill(os.getpid(), signal.SIGQUIT)  # ...exit non-zero, and SGLang's watchdog SIGQUITs the worker
time.sleep(0.2)
sys.exit(0 if stop.requested else 5)  # the stop path (drain, on_stop) ran to its end
"""


def test_a_sigquit_while_the_worker_stops_is_left_to_the_stop_path() -> None:
    """LOW (review 4): a Ctrl-C or cgroup SIGTERM reaches SGLang's children as well; they exit
    non-zero, SGLang's SubprocessWatchdog (utils/watchdog.py:209-222) SIGQUITs the worker while it
    drains, and the handler logged "SGLang subprocess failed" and exited 3 for a graceful stop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _STOPPING_CHILD], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SGLang subprocess failed" not in proc.stderr
    assert "while the worker stops" in proc.stderr
