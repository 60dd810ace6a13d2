"""Dispatcher regressions of the session-14 review, in-process with the scripted buffer and worker
links of test_dispatcher_faults (no gRPC, no model): the real Dispatcher and dispatch loop.

- a chunk held for resync whose request the next snapshot no longer lists is not recorded as the
  end of the response unless the chunk itself ended it (a batch cancelled while the feed was
  reconnecting would otherwise leave a made-up length in the group's lengths and the history);
- a worker that registers again while a weight switch loads its old registration is not dropped
  by that load's failure, and is caught up when the switch ends;
- a worker that keeps lying in its chunk stats needs longer and longer sane periods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from seer.v1 import buffer_pb2, common_pb2, scheduler_pb2, worker_pb2

from services.common.errors import FailedPrecondition, Unavailable

from .test_dispatcher_faults import FakeBuffer, FakeWorkerLink, FakeWorkers, Rig, chunk_events, item, wait_for


class DuplicateBuffer(FakeBuffer):
    """Answers `duplicate` for the listed (request_id, seq): as when the first ack of it was lost."""

    def __init__(self, duplicates: set[tuple[str, int]]) -> None:
        super().__init__()
        self.duplicates = duplicates

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        if (req.request_id, req.seq) in self.duplicates:
            with self.lock:
                self.commits.append(req)
            return buffer_pb2.CommitChunkResponse(accepted=True, duplicate=True, next_seq=req.seq + 1)
        return super().commit(req, timeout)


# ---- item 4: resolving a held chunk whose request is gone ---------------------------------------


@pytest.mark.parametrize("final", [False, True])
def test_a_held_chunk_of_a_request_gone_from_the_snapshot(make_rig: Callable[..., Rig], final: bool) -> None:
    # max_tokens 16, chunk 8: seq 1 ends the response (LENGTH) exactly when `final`.
    t = make_rig(buffer=DuplicateBuffer({("a", 1)}))
    t.register("w0")
    t.run()
    t.d._add_items([item("a", max_tokens=16 if final else 24)])
    wait_for(lambda: t.d._requests["a"].resync is not None)  # seq 1 came back duplicate: held
    assert t.d.core._requests["a"].generated == 8
    # The reconnected feed's snapshot no longer lists it: it finished, or its batch was cancelled
    # while the feed was down (no cancel event for it then).
    t.d._apply_snapshot([])
    assert "a" not in t.d._requests and t.d.stats().in_flight_chunks == 0
    if final:
        # The held chunk ended it: its length is the output before it plus the chunk.
        assert t.d.core.history("k-a") == [16]
    else:
        # A CHUNK does not end a response: the request left the buffer for another reason, with a
        # length we do not know. Nothing is recorded as its final length.
        assert t.d.core.history("k-a") is None
    assert t.d.core.stats()["finished_requests"] == (1 if final else 0)


# ---- item 3: registering during a weight switch --------------------------------------------------


class SwitchWorkers(FakeWorkers):
    """Worker links whose first LoadWeights blocks until `go`; a link closed meanwhile fails it (as a
    closed gRPC channel does). Records every load per link."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = threading.Event()
        self.go = threading.Event()
        self.loads: list[tuple[str, int, int]] = []  # (worker_id, link number, version)
        self.links = 0

    def __call__(self, address: str) -> FakeWorkerLink:
        self.links += 1
        return SwitchLink(self, address.split(":")[0], self.links)


