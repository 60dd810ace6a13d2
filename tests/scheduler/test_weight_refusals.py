"""Weight switches and catch-ups that fail, from a new-user audit (`update_weights(200,
source="/ckpt/typo")` against two workers): the real Dispatcher (over real gRPC on loopback where
the status codes matter) with the scripted worker links of test_dispatcher_faults.

- a switch every worker REFUSED (a bad source: each loaded nothing and still serves the old
  version) drops no worker: they were all dropped, the suite had no worker left and the next switch
  was adopted unchecked with num_workers=0;
- a worker that failed while others loaded, or whose load was lost, is still dropped;
- a failed catch-up load is retried in place with a doubling, bounded delay, one log line per
  attempt (it dropped the worker, which registered again and failed again, ~217 times a minute);
- a switch with no worker registered is accepted with a warning, and the listing shows that no
  worker serves it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import grpc
import pytest
from prometheus_client import REGISTRY
from seer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from services.common.errors import InvalidArgument, Unavailable
from services.scheduler.server import add_to_server
from tests.common.grpc_server import loopback_server

from .test_dispatcher_faults import FakeWorkerLink, FakeWorkers, Rig, item, wait_for

LENGTH = common_pb2.FINISH_REASON_LENGTH


class ScriptedLoads(FakeWorkers):
    """Worker links whose LoadWeights answers by `refuse(worker_id, version, source)`: an exception
    to raise, or None to load. Every call is recorded with its time."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: Callable[[str, int, str], Exception | None] = lambda wid, v, src: None
        self.calls: list[tuple[str, int, str, float]] = []
        self.lock = threading.Lock()

    def __call__(self, address: str) -> FakeWorkerLink:
        return ScriptedLoadLink(self, address.split(":")[0])


class ScriptedLoadLink(FakeWorkerLink):
    def __init__(self, workers: ScriptedLoads, worker_id: str) -> None:
        super().__init__(workers, worker_id)
        self.sw = workers

    def load_weights(self, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        with self.sw.lock:
            self.sw.calls.append((self.worker_id, version, source, time.monotonic()))
        err = self.sw.refuse(self.worker_id, version, source)
        if err is not None:
            raise err
        return worker_pb2.LoadWeightsResponse(version=version)


def _bad_source(wid: str, version: int, source: str) -> Exception | None:
    if "typo" in source:
        return InvalidArgument(f"{source}/config.json not found", field="source")
    return None


@pytest.fixture
def served(
        make_rig: Callable[..., Rig]) -> Iterator[tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]]:
    workers = ScriptedLoads()
    t = make_rig(workers=workers)
    with loopback_server(add_to_server, t.d) as address, grpc.insecure_channel(address) as channel:
        yield t, workers, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _switch(stub: scheduler_pb2_grpc.SchedulerServiceStub, version: int, source: str) -> grpc.RpcError | int:
    try:
        return stub.SwitchWeights(scheduler_pb2.SwitchWeightsRequest(version=version, source=source),
                                  timeout=10).num_workers
    except grpc.RpcError as e:
        return e


def _healthy(stub: scheduler_pb2_grpc.SchedulerServiceStub) -> dict[str, bool]:
    stats = stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)
    return {w.worker_id: w.healthy for w in stats.workers}


# ---- item 1: a switch every worker refused drops nobody -----------------------------------------


def test_a_switch_every_worker_refused_keeps_them_all_serving_the_old_version(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    t, workers, stub = served
    workers.refuse = _bad_source
    t.register("w0")
    t.register("w1")
    assert _switch(stub, 1, "/ckpt/1") == 2
    states = dict(t.d._workers)

    err = _switch(stub, 200, "/ckpt/typo")
    # Every worker found the source bad: INVALID_ARGUMENT naming `source` (the trainer's argument),
    # as the worker README promises; it was FAILED_PRECONDITION naming `version`.
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert details.startswith("source: ") and "no worker could load version 200" in details
    assert "/ckpt/typo/config.json not found" in details  # the source error is named

    # Nobody was dropped: the same registrations, still placed on, still at version 1.
    assert t.d._workers == states and all(w.active and w.policy_version == 1 for w in states.values())
    assert _healthy(stub) == {"w0": True, "w1": True}
    assert (t.d._version, t.d._source) == (1, "/ckpt/1")
    assert stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5).policy_version == 1

    # A second bad switch is refused the same way (it was adopted with num_workers=0, unchecked).
    err = _switch(stub, 201, "/ckpt/typo2")
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (t.d._version, t.d._source) == (1, "/ckpt/1") and t.d._workers == states

    # And the workers still run chunks.
    t.run()
    t.d._add_items([item("a", max_tokens=8)])
    wait_for(lambda: [c.finish_reason for c in t.buffer.of("a")] == [LENGTH])
    assert not any(cast(FakeWorkerLink, w.link).closed for w in states.values())


