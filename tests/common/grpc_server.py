"""One loopback gRPC server for the tests: a stub or scripted servicer served over real gRPC.

Written out by hand in about ten test files before (create, add the servicer, bind 127.0.0.1,
start, stop); import it as `from tests.common.grpc_server import loopback_server` (the repo root is
on sys.path, pyproject's pytest pythonpath). Servers with other needs (an IPv6 or wildcard bind,
the services' own start_server) build their own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TypeVar

import grpc

_S = TypeVar("_S")


@contextlib.contextmanager
def loopback_server(add: Callable[[_S, grpc.Server], object], servicer: _S, *, max_workers: int = 4,
                    port: int = 0, grace: float | None = 0) -> Iterator[str]:
    """Serves `servicer` (registered by `add`, a generated add_*Servicer_to_server or any function
    taking (servicer, server)) on 127.0.0.1:`port` (0: a free one); yields "127.0.0.1:<port>".

    Stopped on exit with `grace` (default 0: in-flight calls are cancelled at once, as a killed
    process's would be). A server whose handlers block must be released by the caller before the
    exit if they are to end (stop does not wait for them)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    try:
        add(servicer, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        # Older grpc returns 0 rather than raising for an address it could not bind.
        if bound == 0:
            raise RuntimeError(f"port: could not bind 127.0.0.1:{port}")
        server.start()
        yield f"127.0.0.1:{bound}"
    finally:
        server.stop(grace)


def add_generic_handler(handler: grpc.GenericRpcHandler, server: grpc.Server) -> None:
    """An `add` for loopback_server serving a hand-built generic handler (no generated servicer)."""
    server.add_generic_rpc_handlers((handler,))