class SwitchLink(FakeWorkerLink):
    def __init__(self, workers: SwitchWorkers, worker_id: str, number: int) -> None:
        super().__init__(workers, worker_id)
        self.sw, self.number, self.closed = workers, number, False

    def load_weights(self, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        if not self.sw.loading.is_set():
            self.sw.loading.set()
            self.sw.go.wait(10)
        if self.closed:
            raise Unavailable("channel closed")
        self.sw.loads.append((self.worker_id, self.number, version))
        return worker_pb2.LoadWeightsResponse()

    def close(self) -> None:
        self.closed = True


def test_a_worker_registering_again_during_a_switch_is_caught_up_not_dropped(make_rig: Callable[..., Rig]) -> None:
    workers = SwitchWorkers()
    t = make_rig(workers=workers)
    t.register("w0", incarnation="inc-1")
    t.register("w1", incarnation="inc-1")
    out: list[tuple[int, float]] = []
    switch = threading.Thread(target=lambda: out.append(t.d.switch_weights(1, "/ckpt/1")))
    switch.start()
    assert workers.loading.wait(5)
    t.register("w0", incarnation="inc-2")  # restarted mid-switch: its old link's load fails
    t.register("w2", incarnation="inc-1")  # a new worker mid-switch, on version 0
    assert {w.worker_id for w in t.d.stats().workers if w.healthy} <= {"w1"}  # not placed on v0
    workers.go.set()
    switch.join(10)
    assert out and out[0][0] == 1  # w1 loaded; w0's old registration did not
    # The new registrations are caught up to version 1 and then serve.
    wait_for(lambda: {w.worker_id for w in t.d.stats().workers if w.healthy} == {"w0", "w1", "w2"})
    assert {(wid, v) for wid, _n, v in workers.loads} == {("w0", 1), ("w1", 1), ("w2", 1)}
    assert all(t.d._workers[w].policy_version == 1 for w in ("w0", "w1", "w2"))
    t.run()
    t.d._add_items([item(f"r{i}") for i in range(6)])
    wait_for(lambda: not t.d._requests)


# ---- item 2: a worker that lies only in its chunk stats ------------------------------------------


def test_a_chunk_stats_liar_is_quarantined_longer_each_time(make_rig: Callable[..., Rig]) -> None:
    """Its telemetry is sane, only its chunk stats lie: each lie (one chunk attempt lost) used to buy
    it 3 heartbeats of quarantine, forever. Now each repeat doubles the sane period."""
    t = make_rig()
    t.register("liar")
    t.workers.script = lambda wid, req: chunk_events(
        req, stats=common_pb2.ChunkStats(steps=100, draft_tokens=1, accepted_tokens=5)
    )
    t.run()
    t.d._add_items([item("a")])
    sane = scheduler_pb2.WorkerTelemetry(free_kv_pages=4000)
    needed = []
    for _ in range(3):
        wait_for(lambda: t.d.core.is_quarantined("liar") and t.d.stats().in_flight_chunks == 0)
        n = 0
        while t.d.core.is_quarantined("liar"):
            assert t.d.heartbeat("liar", sane)
            n += 1
        needed.append(n)
    assert needed == [3, 6, 12]
    assert t.buffer.of("a") == []  # no lying chunk was committed


# ---- session 15: a catch-up load still running when a switch starts -----------------------------


class OneLoadWorkers(FakeWorkers):
    """Links that behave as the real worker does for LoadWeights: one load at a time per worker
    (a second is refused with FAILED_PRECONDITION, field version). A load of `slow_version` blocks
    until `go`."""

    def __init__(self, slow_version: int) -> None:
        super().__init__()
        self.slow_version = slow_version
        self.slow_started = threading.Event()
        self.go = threading.Event()
        self.busy: set[str] = set()
        self.loads: list[tuple[str, int]] = []
        self.refused: list[tuple[str, int]] = []
        self.guard = threading.Lock()

    def __call__(self, address: str) -> FakeWorkerLink:
        return OneLoadLink(self, address.split(":")[0])


class OneLoadLink(FakeWorkerLink):
    def __init__(self, workers: OneLoadWorkers, worker_id: str) -> None:
        super().__init__(workers, worker_id)
        self.ow = workers

    def load_weights(self, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        with self.ow.guard:
            if self.worker_id in self.ow.busy:
                self.ow.refused.append((self.worker_id, version))
                raise FailedPrecondition("another LoadWeights is in progress", field="version")
            self.ow.busy.add(self.worker_id)
        try:
            if version == self.ow.slow_version and self.worker_id == "late":
                self.ow.slow_started.set()
                self.ow.go.wait(10)
            self.ow.loads.append((self.worker_id, version))
            return worker_pb2.LoadWeightsResponse()
        finally:
            with self.ow.guard:
                self.ow.busy.discard(self.worker_id)


def _catching_up(t: Rig, workers: OneLoadWorkers, version_in_force: bool = True) -> Any:
    """w0 at version 1 (when version_in_force), then `late` registering at 0: its catch-up load of
    version 1 is blocked until workers.go."""
    if version_in_force:
        t.register("w0")
        assert t.d.switch_weights(1, "/ckpt/1")[0] == 1
    else:
        with t.d._cond:
            t.d._version, t.d._source = 1, "/ckpt/1"
    t.register("late")
    assert workers.slow_started.wait(5)
    late = t.d._workers["late"]
    assert late.catching_up
    return late


def test_a_switch_waits_for_a_running_catch_up_then_loads_the_worker(make_rig: Callable[..., Rig]) -> None:
    """A switch starting while a worker's catch-up load runs used to load it too: the worker refused
    the second load (one at a time) and the switch dropped it. Now the switch drains catch-ups as
    it drains chunks, then loads that worker with the others."""
    workers = OneLoadWorkers(slow_version=1)
    t = make_rig(workers=workers)
    late = _catching_up(t, workers)
    out: list[tuple[int, float]] = []
    switch = threading.Thread(target=lambda: out.append(t.d.switch_weights(2, "/ckpt/2")))
    switch.start()
    wait_for(lambda: t.d._paused)
    time.sleep(0.2)
    assert not out and ("w0", 2) not in workers.loads  # waiting for the catch-up
    workers.go.set()
    switch.join(10)
    assert out and out[0][0] == 2  # both loaded it
    assert workers.refused == [] and t.d._workers["late"] is late and late.active
    assert [v for wid, v in workers.loads if wid == "late"] == [1, 2]
    assert late.policy_version == 2 and not late.await_switch and not late.catching_up


def test_a_catch_up_that_outlasts_the_drain_is_left_to_itself(make_rig: Callable[..., Rig]) -> None:
    workers = OneLoadWorkers(slow_version=1)
    t = make_rig(workers=workers, drain_timeout=0.3)
    late = _catching_up(t, workers)
    assert t.d.switch_weights(2, "/ckpt/2")[0] == 1  # w0; the worker still loading was not asked
    assert late.await_switch
    workers.go.set()
    # Its catch-up goes on to the switch's version itself, never racing a second catch-up.
    wait_for(lambda: late.active)
    assert workers.refused == [] and t.d._workers["late"] is late
    assert [v for wid, v in workers.loads if wid == "late"] == [1, 2] and late.policy_version == 2


def test_a_switch_with_every_worker_catching_up_is_refused(make_rig: Callable[..., Rig]) -> None:
    """No worker could be asked, so nothing checked the source: the version stays as it was (it used
    to become the suite's version, and each catch-up then loaded an unchecked source)."""
    workers = OneLoadWorkers(slow_version=1)
    t = make_rig(workers=workers, drain_timeout=0.3)
    late = _catching_up(t, workers, version_in_force=False)
    with pytest.raises(FailedPrecondition) as e:
        t.d.switch_weights(2, "/bad")
    assert e.value.field == "version" and "catch up" in str(e.value)
    assert t.d._version == 1 and t.d._source == "/ckpt/1"
    workers.go.set()
    wait_for(lambda: late.active)
    assert late.policy_version == 1 and workers.loads == [("late", 1)]


def test_a_second_catch_up_of_the_same_registration_does_not_load(make_rig: Callable[..., Rig]) -> None:
    """catching_up is held for the whole catch-up, so a second one started meanwhile (e.g. by a
    switch ending between two of the first one's loads) leaves the worker to the first."""
    workers = OneLoadWorkers(slow_version=1)
    t = make_rig(workers=workers)
    late = _catching_up(t, workers)
    t.d._start_catch_up(late)
    time.sleep(0.2)
    workers.go.set()
    wait_for(lambda: late.active)
    assert workers.refused == [] and t.d._workers["late"] is late
    assert [v for wid, v in workers.loads if wid == "late"] == [1]
