"""A worker whose engine is broken (HeartbeatRequest.engine_broken) is loaded by nothing: no weight
switch, no catch-up. And a heartbeat without telemetry (the draining notice) says nothing of a
failing engine. From a review of the engine-health heartbeat (real reference workers on loopback):

- a switch to a bad source with one broken and one healthy worker: the broken one's load failed
  INTERNAL (no refusal), so the healthy one's refusal no longer made the switch a refusal: it was
  UNAVAILABLE "no worker confirmed" and dropped both workers;
- the catch-up of a worker registered broken retried LoadWeights for good (8 loads in 3 s);
- the draining notice (no telemetry, no health fields) cleared engine_failing and logged a false
  "no longer failing", flapping back at the next heartbeat.

The real Dispatcher behind its SchedulerService over gRPC on loopback, with the scripted worker
links of test_weight_refusals (a broken engine's load raises SeerError: INTERNAL, as the worker's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import grpc
import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.errors import SeerError

from .test_dispatcher_faults import FakeWorkerLink, Rig, capacity, wait_for
from .test_engine_health import WEIGHTS
from .test_weight_refusals import ScriptedLoads, _bad_source, _healthy, _switch, served

__all__ = ["served"]  # the fixture, imported for the tests below

ROLLBACK = "RuntimeError: Failed to update weights: shard 2 truncated. Rolling back to original weights."


def _loads_broken(wid: str, version: int, source: str) -> Exception | None:
    """`broken` fails every load as a broken engine does (INTERNAL); the others refuse a bad source."""
    if wid == "broken":
        return SeerError(ROLLBACK)
    return _bad_source(wid, version, source)


def _loaded(workers: ScriptedLoads, wid: str) -> list[tuple[int, str]]:
    with workers.lock:
        return [(v, src) for w, v, src, _ in workers.calls if w == wid]


def test_a_switch_leaves_a_broken_worker_out_and_a_refusal_stays_a_refusal(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    t, workers, stub = served
    workers.refuse = _bad_source
    t.register("ok", incarnation="a")
    t.register("broken", incarnation="b")
    assert _switch(stub, 1, "/ckpt/1") == 2
    workers.refuse = _loads_broken  # its engine breaks (a load that failed after writing weights)
    assert t.d.heartbeat("broken", None, incarnation="b", engine_broken=WEIGHTS)
    states = dict(t.d._workers)

    err = _switch(stub, 2, "/ckpt/typo")
    # A refusal: the only worker asked refused it. It was UNAVAILABLE and both workers were dropped.
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "no worker could load version 2" in (err.details() or "")
    assert t.d._workers == states, "a worker was dropped"
    assert _loaded(workers, "broken") == [(1, "/ckpt/1")], "the broken worker was asked to load"
    assert (t.d._version, t.d._source) == (1, "/ckpt/1")
    assert _healthy(stub) == {"ok": True, "broken": True}  # both still heartbeat and stay registered

    # A good source: the healthy worker loads it, the broken one is left as it is (not dropped).
    assert _switch(stub, 3, "/ckpt/3") == 1
    assert t.d._workers == states and _loaded(workers, "broken") == [(1, "/ckpt/1")]
    assert states["ok"].policy_version == 3 and states["broken"].policy_version == 1
    assert t.d.core.engine_broken("broken") == WEIGHTS


def test_a_switch_with_only_broken_workers_is_in_force_and_their_restart_catches_up(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub],
        caplog: pytest.LogCaptureFixture) -> None:
    """As with no worker registered: the version is in force, none loaded it (num_workers 0), a
    warning names the broken workers. The restarted process (a new incarnation) catches up to it."""
    t, workers, stub = served
    workers.refuse = _loads_broken
    t.d.register_worker("broken", "broken:1", capacity(), "fake", 0, "b", engine_broken=WEIGHTS)
    with caplog.at_level(logging.WARNING, logger="services.scheduler.service"):
        assert _switch(stub, 4, "/ckpt/4") == 0
    warned = [vars(r)["fields"] for r in caplog.records if "every registered worker's engine broken" in r.getMessage()]
    assert [(f["version"], f["broken"]) for f in warned] == [(4, ["broken"])]
    assert _loaded(workers, "broken") == [] and "broken" in t.d._workers
    assert stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5).policy_version == 4

    workers.refuse = lambda wid, v, src: None  # the restarted process's engine loads
    t.d.register_worker("broken", "broken:1", capacity(), "fake", 0, "b2")
    restarted = t.d._workers["broken"]
    wait_for(lambda: restarted.active)
    assert _loaded(workers, "broken") == [(4, "/ckpt/4")] and restarted.policy_version == 4
    assert t.d.core.engine_broken("broken") == ""


def test_the_catch_up_of_a_worker_registered_broken_is_parked(make_rig: Callable[..., Rig]) -> None:
    workers = ScriptedLoads()
    workers.refuse = _loads_broken
    t = make_rig(workers=workers, catch_up_retry_initial=0.05, catch_up_retry_max=0.1)
    with t.d._cond:
        t.d._version, t.d._source = 3, "/ckpt/3"
    t.d.register_worker("broken", "broken:1", capacity(), "fake", 0, "b", engine_broken=WEIGHTS)
    state = t.d._workers["broken"]
    wait_for(lambda: not state.catching_up)
    time.sleep(0.5)  # ten retry delays: it retried a load that could only fail, for good
    assert _loaded(workers, "broken") == []
    assert t.d._workers.get("broken") is state and not state.active  # registered, not placed on
    assert not cast(FakeWorkerLink, state.link).closed


def test_a_catch_up_retrying_stops_when_the_engine_is_said_broken(make_rig: Callable[..., Rig]) -> None:
    """A catch-up waiting to retry (a long delay) parks at the heartbeat that says broken."""
    workers = ScriptedLoads()
    workers.refuse = _loads_broken
    t = make_rig(workers=workers, catch_up_retry_initial=30.0, catch_up_retry_max=30.0)
    with t.d._cond:
        t.d._version, t.d._source = 3, "/ckpt/3"
    t.d.register_worker("broken", "broken:1", capacity(), "fake", 0, "b")  # not yet said broken
    state = t.d._workers["broken"]
    wait_for(lambda: len(_loaded(workers, "broken")) == 1)
    assert t.d.heartbeat("broken", None, incarnation="b", engine_broken=WEIGHTS)
    wait_for(lambda: not state.catching_up, timeout=5)  # not after the 30 s delay
    assert len(_loaded(workers, "broken")) == 1


def test_a_heartbeat_without_telemetry_leaves_engine_failing_alone(
        make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    """The draining notice (no telemetry: it may not read the engine) says nothing of its health."""
    t = make_rig()
    t.register("w0", incarnation="a")
    failing = "the chunks failed and a canary request too: injected fault"
    report = scheduler_pb2.WorkerTelemetry(free_kv_pages=4096)
    assert t.d.heartbeat("w0", report, incarnation="a", engine_failing=failing)
    with caplog.at_level(logging.INFO, logger="services.scheduler.service"):
        assert t.d.heartbeat("w0", None, draining=True, incarnation="a")
    assert t.d._workers["w0"].engine_failing == failing
    assert not any("no longer failing" in r.getMessage() for r in caplog.records)
    # A heartbeat with telemetry does say it: mended.
    assert t.d.heartbeat("w0", report, draining=True, incarnation="a")
    assert t.d._workers["w0"].engine_failing == ""
