"""A network fault for tests: a TCP forwarder whose connections can be cut silently."""

from __future__ import annotations

import socket
import threading
import time


class FreezingProxy:
    """A TCP forwarder between a client and a server whose current connections can be frozen: a
    frozen connection stays open and forwards nothing either way, as a network partition or a lost
    NAT entry leaves it (no FIN, no RST). Connections accepted after the freeze forward again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._live: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def freeze(self) -> int:
        """Freezes every open connection; returns how many."""
        with self._lock:
            for _, _, frozen in self._live:
                frozen.set()
            return len(self._live)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for a, b, _ in self._live:
                a.close()
                b.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            frozen = threading.Event()
            with self._lock:
                self._live.append((down, up, frozen))
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst, frozen), daemon=True, name="proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
        src.settimeout(0.05)
        while not self._closed.is_set():
            if frozen.is_set():
                # Read nothing and send nothing: the peers' bytes pile up in kernel buffers and
                # their pings go unanswered, and neither end sees the connection close.
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                dst.close()
                return
            try:
                dst.sendall(data)
            except OSError:
                return
