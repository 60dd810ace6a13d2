"""A worker whose chunks keep failing by its own fault (a broken engine: a CUDA fault, a hung
device) is quarantined, so it cannot eat the requests' attempts.

Why this matters: such a worker fails every chunk at once, so it always looks free, and
least-loaded placement sends it most chunks. Before the fix, next to one healthy worker, 37 of 40
requests of a batch ran out of their 8 attempts (ABORTED) within a second, 441 of 499 dispatches
going to the broken worker.

Core level (pure, fake clock): the streak counts different requests, a completed chunk clears it,
the last trusted worker is never quarantined, a released worker is on probation (one chunk at a
time, quarantined again at its next failure) until a chunk completes. Dispatcher level
(the real Dispatcher and dispatch loop with scripted links, no gRPC): which errors count, and the
whole batch completing beside a broken worker. Also the dispatch pool: every chunk counted in
flight is running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from seer.v1 import common_pb2, worker_pb2

from services.common.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SeerError,
    Unavailable,
)
from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec
from services.scheduler.links import Cancelled
from services.scheduler.service import MAX_CHUNK_ATTEMPTS, _worker_fault

from .conftest import FakeClock
from .test_dispatcher_faults import ABORTED, FakeWorkerLink, FakeWorkers, Rig, chunk_events, item, rig, wait_for

__all__ = ["rig"]  # the fixture, imported for the tests below

CUDA_FAULT = "INTERNAL: RuntimeError: CUDA error: an illegal memory access was encountered"


def _req(rid: str, max_tokens: int = 64) -> RequestInfo:
    return RequestInfo(rid, f"g-{rid}", f"k-{rid}", 0, 1, 8, max_tokens)


def _core(clock: FakeClock, **cfg: object) -> SchedulerCore:
    """Workers "other" (one slot, kept busy by a request that never ends: it stays trusted and
    takes nothing else) and "w1", where every later dispatch goes."""
    core = SchedulerCore(SchedulerPolicyConfig(policy="divided", chunk_size=8, **cfg), clock=clock)  # type: ignore[arg-type]
    core.add_worker(WorkerSpec("other", total_pages=10_000, page_size=16, max_batch_size=1))
    core.add_request(_req("busy"))
    assert [d.worker_id for d in core.next_dispatches()] == ["other"]
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=64))
    return core


def _place(core: SchedulerCore, *rids: str) -> None:
    for rid in rids:
        core.add_request(_req(rid))
    assert {(d.request_id, d.worker_id) for d in core.next_dispatches()} == {(rid, "w1") for rid in rids}


def _fail(core: SchedulerCore, rid: str) -> bool:
    """The chunk of `rid` on w1 fails by the worker's fault, as the driver reports it; the request
    is then cancelled so that it is not placed again. Whether w1 was quarantined now."""
    quarantined = core.on_worker_fault("w1", rid, CUDA_FAULT)
    core.on_chunk_failed(rid, "w1")
    core.cancel_request(rid)
    return quarantined


# ---- core ---------------------------------------------------------------------------------------


def test_chunks_of_different_requests_failing_in_a_row_quarantine_the_worker(clock: FakeClock) -> None:
    core = _core(clock, worker_failure_limit=3)
    _place(core, "a", "b", "c")
    assert core.on_worker_fault("w1", "a", CUDA_FAULT) is False
    assert core.on_worker_fault("w1", "a", CUDA_FAULT) is False  # the same request again: still one
    assert core.on_worker_fault("w1", "b", CUDA_FAULT) is False
    assert not core.is_quarantined("w1")
    assert core.on_worker_fault("w1", "c", CUDA_FAULT) is True
    assert core.is_quarantined("w1")
    assert "chunks of 3 groups failed in a row" in core.quarantine_reason("w1")
    assert CUDA_FAULT in core.quarantine_reason("w1")
    assert core.stats()["worker_fault_quarantines"] == 1
    # Nothing is placed there any more.
    for rid in ("a", "b", "c"):
        core.on_chunk_failed(rid, "w1")
    assert core.next_dispatches() == []  # "other" is full and w1 quarantined


def test_one_group_failing_is_not_a_broken_worker(clock: FakeClock) -> None:
    """Siblings share one prompt: a prompt the engine cannot run fails every one of them, on any
    worker. The streak counts groups, so one such group quarantines nobody (it quarantined 2 of 3
    healthy workers when it counted requests; found by review)."""
    core = _core(clock, worker_failure_limit=3)
    _place(core, "a", "b", "c", "d")
    for rid in ("a", "b", "c", "d"):
        assert core.on_worker_fault("w1", rid, CUDA_FAULT, group_id="poisoned") is False
    assert not core.is_quarantined("w1")
    # ... and the core's own record of the request's group is used when the driver gives none.
    for rid in ("a", "b", "c", "d"):
        core.on_chunk_failed(rid, "w1")
        core.cancel_request(rid)
    for rid in ("e", "f", "g"):
        core.add_request(RequestInfo(rid, "poisoned-2", "k", 0, 3, 8, 64))
    assert len(core.next_dispatches()) == 3
    for rid in ("e", "f", "g"):
        assert core.on_worker_fault("w1", rid, CUDA_FAULT) is False
    assert not core.is_quarantined("w1")


def test_probation_survives_a_re_registration(clock: FakeClock) -> None:
    """The quarantine is kept by worker id across removal and re-registration, and so are the
    probation and the streak: released, a re-registered worker still runs one chunk at a time."""
    core = _core(clock, worker_failure_limit=2, quarantine_clear_reports=1)
    _place(core, "a", "b")
    _fail(core, "a")
    assert _fail(core, "b") is True
    core.remove_worker("w1")
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=64))
    core.quarantine_worker("w1", "carried over", offence=False)  # as the service carries it
    core.update_worker("w1", free_pages=10, running=0, waiting=0)
    assert not core.is_quarantined("w1")
    core.add_request(_req("c"))
    core.add_request(_req("d"))
    assert [(d.request_id, d.worker_id) for d in core.next_dispatches()] == [("c", "w1")]
    assert _fail(core, "c") is True  # the streak was kept too


def test_a_completed_chunk_clears_the_streak(clock: FakeClock) -> None:
    core = _core(clock, worker_failure_limit=3)
    _place(core, "a", "b", "ok")
    _fail(core, "a")
    _fail(core, "b")
    core.on_chunk_done("ok", "w1", 8, False)  # the worker works: the failures were not all of it
    core.cancel_request("ok")
    _place(core, "c", "d")
    _fail(core, "c")
    _fail(core, "d")
    assert not core.is_quarantined("w1")


def test_the_last_trusted_worker_is_never_quarantined_for_failures(clock: FakeClock) -> None:
    core = _core(clock, worker_failure_limit=2)
    _place(core, "a", "b")
    core.quarantine_worker("other", "impossible telemetry")
    _fail(core, "a")
    assert _fail(core, "b") is False
    assert not core.is_quarantined("w1")  # the requests run out of attempts instead of waiting for ever


def test_a_released_worker_is_on_probation_until_a_chunk_completes(clock: FakeClock) -> None:
    core = _core(clock, worker_failure_limit=2, quarantine_clear_reports=2)
    _place(core, "a", "b")
    _fail(core, "a")
    _fail(core, "b")
    assert core.is_quarantined("w1")
    for _ in range(2):  # sane heartbeats release it
        core.update_worker("w1", free_pages=10, running=0, waiting=0)
    assert not core.is_quarantined("w1")
    # On probation it runs one chunk at a time (half-open), and one more failure of any request
    # quarantines it again, for longer (a repeat offence).
    core.add_request(_req("c"))
    core.add_request(_req("c2"))
    assert [(d.request_id, d.worker_id) for d in core.next_dispatches()] == [("c", "w1")]
    assert _fail(core, "c") is True
    core.cancel_request("c2")
    for _ in range(3):
        core.update_worker("w1", free_pages=10, running=0, waiting=0)
    assert core.is_quarantined("w1")  # 4 sane reports needed now
    core.update_worker("w1", free_pages=10, running=0, waiting=0)
    assert not core.is_quarantined("w1")
    _place(core, "ok")
    core.on_chunk_done("ok", "w1", 8, False)  # it works again: the probation ends
    core.cancel_request("ok")
    _place(core, "d", "e")  # its whole batch again
    assert _fail(core, "d") is False
    assert not core.is_quarantined("w1")


def test_the_baseline_honours_probation_too(clock: FakeClock) -> None:
    """The baseline has no batch limit (the engine queues), but a released worker on probation
    takes one request at a time there too; the rest of its groups move to a worker that is not
    on probation, and it takes its whole share again once a request completes there."""
    core = SchedulerCore(
        SchedulerPolicyConfig(policy="baseline", worker_failure_limit=2, quarantine_clear_reports=1), clock=clock
    )
    for wid in ("w0", "w1"):
        core.add_worker(WorkerSpec(wid, total_pages=10_000, page_size=16, max_batch_size=2))
    for g in range(2):
        for i in range(3):
            core.add_request(RequestInfo(f"g{g}-{i}", f"g{g}", f"k{g}", 0, 3, 8, 64))
    first = core.next_dispatches()
    assert len(first) == 6  # no batch limit: both groups whole, one per worker
    on_w1 = [d.request_id for d in first if d.worker_id == "w1"]
    for rid in on_w1[:2]:
        core.on_worker_fault("w1", rid, CUDA_FAULT, group_id=f"x-{rid}")
    for d in first:
        if d.worker_id == "w1":
            core.on_chunk_failed(d.request_id, "w1")
    assert core.is_quarantined("w1")
    core.update_worker("w1", free_pages=10_000, running=0, waiting=0)
    assert not core.is_quarantined("w1")
    for g in range(2, 4):
        for i in range(3):
            core.add_request(RequestInfo(f"g{g}-{i}", f"g{g}", f"k{g}", 0, 3, 8, 64))
    again = core.next_dispatches()
    assert len(again) == 9  # the 3 re-queued and 6 new ones
    assert sum(d.worker_id == "w1" for d in again) == 1
    probe = next(d.request_id for d in again if d.worker_id == "w1")
    core.on_chunk_done(probe, "w1", 64, True)  # it works again: the probation ends
    for g in range(4, 6):
        for i in range(3):
            core.add_request(RequestInfo(f"g{g}-{i}", f"g{g}", f"k{g}", 0, 3, 8, 64))
    assert sum(d.worker_id == "w1" for d in core.next_dispatches()) >= 3


def test_worker_failure_limit_zero_turns_it_off(clock: FakeClock) -> None:
    core = _core(clock, worker_failure_limit=0)
    _place(core, "a", "b", "c", "d")
    for rid in ("a", "b", "c", "d"):
        core.on_worker_fault("w1", rid, CUDA_FAULT)
    assert not core.is_quarantined("w1")
    with pytest.raises(InvalidArgument) as e:
        _core(clock, worker_failure_limit=-1)
    assert e.value.field == "worker_failure_limit"


# ---- which chunk errors are the worker's --------------------------------------------------------


@pytest.mark.parametrize(("error", "worker_fault"), [
    (SeerError(CUDA_FAULT), True),  # INTERNAL / UNKNOWN
    (DataLoss("DATA_LOSS: x"), True),
    (ResourceExhausted("RESOURCE_EXHAUSTED: out of memory"), True),
    (InvalidArgument("INVALID_ARGUMENT: prompt_token_ids: out of vocabulary"), False),
    (NotFound("NOT_FOUND: x"), False),
    (AlreadyExists("ALREADY_EXISTS: request_id: running"), False),
    (FailedPrecondition("FAILED_PRECONDITION: policy_version: behind"), False),
    (Aborted("ABORTED: x"), False),  # judged apart: the worker's fault only when unasked
    (Cancelled("CANCELLED: x"), False),
    (Unavailable("UNAVAILABLE: x"), False),  # handled apart: the worker is removed
])
def test_only_the_workers_own_errors_count(error: SeerError, worker_fault: bool) -> None:
    assert _worker_fault(error) is worker_fault


# ---- the dispatcher: a batch beside a broken worker ---------------------------------------------


class BrokenWorkers(FakeWorkers):
    """Worker links whose chunks fail with `error(request)` on the workers in `broken`."""

    def __init__(self, broken: set[str], error: Callable[[worker_pb2.RunChunkRequest], SeerError | None]) -> None:
        super().__init__()
        self.broken, self.error = broken, error

    def __call__(self, address: str) -> FakeWorkerLink:
        return BrokenLink(self, address.split(":")[0])


class BrokenLink(FakeWorkerLink):
    def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Iterator[worker_pb2.RunChunkResponse]:
        workers = self.workers
        assert isinstance(workers, BrokenWorkers)
        workers.requests.append((self.worker_id, req))
        error = workers.error(req) if self.worker_id in workers.broken else None
        events = chunk_events(req)

        def stream() -> Iterator[worker_pb2.RunChunkResponse]:
            if error is not None:
                raise error  # at once, as a broken engine does
            yield from events

        return stream()


def _rig(rig: Callable[..., Rig], broken: set[str], error: Callable[[worker_pb2.RunChunkRequest], SeerError | None],
         workers: tuple[str, ...] = ("good", "bad"), **cfg: object) -> tuple[Rig, BrokenWorkers]:
    t = rig(**cfg)
    links = BrokenWorkers(broken, error)
    t.workers = t.d._worker_link_factory = links  # type: ignore[assignment]
    for wid in workers:
        t.register(wid)
    t.run()
    return t, links


def _settled(t: Rig) -> bool:
    """Every request done or given up on, and the ABORTED commits of the latter sent (they run on
    the dispatcher's abort pool, after the request left `_requests`)."""
    return not t.d._requests and not t.d._aborting


def _aborted(t: Rig, rids: list[str]) -> list[str]:
    return [rid for rid in rids if any(c.finish_reason == ABORTED for c in t.buffer.of(rid))]


def test_a_batch_completes_beside_a_worker_whose_every_chunk_fails(rig: Callable[..., Rig]) -> None:
    t, links = _rig(rig, {"bad"}, lambda req: SeerError(CUDA_FAULT))
    rids = [f"r{i}" for i in range(40)]
    t.d._add_items([item(rid, max_tokens=32) for rid in rids])
    wait_for(lambda: _settled(t), timeout=30)
    assert _aborted(t, rids) == []
    assert all(sum(len(c.token_ids) for c in t.buffer.of(rid)) == 32 for rid in rids)
    assert t.d.core.is_quarantined("bad") and not t.d.core.is_quarantined("good")
    assert CUDA_FAULT in t.d.core.quarantine_reason("bad")
    on_bad = sum(wid == "bad" for wid, _ in links.requests)
    # The 3 failures of the limit, plus the chunks already placed there while they came back (at
    # most its batch of 8).
    assert on_bad <= 3 + 8, on_bad


def test_one_request_that_fails_everywhere_quarantines_no_worker(rig: Callable[..., Rig]) -> None:
    t, links = _rig(rig, {"good", "bad"}, lambda req: SeerError(CUDA_FAULT) if req.request_id == "poison" else None)
    rids = ["poison"] + [f"r{i}" for i in range(10)]
    t.d._add_items([item(rid, max_tokens=32) for rid in rids])
    wait_for(lambda: _settled(t), timeout=30)
    assert _aborted(t, rids) == ["poison"]
    assert sum(req.request_id == "poison" for _, req in links.requests) == MAX_CHUNK_ATTEMPTS
    assert not t.d.core.is_quarantined("good") and not t.d.core.is_quarantined("bad")


def test_request_errors_quarantine_no_worker(rig: Callable[..., Rig]) -> None:
    # Every chunk on "bad" is refused as the request's fault: not counted against the worker.
    t, _ = _rig(rig, {"bad"}, lambda req: InvalidArgument("INVALID_ARGUMENT: prompt_token_ids: out of vocabulary"))
    t.d._add_items([item(f"r{i}", max_tokens=32) for i in range(6)])
    wait_for(lambda: _settled(t), timeout=30)
    assert not t.d.core.is_quarantined("bad")


def test_a_sole_broken_worker_is_not_quarantined_and_the_requests_fail(rig: Callable[..., Rig]) -> None:
    t, links = _rig(rig, {"bad"}, lambda req: SeerError(CUDA_FAULT), workers=("bad",))
    rids = ["a", "b"]
    t.d._add_items([item(rid, max_tokens=32) for rid in rids])
    wait_for(lambda: _settled(t), timeout=30)
    assert _aborted(t, rids) == rids  # ABORTED after their attempts, as before: the trainer sees it
    assert len(links.requests) == 2 * MAX_CHUNK_ATTEMPTS
    assert not t.d.core.is_quarantined("bad")


# ---- the dispatch pool ---------------------------------------------------------------------------


class GatedWorkers(FakeWorkers):
    """Worker links whose chunk streams block on `gate`, counting how many are open at once."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.clear()
        self.lock = threading.Lock()
        self.open = 0

    def __call__(self, address: str) -> FakeWorkerLink:
        return GatedLink(self, address.split(":")[0])


class GatedLink(FakeWorkerLink):
    def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Iterator[worker_pb2.RunChunkResponse]:
        workers = self.workers
        assert isinstance(workers, GatedWorkers)
        events = workers.script(self.worker_id, req)

        def stream() -> Iterator[worker_pb2.RunChunkResponse]:
            with workers.lock:
                workers.open += 1
            try:
                workers.gate.wait(10)
                yield from events
            finally:
                with workers.lock:
                    workers.open -= 1

        return stream()


@pytest.mark.parametrize("threads", [0, 3])
def test_chunks_counted_in_flight_are_running(rig: Callable[..., Rig], threads: int) -> None:
    """Each running chunk holds a dispatch thread. The pool was a fixed 64 threads for the whole
    cluster (8 GPU workers x 256 slots ran 64 chunks), and chunks queued behind it counted as in
    flight. Now dispatch_threads 0 runs as many as the workers' slots (2 x 8 here), and a cap
    dispatches no more than it can run."""
    t = rig(dispatch_threads=threads)
    links = GatedWorkers()
    t.workers = t.d._worker_link_factory = links  # type: ignore[assignment]
    t.register("w0")
    t.register("w1")
    t.run()
    t.d._add_items([item(f"r{i}", max_tokens=8) for i in range(40)])
    want = threads or 16
    wait_for(lambda: links.open == want)
    time.sleep(0.2)  # nothing more starts, and nothing more is counted
    assert links.open == want and t.d.stats().in_flight_chunks == want
    links.gate.set()
    wait_for(lambda: _settled(t), timeout=30)
    assert all(sum(len(c.token_ids) for c in t.buffer.of(f"r{i}")) == 8 for i in range(40))



def test_a_capped_pool_runs_only_chunks(rig: Callable[..., Rig]) -> None:
    """A request given up on sends its ABORTED commit (retried up to commit_timeout) after its
    dispatch stopped counting in flight. On the chunk pool it held a thread, so with a cap the next
    chunk counted in flight sat queued (found by review). Abort commits have their own pool."""
    t = rig(dispatch_threads=1, commit_timeout=5.0)
    links = GatedWorkers()
    t.workers = t.d._worker_link_factory = links  # type: ignore[assignment]
    refused = {"bad"}
    links.script = lambda wid, req: (
        [worker_pb2.RunChunkResponse(tokens=worker_pb2.TokenDelta(token_ids=[7], logprobs=[-0.5, -0.5])),
         worker_pb2.RunChunkResponse(done=worker_pb2.ChunkDone(finish_reason=common_pb2.FINISH_REASON_CHUNK))]
        if req.request_id in refused else chunk_events(req))
    t.buffer.aborts_unavailable = True  # the abort commit of "bad" keeps retrying
    links.gate.set()
    t.register("w0")
    t.run()
    t.d._add_items([item("bad", max_tokens=8)])
    wait_for(lambda: "bad" in t.d._aborting)  # 8 malformed attempts, then its abort commit retries
    t.d._add_items([item("good", max_tokens=8)])
    wait_for(lambda: sum(len(c.token_ids) for c in t.buffer.of("good")) == 8, timeout=4)



def test_a_chunk_dispatched_before_the_quarantine_does_not_end_the_probation(clock: FakeClock) -> None:
    """A chunk that was running when the engine broke can still complete (its tokens came before
    the fault, an engine in another process delivers them late): that says nothing about the
    worker now. Before the fix it ended the probation and cleared the streak, so the released
    worker took a whole batch again and needed `worker_failure_limit` more failures."""
    core = _core(clock, worker_failure_limit=2, quarantine_clear_reports=1)
    _place(core, "old", "a", "b")
    _fail(core, "a")
    assert _fail(core, "b") is True
    core.on_chunk_done("old", "w1", 8, False)  # dispatched before the quarantine
    core.cancel_request("old")
    core.update_worker("w1", free_pages=10, running=0, waiting=0)
    assert not core.is_quarantined("w1")
    core.add_request(_req("c"))
    core.add_request(_req("c2"))
    assert [(d.request_id, d.worker_id) for d in core.next_dispatches()] == [("c", "w1")]  # still on probation
    assert _fail(core, "c") is True  # and the streak was kept
