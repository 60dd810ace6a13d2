"""`seer demo` stopped by Ctrl-C or SIGTERM, while the suite starts and while the rollout runs.

The real demo in a subprocess: the real suite, the embedded model, a real batch. What is checked is
what the user is left with: the exit status, one line on stderr and no traceback, no service still
running and no temporary data directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import pids_with, wait_for_line

ROOT = Path(__file__).resolve().parents[2]


def _start_demo(tmp_path: Path) -> subprocess.Popen[str]:
    # A batch that lasts far longer than the test waits (32 responses of up to 400 tokens on CPU),
    # so the signal lands while the results stream in. TMPDIR: the suite's temporary data directory
    # lands under tmp_path, where the test looks for it.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "services.cli", "demo", "--limit", "8", "--group-size", "4", "--max-tokens", "400"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _services_of(pid: int) -> list[int]:
    """Pids of the services started by the demo process `pid` (services.cli.launch --parent-pid)."""
    return pids_with("services.cli.launch", "--parent-pid", str(pid))


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    p = _start_demo(tmp_path)
    yield p
    if p.poll() is None:  # a failed test: the services die with it (their parent-death signal)
        p.kill()
        p.communicate(timeout=30)
    for pid in _services_of(p.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("phase", ["start", "rollout"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_demo_stops_cleanly_on_a_signal(
        demo: subprocess.Popen[str], tmp_path: Path, phase: str, sig: signal.Signals) -> None:
    """Before: SIGTERM killed the demo at once and left its seer-suite-* directory behind (the
    services stopped on their own, by their parent-death signal); Ctrl-C printed a traceback from
    deep inside grpc."""
    if phase == "start":
        # At once: the services are launched but none is serving yet (imports, the model).
        wait_for_line(demo, "starting the suite", timeout=120)
    else:
        wait_for_line(demo, "rollout:", timeout=120)
        time.sleep(2.0)  # the batch submitted, its results streaming
    demo.send_signal(sig)
    try:
        out, err = demo.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"seer demo still running 60 s after {sig.name}") from None
    assert demo.returncode == 128 + sig, f"exit status {demo.returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err
    if phase == "start":
        assert f"seer demo: stopped by {sig.name} before the suite was up" in err, err
    else:
        assert f"seer demo: stopped by {sig.name}\n" in err, err
        assert "cancelled it" in err, "the batch was not cancelled"
        assert "responses " not in out, "the rollout was not interrupted"
    assert _services_of(demo.pid) == [], "services left running"
    assert list(tmp_path.glob("seer-suite-*")) == [], "the temporary data directory was left behind"
