"""HealthSupervisor's verdicts (services/cli/up.py), shared by `seer up` and `seer demo`: which
services it restarts (for their health, after an exit), which failed and which a restart mended, on
a fake clock with scripted health answers and fake processes (the real processes and health checks
are in test_cli_up_health.py, test_cli_up_supervisor.py, test_cli_up_restart_real.py,
test_cli_up_exit_restart_real.py and test_cli_demo_health.py)."""

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
        # No ports: nothing to probe before a relaunch (the real ports: test_cli_up_port_taken.py).
        self.port = 0
        self.metrics_port = 0
        self.running = True
        self.starts = 0
        self.code = 0  # the exit code once it is not running
        self.crash_on_start = False  # each new launch exits at once (with code 3)

    @property
    def returncode(self) -> int | None:
        return None if self.running else self.code

    def alive(self) -> bool:
        return self.running

    def crash(self, code: int = 3) -> None:
        self.running, self.code = False, code

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.running = False

    def kill(self) -> None:
        self.running = False

    def tail(self, _lines: int = 20) -> str:
        return ""  # what the launch wrote: nothing

    def wait(self, _timeout: float) -> int | None:
        return None if self.running else 0

    def start(self) -> None:
        self.running = True
        self.starts += 1
        if self.crash_on_start:
            self.crash()


class _World:
    def __init__(self, tmp_path: Path, limit: int) -> None:
        self.now = 0.0
        self.status = "SERVING"
        self.lines: list[str] = []
        self.proc = _Proc("worker-0", tmp_path)
        self.health = HealthSupervisor(cast(dict[str, ServiceProcess], {"worker-0": self.proc}), self.lines.append,
                                       command="seer x", grace=2.0, interval=0.5, limit=limit,
                                       check=lambda _address: self.status, clock=lambda: self.now)

    def run(self, seconds: float, status: str, stop: _Stop | None = None) -> list[str]:
        """`seconds` of ticks every 0.25 s, the service answering `status`; the exits seen."""
        self.status = status
        exited = []
        end = self.now + seconds
        while self.now < end:
            exited += self.health.tick(stop)
            self.now += 0.25
        return exited


class _Stop:
    def __init__(self) -> None:
        self.set = False

    def is_set(self) -> bool:
        return self.set


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


def test_limit_0_returns_an_exit_once_as_a_failure_and_never_restarts_it(tmp_path: Path) -> None:
    """`seer demo`'s supervision: the exit is said in the demo's own words, once."""
    w = _World(tmp_path, limit=0)
    w.run(1.0, "SERVING")
    w.proc.crash(-9)
    assert w.run(1.0, "UNREACHABLE") == ["worker-0"]
    assert w.proc.starts == 0
    assert w.health.failed() == {"worker-0"} and w.health.exited == ["worker-0"]
    assert w.lines == [f"seer x: worker-0 exited with code -9; see {w.proc.stderr_path} (stdout {w.proc.stdout_path})"]


def test_an_exit_is_restarted_at_once_and_mended_by_a_serving_answer(tmp_path: Path) -> None:
    """Before: an exit was only returned (reported; for the buffer or scheduler, the suite
    stopped), though a rerun of the same command line recovers every response."""
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    w.proc.crash(-9)
    assert w.run(0.25, "UNREACHABLE") == [], "restarted, not reported as left down"
    assert w.proc.starts == 1 and w.proc.running
    assert w.lines == [f"seer x: worker-0 exited with code -9; restarting it (restart 1, 1 of at most 3 in a row); "
                       f"see {w.proc.stderr_path} (stdout {w.proc.stdout_path})"]
    assert w.health.failed() == {"worker-0"}, "not seen SERVING since the restart"
    w.run(1.0, "SERVING")
    assert w.health.failed() == set() and w.health.recovered() == {"worker-0"} and w.health.exited == []


