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
