"""Core regressions of the session-14 review: placement honours a worker's max_context (and a request
that fits no worker's context is dropped as unschedulable), and repeat quarantine offences escalate."""

from __future__ import annotations

import logging

import pytest

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec

from .conftest import FakeClock


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 100, generated: int = 0, group: str = "") -> RequestInfo:
    return RequestInfo(rid, group or f"g-{rid}", f"k-{group or rid}", 0, 1, prompt_len, max_tokens, generated=generated)


def _core(policy: str, clock: FakeClock, **cfg: object) -> SchedulerCore:
    return SchedulerCore(SchedulerPolicyConfig(policy=policy, chunk_size=64, **cfg), clock=clock)  # type: ignore[arg-type]


# ---- item 1: max_context -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["divided", "seer", "seer_history"])
def test_placement_skips_workers_whose_max_context_is_too_short(clock: FakeClock, policy: str) -> None:
    core = _core(policy, clock)
    core.add_worker(WorkerSpec("short", total_pages=10_000, page_size=16, max_batch_size=64, max_context=100))
    core.add_worker(WorkerSpec("long", total_pages=10_000, page_size=16, max_batch_size=64, max_context=4096))
    for i in range(8):
        core.add_request(_req(f"big{i}", prompt_len=50))  # 50 + 64 = 114 > 100
        core.add_request(_req(f"small{i}", prompt_len=10, max_tokens=64))  # 10 + 64 = 74 <= 100
    placed = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert len(placed) == 16 and core.take_unschedulable() == []
    assert all(placed[f"big{i}"] == "long" for i in range(8))
    assert any(w == "short" for w in placed.values())  # the short one still takes what fits it


def test_a_request_past_every_workers_room_is_unschedulable(clock: FakeClock) -> None:
    """Judged per worker, KV capped by max_context: a big-KV short-context worker and a small-KV
    long-context one together do not hold what neither holds alone."""
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("a", total_pages=1000, page_size=16, max_batch_size=8, max_context=500))  # 16000 KV
    core.add_worker(WorkerSpec("b", total_pages=50, page_size=16, max_batch_size=8, max_context=8000))  # 800 KV
    core.add_request(_req("mid", prompt_len=900))  # 964 tokens: over a's context and over b's KV
    core.add_request(_req("ok", prompt_len=400))
    assert [d.request_id for d in core.next_dispatches()] == ["ok"]
    (u,) = core.take_unschedulable()
    assert (u.request_id, u.need_tokens, u.largest_kv_tokens, u.largest_context_tokens, u.largest_room_tokens) == (
        "mid",
        964,
        16000,
        8000,
        800,
    )
    assert "964 tokens" in u.reason and "max_context" in u.reason


def test_unknown_max_context_is_no_limit(clock: FakeClock) -> None:
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("w", total_pages=1000, page_size=16, max_batch_size=8))  # max_context 0
    core.add_request(_req("a", prompt_len=5000))
    assert [d.worker_id for d in core.next_dispatches()] == ["w"]


def test_a_request_only_an_absent_worker_can_hold_waits(clock: FakeClock) -> None:
    core = _core("seer", clock)
    core.add_worker(WorkerSpec("long", total_pages=10_000, page_size=16, max_batch_size=8, max_context=4096))
    core.add_worker(WorkerSpec("short", total_pages=10_000, page_size=16, max_batch_size=8, max_context=100))
    core.remove_worker("long")  # restarting: it may come back
    core.add_request(_req("a", prompt_len=500))
    assert core.next_dispatches() == [] and core.take_unschedulable() == []
    core.add_worker(WorkerSpec("long", total_pages=10_000, page_size=16, max_batch_size=8, max_context=4096))
    assert [d.worker_id for d in core.next_dispatches()] == ["long"]


