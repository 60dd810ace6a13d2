"""A KV store node on loopback whose chosen RPCs take the call and never answer (a GC pause, a
stuck disk) until the context exits; the other RPCs are UNIMPLEMENTED."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from seer.v1 import kvstore_pb2_grpc


@contextlib.contextmanager
def hung_kv_nodes(methods: tuple[str, ...], n: int = 1) -> Iterator[list[str]]:
    """n such nodes; yields their addresses."""
    release = threading.Event()

    def hang(self: Any, request: Any, context: Any) -> Any:
        release.wait(30)
        context.abort(grpc.StatusCode.UNAVAILABLE, "hung")

    servicer = type("Hung", (kvstore_pb2_grpc.KvStoreServiceServicer,), dict.fromkeys(methods, hang))
    servers, addrs = [], []
    try:
        for _ in range(n):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
            kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(servicer(), server)
            addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            servers.append(server)
        yield addrs
    finally:
        release.set()
        for s in servers:
            s.stop(0)
