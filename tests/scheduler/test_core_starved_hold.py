"""A starved request that does not fit the free KV holds the pages it needs (pure core, no gRPC).

Anti-starvation served a starved request first only when it fit at once: otherwise the priority
order went on, and newer, smaller requests took every page a finishing chunk freed, so the starved
one never fit while they kept coming. Now a worker's pages are held for it: the others are admitted
there only from what exceeds its need (and leave it a batch slot), until it is dispatched.
"""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec

from .conftest import FakeClock

PAGE = 16
SMALL_PROMPT, CHUNK = 32, 64  # a small request: one chunk of 6 pages, then it is finished
BIG_PROMPT = 400  # its first chunk needs 29 pages


def _small(core: SchedulerCore, n: int) -> None:
    core.add_request(RequestInfo(f"s{n}", f"gs{n}", f"ks{n}", 0, 1, SMALL_PROMPT, CHUNK))


def _core(clock: FakeClock, policy: str, workers: int = 1, **cfg: object) -> SchedulerCore:
    core = SchedulerCore(SchedulerPolicyConfig(policy=policy, chunk_size=CHUNK, **cfg), clock=clock)  # type: ignore[arg-type]
    for k in range(workers):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=40, page_size=PAGE, max_batch_size=64))
    return core


def _stream_of_small_requests(core: SchedulerCore, clock: FakeClock, rounds: int,
                              running: list[tuple[str, str]] | None = None) -> int | None:
    """Keeps the worker full of small one-chunk requests, one finishing and one arriving a second;
    the round in which the big request was dispatched (None: never). `running`: the small chunks
    in flight (filled in)."""
    seq = itertools.count()
    running = [] if running is None else running
    for _ in range(6):
        _small(core, next(seq))
    running += [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, BIG_PROMPT, 1000))
    for rnd in range(rounds):
        clock.t += 1.0
        rid, wid = running.pop(0)
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
        _small(core, next(seq))
        for d in core.next_dispatches():
            if d.request_id != "big":
                running.append((d.request_id, d.worker_id))
        if core._requests["big"].state == "in_flight":
            return rnd
    return None


@pytest.mark.parametrize("policy", ["divided", "seer"])
def test_a_starved_request_gets_the_pages_it_needs(clock: FakeClock, policy: str) -> None:
    core = _core(clock, policy, starvation_seconds=5.0)
    rnd = _stream_of_small_requests(core, clock, rounds=60)
    # It starves after 5 s; then 4 more chunks must end before 29 pages are free (6 each, 4 free).
    assert rnd is not None, "the starved request never got its pages"
    assert rnd <= 5 + 6
    assert core.stats()["starvation_dispatches"] >= 1
    assert core.stats()["starvation_holds"] == 1


def test_the_hold_goes_with_the_dispatch_and_the_others_run_again(clock: FakeClock) -> None:
    core = _core(clock, "divided", starvation_seconds=5.0)
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
    core = _core(clock, "divided", workers=2, starvation_seconds=5.0)
    # Fill both workers (6 + 6 small ones), then the big one starves.
    for n in range(12):
        _small(core, n)
    running = [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    assert len(running) == 12
    core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, BIG_PROMPT, 1000))
    clock.t += 10.0
    assert core.next_dispatches() == []  # starved, fits nowhere: a hold is taken
    held = [w for w in core._workers.values() if w.held_for == "big"]
    assert len(held) == 1
    other = next(w for w in core._workers.values() if w.held_for is None)
    # A small chunk ends on each worker: the held one keeps its pages, the other takes a newcomer.
    for wid in (held[0].worker_id, other.worker_id):
        rid = next(r for r, w in running if w == wid)
        running.remove((rid, wid))
        core.on_chunk_done(rid, wid, CHUNK, finished=True)
    _small(core, 100)
    _small(core, 101)
    got = core.next_dispatches()
    assert [(d.request_id, d.worker_id) for d in got] == [("s100", other.worker_id)]


def test_a_hold_on_a_removed_worker_is_released(clock: FakeClock) -> None:
    core = _core(clock, "divided", workers=2, starvation_seconds=5.0)
    for n in range(12):
        _small(core, n)
    core.next_dispatches()
    core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, BIG_PROMPT, 1000))
    clock.t += 10.0
    core.next_dispatches()
    held = next(w for w in core._workers.values() if w.held_for == "big")
    core.remove_worker(held.worker_id)
    # Released with its worker (not left for a later check to find) ...
    assert core._hold is None and held.held_for is None and held.held_pages == 0
    # ... and taken again on the remaining worker, where the request still fits, at the next decision.
    core.next_dispatches()
    (other,) = core._workers.values()
    assert other.held_for == "big" or core._requests["big"].state != "pending"
    core.cancel_request("big")
    core.next_dispatches()
    assert all(w.held_for is None and w.held_pages == 0 for w in core._workers.values())