def test_the_chunk_limit_follows_generated_tokens(clock: FakeClock) -> None:
    """A request's context grows chunk by chunk: it leaves a short worker once its next chunk is past
    that worker's context, and is dropped once it is past every worker's."""
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("short", total_pages=10_000, page_size=16, max_batch_size=8, max_context=200))
    core.add_request(_req("a", prompt_len=10, max_tokens=1000))
    seen = []
    while True:
        ds = core.next_dispatches()
        if not ds:
            break
        (d,) = ds
        seen.append(d.max_new_tokens)
        core.on_chunk_done("a", d.worker_id, d.max_new_tokens, False)
    # 10 + 64 * 2 = 138; + 64 = 202 > 200: two chunks, then fits nowhere.
    assert seen == [64, 64]
    (u,) = core.take_unschedulable()
    assert (u.request_id, u.need_tokens) == ("a", 202)


def test_baseline_places_groups_only_where_their_context_fits(clock: FakeClock) -> None:
    core = _core("baseline", clock)
    core.add_worker(WorkerSpec("short", total_pages=10_000, page_size=16, max_batch_size=64, max_context=100))
    core.add_worker(WorkerSpec("long", total_pages=10_000, page_size=16, max_batch_size=64, max_context=4096))
    for g in range(4):
        for i in range(2):
            core.add_request(RequestInfo(f"big{g}-{i}", f"big{g}", f"kb{g}", i, 2, 50, 100))
            core.add_request(RequestInfo(f"small{g}-{i}", f"small{g}", f"ks{g}", i, 2, 10, 50))
    core.add_request(_req("huge", prompt_len=5000))  # past every worker's context
    placed = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert len(placed) == 16
    assert all(w == "long" for rid, w in placed.items() if rid.startswith("big"))
    assert "short" in placed.values()
    assert [u.request_id for u in core.take_unschedulable()] == ["huge"]


def test_worker_spec_validates_max_context() -> None:
    with pytest.raises(Exception) as info:
        WorkerSpec("w", 10, 16, 8, max_context=-1).validate()
    assert getattr(info.value, "field", None) == "max_context"


# ---- item 2: repeat quarantine offences escalate -------------------------------------------------


def _sane(core: SchedulerCore, wid: str, n: int) -> None:
    for _ in range(n):
        core.update_worker(wid, free_pages=100, running=0, waiting=0)


