"""`seer demo` notices a service that dies or turns NOT_SERVING while the rollout runs: one line
naming the service and its log files, the batch cancelled, the suite stopped, the logs kept, exit
status 1, instead of waiting out the rollout's one-hour timeout.

The real demo in a subprocess: the real suite, the embedded model, a real batch that lasts far
longer than the tests wait (32 responses of up to 400 tokens on CPU). A worker is SIGKILLed (a
crash), or its engine reports itself broken on cue (breakable_worker.py: the worker then turns
NOT_SERVING for good, as after a failed weight load).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from cli_helpers import BREAKABLE_WORKERS, breakable_env, launches, pids_with, wait_for_line

ROOT = Path(__file__).resolve().parents[2]

_ARGS = ["--limit", "8", "--group-size", "4", "--max-tokens", "400"]

_DEMO = BREAKABLE_WORKERS + """
import sys
from services.cli import demo
sys.exit(demo.main({argv!r}))
"""


def _services_of(pid: int, *more: str) -> list[int]:
    """Pids of the services started by the demo process `pid` (services.cli.launch --parent-pid)."""
    return pids_with("services.cli.launch", "--parent-pid", str(pid), *more)


@contextlib.contextmanager
def _demo(cmd: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield p
    finally:
        if p.poll() is None:  # a failed test: the services die with it (their parent-death watchdog)
            p.kill()
            p.communicate(timeout=30)
        for pid in _services_of(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _finish(p: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=30)
        raise AssertionError(f"seer demo still running after {timeout:.0f} s\n{out}\n{err}") from None


def _logs_kept(err: str, tmp_path: Path) -> Path:
    m = re.search(r"seer demo: logs kept in (\S+)", err)
    assert m, err
    logs = Path(m.group(1))
    assert logs.is_dir() and logs.is_relative_to(tmp_path), logs
    return logs


def test_demo_fails_at_once_when_a_worker_dies_mid_rollout(tmp_path: Path) -> None:
    """Before: nothing watched the services once the rollout ran; with its only worker dead the
    batch waited out the rollout's one-hour timeout."""
    cmd = [sys.executable, "-m", "services.cli", "demo", *_ARGS]
    with _demo(cmd, dict(os.environ, TMPDIR=str(tmp_path))) as p:
        wait_for_line(p, "rollout:", timeout=120)
        time.sleep(1.0)  # the batch submitted, its results streaming
        [worker] = _services_of(p.pid, "worker-0")
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = _finish(p, timeout=60)
        assert p.returncode == 1, f"exit status {p.returncode}\n{out}\n{err}"
        assert time.monotonic() - t0 < 30, "noticed too late"
        assert _services_of(p.pid) == [], "services left running"
    logs = _logs_kept(err, tmp_path)
    assert f"seer demo: worker-0 exited with code -9; see {logs}/worker-0.log (stdout {logs}/worker-0.out)" in err, err
    assert "seer demo: service(s) failed while the demo ran (worker-0); the rollout was stopped" in err, err
    assert "cancelled it" in err, "the batch was not cancelled"
    assert "Traceback" not in err, err
    assert "responses " not in out, "a summary was shown"


def test_demo_fails_when_a_worker_stays_not_serving_and_does_not_restart_it(tmp_path: Path) -> None:
    """Before: a worker whose engine broke (NOT_SERVING for good) was not noticed: the demo hung."""
    cmd = [sys.executable, "-c", _DEMO.format(argv=[*_ARGS, "--health-grace", "1"])]
    with _demo(cmd, breakable_env(tmp_path)) as p:
        wait_for_line(p, "rollout:", timeout=120)
        # Once the worker registered: it turns broken for good (seen at its next step, or by its
        # idle loop within 0.5 s), and its health NOT_SERVING.
        (tmp_path / "marks" / "worker-0.break").write_text("99")
        out, err = _finish(p, timeout=60)
        assert p.returncode == 1, f"exit status {p.returncode}\n{out}\n{err}"
        assert _services_of(p.pid) == [], "services left running"
    logs = _logs_kept(err, tmp_path)
    assert re.search(rf"seer demo: worker-0 NOT_SERVING since \d\d:\d\d:\d\d \(\d+ s\); longer than the 1 s grace; "
                     rf"see {logs}/worker-0.log \(stdout {logs}/worker-0.out\)", err), err
    assert "seer demo: service(s) failed while the demo ran (worker-0); the rollout was stopped" in err, err
    assert "cancelled it" in err, "the batch was not cancelled"
    assert "Traceback" not in err, err
    assert len(launches(tmp_path, "worker-0")) == 1, "the demo restarted the worker"
    assert "the engine is broken" in (logs / "worker-0.log").read_text()
