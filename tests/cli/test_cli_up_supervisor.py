"""`seer up` as a supervisor: stop requests while the suite starts, services that crash while it
runs, and the exit status and logs that report them.

`seer up` runs for real in a subprocess; its services are tiny stand-in processes (a real service
cannot be made to crash on cue or to hang in start-up), and the health checks are stubbed so that
the stand-ins count as SERVING. Everything else (the signal handling, the start and stop sequence,
the data directory) is the real code.
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

import pytest
from cli_helpers import finish, pids_with, wait_for_line

from services.cli import up

ROOT = Path(__file__).resolve().parents[2]

# The stand-in for a service: sleeps; exits 0 on SIGTERM (a clean drain), or, when its name is in
# CRASH, writes an error and exits 3 after a second; a name in ONCE crashes so in its first launch
# only (the launch's pid is appended to <token>/<name>.launches). The token marks its command line
# (see _alive).
_SERVICE = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "marks = os.path.join(sys.argv[2], sys.argv[1] + '.launches')\n"
    "with open(marks, 'a') as f:\n"
    "    f.write(f'{os.getpid()}\\n')\n"
    "with open(marks) as f:\n"
    "    first = len(f.read().split()) == 1\n"
    "if sys.argv[1] in sys.argv[3].split(',') or (first and sys.argv[1] in sys.argv[4].split(',')):\n"
    "    time.sleep(1.0)\n"
    "    sys.stderr.write('fatal: the stand-in crashed\\n')\n"
    "    sys.exit(3)\n"
    "time.sleep(600)\n"
)

_UP = """
import sys
from services.cli import up
up.ensure_embedded_model = lambda: "/nonexistent-model"
if {healthy}:
    up.health_status = lambda address, timeout=1.0: "SERVING"
    up.Suite.wait_workers = lambda self, count, timeout=120.0, stop=None: None
up.ServiceProcess.command = lambda self: [sys.executable, "-c", {service!r}, self.name, {token!r}, {crash!r},
                                          {once!r}]
