"""Helpers of the tests that run a `seer` command in a subprocess (`seer up`, `seer demo`): wait for
a line of its output, find the processes it left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wait_for_line(p: subprocess.Popen[str], pattern: str, timeout: float = 30.0) -> list[str]:
    """stdout lines up to the first that contains `pattern`. Without one (the command exited, or
    `timeout` passed between lines) the command is killed, so that a failed test leaves nothing
    running, and the error shows its output and stderr."""
    assert p.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if pattern in line:
            return lines
    p.kill()
    _, err = p.communicate(timeout=30)
    raise AssertionError(f"no {pattern!r} in the output of {p.args!r}: {lines}\n{err}")


def pids_with(*args: str) -> list[int]:
    """Pids of the processes whose command line has every one of `args` as an argument (this test
    process left out)."""
    wanted = [a.encode() for a in args]
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if all(w in cmd for w in wanted):
            found.append(int(d.name))
    return found


def outgoing_ipv4() -> str | None:
    """This host's outgoing (non-loopback) IPv4 address, None without one. Connecting a UDP socket
    sends no packet: it only picks the address a packet would leave from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def finish(p: subprocess.Popen[str], timeout: float) -> tuple[int | None, str, str]:
    """(exit code or None if still running after `timeout`, stdout, stderr); never leaves it running."""
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        return None, out, err


# Python lines for a `seer up` / `seer demo` run in a subprocess: its workers are real workers whose
# engine turns broken on cue (breakable_worker.py, started through services.cli.launch as any
# service); run with breakable_env's environment.
BREAKABLE_WORKERS = """
from services.cli import up as _up
_command = _up.ServiceProcess.command
def _breakable(self):
    cmd = _command(self)
    if self.section == "worker":
        cmd[cmd.index("--") + 1] = "breakable_worker"
    return cmd
_up.ServiceProcess.command = _breakable
"""


def breakable_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a command run with BREAKABLE_WORKERS: breakable_worker importable by the
    services, its marks in <tmp_path>/marks (created), the suite's temporary data directory under
    tmp_path (TMPDIR)."""
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, SEER_TEST_MARKS=str(marks), PYTHONPATH=path, TMPDIR=str(tmp_path))


def launches(tmp_path: Path, name: str) -> list[int]:
    """The pids of service `name`'s launches so far (breakable_worker.py, the stand-ins of
    test_cli_up_health.py), in order."""
    path = tmp_path / "marks" / f"{name}.launches"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def run_up(code: str, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A fixture's body: `seer up` run by `code` in a subprocess (pipes for stdout and stderr);
    afterwards it and every service it launched are gone, also after a failed test."""
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield p
    if p.poll() is None:  # a failed test: the services die with it (their parent-death watchdog)
        p.kill()
        p.communicate(timeout=30)
    for pid in pids_with("services.cli.launch", "--parent-pid", str(p.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
