"""Malformed messages to every SchedulerService RPC over real gRPC on loopback (the real servicer
and Dispatcher; the buffer and worker links scripted, as in test_dispatcher_faults): each is
refused INVALID_ARGUMENT with the offending field named, and changes nothing. Impossible telemetry
is no malformed message (a worker's engine may misreport): the Heartbeat is answered and the worker
quarantined, its reason in GetSchedulerStats."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.scheduler.server import add_to_server
from tests.common.grpc_server import loopback_server

from .test_dispatcher_faults import Rig, capacity


@pytest.fixture
def served(make_rig: Callable[..., Rig]) -> Iterator[tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub]]:
    t = make_rig()
    with loopback_server(add_to_server, t.d) as address, grpc.insecure_channel(address) as channel:
        yield t, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _register(**change: object) -> scheduler_pb2.RegisterWorkerRequest:
    req = scheduler_pb2.RegisterWorkerRequest(worker_id="w0", address="127.0.0.1:7001", capacity=capacity(),
                                              engine="reference", policy_version=0, incarnation="i1")
    for name, value in change.items():
        setattr(req, name, value)
    return req


def _refused(call: Callable[[], object], field: str) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    err = e.value
    assert isinstance(err, grpc.Call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    details = err.details() or ""
    assert field in details, details
    return details


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"address": "no-port"}, "address"),
        ({"address": "host:http"}, "address"),
        ({"address": "host:0"}, "address"),
        ({"address": "host:70000"}, "address"),
        ({"address": ":7001"}, "address"),
        ({"address": "unix:"}, "address"),
        ({"policy_version": -1}, "policy_version"),
    ],
)
def test_register_worker_refuses_a_malformed_request_naming_the_field(
        served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub], change: dict[str, object], field: str) -> None:
    t, stub = served
    _refused(lambda: stub.RegisterWorker(_register(**change), timeout=5), field)
    assert t.d.stats().workers == []


@pytest.mark.parametrize("name", ["total_kv_pages", "page_size", "max_batch_size", "max_context"])
def test_register_worker_refuses_a_bad_capacity_by_its_path(
        served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub], name: str) -> None:
    _, stub = served
    req = _register()
    setattr(req.capacity, name, -1)
    _refused(lambda: stub.RegisterWorker(req, timeout=5), f"capacity.{name}")


def test_a_well_formed_registration_is_accepted(served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    t, stub = served
    # A bare IPv6 pod IP before ":port" (the Helm chart's $(POD_IP):port) and unix-socket targets,
    # which the dialling side (grpcutil.bracket_ipv6) takes as given, are well formed too.
    addresses = ("127.0.0.1:7001", "[::1]:7002", "worker-3.local:65535", "fd00::5:50061",
                 "unix:/run/seer/worker.sock", "unix-abstract:seer-worker", "dns:///worker-4:7003")
    for address in addresses:
        stub.RegisterWorker(_register(worker_id=address, address=address), timeout=5)
    assert len(t.d.stats().workers) == len(addresses)


def test_heartbeat_without_a_worker_id_is_refused(served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    _, stub = served
    _refused(lambda: stub.Heartbeat(scheduler_pb2.HeartbeatRequest(
        telemetry=scheduler_pb2.WorkerTelemetry(free_kv_pages=1)), timeout=5), "worker_id")


def test_switch_weights_refuses_a_negative_version(served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    t, stub = served
    _refused(lambda: stub.SwitchWeights(scheduler_pb2.SwitchWeightsRequest(version=-3), timeout=5), "version")
    assert t.d.stats().policy_version is None  # no switch happened


@pytest.mark.parametrize(
    ("telemetry", "reason"),
    [
        ({"free_kv_pages": -1}, "free_pages is negative"),
        ({"free_kv_pages": 5000}, "exceeds total_pages"),
        ({"tokens_per_second": float("nan")}, "tokens_per_second is not finite"),
        ({"running": 9}, "exceeds max_batch_size"),
        ({"accepted_per_position": [5, 1], "proposed_per_position": [4, 1]}, "accepted_per_position[0] 5 exceeds"),
        ({"accepted_per_position": [-1], "proposed_per_position": [4]}, "accepted_per_position[0] is negative"),
        ({"accepted_per_position": [1], "proposed_per_position": [4, 2]}, "positions"),
    ],
)
def test_impossible_telemetry_over_grpc_quarantines_the_worker(
        served: tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub], telemetry: dict[str, object], reason: str) -> None:
    t, stub = served
    stub.RegisterWorker(_register(), timeout=5)
    sane = scheduler_pb2.WorkerTelemetry(free_kv_pages=4000, used_kv_pages=96, running=1,
                                         accepted_per_position=[3, 1], proposed_per_position=[4, 4])
    assert stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0", telemetry=sane), timeout=5).known
    assert not stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5).workers[0].quarantined
    fields: dict[str, object] = {"free_kv_pages": 4000, "used_kv_pages": 96, **telemetry}
    bad = scheduler_pb2.WorkerTelemetry(**fields)  # type: ignore[arg-type]
    assert stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0", telemetry=bad), timeout=5).known
    assert stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5).workers[0].quarantined
    assert reason in t.d.core.quarantine_reason("w0")
