"""A starved request that does not fit the free KV holds the pages it needs (pure core, no gRPC).

Anti-starvation served a starved request first only when it fit at once: otherwise the priority
order went on, and newer, smaller requests took every page a finishing chunk freed, so the starved
one never fit while they kept coming. Now a worker's pages are held for it: the others are admitted
there only from what exceeds its need (and leave it a batch slot), until it is dispatched.
"""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.core import SchedulerCore, WorkerSpec

from .conftest import HOLD_CHUNK as CHUNK
from .conftest import HOLD_PAGE, FakeClock, add_big, add_small, held, hold_core, starve_big


def _stream_of_small_requests(core: SchedulerCore, clock: FakeClock, rounds: int,
                              running: list[tuple[str, str]] | None = None) -> int | None:
    """Keeps the worker full of small one-chunk requests, one finishing and one arriving a second;
    the round in which the big request was dispatched (None: never). `running`: the small chunks
    in flight (filled in)."""
    seq = itertools.count()
    running = [] if running is None else running
    for _ in range(6):
        add_small(core, next(seq))
    running += [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    add_big(core)
    for rnd in range(rounds):
        clock.t += 1.0
        rid, wid = running.pop(0)
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
        add_small(core, next(seq))
        for d in core.next_dispatches():
            if d.request_id != "big":
                running.append((d.request_id, d.worker_id))
        if core._requests["big"].state == "in_flight":
            return rnd
    return None


@pytest.mark.parametrize("policy", ["divided", "seer"])
def test_a_starved_request_gets_the_pages_it_needs(clock: FakeClock, policy: str) -> None:
    core = hold_core(clock, policy, starvation_seconds=5.0)
    rnd = _stream_of_small_requests(core, clock, rounds=60)
    # It starves after 5 s; then 4 more chunks must end before 29 pages are free (6 each, 4 free).
    assert rnd is not None, "the starved request never got its pages"
    assert rnd <= 5 + 6
    assert core.stats()["starvation_dispatches"] >= 1
    assert core.stats()["starvation_holds"] == 1


def test_the_hold_goes_with_the_dispatch_and_the_others_run_again(clock: FakeClock) -> None:
    core = hold_core(clock, "divided", starvation_seconds=5.0)
    running: list[tuple[str, str]] = []
    assert _stream_of_small_requests(core, clock, rounds=60, running=running) is not None
    assert all(w.held_for is None and w.held_pages == 0 for w in core._workers.values())
    for rid, wid in running:  # the small chunks still running end: nothing is held back any more
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
    assert core.pending_count() > 1  # small ones queued behind the big one
    # 40 pages - 29 of the big chunk: one small chunk of 6 fits again (the held 29 left 0 room).
    got = core.next_dispatches()
    assert len(got) == 1 and got[0].request_id != "big"


def test_the_other_workers_are_not_held(clock: FakeClock) -> None:
    """Only one worker holds pages: a second takes the small requests meanwhile."""
    core = hold_core(clock, "divided", workers=2, starvation_seconds=5.0)
    running = starve_big(core, clock)  # both workers full (6 + 6 small ones), the big one starves
    held_on = list(held(core))
    assert len(held_on) == 1
    other = next(w for w in core._workers.values() if w.held_for is None)
    # A small chunk ends on each worker: the held one keeps its pages, the other takes a newcomer.
    for wid in (held_on[0], other.worker_id):
        rid = next(r for r, w in running if w == wid)
        running.remove((rid, wid))
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
    add_small(core, 100)
    add_small(core, 101)
    got = core.next_dispatches()
    assert [(d.request_id, d.worker_id) for d in got] == [("s100", other.worker_id)]


def test_a_hold_on_a_removed_worker_is_released(clock: FakeClock) -> None:
    core = hold_core(clock, "divided", workers=2, starvation_seconds=5.0)
    starve_big(core, clock)
    holder = next(w for w in core._workers.values() if w.held_for == "big")
    core.remove_worker(holder.worker_id)
    # Released with its worker (not left for a later check to find) ...
    assert core._hold is None and holder.held_for is None and holder.held_pages == 0
    # ... and taken again on the remaining worker, where the request still fits, at the next decision.
    core.next_dispatches()
    (other,) = core._workers.values()
    assert other.held_for == "big" or core._requests["big"].state != "pending"
    core.cancel_request("big")
    core.next_dispatches()
    assert all(w.held_for is None and w.held_pages == 0 for w in core._workers.values())


# ---- a worker on probation never holds ------------------------------------------------------------


def _fail_chunks(core: SchedulerCore, worker_id: str, request_ids: list[str]) -> None:
    """Chunks of different groups fail on the worker by its own fault (worker_failure_limit of them
    quarantine it and put it on probation)."""
    for rid in request_ids:
        core.on_chunk_failed(rid, worker_id)
        core.on_worker_fault(worker_id, rid, "CUDA error")


def _sane_report(core: SchedulerCore, worker_id: str) -> None:
    """A sane heartbeat (quarantine_clear_reports=1: it releases a quarantined worker)."""
    w = core._workers[worker_id]
    core.update_worker(worker_id, free_pages=w.free_pages(), running=w.load, waiting=0)


def test_a_starved_request_holds_on_a_healthy_worker_not_on_one_on_probation(clock: FakeClock) -> None:
    """w1 failed chunks and was released on probation: one chunk at a time, its trial chunk running
    (it may hang to the chunk deadline). It has the most free pages, so the hold went there and the
    big request waited on the trial while w0's finishing chunks fed the newcomers. Now w0 holds, and
    the big request runs there once 5 of its small chunks end."""
    core = hold_core(clock, "divided", workers=1, starvation_seconds=5.0, worker_failure_limit=2,
                     quarantine_clear_reports=1)
    core.add_worker(WorkerSpec("w1", total_pages=40, page_size=HOLD_PAGE, max_batch_size=64))
    core.quarantine_worker("w0", "impossible telemetry")  # the two failing chunks go to w1
    failing = [add_small(core, n) for n in (900, 901)]
    assert {d.worker_id for d in core.next_dispatches()} == {"w1"}
    _sane_report(core, "w0")
    _fail_chunks(core, "w1", failing)
    assert core.is_quarantined("w1")
    for rid in failing:
        core.cancel_request(rid)
    _sane_report(core, "w1")
    assert not core.is_quarantined("w1")  # released, on probation
    # w1 runs its trial chunk (its one slot), w0 six small chunks (36 of 40 pages): then big starves.
    running = starve_big(core, clock, smalls=7)
    assert sum(w == "w1" for _, w in running) == 1
    first_hold = held(core)
    seq = itertools.count(100)
    ended = 0  # w0's chunks ended
    while ended < 12:  # w0's chunks end one a second, a newcomer arrives each time; w1's trial runs on
        ended += 1
        clock.t += 1.0
        rid, wid = next((r, w) for r, w in running if w == "w0")
        running.remove((rid, wid))
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
        add_small(core, next(seq))
        running += [(d.request_id, d.worker_id) for d in core.next_dispatches() if d.request_id != "big"]
        if core._requests["big"].state == "in_flight":
            break
    assert core._requests["big"].state == "in_flight", "the big request waited on the worker on probation"
    assert core._requests["big"].worker == "w0" and ended == 5  # 4 free + 5 x 6 >= 29 pages
    assert first_hold == {"w0": ("big", 29)}


def test_a_hold_moves_off_a_worker_that_went_on_probation(clock: FakeClock) -> None:
    """The holding worker fails chunks, is quarantined and released (on probation) between two
    decisions: the hold moves to the other worker, which can gather the pages."""
    core = hold_core(clock, "divided", workers=2, starvation_seconds=5.0, worker_failure_limit=2,
                     quarantine_clear_reports=1)
    running = starve_big(core, clock)
    ((holder, _),) = held(core).items()
    other = "w1" if holder == "w0" else "w0"
    _fail_chunks(core, holder, [r for r, w in running if w == holder][:2])
    assert core.is_quarantined(holder)
    released_with_the_quarantine = held(core) == {}
    _sane_report(core, holder)
    assert not core.is_quarantined(holder)
    assert core.next_dispatches() == []
    assert held(core) == {other: ("big", 29)}
    assert released_with_the_quarantine  # at once, not at the next decision
