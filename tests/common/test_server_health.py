"""The shared server's health status over real gRPC: set_serving(False) is what an orchestrator's
probe sees, and once stop() began nothing turns it SERVING again (a worker whose engine recovers
while the process drains must not look ready)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import ServiceConfig, start_server


def _status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def test_health_follows_set_serving_until_stop() -> None:
    running = start_server("health-test", ServiceConfig(grace_seconds=0.0), lambda server: [])
    try:
        assert _status(running.address) == health_pb2.HealthCheckResponse.SERVING
        running.set_serving(False)
        assert _status(running.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        running.set_serving(True)
        assert _status(running.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop(0)
    running.set_serving(True)  # e.g. the engine recovers after stop began: ignored
    assert running.health.Check(health_pb2.HealthCheckRequest(service=""), None).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
