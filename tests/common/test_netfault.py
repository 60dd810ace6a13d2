"""The test proxy itself (tests/common/netfault.py): it must not lose bytes to a slow reader, block
freeze() behind one, or stop accepting after its upstream was down once."""

from __future__ import annotations

import socket
import threading
import time

from netfault import FreezingProxy


def _echo_less_server() -> tuple[socket.socket, list[socket.socket]]:
    """A server that accepts and never reads (a peer whose receive buffer fills)."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, conns


def test_a_peer_that_stops_reading_does_not_block_freeze() -> None:
    srv, _ = _echo_less_server()
    proxy = FreezingProxy(srv.getsockname()[:2])
    try:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        client.setblocking(False)
        sent, deadline = 0, time.monotonic() + 3
        while time.monotonic() < deadline:  # fill the proxy's send to the server that never reads
            try:
                sent += client.send(b"x" * 65536)
            except BlockingIOError:
                time.sleep(0.01)
        assert sent > 0
        t0 = time.monotonic()
        frozen = proxy.freeze()
        assert frozen == 1
        assert time.monotonic() - t0 < 1.0, "freeze() waited on a send to a full peer"
        client.close()
    finally:
        proxy.close()
        srv.close()


def test_a_slow_reader_gets_every_byte() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    proxy = FreezingProxy(srv.getsockname()[:2])
    payload = bytes(range(256)) * 16384  # 4 MiB: well past the sockets' buffers
    try:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        server_side = srv.accept()[0]
        threading.Thread(target=client.sendall, args=(payload,), daemon=True).start()
        got = bytearray()
        time.sleep(0.5)  # the proxy's sends to us time out meanwhile (0.05 s each)
        server_side.settimeout(10)
        while len(got) < len(payload):
            chunk = server_side.recv(1 << 16)
            assert chunk, f"connection ended after {len(got)} of {len(payload)} bytes"
            got += chunk
            time.sleep(0.001)
        assert bytes(got) == payload
    finally:
        proxy.close()
        srv.close()


def test_keeps_accepting_after_the_upstream_was_down() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    addr = srv.getsockname()[:2]
    srv.close()  # the upstream is down
    proxy = FreezingProxy(addr)
    try:
        refused = socket.create_connection(("127.0.0.1", proxy.port))
        refused.settimeout(5)
        assert refused.recv(1) == b""  # closed by the proxy: nothing to forward to
        srv = socket.create_server(addr)  # back up
        client = socket.create_connection(("127.0.0.1", proxy.port))
        server_side = srv.accept()[0]
        client.sendall(b"ping")
        server_side.settimeout(5)
        assert server_side.recv(4) == b"ping"
    finally:
        proxy.close()
        srv.close()
