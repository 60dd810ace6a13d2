"""OpenTelemetry tracing (context carried in gRPC metadata) and Prometheus metrics.

Tracing is configured by SEER_TRACING = none | console | otlp (OTLP endpoint from the standard
OTEL_EXPORTER_OTLP_ENDPOINT). Health checks are excluded from traces. Metrics are served over HTTP
on the port given to `start_metrics_server` (0 = off).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_lock = threading.Lock()
_configured: str | None = None
_EXCLUDED = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"]


def tracing_mode() -> str:
    # Empty means unset (Helm and compose render an unset value as SEER_TRACING=""): "none".
    return os.environ.get("SEER_TRACING", "").strip().lower() or "none"


def setup_tracing(service: str) -> None:
    """Installs a tracer provider once per process according to SEER_TRACING."""
    global _configured
    with _lock:
        mode = tracing_mode()
        if _configured is not None or mode == "none":
            _configured = _configured or mode
            return
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": f"seer-{service}"}))
        if mode == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif mode == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            raise ValueError(f"SEER_TRACING: unknown mode {mode!r} (none, console, otlp)")
        trace.set_tracer_provider(provider)
        _configured = mode


def server_interceptors() -> list[Any]:
    if tracing_mode() == "none":
        return []
    from opentelemetry.instrumentation.grpc import filters, server_interceptor

    return [server_interceptor(filter_=filters.negate(filters.any_of(*[filters.service_name(s) for s in _EXCLUDED])))]


def client_interceptors() -> list[Any]:
    """OpenTelemetry's client interceptor (grpcext interface), for calls with a single response.

    Not for server-streaming calls: it turns their call object into a plain generator, which has no
    cancel(), so the scheduler could no longer end a running chunk's RunChunk stream (a dropped
    request, a removed worker) and the chunk ran to its end holding its slot and KV. Those calls get
    services.common.grpcutil's stream interceptor instead: the trace context in their metadata (the
    server's span continues the caller's trace), the real call object returned."""
    if tracing_mode() == "none":
        return []
    from opentelemetry.instrumentation.grpc import client_interceptor, filters

    excluded = filters.any_of(*[filters.service_name(s) for s in _EXCLUDED])

    def traced(info: Any) -> bool:
        return not excluded(info) and not getattr(info, "is_server_stream", False)

    return [client_interceptor(filter_=traced)]


def current_trace_context() -> dict[str, str]:
    """The active span's context as W3C trace-context keys ({} when tracing is off), to hand on
    through a message rather than gRPC metadata (a batch's work items are dispatched long after
    the SubmitBatch call that carried the trainer's context)."""
    if tracing_mode() == "none":
        return {}
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def context_from(carrier: Mapping[str, str]) -> Any:
    """The OpenTelemetry context of a carrier from current_trace_context (None when empty)."""
    if not carrier:
        return None
    from opentelemetry.propagate import extract

    return extract(dict(carrier))


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass


class _NoTracer:
    """What `tracer` gives with tracing off: spans that cost a context manager, not OpenTelemetry's
    import and its no-op span machinery on every dispatch."""

    @contextlib.contextmanager
    def start_as_current_span(self, name: str, context: Any = None, **kwargs: Any) -> Iterator[_NoSpan]:
        yield _NoSpan()


def tracer(name: str) -> Any:
    if tracing_mode() == "none":
        return _NoTracer()
    from opentelemetry import trace

    return trace.get_tracer(name)


def start_metrics_server(port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serves /metrics; returns the bound port (0 = disabled)."""
    if port < 0:
        return 0
    if port == 0:
        return 0
    server, _thread = start_http_server(port, registry=registry)
    return int(server.server_port)


__all__ = [
    "Counter",
    "Gauge",
    "Histogram",
    "client_interceptors",
    "context_from",
    "current_trace_context",
    "server_interceptors",
    "setup_tracing",
    "start_metrics_server",
    "tracer",
]