sys.exit(up.main(["--base-port", "0", "--workers", "{workers}", "--timeout", "30"]))
"""


def _start_up(tmp_path: Path, *, healthy: bool, crash: str = "", once: str = "", workers: int = 1
              ) -> subprocess.Popen[str]:
    code = _UP.format(healthy=healthy, service=_SERVICE, token=str(tmp_path), crash=crash, once=once,
                      workers=workers)
    # TMPDIR: the suite's default temporary data directory lands under tmp_path, where the test can
    # look for it and pytest removes it.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _alive(token: str) -> list[int]:
    """Pids of stand-in services still running (their command line holds the token)."""
    return pids_with("-c", token)


def _state_dir(stdout: str) -> Path:
    m = re.search(r"state in (\S+)\)", stdout)
    assert m, stdout
    return Path(m.group(1))


@pytest.fixture(autouse=True)
def _no_stand_in_left(tmp_path: Path) -> Iterator[None]:
    """Kills stand-ins that a failing `seer up` (SIGKILLed by _finish) left behind: they are not
    started through services.cli.launch, so nothing else takes them down."""
    yield
    for pid in _alive(str(tmp_path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_stops_on_a_signal_while_the_suite_starts(tmp_path: Path, sig: signal.Signals) -> None:
    """Before: the handler only set a flag that nothing read until the suite was up, so Ctrl-C
    waited out --timeout (30 s here, 300 s by default) with the services running."""
    p = _start_up(tmp_path, healthy=False)  # the stand-ins never answer a health check
    head = wait_for_line(p, "starting the suite")
    time.sleep(1.5)  # into wait_healthy, the services launched
    t0 = time.monotonic()
    p.send_signal(sig)
    code, out, err = finish(p, timeout=10)
    assert code is not None, f"seer up still running {time.monotonic() - t0:.0f}s after {sig.name}"
    assert code == 128 + sig
    assert "stopped before the suite was up" in err
    assert _alive(str(tmp_path)) == [], "services left running"
    assert not _state_dir("".join(head) + out).exists(), "a clean stop keeps no temporary data"


def _launches(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.launches"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


_EXIT_RESTART = re.compile(r"seer up: (\S+) exited with code 3; restarting it(?: in \d+ s)? \(restart (\d), (\d) of "
                           r"at most 3 in a row\); see (\S+) \(stdout (\S+)\)")


def test_up_restarts_a_crashing_buffer_3_times_then_stops_keeping_the_state(tmp_path: Path) -> None:
    """Past the restart limit, the old behaviour: the suite stops by itself, exit 1, the logs and
    the state kept, and the line says how to resume (before: no restart at all, and no word on the
    state or on how to resume)."""
    p = _start_up(tmp_path, healthy=True, crash="buffer")
    head = "".join(wait_for_line(p, "suite is up"))
    code, out, err = finish(p, timeout=40)  # no signal: the suite must stop by itself
    assert code == 1, f"exit status {code}\n{out}\n{err}"
    restarts = _EXIT_RESTART.findall(err)
    assert [r[:3] for r in restarts] == [("buffer", "1", "1"), ("buffer", "2", "2"), ("buffer", "3", "3")], err
    assert len(_launches(tmp_path, "buffer")) == 4
    m = re.search(r"seer up: buffer exited with code 3; not restarted again: 3 restart\(s\) in a row did not mend "
                  r"it; see (\S+)", err)
    assert m, err
    log = Path(m.group(1))
    assert log.exists(), "the crash log the line names was deleted"
    assert log.read_text().count("fatal: the stand-in crashed") == 4
    state = _state_dir(head)
    assert (f"seer up: buffer is down (not restarted again); the suite cannot work without it: stopping; the state "
            f"is kept: `seer up --base-port 0 --workers 1 --timeout 30 --data-dir {state}` resumes it") in err, err
    assert f"logs kept in {log.parent}" in err and state.exists()
    assert _alive(str(tmp_path)) == []


@pytest.mark.parametrize("name", ["buffer", "scheduler", "worker-0"])
def test_up_restarts_a_service_that_crashed_once_and_exits_0(tmp_path: Path, name: str) -> None:
    """Before: the buffer's or scheduler's exit stopped the suite (exit 1), a worker's was only
    reported and the worker left down (exit 1 at the end), though a rerun of `seer up` with the same
    data dir recovers every response."""
    p = _start_up(tmp_path, healthy=True, once=name)
    wait_for_line(p, "suite is up")
    deadline = time.monotonic() + 20
    while len(_launches(tmp_path, name)) < 2:
        assert time.monotonic() < deadline and p.poll() is None, f"{name} was not restarted"
        time.sleep(0.1)
    time.sleep(1.5)  # the restarted stand-in runs on (the check before the stop, stubbed, sees it SERVING)
    assert p.poll() is None, "seer up stopped"
    p.send_signal(signal.SIGINT)
    code, out, err = finish(p, timeout=20)
    assert code == 0, f"exit status {code}\n{out}\n{err}"
    [(who, restart, in_a_row, log, stdout)] = _EXIT_RESTART.findall(err)
    assert (who, restart, in_a_row) == (name, "1", "1")
    assert Path(stdout) == Path(log).with_suffix(".out")
    assert "fatal: the stand-in crashed" in Path(log).read_text(), "the crashed launch's log is kept"
    assert f"seer up: restarted and SERVING since: {name}; logs kept in {Path(log).parent}" in err, err
    assert "stopped cleanly" in out
    assert _alive(str(tmp_path)) == []


def test_up_leaves_a_worker_down_past_the_limit_serves_on_and_fails_at_the_end(tmp_path: Path) -> None:
    """A worker is not central (the scheduler re-runs its chunks on the others): past the limit the
    suite serves on without it, but the exit status after Ctrl-C reports it and the log is kept."""
    p = _start_up(tmp_path, healthy=True, crash="worker-0", workers=2)
    head = "".join(wait_for_line(p, "suite is up"))
    deadline = time.monotonic() + 30
    while len(_launches(tmp_path, "worker-0")) < 4:
        assert time.monotonic() < deadline and p.poll() is None, "worker-0 was not restarted 3 times"
        time.sleep(0.1)
    time.sleep(5.0)  # the last launch has crashed (~1 s), been noticed (0.5 s ticks) and left down: margin
    assert p.poll() is None, "seer up stopped although only one of two workers crashed"
    assert len(_launches(tmp_path, "worker-0")) == 4
    p.send_signal(signal.SIGINT)
    code, out, err = finish(p, timeout=20)
    assert code == 1, f"exit status {code}\n{out}\n{err}"
    assert "seer up: worker-0 exited with code 3; not restarted again: 3 restart(s) in a row" in err, err
    assert "no worker" not in err, err
    log = _state_dir(head) / "logs" / "worker-0.log"
    assert log.exists() and "fatal: the stand-in crashed" in log.read_text()
    assert "logs kept in" in err


def test_up_stops_when_its_only_worker_is_left_down_keeping_the_state(tmp_path: Path) -> None:
    """With --workers 1, the worker left down past the limit left a suite that accepts batches and
    finishes none, serving on with only the worker's give-up line to tell. Now as for a buffer or
    scheduler left down: it stops by itself, exit 1, the state kept and the resume line."""
    p = _start_up(tmp_path, healthy=True, crash="worker-0")
    head = "".join(wait_for_line(p, "suite is up"))
    code, out, err = finish(p, timeout=40)  # no signal: the suite must stop by itself
    assert code == 1, f"exit status {code}\n{out}\n{err}"
    assert len(_launches(tmp_path, "worker-0")) == 4
    state = _state_dir(head)
    assert ("seer up: no worker is left (worker-0 down, not restarted again); the suite cannot finish a batch "
            f"without one: stopping; the state is kept: `seer up --base-port 0 --workers 1 --timeout 30 --data-dir "
            f"{state}` resumes it") in err, err
    assert state.exists() and "logs kept in" in err
    assert _alive(str(tmp_path)) == []


def test_up_clean_stop_exits_0_and_removes_its_temporary_data(tmp_path: Path) -> None:
    """And says at start how many state directories earlier runs kept (before: nothing, and they
    piled up in the temporary directory unnoticed); it removes none of them."""
    earlier = [tmp_path / "seer-suite-old1", tmp_path / "seer-suite-old2"]
    for age, d in zip((7200, 3600), earlier, strict=True):
        (d / "logs").mkdir(parents=True)
        os.utime(d, (time.time() - age, time.time() - age))
    p = _start_up(tmp_path, healthy=True)
    head = "".join(wait_for_line(p, "trainer API"))
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    code, out, err = finish(p, timeout=20)
    assert code == 0, f"exit status {code}\n{out}\n{err}"
    # Each service's stdout file beside its log: console tracing's spans are there (the README).
    assert "logs/scheduler.log, stdout " in head and "logs/scheduler.out)" in head, head
    assert "stopped cleanly" in out
    assert not _state_dir(head).exists()
    assert (f"seer up: note: 2 state directories of earlier runs in {tmp_path} (seer-suite-*, the newest "
            "seer-suite-old2): kept after a failure or a restart") in err, err
    assert all(d.exists() for d in earlier)


class _Stubborn(up.ServiceProcess):
    """A process that ignores SIGTERM (a service stuck in its drain)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(600)\n"]


def test_a_group_that_ignores_sigterm_costs_one_timeout_not_one_per_process(tmp_path: Path) -> None:
    procs = [_Stubborn(name=f"worker-{i}", module="", args=[], port=0, metrics_port=0, log_dir=tmp_path,
                       env=dict(os.environ)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:  # SIGTERM is ignored only once the handler is set
        deadline = time.monotonic() + 30
        while b"ready" not in p.stdout_path.read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    t0 = time.monotonic()
    codes = up.stop_together(procs, timeout=1.5)
    elapsed = time.monotonic() - t0
    assert codes == {f"worker-{i}": -signal.SIGKILL for i in range(3)}
    # One deadline for the group: about 1.5 s, where a timeout per process took 4.5 s.
    assert elapsed < 3.5, elapsed
