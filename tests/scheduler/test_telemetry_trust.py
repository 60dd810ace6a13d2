"""A telemetry report the core rejects as impossible (workers.telemetry_problem) quarantines the
worker and is dropped: GetSchedulerStats keeps listing the last trusted report, with the quarantine
and its reason, and the per-worker gauges keep the last trusted figures. Before, the rejected report
was copied into the listing and the gauges (an acceptance of 7.0 from accepted > proposed, absurd
tokens/s), so a dashboard showed untrusted numbers as the worker's.

Over real gRPC on loopback (the real servicer and Dispatcher; the buffer and worker links scripted,
as in test_grpc_bad_input). Each test uses its own worker ids: the gauges are process-wide.

Also a chunk's own values (token ids, log-probabilities): impossible ones are the worker's fault,
checked before the commit (the real Dispatcher and dispatch loop with scripted links, no gRPC)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from prometheus_client import REGISTRY
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from services.scheduler.server import add_to_server
from tests.common.grpc_server import loopback_server

from .test_dispatcher_faults import Rig, capacity, chunk_events, item, wait_for

Served = tuple[Rig, scheduler_pb2_grpc.SchedulerServiceStub]

SANE = {"free_kv_pages": 4000, "used_kv_pages": 96, "running": 1, "tokens_per_second": 50.0,
        "accepted_per_position": [3, 1], "proposed_per_position": [4, 4]}


@pytest.fixture
def served(make_rig: Callable[..., Rig]) -> Iterator[Served]:
    t = make_rig()
    with loopback_server(add_to_server, t.d) as address, grpc.insecure_channel(address) as channel:
        yield t, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _register(stub: scheduler_pb2_grpc.SchedulerServiceStub, wid: str, *, version: int = 0,
              incarnation: str = "i1") -> None:
    stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
        worker_id=wid, address="127.0.0.1:7001", capacity=capacity(), engine="reference",
        policy_version=version, incarnation=incarnation), timeout=5)


def _beat(stub: scheduler_pb2_grpc.SchedulerServiceStub, wid: str, **fields: object) -> None:
    telemetry = scheduler_pb2.WorkerTelemetry(**fields)  # type: ignore[arg-type]
    assert stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=wid, telemetry=telemetry), timeout=5).known


def _listed(stub: scheduler_pb2_grpc.SchedulerServiceStub, wid: str) -> scheduler_pb2.WorkerInfo:
    workers = stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5).workers
    return next(w for w in workers if w.worker_id == wid)


def _gauges(wid: str) -> tuple[float | None, float | None]:
    return (REGISTRY.get_sample_value("seer_scheduler_worker_tokens_per_second", {"worker_id": wid}),
            REGISTRY.get_sample_value("seer_scheduler_worker_draft_acceptance", {"worker_id": wid}))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"accepted_per_position": [28, 1], "proposed_per_position": [4, 4]}, "accepted_per_position[0] 28 exceeds"),
        ({"tokens_per_second": -1e9}, "tokens_per_second is negative"),
        ({"tokens_per_second": float("inf")}, "tokens_per_second is not finite"),
        ({"free_kv_pages": 999_999, "tokens_per_second": 9e9}, "exceeds total_pages"),
        ({"policy_version": -4}, "policy_version is negative"),
    ],
)
def test_a_rejected_report_is_neither_listed_nor_exported(served: Served, bad: dict[str, object], reason: str) -> None:
    _, stub = served
    wid = f"trust-{reason.split()[0]}-{len(reason)}"
    _register(stub, wid)
    _beat(stub, wid, **SANE)
    assert _gauges(wid) == (50.0, 0.5)
    assert not _listed(stub, wid).quarantined

    _beat(stub, wid, **{**SANE, **bad})
    info = _listed(stub, wid)
    # The last trusted report stands, in the listing and in the gauges.
    assert info.telemetry == scheduler_pb2.WorkerTelemetry(**SANE)  # type: ignore[arg-type]
    assert _gauges(wid) == (50.0, 0.5)
    assert info.quarantined and reason in info.quarantine_reason, info.quarantine_reason

    # A sane report is shown again (the quarantine lasts its sane reports: 3 for a first offence).
    _beat(stub, wid, **{**SANE, "tokens_per_second": 60.0, "accepted_per_position": [2, 1]})
    info = _listed(stub, wid)
    assert info.telemetry.tokens_per_second == 60.0 and info.quarantined
    assert _gauges(wid) == (60.0, 3 / 8)
    for _ in range(2):
        _beat(stub, wid, **SANE)
    info = _listed(stub, wid)
    assert not info.quarantined and info.quarantine_reason == ""


def test_a_worker_not_yet_serving_has_its_report_checked_too(served: Served) -> None:
    """A worker ahead of the suite's version stays out of the core until a switch reaches it; its
    reports were shown and exported unchecked."""
    _, stub = served
    stub.SwitchWeights(scheduler_pb2.SwitchWeightsRequest(version=1), timeout=10)
    wid = "trust-inactive"
    _register(stub, wid, version=2)  # ahead of the suite: not placed on, not in the core
    assert not _listed(stub, wid).healthy
    _beat(stub, wid, **SANE)
    assert _gauges(wid) == (50.0, 0.5)
    _beat(stub, wid, **{**SANE, "running": 9, "tokens_per_second": 1e12})  # over max_batch_size 8
    assert _listed(stub, wid).telemetry == scheduler_pb2.WorkerTelemetry(**SANE)  # type: ignore[arg-type]
    assert _gauges(wid) == (50.0, 0.5)


def test_a_quarantine_carried_over_a_re_registration_is_listed(served: Served) -> None:
    """A quarantined worker that registers again and waits out of the core (here: ahead of the
    suite's version) keeps its quarantine (applied again when it serves): it was listed as trusted."""
    _, stub = served
    stub.SwitchWeights(scheduler_pb2.SwitchWeightsRequest(version=1), timeout=10)
    wid = "trust-carried"
    _register(stub, wid, version=1)
    _beat(stub, wid, **{**SANE, "free_kv_pages": -1})
    assert _listed(stub, wid).quarantined
    _register(stub, wid, version=2, incarnation="i2")  # a new process: the old state is removed
    info = _listed(stub, wid)
    assert not info.healthy
    assert info.quarantined and "free_pages is negative" in info.quarantine_reason, info


# ---- worker-reported values of a chunk --------------------------------------------------------


@pytest.mark.parametrize(
    ("token_id", "logprob"),
    [(7, float("nan")), (7, 0.5), (-3, -0.5)],
)
def test_a_chunk_with_impossible_values_is_the_workers_fault(
        make_rig: Callable[..., Rig], token_id: int, logprob: float) -> None:
    """A chunk with a NaN or positive log-probability or a negative token id is malformed: not
    committed (the buffer refuses it, INVALID_ARGUMENT, and that refusal was blamed on nobody, so a
    worker streaming them was never quarantined and each of its chunks cost an attempt), a fault of
    the worker's. The batch completes beside it on the healthy worker."""
    t = make_rig()

    def script(wid: str, req: worker_pb2.RunChunkRequest) -> list[worker_pb2.RunChunkResponse]:
        events = chunk_events(req)
        if wid == "bad":
            events[0] = worker_pb2.RunChunkResponse(
                tokens=worker_pb2.TokenDelta(token_ids=[token_id], logprobs=[logprob]))
        return events

    t.workers.script = script
    for wid in ("good", "bad"):
        t.register(wid)
    t.run()
    rids = [f"r{i}" for i in range(12)]
    t.d._add_items([item(rid, max_tokens=16) for rid in rids])
    wait_for(lambda: not t.d._requests and not t.d._aborting, timeout=30)
    committed = [c for rid in rids for c in t.buffer.of(rid)]
    assert all(c.worker_id == "good" for c in committed), {c.worker_id for c in committed}
    assert all(sum(len(c.token_ids) for c in t.buffer.of(rid)) == 16 for rid in rids)
    assert t.d.core.is_quarantined("bad") and "a malformed chunk" in t.d.core.quarantine_reason("bad")


def test_a_removed_workers_series_go_with_it(served: Served) -> None:
    """Worker ids churn (a pod name per restart under Kubernetes); a removed worker's per-worker
    series stayed exported with its last figures for the life of the scheduler."""
    t, stub = served
    _register(stub, "gone-1")
    _beat(stub, "gone-1", **SANE)
    assert _gauges("gone-1") == (50.0, 0.5)
    with t.d._cond:
        t.d._remove_worker_locked("gone-1", "test")
    assert _gauges("gone-1") == (None, None)
    # Registered again (a restart under the same id): its series come back with its reports.
    _register(stub, "gone-1", incarnation="i2")
    _beat(stub, "gone-1", **SANE)
    assert _gauges("gone-1") == (50.0, 0.5)
