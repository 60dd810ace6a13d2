"""The scheduler's side of a worker's drain (review of 6a7c69d): a heartbeat from another process
of the same worker id, a draining notice without telemetry, and a chunk a draining worker refuses.
Over the real Dispatcher with scripted worker links (tests/scheduler/test_dispatcher_faults.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from seer.v1 import scheduler_pb2, worker_pb2

from services.common.errors import Unavailable
from services.scheduler.service import WorkerView

from .test_dispatcher_faults import Rig, chunk_events, item, wait_for


def _view(t: Rig, wid: str) -> WorkerView:
    return next(w for w in t.d.stats().workers if w.worker_id == wid)


def test_an_old_process_heartbeat_changes_nothing(make_rig: Callable[..., Rig]) -> None:
    """The old process of a worker id, still draining while its replacement runs, must not mark the
    replacement draining (restart_same_id.py: draining in 16 of 80 samples) or overwrite its report."""
    t = make_rig()
    t.register("w0", incarnation="new")
    assert t.d.heartbeat("w0", scheduler_pb2.WorkerTelemetry(free_kv_pages=4000), incarnation="new")
    old = scheduler_pb2.WorkerTelemetry(free_kv_pages=7)
    assert not t.d.heartbeat("w0", old, draining=True, incarnation="old")
    assert not t.d.core.is_draining("w0")
    view = _view(t, "w0")
    assert not view.draining
    assert view.telemetry.free_kv_pages == 4000
    # A heartbeat that names no incarnation (an older worker build) is still taken.
    assert t.d.heartbeat("w0", scheduler_pb2.WorkerTelemetry(free_kv_pages=3000))


def test_a_notice_without_telemetry_keeps_the_last_report(make_rig: Callable[..., Rig]) -> None:
    """drain_now sends no telemetry; read as zeros it set the worker's free pages to 0
    (drain_now_tel.py)."""
    t = make_rig()
    t.register("w0", incarnation="i")
    assert t.d.heartbeat("w0", scheduler_pb2.WorkerTelemetry(free_kv_pages=4000), incarnation="i")
    assert t.d.heartbeat("w0", None, draining=True, incarnation="i")
    assert t.d.core.is_draining("w0")
    assert _view(t, "w0").telemetry.free_kv_pages == 4000
    assert t.d.core.stats()["workers"]["w0"]["free_pages"] > 0


def test_a_chunk_a_draining_worker_refuses_runs_elsewhere_and_its_others_finish(make_rig: Callable[..., Rig]) -> None:
    """A chunk placed just before the notice arrives is refused UNAVAILABLE by the stopping server.
    Only that chunk runs again; the worker is not dropped, so its other chunks in flight finish
    there (dropping it cut them off, and they ran again elsewhere)."""
    t = make_rig()
    t.register("w0", incarnation="i")

    def script(wid: str, req: worker_pb2.RunChunkRequest) -> Iterator[worker_pb2.RunChunkResponse]:
        if wid == "w0" and req.request_id == "b":
            def refused() -> Iterator[worker_pb2.RunChunkResponse]:
                raise Unavailable("the server is stopping")
                yield  # a generator
            return refused()
        return iter(chunk_events(req))

    t.workers.script = script
    t.workers.gate.clear()
    t.run()
    t.d._add_items([item("a", max_tokens=8), item("b", max_tokens=8)])
    wait_for(lambda: t.d.stats().in_flight_chunks == 2)
    assert t.d.heartbeat("w0", None, draining=True, incarnation="i")
    t.register("w1", incarnation="j")
    t.workers.gate.set()
    wait_for(lambda: not t.d._requests)
    assert [w.worker_id for w in t.d.stats().workers] == ["w0", "w1"]
    ran = [(wid, r.request_id) for wid, r in t.workers.requests]
    assert ran.count(("w0", "a")) == 1 and ("w1", "a") not in ran  # a finished where it ran
    assert ("w1", "b") in ran  # b ran again elsewhere
    assert t.d.stats().redispatched_chunks == 1  # b only (dropping w0 re-queued a too)
