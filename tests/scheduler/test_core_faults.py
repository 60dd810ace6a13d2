"""Core regressions from the code review: settled requests are not re-added silently, requests that
fit on no worker are dropped and reported (and do not block the others), the baseline policy honours
quarantine, a request's generated count can be resynced, and impossible chunk stats are detected."""

from __future__ import annotations

import math

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec, chunk_stats_problem

from .conftest import FakeClock, make_core


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 100, generated: int = 0) -> RequestInfo:
    return RequestInfo(rid, f"g-{rid}", f"k-{rid}", 0, 1, prompt_len, max_tokens, generated=generated)


def _quarantine_by_telemetry(core: SchedulerCore, worker_id: str) -> None:
    core.update_worker(worker_id, free_pages=10**9, running=0, waiting=0)
    assert core.is_quarantined(worker_id)


# ---- add_request reports whether it queued the request ---------------------------------------


def test_add_request_reports_whether_the_request_will_run(clock: FakeClock) -> None:
    core = make_core("divided", clock)
    assert core.add_request(_req("a")) is True
    assert core.add_request(_req("a")) is False  # re-delivery
    core.cancel_request("a")
    # Settled (cancelled, dropped): the core ignores it; the driver must not wait for it.
    assert core.add_request(_req("a")) is False
    assert core.pending_count() == 0
    assert core.add_request(_req("full", max_tokens=5, generated=5)) is False


# ---- unschedulable requests ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["divided", "seer", "seer_history"])
def test_requests_that_fit_nowhere_are_reported_and_do_not_block_the_rest(clock: FakeClock, policy: str) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy=policy, chunk_size=64), clock=clock)  # type: ignore[arg-type]
    core.add_worker(WorkerSpec("w0", total_pages=100, page_size=16, max_batch_size=32))  # 1600 tokens of KV
    n = core.cfg.admission_lookahead
    for i in range(n):
        core.add_request(_req(f"big{i}", prompt_len=2000, max_tokens=500))
    core.add_request(_req("small"))
    got = [d.request_id for d in core.next_dispatches()]
    assert got == ["small"]
    dropped = core.take_unschedulable()
    assert sorted(u.request_id for u in dropped) == sorted(f"big{i}" for i in range(n))
    assert all((u.need_tokens, u.largest_kv_tokens) == (2064, 1600) for u in dropped)
    assert core.take_unschedulable() == []  # taken once
    assert core.pending_count() == 0
    assert core.stats()["unschedulable_requests"] == n
    assert core.stats()["admission_skips"] == 0  # they did not use up the lookahead
    assert core.add_request(_req("big0", prompt_len=2000, max_tokens=500)) is False  # settled


def test_a_full_cluster_is_not_unschedulable(clock: FakeClock) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="divided", chunk_size=64), clock=clock)
    core.add_worker(WorkerSpec("w0", total_pages=100, page_size=16, max_batch_size=32))
    core.add_request(_req("a", prompt_len=1000, max_tokens=200))
    core.add_request(_req("b", prompt_len=1000, max_tokens=200))  # fits alone, not beside "a"
    assert [d.request_id for d in core.next_dispatches()] == ["a"]
    assert core.next_dispatches() == [] and core.take_unschedulable() == []
    assert core.pending_count() == 1


def test_the_chunk_counts_towards_the_need_and_quarantined_workers_count_too(clock: FakeClock) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="divided", chunk_size=64), clock=clock)
    core.add_worker(WorkerSpec("small", total_pages=100, page_size=16, max_batch_size=32))
    core.add_worker(WorkerSpec("big", total_pages=1000, page_size=16, max_batch_size=32))
    _quarantine_by_telemetry(core, "big")
    # 1550 + 64 > 1600 (small's whole KV), but quarantined "big" could hold it once released: wait.
    core.add_request(_req("a", prompt_len=1550, max_tokens=500))
    assert core.next_dispatches() == [] and core.take_unschedulable() == []
    core.add_request(_req("b", prompt_len=15_990, max_tokens=500))  # 15990 + 64 > 16000: fits nowhere
    assert core.next_dispatches() == []
    assert [u.request_id for u in core.take_unschedulable()] == ["b"]
    assert core.pending_count() == 1


