"""The worker's heartbeat tells the scheduler of its engine's health, over real gRPC.

A worker whose engine broke for good (a weight load that failed after writing weights: SGLang's
"Rolling back to original weights") turns its gRPC health NOT_SERVING, but its restart waits for
the orchestrator's grace period (60 s). The scheduler did not hear of it: it kept placing chunks
there, each failing INTERNAL and costing a request an attempt, until the failures quarantined the
worker. Now the heartbeat (sent at once when the health changes) carries engine_broken and the
scheduler places nothing more there. A transiently failing engine (the chunks failed and a canary
too) is reported as engine_failing and still placed on: the chunk that gets a token mends it.

The scheduler's Dispatcher behind its SchedulerService and real workers (reference engine on the
embedded model) behind their WorkerService, each with its Registrar; only the buffer is a stub."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common.grpcutil import channel
from services.scheduler.service import Dispatcher
from services.worker.core import EngineHealth, Worker
from services.worker.engine import Draft, StepOutput
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import Registrar, register_request
from tests.scheduler.test_dispatcher_faults import ABORTED, CHUNK, FakeBuffer, item, wait_for
from tests.worker.test_worker_draining import _dispatcher, _Recorded, _serve

ROLLBACK = "Failed to update weights: shard 2 truncated.\nRolling back to original weights."


class _BreakableEngine(ReferenceEngine):
    """A reference engine whose weight load fails after "writing weights": broken for good (as
    SGLang's after a rolled-back load), every later step failing as a corrupted engine's would."""

    reason: str | None = None

    @property
    def broken(self) -> str | None:
        return self.reason

    def load_weights(self, path: str | None, version: str) -> None:
        self.reason = f"a weight load failed after writing weights: {ROLLBACK}"
        raise RuntimeError(ROLLBACK)

    def step(self, drafts: Mapping[str, Draft] | None = None) -> list[StepOutput]:
        if self.reason is not None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step(drafts)


@pytest.fixture
def scheduler() -> Iterator[tuple[Dispatcher, FakeBuffer, _Recorded, str]]:
    # Heartbeats every 60 s (longer than the test): every one seen is one sent at a health change.
    with _dispatcher(chunk_size=4, commit_timeout=2.0) as s:
        yield s


def _finished(buffer: FakeBuffer, rids: list[str]) -> bool:
    return all(buffer.of(rid) and buffer.of(rid)[-1].finish_reason != CHUNK for rid in rids)


def test_no_chunk_goes_to_a_worker_whose_engine_broke(
    scheduler: tuple[Dispatcher, FakeBuffer, _Recorded, str], ref_engine: ReferenceEngine, model_dir: Path
) -> None:
    d, buffer, links, address = scheduler
    broken_engine = _BreakableEngine.from_dir(model_dir, num_pages=256, max_batch_size=16, page_size=16)
    broken, broken_srv = _serve(broken_engine, "w-broken")
    ok, ok_srv = _serve(ref_engine, "w-ok")
    regs = [Registrar(w, address, srv.address).start() for w, srv in ((broken, broken_srv), (ok, ok_srv))]
    worker_ch, sched_ch = channel(broken_srv.address), channel(address)
    try:
        wait_for(lambda: len(d.core.stats()["workers"]) == 2)
        assert regs[0].heartbeats == 0
        # The catch-up or switch load that breaks the engine: INTERNAL, health NOT_SERVING for good.
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerServiceStub(worker_ch).LoadWeights(worker_pb2.LoadWeightsRequest(version=0),
                                                                     timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert not broken.engine_healthy
        # At once, not at the next heartbeat (60 s away): the health change wakes the registrar.
        wait_for(lambda: regs[0].heartbeats >= 1, timeout=5)

        rids = [f"r{i}" for i in range(6)]
        d._add_items([item(rid, max_tokens=8) for rid in rids])
        wait_for(lambda: _finished(buffer, rids) and d.stats().in_flight_chunks == 0, timeout=60)
        assert links.to(broken_srv.address) == [], "a chunk was placed on the worker whose engine is broken"
        assert set(links.to(ok_srv.address)) == set(rids)
        assert d.stats().redispatched_chunks == 0

        # Listed with its reason (still alive: `healthy` is about its heartbeats), once.
        stats = scheduler_pb2_grpc.SchedulerServiceStub(sched_ch).GetSchedulerStats(
            scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)
        info = {w.worker_id: w for w in stats.workers}
        assert "Rolling back to original weights" in info["w-broken"].engine_broken
        assert info["w-broken"].healthy and info["w-ok"].engine_broken == "" == info["w-ok"].engine_failing
    finally:
        for r in regs:
            r.stop()
        worker_ch.close()
        sched_ch.close()
        broken_srv.stop(1.0)
        ok_srv.stop(1.0)


def test_a_failing_engine_is_still_placed_on_and_recovers(
    scheduler: tuple[Dispatcher, FakeBuffer, _Recorded, str], ref_engine: ReferenceEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every forward pass fails (a device briefly gone) until the scheduler has heard the engine is
    failing: the worker's chunks fail and so does its canary, its heartbeat says engine_failing,
    and the scheduler keeps placing chunks there (the only worker). The next one gets its tokens,
    the worker is healthy again, and its heartbeat clears engine_failing. Excluding a failing
    worker would have left these requests waiting for ever."""
    d, buffer, links, address = scheduler
    heard = threading.Event()
    told: list[str] = []  # the scheduler's WorkerState.engine_failing when it had heard
    real_run = ref_engine.runner.run

    def run(seqs: list[Any], trees: list[Any]) -> Any:
        if not heard.is_set():
            state = d._workers.get("w-flaky")
            if state is None or not state.engine_failing:
                raise RuntimeError("injected device fault")
            told.append(state.engine_failing)
            heard.set()  # the scheduler knows: the device comes back
        return real_run(seqs, trees)

    monkeypatch.setattr(ref_engine.runner, "run", run)
    worker, srv = _serve(ref_engine, "w-flaky")
    healths: list[bool] = []
    worker.on_engine_health(healths.append)
    reg = Registrar(worker, address, srv.address).start()
    try:
        wait_for(lambda: len(d.core.stats()["workers"]) == 1)
        rids = ["r0", "r1"]
        d._add_items([item(rid, max_tokens=8) for rid in rids])
        wait_for(heard.is_set, timeout=30)
        assert "a canary request too" in told[0], told
        wait_for(lambda: _finished(buffer, rids) and d.stats().in_flight_chunks == 0, timeout=60)
        assert all(buffer.of(rid)[-1].finish_reason != ABORTED for rid in rids)
        assert set(links.to(srv.address)) == set(rids)
        assert healths[:3] == [True, False, True] and worker.engine_healthy
        # Healthy again: the heartbeat the change sent clears it.
        wait_for(lambda: [w.engine_failing for w in d.stats().workers] == [""], timeout=5)
        assert d.core.engine_broken("w-flaky") == ""
    finally:
        reg.stop()
        srv.stop(1.0)



def test_engine_health_and_registration_read_the_engine_at_once(ref_engine: ReferenceEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.broken is read by the heartbeat itself (one attribute, no engine lock), so an idle
    worker whose engine broke outside a load says so before its step loop notices; RegisterWorker
    carries it too (a scheduler that restarted must not place chunks there until a heartbeat)."""
    worker = Worker(ref_engine, worker_id="w-idle", speculation=False)  # not started: no step loop
    assert worker.engine_health() == EngineHealth()
    assert register_request(worker, "127.0.0.1:1").engine_broken == ""
    monkeypatch.setattr(ReferenceEngine, "broken", property(lambda self: "device lost"))
    assert worker.engine_health() == EngineHealth(broken="device lost")
    assert register_request(worker, "127.0.0.1:1").engine_broken == "device lost"


def test_an_engine_broken_before_the_first_step_is_not_serving_at_once(ref_engine: ReferenceEngine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose engine is broken when its health listener (the gRPC health status) attaches
    reports NOT_SERVING then: registered broken, it gets no chunk, runs no step, and would never
    notice, so neither `seer up` nor a liveness probe would restart it."""
    worker = Worker(ref_engine, worker_id="w-born-broken", speculation=False)  # not started
    monkeypatch.setattr(ReferenceEngine, "broken", property(lambda self: "device lost"))
    heard: list[bool] = []
    worker.on_engine_health(heard.append)
    assert heard and heard[-1] is False and not worker.engine_healthy


def test_the_draining_notice_carries_the_engine_health_without_the_engine_lock(
    scheduler: tuple[Dispatcher, FakeBuffer, _Recorded, str], ref_engine: ReferenceEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """drain_now (the SIGQUIT path: the engine may be dead, a step may hold its lock for good) sends
    engine_failing / engine_broken read from plain attributes. Sent without them, the scheduler took
    the notice for a mended engine: a false "no longer failing" that flapped back at the next
    heartbeat."""
    d, _buffer, _links, address = scheduler
    heard: list[tuple[bool, str, str]] = []  # (draining, engine_broken, engine_failing) the scheduler got
    real_heartbeat = d.heartbeat

    def spy(worker_id: str, telemetry: Any, draining: bool = False, incarnation: str = "",
            engine_broken: str = "", engine_failing: str = "") -> bool:
        heard.append((draining, engine_broken, engine_failing))
        return real_heartbeat(worker_id, telemetry, draining, incarnation, engine_broken, engine_failing)

    monkeypatch.setattr(d, "heartbeat", spy)
    worker, srv = _serve(ref_engine, "w-f")
    reg = Registrar(worker, address, srv.address).start()
    failing = "the chunks failed and a canary request too: injected"
    try:
        wait_for(lambda: "w-f" in d._workers)
        with worker._locked():
            worker._set_engine_health_locked(False, RuntimeError("injected"))
        wait_for(lambda: d._workers["w-f"].engine_failing == failing, timeout=5)
        # A step hung in a dead engine holds its lock: the notice must not wait for it.
        done = threading.Event()

        def notice() -> None:
            reg.drain_now(2.0)
            done.set()

        with worker._locked():
            threading.Thread(target=notice, daemon=True).start()
            assert done.wait(3.0), "drain_now waited for the engine lock"
        assert heard[-1] == (True, "", failing)
        (view,) = d.stats().workers
        assert view.draining and view.engine_failing == failing
        # A dying engine whose health cannot be read still gets the notice out (health left out).
        monkeypatch.setattr(worker, "engine_health", lambda: (_ for _ in ()).throw(RuntimeError("dead engine")))
        heard.clear()
        assert reg.drain_now(2.0)
        assert heard == [(True, "", "")]
        assert d.stats().workers[0].engine_failing == failing  # a notice without telemetry changes it not
    finally:
        with worker._locked():
            worker._set_engine_health_locked(True)
        reg.stop()
        srv.stop(1.0)


def test_stop_removes_the_registrars_health_listener(ref_engine: ReferenceEngine) -> None:
    """Registrar.start() listens to Worker.on_engine_health; stop() takes it off (they piled up on a
    worker outliving its registrars), without the engine lock (a hung step must not hold a stop)."""
    worker = Worker(ref_engine, worker_id="w-l", speculation=False)  # not started
    before = list(worker._health_listeners)

    def stop(reg: Registrar, stopped: threading.Event) -> None:
        reg.stop()
        stopped.set()

    for _ in range(3):
        reg = Registrar(worker, "127.0.0.1:1", "127.0.0.1:5557", max_backoff=0.1).start()
        assert len(worker._health_listeners) == len(before) + 1
        stopped = threading.Event()
        with worker._locked():
            threading.Thread(target=stop, args=(reg, stopped), daemon=True).start()
            assert stopped.wait(3.0), "stop() waited for the engine lock"
    assert worker._health_listeners == before


def test_an_engine_that_breaks_while_the_worker_is_idle_turns_not_serving(ref_engine: ReferenceEngine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat reports Engine.broken at once (engine_health) and the scheduler then places
    nothing on the worker, so no step would ever see it: health stayed SERVING for good and nothing
    restarted the worker (the final review of session 32 caught `seer up`'s restart test hanging
    on it). The idle loop looks too."""
    worker = Worker(ref_engine, worker_id="w-idle-break", speculation=False).start()
    heard: list[bool] = []
    try:
        worker.on_engine_health(heard.append)
        assert heard == [True]
        monkeypatch.setattr(ReferenceEngine, "broken", property(lambda self: "device lost"))
        wait_for(lambda: heard[-1] is False, timeout=3)
        assert not worker.engine_healthy and worker.engine_health() == EngineHealth(broken="device lost")
    finally:
        worker.close()
