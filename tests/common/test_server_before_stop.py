"""RunningServer.before_stop runs inside stop() while the server still accepts new calls, then the
server refuses them: a worker tells its scheduler it drains there, before a chunk placed on it can be
refused UNAVAILABLE (the scheduler took that for a dead worker). Real gRPC on loopback."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import ServiceConfig, start_server


def _call(address: str) -> grpc.StatusCode:
    """A new call's outcome: OK (the server took it) or the code it was refused with."""
    with grpc.insecure_channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_before_stop_runs_while_new_calls_are_still_taken() -> None:
    running = start_server("before-stop-test", ServiceConfig(grace_seconds=0.5), lambda server: [])
    seen: list[grpc.StatusCode] = []
    running.before_stop = lambda: seen.append(_call(running.address))
    running.stop()
    assert seen == [grpc.StatusCode.OK]
    assert _call(running.address) != grpc.StatusCode.OK  # stopped: refused
    running.stop()  # idempotent: the hook is not run twice
    assert len(seen) == 1


def test_a_failing_before_stop_does_not_stop_the_stop() -> None:
    stopped: list[bool] = []
    running = start_server("before-stop-test", ServiceConfig(grace_seconds=0.0), lambda server: [],
                           on_stop=lambda: stopped.append(True))

    def fail() -> None:
        raise RuntimeError("scheduler unreachable")

    running.before_stop = fail
    running.stop()
    assert stopped == [True]
    running.wait()


def test_a_bare_ipv6_host_binds() -> None:
    """--host ::1 (unbracketed, as an operator types it): gRPC refused "::1:port" with "Failed to
    bind" and the service did not start; the server brackets it."""
    from tests.common.test_telemetry import _has_ipv6_loopback

    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback")
    running = start_server("bare-ipv6-test", ServiceConfig(host="::1", grace_seconds=0.0), lambda server: [])
    try:
        assert _call(f"[::1]:{running.port}") == grpc.StatusCode.OK
    finally:
        running.stop()
