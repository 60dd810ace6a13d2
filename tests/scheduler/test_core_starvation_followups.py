"""Anti-starvation by newer work: a finished later submission stops the clocks it started, the age
queues stay bounded by the requests, and a decision does not grow with the tracked submissions
(pure core, no gRPC)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from services.common.errors import SeerError
from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec
from services.scheduler.core.queues import AgeQueue

from .conftest import SMALL_SUBMISSION, FakeClock, add_big, add_small, held, hold_core, make_core


def _add(core: SchedulerCore, rid: str, true_length: int, submission: int) -> None:
    core.add_request(RequestInfo(rid, f"g-{rid}", f"k-{rid}", 0, 1, 8, 1000, true_length=true_length,
                                 incarnation=submission))


def test_a_finished_later_submission_no_longer_postpones_the_earlier_one(clock: FakeClock) -> None:
    """Submission 1 (one long request, five short ones; oracle: longest first, one slot, 10 s a
    chunk); a one-chunk submission 2 runs at t = 20 and ends. Its run started submission 1's clock;
    once it ended nothing newer postpones submission 1, so its order is the policy's again. The
    clock used to run on for ever: the short ones went first 30 s later, as under the old FIFO rule."""
    core = make_core("oracle", clock, workers=1, batch=1, chunk_size=10)
    left = {"long": 300, **{f"short{i}": 5 for i in range(5)}}
    for rid, n in left.items():
        _add(core, rid, n, 1)
    order = [core.next_dispatches()[0].request_id]
    while True:
        clock.t += 10.0
        if clock.t == 20.0:
            _add(core, "tiny", 900, 2)  # ranked first; ends after one chunk
            left["tiny"] = 10
        rid = order[-1]
        left[rid] -= 10
        core.on_chunk_done(rid, "w0", 10, finished=left[rid] <= 0)
        ds = core.next_dispatches()
        if not ds:
            break
        order.append(ds[0].request_id)
    assert order[:3] == ["long", "long", "tiny"]
    assert order[-5:] == [f"short{i}" for i in range(5)], order
    assert core.stats()["starvation_dispatches"] == 0


def test_the_clock_goes_on_while_a_later_submission_that_ran_is_tracked(clock: FakeClock) -> None:
    """Submission 1 waits behind submissions 2 and 3 (both ran). Submission 2 goes (cancelled), 3
    still runs: the postponement had no break, so submission 1 starves 30 s after submission 2's
    first chunk."""
    core = make_core("oracle", clock, workers=1, batch=1, chunk_size=10)
    _add(core, "old", 5, 1)
    _add(core, "two", 800, 2)
    assert core.next_dispatches()[0].request_id == "two"  # t = 0: old's clock starts
    _add(core, "three", 900, 3)
    clock.t = 10.0
    core.on_chunk_done("two", "w0", 10, finished=False)
    assert core.next_dispatches()[0].request_id == "three"
    clock.t = 20.0
    core.on_chunk_done("three", "w0", 10, finished=False)
    core.cancel_request("two")  # submission 2 goes; 3 has run and is tracked
    assert core.next_dispatches()[0].request_id == "three"  # old waited 20 s: not starved yet
    clock.t = 31.0
    core.on_chunk_done("three", "w0", 10, finished=False)
    assert core.next_dispatches()[0].request_id == "old"  # 31 s since t = 0
    assert core.stats()["starvation_dispatches"] == 1


def test_a_hold_is_released_when_the_later_submission_ends(clock: FakeClock) -> None:
    """The big request (submission 0) starves behind small ones of a later submission and takes a
    hold. When every small one is done nothing newer postpones it: the hold goes at once (it kept
    pages and a slot from the others for a request the policy's order now decides on)."""
    core = hold_core(clock, "seer", workers=1, starvation_seconds=5.0)
    for n in range(6):
        add_small(core, n)
    running = [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    assert len(running) == 6
    add_big(core)
    clock.t = 10.0
    assert core.next_dispatches() == []
    assert held(core) == {"w0": ("big", 29)}
    for rid, wid in running:
        core.on_chunk_done(rid, wid, 64, finished=True)
    assert SMALL_SUBMISSION not in core._starvation._subs
    assert held(core) == {}
    assert [d.request_id for d in core.next_dispatches()] == ["big"]
    assert core.stats()["starvation_dispatches"] == 0  # by the priority order


def test_a_deferred_head_does_not_let_its_submissions_age_queue_grow(clock: FakeClock) -> None:
    """One submission (so nothing is ever served early): a short request longest-first keeps
    deferring stays at the head of the age queue, and every chunk of the others was appended
    behind it, one entry per chunk. Now compacted: a small multiple of the requests."""
    core = make_core("oracle", clock, workers=1, batch=32, chunk_size=8)
    _add(core, "short", 5, 7)
    for i in range(200):
        _add(core, f"l{i}", 990, 7)
    inflight = core.next_dispatches()
    peak = 0
    for _ in range(100):
        clock.t += 1.0
        for d in inflight:
            core.on_chunk_done(d.request_id, d.worker_id, d.max_new_tokens, finished=False)
        inflight = core.next_dispatches()
        peak = max(peak, len(core._starvation._subs[7].waiting.items))
    assert "short" not in {d.request_id for d in inflight}  # still deferred: its entry is alive
    assert peak <= 4 * 201 + 1, peak  # 3,200 appended
    assert core.stats()["starvation_dispatches"] == 0


@pytest.fixture
def oldest_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts AgeQueue.oldest calls (one per submission looked at)."""
    calls = [0]
    real = AgeQueue.oldest

    def counted(self: AgeQueue, alive: object) -> object:
        calls[0] += 1
        return real(self, alive)  # type: ignore[arg-type]

    monkeypatch.setattr(AgeQueue, "oldest", counted)
    yield calls


@pytest.mark.parametrize("starved", [False, True])
def test_a_decision_does_not_look_at_every_submission(
    clock: FakeClock, oldest_calls: list[int], starved: bool
) -> None:
    """2,000 tracked submissions, every one but the newest postponed (the newest ran first): a
    decision read every submission's oldest wait (1.6 ms a decision with 5,000). Now the heap's top:
    a few looks per decision, whether or not clocks are past the limit."""
    subs = 2000
    core = SchedulerCore(SchedulerPolicyConfig(policy="seer", chunk_size=64), clock=clock)
    for w in range(4):
        core.add_worker(WorkerSpec(f"w{w}", total_pages=10**6, page_size=16, max_batch_size=8))
    for s in range(subs, 0, -1):  # newest first (a restart's order): it runs first
        for i in range(2):
            core.add_request(RequestInfo(f"s{s}-{i}", f"s{s}-{i}", f"k{s}-{i}", 0, 1, 16, 8192, incarnation=s))
    inflight = core.next_dispatches()
    assert sum(sub.newer_since is not None for sub in core._starvation._subs.values()) == subs - 1
    oldest_calls[0] = 0
    decisions = 300
    for _ in range(decisions):
        clock.t += 1.0 if starved else 0.001
        d = inflight.pop(0)
        core.on_chunk_done(d.request_id, d.worker_id, d.max_new_tokens, finished=False)
        inflight += core.next_dispatches(limit=1)
    assert (core.stats()["starvation_dispatches"] > 0) == starved
    assert oldest_calls[0] <= 3 * decisions, oldest_calls[0]  # 2,000 per decision before


def _naive_starved(core: SchedulerCore, now: float) -> tuple[float, str, int] | None:
    """The rule as a scan of every submission (what the heap must agree with)."""
    best: tuple[float, int, tuple[float, str, int]] | None = None
    for sid, sub in core._starvation._subs.items():
        oldest = sub.waiting.oldest(core._waiting_since)
        if oldest is None or sub.newer_since is None:
            continue
        start = max(oldest[0], sub.newer_since)
        if now - start > core.cfg.starvation_seconds and (best is None or (start, sid) < best[:2]):
            best = (start, sid, oldest)
    return None if best is None else best[2]


def _check(core: SchedulerCore, now: float) -> None:
    ran = [s for s, o in core._starvation._subs.items() if o.dispatched]
    top = max(ran, default=None)
    assert core._starvation._top_dispatched == top
    for s, o in core._starvation._subs.items():
        # Postponed exactly while a later submission that ran is tracked.
        assert (o.newer_since is not None) == (top is not None and s < top), (s, top)
    assert core._starvation.starved_entry(now) == _naive_starved(core, now)


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_agree_with_the_scan_of_every_submission(seed: int) -> None:
    """Adds (submissions in any order), re-deliveries, cancels, chunks done / failed / finished and
    worker changes: after every step the postponed submissions are those below the newest one that
    ran, and the heap finds the same starved request as a scan of every submission."""
    rnd = random.Random(seed)
    clock = FakeClock()
    core = SchedulerCore(SchedulerPolicyConfig(policy=rnd.choice(["seer", "oracle"]), chunk_size=8,
                                               starvation_seconds=3.0), clock=clock)
    workers = 0

    def add_worker() -> None:
        nonlocal workers
        core.add_worker(WorkerSpec(f"w{workers}", total_pages=200, page_size=16, max_batch_size=4))
        workers += 1

    add_worker()
    add_worker()
    inflight: dict[str, tuple[str, int]] = {}
    known: dict[str, RequestInfo] = {}
    for _ in range(1500):
        clock.t += rnd.random()
        op = rnd.random()
        try:
            if op < 0.25:
                sub, g = rnd.randint(0, 8), rnd.randint(0, 20)
                for i in range(2):
                    info = RequestInfo(f"g{g}-{i}", f"g{g}", f"k{g}", i, 2, 16, 40, incarnation=sub,
                                       generated=rnd.choice([0, 0, 3, 40]), true_length=rnd.randint(1, 40))
                    core.add_request(info)
                    known[info.request_id] = info
            elif op < 0.30 and known:
                core.add_request(known[rnd.choice(sorted(known))])
            elif op < 0.38 and known:
                core.cancel_request(rnd.choice(sorted(known)))
            elif op < 0.40:
                if len(core._workers) > 1:
                    for rid in core.remove_worker(rnd.choice(sorted(core._workers))):
                        inflight.pop(rid, None)
                add_worker()
            else:
                for d in core.next_dispatches():
                    inflight[d.request_id] = (d.worker_id, d.max_new_tokens)
                if inflight:
                    rid = rnd.choice(sorted(inflight))
                    wid, most = inflight.pop(rid)
                    if rnd.random() < 0.1:
                        core.on_chunk_failed(rid, wid)
                    else:
                        core.on_chunk_done(rid, wid, rnd.randint(0, most), finished=rnd.random() < 0.3)
        except SeerError:
            pass  # e.g. a cancel of a request already settled
        for rid in list(inflight):
            r = core._requests.get(rid)
            if r is None or r.state != "in_flight":
                del inflight[rid]
        _check(core, clock.t)
    for rid in list(core._requests):
        if rid in core._requests:
            core.cancel_request(rid)
    assert core._starvation._subs == {} and core._starvation._top_dispatched is None