def test_a_crash_loop_is_restarted_with_backoff_up_to_the_limit_then_left_down(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    w.proc.crash_on_start = True
    w.proc.crash()
    exited: list[str] = []
    starts_at: dict[int, float] = {}
    while w.now < 20.0:
        exited += w.run(0.25, "UNREACHABLE")
        starts_at.setdefault(w.proc.starts, w.now)
    assert w.proc.starts == 3 and exited == ["worker-0"], "3 restarts, then left down and returned once"
    # At once, then 1 s, then 2 s after the exit before (each exit is seen on the tick after it).
    assert starts_at[2] - starts_at[1] == pytest.approx(1.0, abs=0.3)
    assert starts_at[3] - starts_at[2] == pytest.approx(2.0, abs=0.3)
    assert [line.split(";")[1].strip() for line in w.lines] == [
        "restarting it (restart 1, 1 of at most 3 in a row)",
        "restarting it in 1 s (restart 2, 2 of at most 3 in a row)",
        "restarting it in 2 s (restart 3, 3 of at most 3 in a row)",
        "not restarted again: 3 restart(s) in a row did not mend it"]
    assert w.health.failed() == {"worker-0"} and w.health.recovered() == set()


def test_a_relaunch_that_fails_is_worded_as_such_not_as_a_new_exit(tmp_path: Path) -> None:
    """A relaunch whose log cannot be opened leaves the old, dead process: the next exit check
    counted it as a fresh exit, worded with that process's stale exit code."""
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    fails = [OSError(21, "Is a directory")]

    def start() -> None:
        if fails:
            raise fails.pop()
        w.proc.running = True
        w.proc.starts += 1

    w.proc.start = start  # type: ignore[method-assign]
    w.proc.crash(-9)
    w.run(2.0, "UNREACHABLE")
    assert w.proc.starts == 1 and w.proc.running
    assert [line.split(";")[0] for line in w.lines] == [
        "seer x: worker-0 exited with code -9",
        "seer x: worker-0 could not be started again ([Errno 21] Is a directory)"]
    assert "restarting it in 1 s (restart 2, 2 of at most 3 in a row)" in w.lines[1]


def test_a_serving_answer_between_exits_resets_the_count(tmp_path: Path) -> None:
    """The limit is in a row: a service that crashes now and then, serving in between, is always
    restarted (and at once)."""
    w = _World(tmp_path, limit=2)
    for i in range(5):
        w.run(1.0, "SERVING")
        w.proc.crash()
        assert w.run(0.25, "UNREACHABLE") == []
        assert w.proc.starts == i + 1 and w.proc.running
    w.run(1.0, "SERVING")
    assert w.health.failed() == set() and w.health.recovered() == {"worker-0"}
    assert all("restarting it (restart" in line and "1 of at most 2 in a row" in line for line in w.lines)


def test_exits_and_health_restarts_share_one_limit(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=2)
    w.run(3.5, "NOT_SERVING")  # restart 1, for its health
    assert w.proc.starts == 1
    w.proc.crash()
    w.run(1.5, "UNREACHABLE")  # restart 2, after an exit (the second in a row: after 1 s)
    assert w.proc.starts == 2 and "2 of at most 2 in a row" in w.lines[-1]
    w.proc.crash()
    assert w.run(5.0, "UNREACHABLE") == ["worker-0"]
    assert w.proc.starts == 2 and "not restarted again: 2 restart(s)" in w.lines[-1]


def test_an_exit_seen_once_a_stop_is_requested_is_not_restarted(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.run(1.0, "SERVING")
    stop = _Stop()
    stop.set = True
    w.proc.crash()
    assert w.run(0.25, "UNREACHABLE", stop) == ["worker-0"]
    assert w.proc.starts == 0 and w.health.failed() == {"worker-0"}


def test_a_restart_waiting_out_its_backoff_is_no_exit_and_is_started_later(tmp_path: Path) -> None:
    w = _World(tmp_path, limit=3)
    w.proc.crash()
    w.run(0.25, "UNREACHABLE")
    w.proc.crash()  # at once after the first restart: the second waits 1 s
    assert w.run(0.5, "UNREACHABLE") == [] and not w.proc.running and w.health.restarting("worker-0")
    w.run(1.0, "UNREACHABLE")
    assert w.proc.running and w.proc.starts == 2 and not w.health.restarting("worker-0")


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit: must be >= 0"):
        HealthSupervisor({}, print, limit=-1)


def test_a_service_that_crashes_before_its_first_check_counts_in_a_row(tmp_path: Path) -> None:
    """The row is "without a SERVING answer in between" (the README): a restarted service is first
    checked an interval after its start (HEALTH_CHECK_INTERVAL, 5 s, in `seer up`), so one that
    serves less than that between crashes is never seen SERVING and counts in a row, left down at
    the limit; one that served past a check starts a new row
    (test_a_serving_answer_between_exits_resets_the_count)."""
    w = _World(tmp_path, limit=2)
    w.run(1.0, "SERVING")
    exited: list[str] = []
    for _ in range(3):
        w.proc.crash()
        while not w.proc.running and not exited:
            exited += w.run(0.25, "SERVING")
        if exited:
            break
        exited += w.run(0.25, "SERVING")  # up 0.25 s, answering SERVING had it been asked: under the 0.5 s interval
    assert exited == ["worker-0"] and w.proc.starts == 2
    assert [line.split(";")[1].strip() for line in w.lines] == [
        "restarting it (restart 1, 1 of at most 2 in a row)",
        "restarting it in 1 s (restart 2, 2 of at most 2 in a row)",
        "not restarted again: 2 restart(s) in a row did not mend it"]
