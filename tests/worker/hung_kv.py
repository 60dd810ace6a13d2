"""A KV store node on loopback whose chosen RPCs take the call and never answer (a GC pause, a
stuck disk) until the context exits; the other RPCs are UNIMPLEMENTED."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from seer.v1 import kvstore_pb2_grpc

from tests.common.grpc_server import loopback_server


@contextlib.contextmanager
def hung_kv_nodes(methods: tuple[str, ...], n: int = 1) -> Iterator[list[str]]:
    """n such nodes; yields their addresses."""
    release = threading.Event()

    def hang(self: Any, request: Any, context: Any) -> Any:
        release.wait(30)
        context.abort(grpc.StatusCode.UNAVAILABLE, "hung")

    servicer = type("Hung", (kvstore_pb2_grpc.KvStoreServiceServicer,), dict.fromkeys(methods, hang))
    with contextlib.ExitStack() as servers:
        try:
            yield [servers.enter_context(loopback_server(kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server,
                                                         servicer(), max_workers=64)) for _ in range(n)]
        finally:
            release.set()  # before the servers stop: their held handlers return
