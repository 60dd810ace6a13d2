"""The one edge where typed core errors become gRPC status codes, plus small channel helpers."""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from services.common.errors import SeerError
from services.common.log import get_logger

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# 64 MiB: big enough for a batch of long prompts, small enough that a runaway message is refused
# with RESOURCE_EXHAUSTED by gRPC itself rather than exhausting memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Trailing metadata naming why an UNAVAILABLE is worth waiting for (SeerError.retry_reason).
RETRY_REASON_KEY = "seer-retry-reason"


def keepalive_options(every_ms: int, timeout_ms: int) -> list[tuple[str, Any]]:
    """Ping every `every_ms` on a connection; drop it when a ping is not acknowledged in `timeout_ms`.

    Long quiet streams (WatchWork, StreamResults) learn of a connection cut without FIN or RST (a
    partition, a killed node) only from these pings. gRPC's defaults stop the pings after two
    without data (max_pings_without_data), so a stream quiet that long was never checked again, and
    time an unacknowledged ping out by ping_timeout_ms (a minute), not keepalive_timeout_ms alone
    (tests/common/test_keepalive.py fails without either). Every Seer server accepts a ping every
    10 s (services/common/server.py); a default gRPC server would answer 30 s pings with GOAWAY
    "too_many_pings", but internal channels only reach Seer servers."""
    return [("grpc.keepalive_time_ms", every_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.http2.max_pings_without_data", 0)]


CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 0),
    # Services restart (kill -9 tests, rolling updates); reconnect within a second, not minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *keepalive_options(30_000, 10_000),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    # Only the typed errors name the caller's fault. A bare ValueError or KeyError is as likely a
    # bug of ours (a lost dict entry, a closed file) as a bad request: mapped to INVALID_ARGUMENT /
    # NOT_FOUND it reached the caller as "your request was wrong" (not retried, no traceback).
    if isinstance(exc, SeerError):
        return getattr(grpc.StatusCode, exc.code_name), str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, msg = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
    else:
        log.info("%s -> %s: %s", method, code.name, msg)
    reason = getattr(exc, "retry_reason", "")
    if reason:
        context.set_trailing_metadata(((RETRY_REASON_KEY, reason),))
    context.abort(code, msg)


def rpc(fn: F) -> F:
    """Decorates a servicer method (unary or streaming response) so typed errors become statuses.

    The servicer stays a converter: it calls the core and lets this map what the core raises.
    """
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from fn(self, request, context)
            except grpc.RpcError:
                raise
            except Exception as exc:
                _abort(context, exc, fn.__qualname__)

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:
            _abort(context, exc, fn.__qualname__)

    return wrapper  # type: ignore[return-value]


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _StreamContextInterceptor(grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Tracing on: puts the current trace context into a server-streaming call's metadata and
    returns the call itself. OpenTelemetry's client interceptor turns such a call into a plain
    generator with no cancel(), so the scheduler could not end a running chunk's RunChunk stream (a
    dropped request, a removed worker) and the chunk ran to its end holding its slot and KV; it is
    used for the other calls only (telemetry.client_interceptors)."""

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        from services.common.telemetry import current_trace_context

        metadata = [*(d.metadata or ()), *current_trace_context().items()]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def bracket_ipv6(address: str) -> str:
    """host:port with an IPv6 host in brackets, as gRPC targets need it. A pod IP put in front of
    ":port" (the Helm chart's `$(POD_IP):50061`) is a bare IPv6 literal on an IPv6 cluster
    ("fd00::5:50061"), which no client can dial; the port is what follows the last colon."""
    if ":/" in address or address.startswith(("ipv4:", "ipv6:", "unix:", "dns:", "unix-abstract:")):
        return address  # a target with a scheme (dns:///host:port, ipv6:[::1]:port): as given
    host, sep, port = address.rpartition(":")
    if sep and ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return address


def channel(address: str) -> grpc.Channel:
    """An insecure channel with Seer's message limits and OpenTelemetry context propagation."""
    from services.common.telemetry import client_interceptors

    ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    interceptors = client_interceptors()
    if not interceptors:
        return ch
    # Innermost: server-streaming calls, which the OpenTelemetry interceptor lets through.
    ch = grpc.intercept_channel(ch, _StreamContextInterceptor())
    # OpenTelemetry's client interceptor implements its own grpcext interface, which
    # grpc.intercept_channel rejects; its own intercept_channel wraps it.
    from opentelemetry.instrumentation.grpc import grpcext

    return grpcext.intercept_channel(ch, *interceptors)  # type: ignore[no-any-return]


def wait_ready(ch: grpc.Channel, timeout: float) -> None:
    grpc.channel_ready_future(ch).result(timeout=timeout)
