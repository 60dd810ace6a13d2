"""`seer up` supervises its services' health: one whose gRPC health answers NOT_SERVING for longer
than the grace is restarted (a worker whose engine a failed weight load broke is alive and useless
until then), at most HEALTH_RESTART_LIMIT times in a row; one that does not answer at all is left.
A restart that mends its service is no failure (exit 0); the limit reached is (exit 1).

`seer up` runs for real in a subprocess, its supervisor and health checks included (real gRPC on
loopback); its services are stand-ins that serve the standard gRPC health service (a real worker
cannot be broken on cue). Each stand-in appends its pid to <marks>/<name>.launches; it turns
NOT_SERVING while <marks>/<name>.break holds a number >= its launch number (so "1" breaks the first
launch only, "99" every launch, from its start), and stops answering (its server stopped, the
process alive) once <marks>/<name>.mute exists. Only wait_workers is stubbed (the stand-ins do not
register with a scheduler).
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

ROOT = Path(__file__).resolve().parents[2]

_SERVICE = """
import os, signal, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
name, token, port, marks = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# os._exit: a clean drain, without waiting for the gRPC server's threads.
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
with open(os.path.join(marks, name + ".launches"), "a") as f:
    f.write(f"{os.getpid()}\\n")
with open(os.path.join(marks, name + ".launches")) as f:
    launch = len(f.read().split())

def broken():
    try:
        with open(os.path.join(marks, name + ".break")) as f:
            return int(f.read().strip() or 0) >= launch
    except (OSError, ValueError):
        return False

h = health.HealthServicer()
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
while True:
    if os.path.exists(os.path.join(marks, name + ".mute")):
        server.stop(None)
        time.sleep(600)
    h.set("", N if broken() else S)
    time.sleep(0.1)
"""

_UP = """
import sys
from services.cli import up
up.ensure_embedded_model = lambda: "/nonexistent-model"
up.Suite.wait_workers = lambda self, count, timeout=120.0, stop=None: None
up.HEALTH_GRACE_SECONDS = {grace_constant!r}
up.ServiceProcess.command = lambda self: [sys.executable, "-c", {service!r}, self.name, {token!r}, str(self.port),
                                          {marks!r}]
sys.exit(up.main(["--base-port", "0", "--timeout", "60", *{argv!r}]))
"""

_RESTART = re.compile(r"seer up: (\S+) NOT_SERVING since \d\d:\d\d:\d\d \(\d+ s\); restarting it "
                      r"\(restart (\d+), (\d+) of at most 3 in a row\)")


def _start_up(tmp_path: Path, argv: list[str], grace_constant: float = 60.0) -> subprocess.Popen[str]:
    marks = tmp_path / "marks"
    marks.mkdir()
    code = _UP.format(service=_SERVICE, token=str(tmp_path), marks=str(marks), argv=argv,
                      grace_constant=grace_constant)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _launches(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / "marks" / f"{name}.launches"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_launches(p: subprocess.Popen[str], tmp_path: Path, name: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_launches(tmp_path, name)) < count:
        if time.monotonic() > deadline or p.poll() is not None:
            code, out, err = finish(p, 20)
            raise AssertionError(f"{name} launched {len(_launches(tmp_path, name))} times, not {count} "
                                 f"(seer up: {code})\n{out}\n{err}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet by `seer up`) is not alive.
    with contextlib.suppress(OSError):
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    return False


@pytest.fixture(autouse=True)
def _no_stand_in_left(tmp_path: Path) -> Iterator[None]:
    """Kills stand-ins a failing `seer up` left (they are not started through services.cli.launch)."""
    yield
    for pid in pids_with("-c", str(tmp_path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_that_turns_not_serving_is_restarted_and_one_that_does_not_answer_is_not(tmp_path: Path) -> None:
    """Before: `seer up` only watched for exits; the NOT_SERVING worker stayed up, useless, until
    the whole suite was restarted."""
    p = _start_up(tmp_path, ["--workers", "2", "--health-grace", "1.5"])
    wait_for_line(p, "suite is up")
    [first] = _launches(tmp_path, "worker-0")
    [mute] = _launches(tmp_path, "worker-1")
    t0 = time.monotonic()
    (tmp_path / "marks" / "worker-0.break").write_text("1")  # the first launch only: a restart mends it
    (tmp_path / "marks" / "worker-1.mute").write_text("")  # busy: no answer, but alive
    _wait_launches(p, tmp_path, "worker-0", 2, timeout=20)
    # Not before the grace: NOT_SERVING is seen within a check interval, then 1.5 s must pass.
    assert time.monotonic() - t0 > 1.5
    time.sleep(4.0)  # more than twice the grace: the restarted worker serves, the mute one is left
    assert p.poll() is None, "seer up stopped"
    old, new = _launches(tmp_path, "worker-0")
    assert not _alive(old) and _alive(new)
    assert _launches(tmp_path, "worker-1") == [mute] and _alive(mute), "a worker that did not answer was restarted"
    p.send_signal(signal.SIGINT)
    code, out, err = finish(p, timeout=30)
    # The restart mended it: a clean stop exits 0 (before: 1, "service(s) failed (worker-0)"), and
    # the broken launch's log is kept.
    assert code == 0, f"exit status {code}\n{out}\n{err}"
    restarts = _RESTART.findall(err)
    assert restarts == [("worker-0", "1", "1")], err
    assert "failed" not in err, err
    m = re.search(r"seer up: restarted and SERVING since: worker-0; logs kept in (\S+)", err)
    assert m and Path(m.group(1), "worker-0.log").exists(), err
    assert "exited" not in out, out  # the restart is no exit of its own
    assert first == old


def test_a_service_broken_at_start_is_restarted_at_most_the_limit_then_left(tmp_path: Path) -> None:
    """The grace from the module constant (the --health-grace default); a worker that is
    NOT_SERVING again from each new start is restarted 3 times, then reported once and left
    running (as an exited service is reported and left), not restarted in a loop; that it was the
    only worker is said once as an error."""
    p = _start_up(tmp_path, ["--workers", "1"], grace_constant=1.0)
    wait_for_line(p, "suite is up")
    (tmp_path / "marks" / "worker-0.break").write_text("99")
    _wait_launches(p, tmp_path, "worker-0", 4, timeout=40)
    time.sleep(5.0)  # the give-up, and time for a fifth launch that must not come
    launches = _launches(tmp_path, "worker-0")
    assert len(launches) == 4, launches
    assert _alive(launches[-1]), "the last launch is left running"
    assert all(not _alive(pid) for pid in launches[:-1])
    p.send_signal(signal.SIGINT)
    code, out, err = finish(p, timeout=30)
    assert code == 1, f"exit status {code}\n{out}\n{err}"
    assert _RESTART.findall(err) == [("worker-0", "1", "1"), ("worker-0", "2", "2"), ("worker-0", "3", "3")], err
    gave_up = re.findall(r"seer up: worker-0 NOT_SERVING since .*; not restarted again: 3 restart\(s\) in a row", err)
    assert len(gave_up) == 1, err
    # Its only worker: the suite finishes no batch now, said once as the error it is (before: only
    # the give-up line above); not stopped, as a NOT_SERVING service may still come back.
    assert err.count("seer up: error: no worker is serving (worker-0 left down or NOT_SERVING, not restarted "
                     "again): batches wait until one answers SERVING again") == 1, err
    assert "service(s) failed (worker-0)" in err
