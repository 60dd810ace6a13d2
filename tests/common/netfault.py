"""A network fault for tests: a TCP forwarder whose connections can be cut silently."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Conn:
    down: socket.socket
    up: socket.socket
    frozen: bool = False
    # Held while a pump forwards, and by freeze(): once freeze() returns, nothing more is delivered
    # (a pump that had already read bytes could otherwise forward them just after the freeze, and a
    # test would see its result arrive through the "cut" connection).
    lock: threading.Lock = field(default_factory=threading.Lock)


class FreezingProxy:
    """A TCP forwarder between a client and a server whose current connections can be frozen: a
    frozen connection stays open and forwards nothing either way, as a network partition or a lost
    NAT entry leaves it (no FIN, no RST). Connections accepted after the freeze forward again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._live: list[_Conn] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def freeze(self) -> int:
        """Freezes every open connection; returns how many. Nothing is forwarded on them after it
        returns."""
        with self._lock:
            for c in self._live:
                with c.lock:
                    c.frozen = True
            return len(self._live)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for c in self._live:
                c.down.close()
                c.up.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            c = _Conn(down, socket.create_connection(self.upstream))
            with self._lock:
                self._live.append(c)
            for src, dst in ((c.down, c.up), (c.up, c.down)):
                threading.Thread(target=self._pump, args=(c, src, dst), daemon=True, name="proxy-pump").start()

    def _pump(self, c: _Conn, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self._closed.is_set():
            if c.frozen:
                # Read nothing and send nothing: the peers' bytes pile up in kernel buffers, their
                # pings go unanswered, and neither end sees the connection close.
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with c.lock:
                if c.frozen:
                    continue  # read just before the freeze: lost in the partition
                try:
                    if not data:
                        dst.close()
                        return
                    dst.sendall(data)
                except OSError:
                    return
