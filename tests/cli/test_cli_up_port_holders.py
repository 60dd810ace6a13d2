"""Who holds a port (services/cli/sysinfo.py) when it is not a listener, the earlier state
directories counted at start, and the ports `seer up --base-port` moves or keeps on a relaunch
(services/cli/up.py). Real sockets on loopback; no service is started."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import up
from services.cli.sysinfo import PortHolder, describe_holders, holders_remedy, port_holders


@pytest.fixture
def socks() -> Iterator[list[socket.socket]]:
    """Sockets a test opened, closed afterwards."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def _connection(socks: list[socket.socket], local_port: int = 0) -> socket.socket:
    """An established loopback connection from this process; its client end bound to `local_port`
    (0: an ephemeral port, as for any outgoing connection). Returns the client end."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    socks.append(server)
    client = socket.socket()
    socks.append(client)
    client.bind(("127.0.0.1", local_port))
    client.connect(server.getsockname())
    accepted, _ = server.accept()
    socks.append(accepted)
    return client


def test_a_connections_local_port_is_found_and_worded_as_such(socks: list[socket.socket]) -> None:
    """Before: only listeners were looked for, so a port held as an outgoing connection's local port
    (which the default --base-port 50051 layout may be: it is inside Linux's ephemeral range) was
    "a process this user cannot see"."""
    port = _connection(socks).getsockname()[1]
    [holder] = port_holders(port)
    assert holder.pid == os.getpid() and not holder.listening
    described = describe_holders(port)
    assert described.startswith(f"pid {os.getpid()} (") and described.endswith(") (a connection's local port)")
    assert holders_remedy([holder]) == "it frees itself once that connection has closed (up to a minute later)"


def test_a_listener_is_found_with_its_accepted_connections_as_one_listening_holder(
        socks: list[socket.socket]) -> None:
    """A listener's accepted connections share its local port: still a listener, named once."""
    client = _connection(socks)
    port = client.getpeername()[1]
    assert port_holders(port) == [PortHolder(os.getpid(), port_holders(port)[0].cmd, True)]
    assert "(a connection's local port)" not in describe_holders(port)
    assert holders_remedy(port_holders(port)) == "stop that process"


def test_none_visible_says_what_it_may_be() -> None:
    # A port nobody holds: what the line says when the holder cannot be seen.
    assert describe_holders(up.free_port()) == (
        "a process this user cannot see (another user's, or a connection's local port, which frees itself "
        "once that connection has closed, up to a minute later)")
    assert holders_remedy([]) == "stop that process, or wait for that connection to close"


def test_a_relative_data_dir_is_not_counted_as_an_earlier_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Before: `seer up --data-dir seer-suite-x` run in the temporary directory (a resume) compared
    the relative path with the glob's absolute ones and counted its own directory as an earlier run's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    own, other = tmp_path / f"{up.STATE_DIR_PREFIX}own", tmp_path / f"{up.STATE_DIR_PREFIX}other"
    own.mkdir()
    other.mkdir()
    monkeypatch.chdir(tmp_path)
    assert up.earlier_state_dirs(Path(own.name)) == [other]
    assert up.earlier_state_dirs(Path(".") / ".." / tmp_path.name / own.name) == [other]


def _fixed_suite(tmp_path: Path, base_port: int) -> up.Suite:
    return up.Suite(workers=2, base_port=base_port, data_dir=tmp_path / "data", model_dir="/x")


def test_pick_port_never_hands_out_a_port_of_the_fixed_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Before: under --base-port no port was handed out by the suite, so pick_port avoided none of
    them: a worker moved on a relaunch could land on a port of a service that was down just then
    (its port free), or on a /metrics port."""
    suite = _fixed_suite(tmp_path, 40000)
    ours = [suite.services["worker-1"].port, suite.services["buffer"].port, suite.services["worker-0"].metrics_port]
    offered = iter([*ours, 45678])
    monkeypatch.setattr(up, "free_port", lambda host="127.0.0.1": next(offered))
    assert suite.pick_port("127.0.0.1") == 45678


def test_under_base_port_a_taken_metrics_port_is_kept_and_its_holder_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, socks: list[socket.socket]) -> None:
    """Before: the supervisor moved it to a free port on a relaunch, though the start keeps it at
    port+100 under --base-port (and README says /metrics is there): scrapers lost it."""
    taken = socket.socket()
    socks.append(taken)
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    mport = taken.getsockname()[1]
    worker0_metrics_offset = 110  # base + 100 + worker 0's offset 10
    if mport - worker0_metrics_offset < 1024:
        pytest.skip("the kernel gave a port too low for a base port below it")
    suite = _fixed_suite(tmp_path, mport - worker0_metrics_offset)
    w = suite.services["worker-0"]
    assert w.metrics_port == mport
    # Never started: the first tick restarts every service, as after an exit; none can launch (the
    # suite's log directory does not exist: "could not be started again"), and one that could would
    # run a harmless sleeper, not a service.
    monkeypatch.setattr(up.ServiceProcess, "command", lambda self: [sys.executable, "-c", "import time; "
                                                                    "time.sleep(30)"])
    lines: list[str] = []
    health = suite.supervisor(lines.append, check=lambda _address: "SERVING", interval=0.25, backoff=0.0)
    try:
        health.tick()
        health.tick()
        assert w.metrics_port == mport and f"--metrics-port {mport}" in " ".join(w.args), lines
        blocked = [line for line in lines if "worker-0 could not be started again" in line]
        assert blocked, lines
        assert (f"worker-0 could not be started again (its metrics port {mport} is taken by pid {os.getpid()} (") \
            in blocked[0]
        assert ("; it keeps that port (--base-port: /metrics on port+100, where scrapers look): stop that "
                "process); restarting it") in blocked[0], blocked[0]
    finally:
        for service in suite.services.values():
            service.kill()
