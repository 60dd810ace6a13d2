"""The shared server's health status over real gRPC: set_serving(False) is what an orchestrator's
probe sees, and once stop() began nothing turns it SERVING again (a worker whose engine recovers
while the process drains must not look ready)."""

from __future__ import annotations

from unittest.mock import create_autospec

import grpc
import pytest
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
    # The health servicer ignores its context: an autospec stands in for gRPC's.
    context = create_autospec(grpc.ServicerContext, instance=True)
    assert running.health.Check(health_pb2.HealthCheckRequest(service=""), context).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_start_that_fails_on_its_metrics_port_never_serves() -> None:
    """The gRPC server was started before the metrics port was bound, and grpcio's health servicer
    answers SERVING for "" until told otherwise: a metrics port taken by another socket left a
    running gRPC server, SERVING, behind the exception (the launcher took a dying buffer for a
    healthy one: the flaky test_a_service_whose_picked_port_was_taken_starts_again)."""
    import socket

    from services.cli.up import free_port

    grpc_port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(OSError):
            start_server("health-test", ServiceConfig(port=grpc_port, metrics_port=taken, grace_seconds=0.0),
                         lambda server: [])
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_nothing_reads_serving_before_the_start_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window itself: a probe between the gRPC server's start and the rest of the start."""
    import services.common.server as server_mod
    from services.cli.up import free_port

    address = f"127.0.0.1:{free_port()}"
    seen: list[int] = []

    def metrics_taken(port: int) -> int:
        seen.append(_status(address))
        raise OSError("Address already in use")

    monkeypatch.setattr(server_mod, "start_metrics_server", metrics_taken)
    with pytest.raises(OSError):
        start_server("health-test", ServiceConfig(port=int(address.rsplit(":", 1)[1]), grace_seconds=0.0),
                     lambda server: ["seer.v1.Nothing"])
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]


def test_only_typed_errors_name_the_callers_fault(caplog: pytest.LogCaptureFixture) -> None:
    """A bare KeyError or ValueError in a servicer is a bug of ours as likely as a bad request (a
    lost dict entry, a closed file): they were NOT_FOUND / INVALID_ARGUMENT, logged at INFO with no
    traceback. Now INTERNAL with the traceback; the typed errors keep their codes."""
    import logging

    from services.common.errors import InvalidArgument, NotFound
    from services.common.grpcutil import status_for

    assert status_for(KeyError("g-1"))[0] == grpc.StatusCode.INTERNAL
    assert status_for(ValueError("I/O operation on closed file"))[0] == grpc.StatusCode.INTERNAL
    assert status_for(InvalidArgument("bad", field="x")) == (grpc.StatusCode.INVALID_ARGUMENT, "x: bad")
    assert status_for(NotFound("no group", field="group_id")) == (grpc.StatusCode.NOT_FOUND, "group_id: no group")

    from services.common.grpcutil import rpc

    class Servicer:
        @rpc
        def Get(self, request: object, context: grpc.ServicerContext) -> object:
            lost: dict[str, object] = {}
            return lost["lost"]

    class Context:
        code: grpc.StatusCode | None = None

        def abort(self, code: grpc.StatusCode, msg: str) -> None:
            self.code = code
            raise RuntimeError(msg)

    ctx = Context()
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError):
        Servicer().Get(None, ctx)  # type: ignore[arg-type]
    assert ctx.code == grpc.StatusCode.INTERNAL
    assert any(r.exc_info for r in caplog.records)