def test_no_worker_or_a_quarantined_one_means_wait_not_unschedulable(clock: FakeClock) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="divided", chunk_size=64), clock=clock)
    core.add_request(_req("a", prompt_len=1000))
    assert core.next_dispatches() == [] and core.take_unschedulable() == []  # no worker yet
    core.add_worker(WorkerSpec("w0", total_pages=100, page_size=16, max_batch_size=32))
    _quarantine_by_telemetry(core, "w0")
    assert core.next_dispatches() == [] and core.take_unschedulable() == []  # none trusted: wait
    assert core.pending_count() == 1


def test_a_starving_unschedulable_request_is_dropped_too(clock: FakeClock) -> None:
    """The starvation path drops a request that fits nowhere as the priority path does. "big"
    (submission 0) starves only once a chunk of a later submission ran ("small", submission 1), and
    it ranks last (oracle: shortest), so the priority path picks "other" without reaching it: only
    the starvation path's own drop reports it in this decision."""
    core = SchedulerCore(SchedulerPolicyConfig(policy="oracle", chunk_size=64, starvation_seconds=1.0), clock=clock)
    core.add_worker(WorkerSpec("w0", total_pages=100, page_size=16, max_batch_size=32))

    def add(rid: str, submission: int, true_length: int, prompt_len: int = 10) -> None:
        core.add_request(RequestInfo(rid, f"g-{rid}", f"k-{rid}", 0, 1, prompt_len, 100,
                                     true_length=true_length, incarnation=submission))

    add("big", 0, 1, prompt_len=2000)
    add("small", 1, 90)
    assert [d.request_id for d in core.next_dispatches(limit=1)] == ["small"]  # big's clock starts
    add("other", 1, 80)
    clock.t = 100.0
    assert [d.request_id for d in core.next_dispatches(limit=1)] == ["other"]
    assert [u.request_id for u in core.take_unschedulable()] == ["big"]
    assert core.stats()["starvation_dispatches"] == 0


# ---- baseline and quarantine -----------------------------------------------------------------


def test_baseline_never_places_on_a_quarantined_worker(clock: FakeClock) -> None:
    core = make_core("baseline", clock)
    _quarantine_by_telemetry(core, "w0")
    for g in range(4):
        core.add_request(_req(f"r{g}"))
    assert {d.worker_id for d in core.next_dispatches()} == {"w1"}


def test_baseline_moves_a_group_off_its_quarantined_worker(clock: FakeClock) -> None:
    core = make_core("baseline", clock)
    for i in range(2):
        core.add_request(RequestInfo(f"g-{i}", "g", "k", i, 2, 10, 100))
    first = core.next_dispatches(limit=1)[0]
    core.quarantine_worker(first.worker_id, "test")
    (second,) = core.next_dispatches()
    assert second.worker_id != first.worker_id


def test_baseline_with_every_worker_quarantined_waits(clock: FakeClock) -> None:
    core = make_core("baseline", clock)
    for w in ("w0", "w1"):
        core.quarantine_worker(w, "test")
    core.add_request(_req("a"))
    assert core.next_dispatches() == []
    assert core.pending_count() == 1


def test_quarantine_worker_and_its_release(clock: FakeClock) -> None:
    core = make_core("divided", clock, quarantine_clear_reports=2)
    with pytest.raises(NotFound):
        core.quarantine_worker("nope", "x")
    with pytest.raises(InvalidArgument):
        core.quarantine_worker("w0", "")
    core.quarantine_worker("w0", "lied")
    assert core.quarantine_reason("w0") == "lied"
    # A new capacity does not clear it.
    core.add_worker(WorkerSpec("w0", total_pages=5000, page_size=16, max_batch_size=64))
    assert core.is_quarantined("w0")
    for _ in range(2):
        core.update_worker("w0", free_pages=10, running=0, waiting=0)
    assert not core.is_quarantined("w0") and core.quarantine_reason("w0") == ""


# ---- resync of the generated count -----------------------------------------------------------


