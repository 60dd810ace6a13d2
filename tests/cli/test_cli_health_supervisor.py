"""HealthSupervisor's verdicts (services/cli/up.py), shared by `seer up` and `seer demo`: which
services failed and which a restart mended, on a fake clock with scripted health answers and fake
processes (the real processes and health checks are in test_cli_up_health.py,
test_cli_up_restart_real.py and test_cli_demo_health.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import cast

import pytest

from services.cli.up import HealthSupervisor, ServiceProcess


class _Proc:
    """What HealthSupervisor uses of a ServiceProcess; SIGTERM ends it at once."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.address = f"{name}:1"
        self.stderr_path = log_dir / f"{name}.log"
        self.stdout_path = log_dir / f"{name}.out"
        self.pid = 1
        self.running = True
        self.starts = 0

    def alive(self) -> bool:
        return self.running

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.running = False

    def kill(self) -> None:
        self.running = False

    def wait(self, _timeout: float) -> int | None:
        return None if self.running else 0

    def start(self) -> None:
        self.running = True
        self.starts += 1


class _World:
    def __init__(self, tmp_path: Path, limit: int) -> None:
        self.now = 0.0
        self.status = "SERVING"
        self.lines: list[str] = []
        self.proc = _Proc("worker-0", tmp_path)
        self.health = HealthSupervisor(cast(dict[str, ServiceProcess], {"worker-0": self.proc}), self.lines.append,
                                       command="seer x", grace=2.0, interval=0.5, limit=limit,
                                       check=lambda _address: self.status, clock=lambda: self.now)

    def run(self, seconds: float, status: str) -> list[str]:
        """`seconds` of ticks every 0.25 s, the service answering `status`; the exits seen."""
        self.status = status
        exited = []
        end = self.now + seconds
        while self.now < end:
            exited += self.health.tick()
            self.now += 0.25
        return exited


def test_a_restart_that_mended_its_service_is_no_failure(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    assert w.run(3.0, "NOT_SERVING") == []  # restarted: no exit of its own
    assert w.proc.starts == 1
    assert w.health.failed() == {"worker-0"}, "restarted and not seen SERVING yet"
    w.run(1.0, "SERVING")
    assert w.health.failed() == set() and w.health.recovered() == {"worker-0"}
    assert len(w.lines) == 1 and "restarting it (restart 1, 1 of at most 3 in a row)" in w.lines[0]
    assert w.lines[0].endswith(f"see {w.proc.stderr_path} (stdout {w.proc.stdout_path})")


def test_a_restart_not_checked_yet_is_checked_before_the_stop_and_nothing_more(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.run(3.5, "NOT_SERVING")
    assert w.proc.starts == 1 and w.health.failed() == {"worker-0"}
    # Broken again (and past the grace, had a tick looked): check_restarted neither restarts nor
    # mends it.
    w.now += 10.0
    w.health.check_restarted()
    assert w.proc.starts == 1 and w.health.failed() == {"worker-0"} and len(w.lines) == 1
    w.status = "SERVING"  # mended since the last tick
    w.health.check_restarted()
    assert w.health.failed() == set() and w.health.recovered() == {"worker-0"}


def test_the_limit_reached_is_a_failure(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=1)
    w.run(12.0, "NOT_SERVING")
    assert w.proc.starts == 1
    assert w.health.failed() == {"worker-0"} and w.health.recovered() == set()
    assert "not restarted again: 1 restart(s) in a row did not mend it" in w.lines[-1]


@pytest.mark.parametrize("seen_by", ["tick", "check_restarted"])
def test_a_service_given_up_on_that_serves_later_is_judged_alike_either_way(tmp_path: Path, seen_by: str) -> None:
    """Given up on at the limit, then SERVING: a tick and the check before the stop agree (the
    check skipped a service given up on, so the exit status hung on which saw the answer)."""
    w = _World(tmp_path, limit=1)
    w.run(12.0, "NOT_SERVING")
    assert w.health.failed() == {"worker-0"}
    if seen_by == "tick":
        w.run(1.0, "SERVING")
    else:
        w.status = "SERVING"
        w.health.check_restarted()
    assert w.health.failed() == set() and w.health.recovered() == {"worker-0"}


def test_limit_0_never_restarts_and_fails_at_the_first_overrun(tmp_path: Path) -> None:
    """`seer demo`'s supervision."""
    w = _World(tmp_path, limit=0)
    w.run(1.75, "NOT_SERVING")
    assert w.health.failed() == set(), "within the grace"
    w.run(1.0, "NOT_SERVING")
    assert w.proc.starts == 0 and w.proc.running
    assert w.health.failed() == {"worker-0"}
    [line] = w.lines
    assert line.startswith("seer x: worker-0 NOT_SERVING since ") and "; longer than the 2 s grace; see " in line
    assert line.endswith(f"(stdout {w.proc.stdout_path})")


def test_an_exit_is_returned_once_and_is_a_failure(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    w.proc.running = False
    assert w.run(1.0, "UNREACHABLE") == ["worker-0"]
    assert w.health.failed() == {"worker-0"} and w.health.exited == ["worker-0"]


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit: must be >= 0"):
        HealthSupervisor({}, print, limit=-1)
