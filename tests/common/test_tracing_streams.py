"""Tracing on (SEER_TRACING), a server-streaming call through services.common.grpcutil.channel
keeps its cancel() (OpenTelemetry's client interceptor made it a plain generator: the scheduler's
cancel of a running RunChunk did nothing, and the chunk ran on holding its slot and KV) and still
carries the caller's trace context to the server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from services.common.grpcutil import channel
from tests.common.grpc_server import add_generic_handler, loopback_server


@pytest.fixture
def streaming_server() -> Iterator[tuple[str, dict[str, Any]]]:
    seen: dict[str, Any] = {"cancelled": threading.Event(), "metadata": None}

    def stream(_request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        seen["metadata"] = dict(context.invocation_metadata())
        context.add_callback(seen["cancelled"].set)
        while context.is_active():
            yield b"x"
            time.sleep(0.01)

    handler = grpc.method_handlers_generic_handler("t.S", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
    with loopback_server(add_generic_handler, handler) as address:
        yield address, seen


def test_a_traced_stream_can_be_cancelled_and_carries_the_trace(
    streaming_server: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("SEER_TRACING", "console")
    address, seen = streaming_server
    ch = channel(address)
    tracer = TracerProvider().get_tracer("test")
    try:
        with tracer.start_as_current_span("caller") as span:
            call = ch.unary_stream("/t.S/Stream", request_serializer=None, response_deserializer=None)(b"")
            assert next(iter(call)) == b"x"
        trace_id = format(span.get_span_context().trace_id, "032x")
        assert trace_id in seen["metadata"].get("traceparent", ""), seen["metadata"]
        call.cancel()
        assert seen["cancelled"].wait(5), "the server never saw the cancel"
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
    finally:
        ch.close()