def test_resync_generated_moves_a_queued_request_to_the_buffers_count(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1, chunk_size=8)
    core.add_request(_req("a", max_tokens=24))
    (d,) = core.next_dispatches()
    core.remove_worker("w0")  # its chunk is re-queued, generated 0
    core.resync_generated("a", 8)  # ...but its commit landed
    core.add_worker(WorkerSpec("w0", total_pages=10_000, page_size=16, max_batch_size=64))
    (d,) = core.next_dispatches()
    assert d.max_new_tokens == 8
    core.on_chunk_done("a", "w0", 8, False)
    (d,) = core.next_dispatches()
    core.on_chunk_done("a", "w0", 8, True)
    assert core.history("k-a") == [24]  # not 16: the core counted the resynced chunk


def test_resync_generated_refuses_what_it_cannot_take(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1)
    core.add_request(_req("a", max_tokens=24))
    with pytest.raises(NotFound):
        core.resync_generated("b", 1)
    with pytest.raises(InvalidArgument):
        core.resync_generated("a", 24)
    core.next_dispatches()
    with pytest.raises(FailedPrecondition):
        core.resync_generated("a", 3)  # in flight: its chunk settles it


# ---- chunk stats -----------------------------------------------------------------------------

_HEALTHY = {"prefill_tokens": 6, "cached_tokens": 0, "kv_loaded_tokens": 0, "draft_tokens": 12,
            "accepted_tokens": 5, "steps": 4, "wall_seconds": 0.2, "kv_recomputed_pages": 0}


def test_plausible_chunk_stats_pass() -> None:
    assert chunk_stats_problem(_HEALTHY, 8, 6) == ""
    assert chunk_stats_problem({**_HEALTHY, "steps": 9}, 8, 6) == ""  # a final empty finish message
    assert chunk_stats_problem({**_HEALTHY, "steps": 1, "draft_tokens": 0, "accepted_tokens": 0}, 0, 6) == ""
    assert chunk_stats_problem({k: 0 for k in _HEALTHY}, 0, 0) == ""


@pytest.mark.parametrize(
    ("change", "tokens", "word"),
    [
        ({"steps": -5}, 8, "steps is negative"),
        ({"prefill_tokens": -1}, 8, "prefill_tokens is negative"),
        ({"wall_seconds": math.nan}, 8, "wall_seconds is not finite"),
        ({"wall_seconds": math.inf}, 8, "wall_seconds is not finite"),
        ({"accepted_tokens": 13}, 8, "accepted_tokens 13 exceeds draft_tokens 12"),
        ({"steps": 10}, 8, "steps 10 exceeds"),
        # Tokens from no engine step, and prefix counts beyond the chunk's context (6 tokens):
        ({"steps": 0}, 8, "steps 0 for the chunk's 8 tokens"),
        ({"prefill_tokens": 7}, 8, "prefill_tokens + cached_tokens 7 exceeds the chunk's context of 6"),
        ({"prefill_tokens": 2, "cached_tokens": 5}, 8, "prefill_tokens + cached_tokens 7 exceeds"),
        ({"kv_loaded_tokens": 10**9}, 8, "kv_loaded_tokens 1000000000 exceeds the chunk's context of 6"),
        ({"kv_recomputed_pages": 7}, 8, "kv_recomputed_pages 7 exceeds"),
    ],
)
def test_impossible_chunk_stats_are_named(change: dict[str, float], tokens: int, word: str) -> None:
    assert word in chunk_stats_problem({**_HEALTHY, **change}, tokens, 6)


def test_a_request_only_an_absent_worker_holds_waits_for_it(clock: FakeClock) -> None:
    """The big worker restarts (removed, registered again): a request only it can hold waits."""
    core = SchedulerCore(SchedulerPolicyConfig(policy="divided", chunk_size=64), clock=clock)
    core.add_worker(WorkerSpec("small", total_pages=100, page_size=16, max_batch_size=32))
    core.add_worker(WorkerSpec("big", total_pages=1000, page_size=16, max_batch_size=32))
    core.remove_worker("big")
    core.add_request(_req("r0", prompt_len=6000, max_tokens=500))
    assert core.next_dispatches() == [] and core.take_unschedulable() == []
    core.add_worker(WorkerSpec("big", total_pages=1000, page_size=16, max_batch_size=32))
    assert [d.request_id for d in core.next_dispatches()] == ["r0"]
