"""A worker whose engine is broken for good (HeartbeatRequest.engine_broken) gets no new chunk; one
whose engine is only failing now (engine_failing) still does.

The scheduler did not hear of it: it kept placing chunks on a worker whose engine could serve
nothing (a weight load that failed after writing weights), each failing INTERNAL and costing a
request an attempt, until the failures quarantined the worker, while the worker waited out its
orchestrator's grace period (60 s) before a restart. A transiently failing engine is mended by a
chunk that gets a token, so it is shown and left placeable (excluded, it could never recover).

Core level (pure, fake clock), then the Dispatcher (scripted links, no gRPC): the heartbeat and
registration fields, stickiness, the listing and the gauges. tests/worker/test_engine_health_heartbeat.py
runs it over real gRPC with real workers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from seer.v1 import scheduler_pb2

from services.common.errors import NotFound

from .conftest import FakeClock, add_group, held, hold_core, make_core, starve_big
from .test_dispatcher_faults import LENGTH, Rig, capacity, item, rig, wait_for

__all__ = ["rig"]  # the fixture, imported for the tests below

WEIGHTS = "weight load failed after writing weights: Rolling back to original weights"


# ---- core ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["divided", "seer", "baseline"])
def test_no_chunk_is_placed_on_a_broken_worker(clock: FakeClock, policy: str) -> None:
    core = make_core(policy, clock, chunk_size=8)
    ids = add_group(core, "g", 4, max_tokens=32)
    first = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert set(first) == set(ids)
    on_w0 = [rid for rid, wid in first.items() if wid == "w0"]
    assert on_w0
    core.set_engine_broken("w0", WEIGHTS)
    assert core.engine_broken("w0") == WEIGHTS
    more = add_group(core, "h", 4, max_tokens=32)
    placed = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert set(placed) == set(more) and set(placed.values()) == {"w1"}
    # As for draining: its chunks in flight are neither re-queued nor refused; they end as they end.
    assert core.in_flight_count() == 8
    for rid in on_w0:
        core.on_chunk_done(rid, "w0", 8, finished=False)
    again = {d.request_id: d.worker_id for d in core.next_dispatches() if d.request_id in on_w0}
    assert again == dict.fromkeys(on_w0, "w1")
    assert core.stats()["workers"]["w0"]["engine_broken"] == WEIGHTS


def test_broken_is_for_good_until_the_worker_registers_again(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1, chunk_size=8)
    add_group(core, "g", 2, max_tokens=32)
    core.set_engine_broken("w0", WEIGHTS)
    assert core.next_dispatches() == []
    core.set_engine_broken("w0", "")  # a heartbeat without the field (a draining notice, an old worker)
    core.set_engine_broken("w0", "another reason")  # the first reason stays
    assert core.next_dispatches() == [] and core.engine_broken("w0") == WEIGHTS
    # Only a new registration (a restarted process) is placed on again.
    spec = core._workers["w0"].spec
    core.remove_worker("w0")
    core.add_worker(spec)
    assert core.engine_broken("w0") == "" and len(core.next_dispatches()) == 2


def test_a_hold_moves_off_a_worker_whose_engine_breaks(clock: FakeClock) -> None:
    core = hold_core(clock, "divided", workers=2, starvation_seconds=5.0)
    starve_big(core, clock)
    ((holder, _),) = held(core).items()
    core.set_engine_broken(holder, WEIGHTS)
    assert held(core) == {}  # released at once, as for a draining or quarantined worker
    core.next_dispatches()
    other = "w1" if holder == "w0" else "w0"
    assert list(held(core)) == [other]


def test_unknown_worker_is_named(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1)
    with pytest.raises(NotFound, match="worker_id"):
        core.set_engine_broken("nope", WEIGHTS)


# ---- dispatcher -----------------------------------------------------------------------------------


def _gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def _listed(t: Rig, wid: str) -> object:
    (view,) = [w for w in t.d.stats().workers if w.worker_id == wid]
    return view


def _finished(t: Rig, rids: list[str]) -> bool:
    return all(t.buffer.of(rid) and t.buffer.of(rid)[-1].finish_reason == LENGTH for rid in rids)


def test_a_broken_heartbeat_stops_placement_at_once(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.register("w0", incarnation="a")
    t.register("w1", incarnation="b")
    t.run()
    assert _gauge("seer_scheduler_serving_workers") == 2 and _gauge("seer_scheduler_engine_broken_workers") == 0
    assert t.d.heartbeat("w0", None, incarnation="a", engine_broken=WEIGHTS)
    view = _listed(t, "w0")
    assert view.engine_broken == WEIGHTS and view.healthy  # type: ignore[attr-defined]
    # The gauges agree with placement: w0 is no longer counted serving.
    assert _gauge("seer_scheduler_serving_workers") == 1 and _gauge("seer_scheduler_engine_broken_workers") == 1
    rids = [f"r{i}" for i in range(6)]
    t.d._add_items([item(rid, max_tokens=16) for rid in rids])
    wait_for(lambda: _finished(t, rids))
    assert {wid for wid, _ in t.workers.requests} == {"w1"}, "a chunk was placed on the broken worker"
    # A heartbeat without the field (a draining notice, sent without reading the engine) clears nothing.
    assert t.d.heartbeat("w0", None, draining=True, incarnation="a")
    assert t.d.heartbeat("w0", None, incarnation="a")
    assert _listed(t, "w0").engine_broken == WEIGHTS  # type: ignore[attr-defined]
    assert t.d.core.engine_broken("w0") == WEIGHTS
    # The restarted worker (a new incarnation) is placed on again.
    t.register("w0", incarnation="a2")
    assert _listed(t, "w0").engine_broken == ""  # type: ignore[attr-defined]
    assert _gauge("seer_scheduler_serving_workers") == 2 and _gauge("seer_scheduler_engine_broken_workers") == 0


def test_a_worker_registering_broken_is_never_placed_on(rig: Callable[..., Rig]) -> None:
    """After a scheduler restart, a worker whose engine broke before registers broken: not placed
    on between its registration and its first heartbeat (an interval later)."""
    t = rig()
    t.d.register_worker("w0", "w0:1", capacity(), "fake", 0, "a", engine_broken=WEIGHTS)
    t.register("w1", incarnation="b")
    t.run()
    assert t.d.core.engine_broken("w0") == WEIGHTS
    rids = [f"r{i}" for i in range(4)]
    t.d._add_items([item(rid, max_tokens=16) for rid in rids])
    wait_for(lambda: _finished(t, rids))
    assert {wid for wid, _ in t.workers.requests} == {"w1"}
    # The same process reconnecting keeps it (and one that says so only then gets it).
    t.d.register_worker("w0", "w0:1", capacity(), "fake", 0, "a")
    assert t.d.core.engine_broken("w0") == WEIGHTS
    t.d.register_worker("w1", "w1:1", capacity(), "fake", 0, "b", engine_broken=WEIGHTS)
    assert t.d.core.engine_broken("w1") == WEIGHTS and _gauge("seer_scheduler_serving_workers") == 0


def test_broken_said_while_catching_up_holds_once_active(rig: Callable[..., Rig]) -> None:
    """A worker not yet in the core (awaiting a weight switch's end, catching up) that says its
    engine is broken is still not placed on once it is activated."""
    t = rig()
    t.register("w0", incarnation="a")
    t.d._paused = True  # a switch in progress: w1 registers inactive, awaiting its end
    t.register("w1", incarnation="b")
    assert t.d.heartbeat("w1", None, incarnation="b", engine_broken=WEIGHTS)
    t.d._paused = False
    with t.d._cond:
        t.d._activate_locked(t.d._workers["w1"], t.d._workers["w1"].spec)  # type: ignore[arg-type]
    assert t.d.core.engine_broken("w1") == WEIGHTS


def test_a_failing_engine_is_shown_and_still_placed_on(rig: Callable[..., Rig]) -> None:
    """Transient (a canary failed; a chunk that gets a token mends it): excluded, the worker could
    never get that chunk. Shown in the listing and the gauge, placement unchanged."""
    t = rig()
    t.register("w0", incarnation="a")
    t.run()
    failing = "the chunks failed and a canary request too: injected fault"
    # With telemetry: one without (the draining notice) leaves engine_failing as it was.
    report = scheduler_pb2.WorkerTelemetry(free_kv_pages=4096)
    assert t.d.heartbeat("w0", report, incarnation="a", engine_failing=failing)
    assert _listed(t, "w0").engine_failing == failing  # type: ignore[attr-defined]
    assert _gauge("seer_scheduler_engine_failing_workers") == 1
    assert _gauge("seer_scheduler_serving_workers") == 1
    rids = ["r0", "r1"]
    t.d._add_items([item(rid, max_tokens=16) for rid in rids])
    wait_for(lambda: _finished(t, rids))  # the only worker, still placed on
    assert {wid for wid, _ in t.workers.requests} == {"w0"}
    assert t.d.heartbeat("w0", report, incarnation="a")  # a chunk got a token: healthy again
    assert _listed(t, "w0").engine_failing == ""  # type: ignore[attr-defined]
    assert _gauge("seer_scheduler_engine_failing_workers") == 0


def test_the_listing_carries_the_fields_over_grpc_types(rig: Callable[..., Rig]) -> None:
    """SchedulerServicer copies them into WorkerInfo (the proto's defaults mean healthy)."""
    from services.scheduler.server import SchedulerServicer

    t = rig()
    t.register("w0", incarnation="a")
    assert scheduler_pb2.HeartbeatRequest().engine_broken == "" == scheduler_pb2.WorkerInfo().engine_broken
    servicer = SchedulerServicer(t.d)
    servicer.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0", incarnation="a", engine_broken=WEIGHTS,
                                                      engine_failing=""), None)  # type: ignore[arg-type]
    resp = servicer.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), None)  # type: ignore[arg-type]
    (info,) = resp.workers
    assert info.engine_broken == WEIGHTS and info.engine_failing == ""
