"""Long-lived streams (StreamResults, WatchWork) never take every handler thread, and the streams of a
client that vanished without closing its connection end (server keepalive)."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from buffer_helpers import STOP, BufferHandle, commit, group, snapshot, submit, wait_for
from seer.v1 import rollout_pb2, rollout_pb2_grpc

from services.buffer.config import BufferConfig
from services.common import server as common_server


def _drain(stream: Any, out: list[Any]) -> None:
    """Appends the stream's results, then its end: "ok" or the status code and details."""
    try:
        for resp in stream:
            out.append(resp.result.request_id)
        out.append("ok")
    except grpc.RpcError as e:
        out.append((e.code(), e.details()))


def test_stream_limit_defaults_and_validation() -> None:
    assert BufferConfig().stream_limit() == 56  # 64 threads - 8
    assert BufferConfig(max_workers=8).stream_limit() == 4
    assert BufferConfig(max_workers=8, max_streams=6).stream_limit() == 6
    with pytest.raises(ValueError, match="max_streams"):
        BufferConfig(max_workers=8, max_streams=8).validate()
    with pytest.raises(ValueError, match="max_streams"):
        BufferConfig(max_streams=-1).validate()


def test_waiting_result_streams_leave_threads_for_commits(make_buffer: Callable[..., BufferHandle]) -> None:
    # 8 handler threads; 4 streams at most, the last 2 kept for WatchWork: 2 StreamResults.
    h = make_buffer(max_workers=8, max_streams=4)
    submit(h.rollout, "x", [group(group_size=1)])
    outs: list[list[Any]] = [[] for _ in range(h.cfg.max_workers)]
    streams = [h.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="x"), timeout=20) for _ in outs]
    for s, out in zip(streams, outs, strict=True):
        threading.Thread(target=_drain, args=(s, out), daemon=True).start()
    try:
        assert wait_for(lambda: sum(1 for o in outs if o) == len(outs) - 2)
        refused = [o[0] for o in outs if o]
        assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams" in msg for code, msg in refused)
        # The scheduler still gets its feed with StreamResults at their cap...
        assert [it.request_id for it in snapshot(h.internal)] == ["x/0/0"]
        # ...and a commit finds a thread (before: every thread waited in a stream, a deadlock).
        assert commit(h.internal, "x/0/0", 0, [5], reason=STOP).request_finished
        assert wait_for(lambda: all(o for o in outs) and sum(1 for o in outs if o == ["x/0/0", "ok"]) == 2)
        # Ended streams give their slots back.
        assert [r.result.request_id for r in h.rollout.StreamResults(
            rollout_pb2.StreamResultsRequest(batch_id="x"), timeout=5)] == ["x/0/0"]
    finally:
        for s in streams:
            s.cancel()


class _FreezableProxy:
    """A TCP proxy whose freeze() stops forwarding without closing anything: to the server, the
    client looks like a peer that vanished without a FIN (a killed node, a partition)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._frozen = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        self._frozen.set()
        for s in [self._listener, *self._socks]:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._frozen.is_set():
                if not select.select([src], [], [], 0.05)[0] or self._frozen.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
        except OSError:
            return


def test_keepalive_ends_the_streams_of_a_vanished_client(make_buffer: Callable[..., BufferHandle],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common_server, "KEEPALIVE_TIME_MS", 300)
    monkeypatch.setattr(common_server, "KEEPALIVE_TIMEOUT_MS", 300)
    # max_streams 2, 1 kept for WatchWork: one StreamResults at a time.
    h = make_buffer(max_workers=4, max_streams=2)
    # Two responses, one finished: an admitted stream yields a result at once and then waits, so
    # admission is a result, never a timeout (a slow refusal must not pass for an admission).
    submit(h.rollout, "k", [group(group_size=2)])
    assert commit(h.internal, "k/0/0", 0, [5], reason=STOP).request_finished
    proxy = _FreezableProxy(h.running.port)
    ch = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")
    try:
        out: list[Any] = []
        stream = rollout_pb2_grpc.RolloutServiceStub(ch).StreamResults(rollout_pb2.StreamResultsRequest(batch_id="k"))
        threading.Thread(target=_drain, args=(stream, out), daemon=True).start()
        assert wait_for(lambda: out == ["k/0/0"])  # admitted: it holds the one slot, waiting for k/0/1

        def admitted() -> bool:
            s = h.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="k"), timeout=10)
            try:
                return next(iter(s)).result.request_id == "k/0/0"
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
            finally:
                s.cancel()

        assert not admitted()
        proxy.freeze()
        # The server's unanswered keepalive ping closes the connection, which ends the stream.
        assert wait_for(admitted, timeout=8.0)
    finally:
        proxy.close()
        ch.close()
