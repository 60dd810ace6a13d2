"""OpenTelemetry tracing (context carried in gRPC metadata) and Prometheus metrics.

Tracing is configured by SEER_TRACING = none | console | otlp (OTLP endpoint from the standard
OTEL_EXPORTER_OTLP_ENDPOINT). Health checks are excluded from traces. Metrics are served over HTTP
on the port given to `start_metrics_server` (0 = off), on every address: IPv6 and IPv4 (one
dual-stack socket on "::") where the host has IPv6, else IPv4 only (0.0.0.0).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from services.common.ports import ipv6_unavailable, wildcard_port_is_free

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


class _QuietHandler(WSGIRequestHandler):
    """No access log line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _DualStackServer(ThreadingWSGIServer):
    """prometheus_client's server on an IPv6 socket that also accepts IPv4 (as ::ffff:a.b.c.d).
    IPV6_V6ONLY is cleared explicitly: its default follows net.ipv6.bindv6only, and where that is 1
    a plain "::" bind would have dropped IPv4 scrapes instead."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _start_http_server(port: int, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """prometheus_client's start_http_server, on the dual-stack server where the host allows it.
    Bound once: a separate dual-stack probe before the bind was a second socket and a race."""
    app = make_wsgi_app(registry)
    server: ThreadingWSGIServer  # either class: make_server's return type is its argument's
    try:
        server = make_server("::", port, app, _DualStackServer, handler_class=_QuietHandler)
    except OSError as e:
        if not ipv6_unavailable(e):
            raise
        server = make_server("0.0.0.0", port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="seer-metrics", daemon=True).start()
    return server


def metrics_port_is_free(port: int) -> bool:
    """Whether start_metrics_server could bind `port` now: the same socket (dual-stack on "::", IPv4
    only where the host has no IPv6) with SO_REUSEADDR as the server's, so a listener on any one
    address (127.0.0.1 only, [::1] only) counts as taken and a port in TIME_WAIT as free."""
    return wildcard_port_is_free(port)


def metrics_bind_error(port: int) -> str:
    """The start of the error when the metrics port cannot be bound: named, as "Address already in
    use" alone does not say which of a service's two ports it was; `seer up` finds a clashing
    metrics port by this text in the service's log (services/cli/up.py) and picks another."""
    return f"metrics_port {port}: cannot bind"


def start_metrics_server(port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serves /metrics on every address of the host, IPv6 included (gRPC's own ports are dual-stack
    too: prometheus_client binds 0.0.0.0 only, so a scrape over IPv6 found nothing); returns the
    bound port (0 = disabled)."""
    if port <= 0:
        return 0
    try:
        server = _start_http_server(port, registry)
    except OSError as e:
        raise OSError(e.errno, f"{metrics_bind_error(port)} it: {e.strerror}") from e
    return int(server.server_port)


__all__ = [
    "Counter",
    "Gauge",
    "Histogram",
    "client_interceptors",
    "context_from",
    "current_trace_context",
    "metrics_bind_error",
    "metrics_port_is_free",
    "server_interceptors",
    "setup_tracing",
    "start_metrics_server",
    "tracer",
]
