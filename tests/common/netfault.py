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
    pumps_done: int = 0  # pumps (one per direction) that ended; under FreezingProxy._lock


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
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                # The server is down (restarting): refuse this client as the server would, and keep
                # accepting (an unhandled error here ended the accept thread, and no later
                # reconnect was ever forwarded).
                down.close()
                continue
            c = _Conn(down, up)
            with self._lock:
                self._live.append(c)
            for src, dst in ((c.down, c.up), (c.up, c.down)):
                threading.Thread(target=self._pump, args=(c, src, dst), daemon=True, name="proxy-pump").start()

    def _pump(self, c: _Conn, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        try:
            self._forward(c, src, dst)
        finally:
            with self._lock:
                c.pumps_done += 1
                if c.pumps_done == 2 and c in self._live:
                    self._live.remove(c)  # both directions over: not a connection freeze() counts

    def _forward(self, c: _Conn, src: socket.socket, dst: socket.socket) -> None:
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
            if not data:
                with c.lock:
                    dst.close()
                return
            # Sent a piece at a time, each under the lock (a send waits at most the sockets' 0.05 s
            # timeout): freeze() takes the lock, so once it returns nothing more is delivered, and a
            # peer that stops reading only stalls this pump, never freeze(). sendall under the lock
            # blocked freeze() (and so every accept) behind a full peer, and its 0.05 s timeout
            # ended the pump with the bytes lost.
            view = memoryview(data)
            while view:
                with c.lock:
                    if c.frozen:
                        break  # read just before the freeze: lost in the partition
                    try:
                        sent = dst.send(view)
                    except TimeoutError:
                        sent = 0
                    except OSError:
                        return
                view = view[sent:]
                if self._closed.is_set():
                    return