def test_repeat_chunk_stats_offences_need_longer_sane_periods(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that lies only in its chunk stats (its telemetry is sane) used to be released after 3
    heartbeats every time, and cost an attempt per lie forever: each offence now doubles the sane
    period, up to quarantine_max_reports."""
    core = _core("divided", clock, quarantine_max_reports=20)
    core.add_worker(WorkerSpec("liar", total_pages=100, page_size=16, max_batch_size=8))
    needed = []
    with caplog.at_level(logging.INFO, logger="services.scheduler.core.workers"):
        for _ in range(5):
            core.quarantine_worker("liar", "impossible chunk stats: steps -1 is negative")
            n = 0
            while core.is_quarantined("liar"):
                _sane(core, "liar", 1)
                n += 1
            needed.append(n)
    assert needed == [3, 6, 12, 20, 20]
    # The structured fields of each line (log.kv puts them in the record's `fields`).
    lines = [vars(r)["fields"] for r in caplog.records if r.getMessage() == "worker quarantined"]
    assert len(lines) == 5 and all(f["worker_id"] == "liar" for f in lines)
    assert [f["offences"] for f in lines] == [1, 2, 3, 4, 5]
    assert [f["sane_reports_needed"] for f in lines] == [3, 6, 12, 20, 20]


def test_offences_decay_after_a_long_clean_period(clock: FakeClock) -> None:
    core = _core("divided", clock, quarantine_decay_reports=10)
    core.add_worker(WorkerSpec("w", total_pages=100, page_size=16, max_batch_size=8))
    for _ in range(3):
        core.quarantine_worker("w", "impossible chunk stats")
        _sane(core, "w", 12)
    assert not core.is_quarantined("w")
    _sane(core, "w", 10)  # clean for 10 reports: one offence forgiven (3 -> 2)
    core.quarantine_worker("w", "impossible chunk stats")  # the 3rd offence again: 12 reports
    _sane(core, "w", 11)
    assert core.is_quarantined("w")
    _sane(core, "w", 1)
    assert not core.is_quarantined("w")
    _sane(core, "w", 30)  # three clean periods: every offence forgiven
    core.quarantine_worker("w", "impossible chunk stats")
    _sane(core, "w", 3)
    assert not core.is_quarantined("w")


def test_offences_survive_removal_and_a_new_capacity(clock: FakeClock) -> None:
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("w", total_pages=100, page_size=16, max_batch_size=8))
    core.quarantine_worker("w", "impossible chunk stats")
    _sane(core, "w", 3)
    core.remove_worker("w")
    core.add_worker(WorkerSpec("w", total_pages=200, page_size=16, max_batch_size=8))
    core.quarantine_worker("w", "impossible chunk stats")
    _sane(core, "w", 5)
    assert core.is_quarantined("w")  # its second offence: 6 reports
    _sane(core, "w", 1)
    assert not core.is_quarantined("w")


def test_impossible_telemetry_counts_as_an_offence_too(clock: FakeClock) -> None:
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("w", total_pages=100, page_size=16, max_batch_size=8))
    for expected in (3, 6):
        core.update_worker("w", free_pages=10**6, running=0, waiting=0)
        core.update_worker("w", free_pages=10**6, running=0, waiting=0)  # while quarantined: no new offence
        assert core.is_quarantined("w")
        _sane(core, "w", expected - 1)
        assert core.is_quarantined("w")
        _sane(core, "w", 1)
        assert not core.is_quarantined("w")


def test_a_quarantine_carried_over_registration_is_no_new_offence(clock: FakeClock) -> None:
    core = _core("divided", clock)
    core.add_worker(WorkerSpec("w", total_pages=100, page_size=16, max_batch_size=8))
    core.quarantine_worker("w", "impossible chunk stats")
    core.remove_worker("w")
    core.add_worker(WorkerSpec("w", total_pages=100, page_size=16, max_batch_size=8))
    core.quarantine_worker("w", "impossible chunk stats", offence=False)  # the driver's carry-over
    _sane(core, "w", 3)
    assert not core.is_quarantined("w")


# ---- item 5: a request moved off a dead worker pulls its KV ------------------------------------


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_request_moved_off_a_dead_worker_fetches_its_kv(clock: FakeClock, in_flight: bool) -> None:
    core = _core("seer", clock)
    core.add_worker(WorkerSpec("w0", total_pages=10_000, page_size=16, max_batch_size=8))
    core.add_request(_req("a", prompt_len=1000, max_tokens=1000))
    (d,) = core.next_dispatches()
    core.on_chunk_done("a", "w0", 64, False)  # w0 offloaded prompt + 64 tokens to the pool
    if in_flight:
        (d,) = core.next_dispatches()
        assert d.worker_id == "w0" and not d.fetch_kv
    core.remove_worker("w0")  # it dies (with or without the next chunk in flight)
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=8))
    (d,) = core.next_dispatches()
    assert (d.worker_id, d.fetch_kv) == ("w1", True)
    assert core.stats()["kv_fetch_dispatches"] == 1


def test_a_short_prefix_off_a_dead_worker_is_re_prefilled(clock: FakeClock) -> None:
    core = _core("seer", clock)
    core.add_worker(WorkerSpec("w0", total_pages=10_000, page_size=16, max_batch_size=8))
    core.add_request(_req("a", prompt_len=100, max_tokens=1000))
    core.next_dispatches()
    core.on_chunk_done("a", "w0", 64, False)
    core.remove_worker("w0")
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=8))
    (d,) = core.next_dispatches()
    assert not d.fetch_kv  # 164 tokens: under prefix_gap_margin, recomputing is cheaper