def test_a_worker_that_refused_while_another_loaded_is_dropped(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    # It cannot serve the new version: it goes (and may register again to catch up).
    t, workers, stub = served
    workers.refuse = lambda wid, v, src: InvalidArgument("no such file here", field="source") if wid == "w1" else None
    t.register("w0")
    t.register("w1")
    w1 = t.d._workers["w1"]
    assert _switch(stub, 1, "/ckpt/1") == 1
    assert set(t.d._workers) == {"w0"} and cast(FakeWorkerLink, w1.link).closed
    assert t.d._version == 1


def test_a_switch_whose_loads_were_all_lost_still_drops_the_workers(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    # The outcome is unknown (a worker may come back on the new version): as before, UNAVAILABLE,
    # and the workers are dropped to register again.
    t, workers, stub = served
    workers.refuse = lambda wid, v, src: Unavailable("connection reset")
    t.register("w0")
    err = _switch(stub, 1, "/ckpt/1")
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE
    assert t.d._workers == {} and t.d._version is None


def test_mixed_refusal_and_lost_load_drops_both(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    # One refused, one lost: the lost one may have switched, so this is no "nothing switched".
    t, workers, stub = served
    workers.refuse = lambda wid, v, src: (InvalidArgument("bad", field="source") if wid == "w0"
                                          else Unavailable("deadline"))
    t.register("w0")
    t.register("w1")
    err = _switch(stub, 1, "/ckpt/1")
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE
    assert t.d._workers == {}


# ---- item 2: a failed catch-up is retried with a bounded backoff --------------------------------


def test_a_failed_catch_up_is_retried_in_place_with_a_doubling_delay(
        make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    workers = ScriptedLoads()
    t = make_rig(workers=workers, catch_up_retry_initial=0.1, catch_up_retry_max=0.4)
    with t.d._cond:
        t.d._version, t.d._source = 3, "/ckpt/3"
    failures = 5
    workers.refuse = lambda wid, v, src: (
        InvalidArgument(f"{src}/config.json not found", field="source") if len(workers.calls) <= failures else None)
    with caplog.at_level(logging.INFO, logger="services.scheduler.service"):
        t.register("late")
        late = t.d._workers["late"]
        wait_for(lambda: late.active)
    assert t.d._workers.get("late") is late and not cast(FakeWorkerLink, late.link).closed  # never dropped
    assert late.policy_version == 3 and not late.catching_up
    assert [(wid, v, src) for wid, v, src, _ in workers.calls] == [("late", 3, "/ckpt/3")] * (failures + 1)
    gaps = [b[3] - a[3] for a, b in zip(workers.calls, workers.calls[1:], strict=False)]
    # 0.1, 0.2, 0.4, 0.4, 0.4 s: doubling, capped (a scheduler thread may start a little late).
    for gap, want in zip(gaps, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert want * 0.9 <= gap < want + 0.5, gaps
    retries = [vars(r)["fields"] for r in caplog.records if r.getMessage() == "catch-up weight load failed; retrying"]
    assert len(retries) == failures  # one line per failed attempt
    for n, f in enumerate(retries, 1):
        assert (f["worker_id"], f["version"], f["source"], f["attempt"]) == ("late", 3, "/ckpt/3", n)
        assert "config.json not found" in f["error"]
    assert [f["retry_in_s"] for f in retries] == [0.1, 0.2, 0.4, 0.4, 0.4]


def test_a_failing_catch_up_is_listed_unhealthy_and_a_switch_does_not_wait_for_its_retry(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    t, workers, stub = served
    # `late` cannot read version 1's checkpoint (not on its node, say); version 2's it can.
    workers.refuse = lambda wid, v, src: (InvalidArgument(f"{src} not found", field="source")
                                          if (wid, v) == ("late", 1) else None)
    t.register("w0")
    assert _switch(stub, 1, "/ckpt/1") == 1
    t.d.cfg = dataclasses.replace(t.d.cfg, catch_up_retry_initial=30.0, catch_up_retry_max=30.0)
    t.register("late")
    late = t.d._workers["late"]
    wait_for(lambda: any(c[0] == "late" for c in workers.calls))
    time.sleep(0.1)
    assert late.catching_up and t.d._workers.get("late") is late
    assert _healthy(stub) == {"w0": True, "late": False}  # registered, not serving
    # A switch drains catch-ups: it must not wait out the 30 s retry delay.
    t0 = time.monotonic()
    assert _switch(stub, 2, "/ckpt/2") == 2  # w0 and late both loaded it
    assert time.monotonic() - t0 < 5
    wait_for(lambda: late.active)
    assert late.policy_version == 2 and _healthy(stub) == {"w0": True, "late": True}


def test_a_catch_up_waiting_to_retry_stops_when_the_worker_goes(make_rig: Callable[..., Rig]) -> None:
    workers = ScriptedLoads()
    t = make_rig(workers=workers, catch_up_retry_initial=30.0, catch_up_retry_max=30.0)
    with t.d._cond:
        t.d._version, t.d._source = 1, "/ckpt/typo"
    workers.refuse = _bad_source
    t.register("late")
    late = t.d._workers["late"]
    wait_for(lambda: len(workers.calls) == 1)
    with t.d._cond:
        t.d._remove_worker_locked("late", reason="missed heartbeats")
    wait_for(lambda: not late.catching_up, timeout=5)
    assert len(workers.calls) == 1


# ---- item 3: a switch with no worker registered -------------------------------------------------


def test_a_switch_with_no_worker_is_accepted_with_a_warning_and_none_serves_it(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub],
        caplog: pytest.LogCaptureFixture) -> None:
    t, workers, stub = served
    with caplog.at_level(logging.WARNING, logger="services.scheduler.service"):
        assert _switch(stub, 5, "/ckpt/5") == 0
    assert any("no worker loaded it" in r.getMessage() and vars(r)["fields"]["version"] == 5
               for r in caplog.records if r.levelno == logging.WARNING)
    stats = stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)
    assert stats.policy_version == 5 and not any(w.healthy for w in stats.workers)
    # A worker joining later catches up to it.
    t.register("w0")
    wait_for(lambda: t.d._workers["w0"].active)
    assert [(wid, v, src) for wid, v, src, _ in workers.calls] == [("w0", 5, "/ckpt/5")]
    assert _healthy(stub) == {"w0": True}


# ---- the serving gauge --------------------------------------------------------------------------


def _serving_gauge() -> float | None:
    return REGISTRY.get_sample_value("seer_scheduler_serving_workers")


def test_the_serving_gauge_counts_only_workers_chunks_can_be_placed_on(
        served: tuple[Rig, ScriptedLoads, scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
    """It was sum(active): quarantined and draining workers, never placed on, counted as serving.
    It is read at scrape time, so a change made anywhere (a quarantine lifted inside the core, a
    draining heartbeat) shows at once."""
    t, _workers, stub = served
    t.register("w0")
    t.register("w1")
    assert _switch(stub, 1, "/ckpt/1") == 2
    assert _serving_gauge() == 2.0
    t.d.core.quarantine_worker("w0", "impossible chunk stats (test)")
    assert _serving_gauge() == 1.0
    assert t.d.heartbeat("w1", None, draining=True)
    assert _serving_gauge() == 0.0
    assert t.d.heartbeat("w1", None, draining=False)
    assert _serving_gauge() == 1.0
    with t.d._cond:
        t.d._remove_worker_locked("w1", "test")
    assert _serving_gauge() == 0.0 and t.d._workers["w0"].active  # w0: registered, quarantined
