"""HealthSupervisor (services/cli/up.py) relaunching a service whose port another process took while
it was down: real child processes that bind their --port as a gRPC server does (SO_REUSEADDR on
127.0.0.1), real ports, this test process as the other one that took the port. A worker moves to a
free port (it registers its address with the scheduler at each start); a central service keeps its
port (the others and the clients dial it) and the line names the port and who holds it."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.cli.sysinfo import port_holders
from services.cli.up import HealthSupervisor, ServiceProcess, free_port

# Binds --port, or exits 1 with the error a gRPC server's failed bind logs; SIGTERM: exit 0.
_STAND_IN = (
    "import signal, socket, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "try:\n"
    "    s.bind(('127.0.0.1', port))\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'Failed to bind to address 127.0.0.1:{port}: {e}\\n')\n"
    "    sys.exit(1)\n"
    "s.listen()\n"
    "time.sleep(600)\n"
)


class _StandIn(ServiceProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, *self.args]


def _service(tmp_path: Path, name: str, module: str) -> _StandIn:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEER_")}
    return _StandIn(name=name, module=module, args=["--port", str(port), "--metrics-port", "0"], port=port,
                    metrics_port=0, log_dir=tmp_path, env=env)


def _wait_listening(s: ServiceProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while s.pid not in [h.pid for h in port_holders(s.port) if h.listening]:
        assert s.alive(), f"{s.name} exited: {s.tail()}"
        assert time.monotonic() < deadline, f"{s.name} does not listen on {s.port}"
        time.sleep(0.05)


@pytest.fixture
def lines() -> list[str]:
    return []


def _supervisor(s: ServiceProcess, lines: list[str]) -> HealthSupervisor:
    return HealthSupervisor({s.name: s}, lines.append, check=lambda _address: "SERVING", interval=0.25,
                            backoff=0.3)


@pytest.fixture
def holder() -> Iterator[list[socket.socket]]:
    """The other process's listener (this test's), closed afterwards."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def _tick_until(health: HealthSupervisor, lines: list[str], done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Ticks the supervisor until `done()`, failing (with its lines) on a timeout or a service it
    reports exited."""
    deadline = time.monotonic() + timeout
    while not done():
        health.tick()
        assert time.monotonic() < deadline and health.exited == [], lines
        time.sleep(0.1)


def _take(port: int, holder: list[socket.socket]) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    holder.append(sock)
    return sock


def test_a_worker_whose_port_was_taken_is_relaunched_on_a_free_one(
        tmp_path: Path, lines: list[str], holder: list[socket.socket]) -> None:
    """Before: relaunched on the taken port, it died at its bind, was counted as a crash 3 times in
    a row and left down."""
    w = _service(tmp_path, "worker-0", "services.worker")
    try:
        w.start()
        _wait_listening(w)
        health = _supervisor(w, lines)
        old = w.port
        w.kill()
        _take(old, holder)
        deadline = time.monotonic() + 10
        while not (w.alive() and w.port != old):
            health.tick()
            assert time.monotonic() < deadline and health.exited == [], f"not relaunched elsewhere: {lines}"
            time.sleep(0.1)
        _wait_listening(w)
        assert w.args[w.args.index("--port") + 1] == str(w.port)
        assert w.address == f"127.0.0.1:{w.port}", "health checks follow it to the new port"
        [moved] = [line for line in lines if "is taken by" in line]
        assert moved == (f"seer up: worker-0's port {old} on 127.0.0.1 is taken by pid {os.getpid()} "
                         f"({moved.split('(', 1)[1].split(')')[0]}): starting it on port {w.port} (it registers "
                         "its new address with the scheduler)")
        assert "restarting it (restart 1, 1 of at most 3 in a row)" in lines[0]
    finally:
        w.kill()


def test_a_central_service_keeps_its_port_and_the_line_names_who_holds_it(
        tmp_path: Path, lines: list[str], holder: list[socket.socket]) -> None:
    """Before: "buffer exited with code 1", three times, and left down: no word of the port."""
    b = _service(tmp_path, "buffer", "services.buffer")
    try:
        b.start()
        _wait_listening(b)
        health = _supervisor(b, lines)
        port = b.port
        b.kill()
        sock = _take(port, holder)
        _tick_until(health, lines, lambda: any("could not be started again" in line for line in lines))
        line = lines[-1]
        assert (f"seer up: buffer could not be started again (its port {port} on 127.0.0.1 is taken by pid "
                f"{os.getpid()} (") in line, line
        assert "it keeps that port (the other services and the clients dial it): stop that process); restarting " \
               "it in 0.3 s (restart 2, 2 of at most 3 in a row)" in line, line
        sock.close()  # the other process goes: the next try binds the same port
        _tick_until(health, lines, b.alive)
        _wait_listening(b)
        assert b.port == port
    finally:
        b.kill()


def _connect_from(port: int, holder: list[socket.socket]) -> None:
    """An established connection of this process whose local port is `port` (as an outgoing
    connection's ephemeral port may be: the kernel picks them from a range the default layout's
    ports fall in). No SO_REUSEADDR, as on such a socket: a bind of the port then fails beside it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.socket()
    holder += [server, client]
    client.bind(("127.0.0.1", port))
    client.connect(server.getsockname())
    holder.append(server.accept()[0])


def test_a_central_service_whose_port_is_a_connections_local_port_is_not_told_to_stop_that_process(
        tmp_path: Path, lines: list[str], holder: list[socket.socket]) -> None:
    """Before: "taken by a process this user cannot see ...: stop that process", though the holder
    (here this test, as it may be a connection of seer's own) only has a connection from that port:
    listeners alone were looked for; the port frees itself when the connection closes."""
    b = _service(tmp_path, "buffer", "services.buffer")
    try:
        b.start()
        _wait_listening(b)
        health = _supervisor(b, lines)
        port = b.port
        b.kill()
        _connect_from(port, holder)
        _tick_until(health, lines, lambda: any("could not be started again" in line for line in lines))
        line = lines[-1]
        assert f"its port {port} on 127.0.0.1 is taken by pid {os.getpid()} (" in line, line
        assert (") (a connection's local port); it keeps that port (the other services and the clients dial it): it "
                "frees itself once that connection has closed (up to a minute later)); restarting it") in line, line
        assert "stop that process" not in line
        for sock in holder:
            # Reset, not closed: a side that closes first keeps its port in TIME_WAIT for a minute.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # the connection is gone: the next try binds the same port
        _tick_until(health, lines, b.alive)
        _wait_listening(b)
        assert b.port == port
    finally:
        b.kill()
