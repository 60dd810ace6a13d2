"""The scheduler core: policies, estimates, admission, placement, faults (pure, no grpc)."""

from __future__ import annotations

import logging
import random
import time

import pytest

from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec
from services.scheduler.core.groups import posterior_max

from .conftest import FakeClock, add_group, make_core


def test_bad_config_and_input_name_the_field(clock: FakeClock) -> None:
    with pytest.raises(InvalidArgument, match="policy"):
        SchedulerCore(SchedulerPolicyConfig(policy="fastest"))
    with pytest.raises(InvalidArgument, match="chunk_size"):
        SchedulerCore(SchedulerPolicyConfig(chunk_size=0))
    core = make_core("seer", clock)
    with pytest.raises(InvalidArgument) as e:
        core.add_request(RequestInfo("r", "g", "k", 3, 2, 10, 100))
    assert e.value.field == "sample_index"
    with pytest.raises(InvalidArgument) as e:
        core.add_request(RequestInfo("r", "g", "k", 0, 2, 0, 100))
    assert e.value.field == "prompt_len"
    with pytest.raises(InvalidArgument) as e:
        core.add_worker(WorkerSpec("w9", total_pages=0, page_size=16, max_batch_size=4))
    assert e.value.field == "total_pages"
    add_group(core, "g", 2, max_tokens=100)
    with pytest.raises(InvalidArgument) as e:  # a third member disagreeing with its group
        core.add_request(RequestInfo("x", "g", "k", 0, 2, 10, 100))
    assert e.value.field == "prompt_key"
    with pytest.raises(AlreadyExists):
        core.add_request(RequestInfo("x", "g", "key-g", 0, 2, 10, 100))
    with pytest.raises(NotFound):
        core.update_worker("nope", free_pages=1, running=0, waiting=0)
    with pytest.raises(InvalidArgument) as e:
        core.set_history("k", [5, -1])
    assert e.value.field == "lengths[1]"
    # The core keeps serving after bad input.
    assert len(core.next_dispatches()) == 2


def test_add_request_is_idempotent(clock: FakeClock) -> None:
    core = make_core("divided", clock)
    add_group(core, "g", 2)
    add_group(core, "g", 2)  # re-delivery of the same work
    assert core.pending_count() == 2


def test_baseline_runs_to_completion_groups_round_robin(clock: FakeClock) -> None:
    core = make_core("baseline", clock, workers=2)
    for g in range(4):
        add_group(core, f"g{g}", 3, max_tokens=700)
    ds = core.next_dispatches()
    assert len(ds) == 12 and all(d.max_new_tokens == 700 for d in ds)
    by_group: dict[str, set[str]] = {}
    for d in ds:
        by_group.setdefault(d.request_id.split("-")[0], set()).add(d.worker_id)
    assert all(len(ws) == 1 for ws in by_group.values())  # a group stays on one instance
    assert [next(iter(by_group[f"g{g}"])) for g in range(4)] == ["w0", "w1", "w0", "w1"]


def test_divided_chunks_least_loaded_fifo(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=2, chunk_size=100)
    add_group(core, "a", 2, max_tokens=250)
    add_group(core, "b", 2, max_tokens=250)
    ds = core.next_dispatches()
    assert [d.request_id for d in ds] == ["a-0", "a-1", "b-0", "b-1"]  # FIFO, no length context
    assert sorted(d.worker_id for d in ds) == ["w0", "w0", "w1", "w1"]  # least loaded
    assert all(d.max_new_tokens == 100 and not d.is_probe for d in ds)
    for d in ds:
        core.on_chunk_done(d.request_id, d.worker_id, 100, finished=False)
    for d in core.next_dispatches():
        core.on_chunk_done(d.request_id, d.worker_id, 100, finished=False)
    last = core.next_dispatches()
    assert {d.max_new_tokens for d in last} == {50}  # min(chunk, max_tokens - generated)


def test_seer_probes_first_then_longest_first(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, batch=2, chunk_size=100)
    add_group(core, "short", 3)
    add_group(core, "long", 3)
    first = core.next_dispatches()
    assert [d.request_id for d in first] == ["short-0", "long-0"] and all(d.is_probe for d in first)
    # The short group's probe ends at 40 tokens: its estimate is now 40; the long group's probe
    # is still running, so that group is estimated at max_tokens and served first.
    core.on_chunk_done("short-0", "w0", 40, finished=True)
    assert core.group_estimate("short") == 40 and core.group_estimate("long") == 1000
    nxt = core.next_dispatches()
    assert [d.request_id for d in nxt] == ["long-1"] and not nxt[0].is_probe
    # Probes: smallest generated length first.
    core.on_chunk_done("long-0", "w0", 100, finished=False)
    assert [d.request_id for d in core.next_dispatches()] == ["long-0"]


def test_probe_order_smallest_generated_first(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, batch=1, chunk_size=10)
    core.add_request(RequestInfo("a-0", "a", "ka", 0, 2, 8, 100, generated=30))
    core.add_request(RequestInfo("b-0", "b", "kb", 0, 2, 8, 100, generated=5))
    assert core.next_dispatches()[0].request_id == "b-0"


def test_member_past_its_group_estimate_becomes_top_priority(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, batch=1, chunk_size=50)
    add_group(core, "g", 3)
    add_group(core, "h", 3)
    d = core.next_dispatches()[0]
    core.on_chunk_done(d.request_id, d.worker_id, 20, finished=True)  # g's estimate 20
    d = core.next_dispatches()[0]
    core.on_chunk_done(d.request_id, d.worker_id, 30, finished=True)  # h's estimate 30
    d = core.next_dispatches()[0]
    assert d.request_id.startswith("h")  # 30 > 20: longest-first
    core.on_chunk_done(d.request_id, d.worker_id, 50, finished=False)  # outgrew its siblings
    assert core.next_dispatches()[0].request_id == d.request_id


def test_seer_history_ranks_groups_from_the_first_dispatch(clock: FakeClock) -> None:
    core = make_core("seer_history", clock, workers=1, batch=1)
    core.set_history("key-a", [100, 120])
    core.set_history("key-b", [900, 50])
    add_group(core, "a", 2)
    add_group(core, "b", 2)
    d = core.next_dispatches()
    assert d[0].request_id.startswith("b") and not d[0].is_probe
    assert core.group_estimate("a") == 120


@pytest.mark.parametrize("mode", ["floor", "scaled"])
def test_history_prior_refined_by_finished_siblings(clock: FakeClock, mode: str) -> None:
    """floor: finished siblings only raise the prior; scaled: the prior follows this iteration's
    drift (the first finishers against the previous iteration's shortest)."""
    core = make_core("seer_history", clock, workers=1, chunk_size=1000, estimate_quantile=0, history_estimate=mode)
    core.set_history("key-up", [100, 200, 300, 400])
    core.set_history("key-down", [100, 200, 300, 400])
    add_group(core, "up", 4)
    add_group(core, "down", 4)
    assert core.group_estimate("up") == core.group_estimate("down") == 400  # the prior, before any finish
    done = {d.request_id: d for d in core.next_dispatches()}
    core.on_chunk_done("up-0", done["up-0"].worker_id, 150, finished=True)  # 1.5x the previous shortest
    core.on_chunk_done("down-0", done["down-0"].worker_id, 50, finished=True)  # half of it
    if mode == "floor":
        assert core.group_estimate("up") == 400 and core.group_estimate("down") == 400
    else:
        assert core.group_estimate("up") == 600 and core.group_estimate("down") == 200
        core.on_chunk_done("down-1", done["down-1"].worker_id, 390, finished=True)  # (50 + 390) / (100 + 200)
        assert core.group_estimate("down") == 587
        # A finished sibling is a hard lower bound of the group's longest response.
        core.on_chunk_done("up-1", done["up-1"].worker_id, 990, finished=True)
        assert core.group_estimate("up") == 1000  # (150 + 990) / 300 x 400 = 1520, capped at max_tokens


@pytest.mark.parametrize("mode", ["scaled", "posterior"])
def test_history_posterior_ranks_by_the_typical_length_not_one_outlier(clock: FakeClock, mode: str) -> None:
    """posterior: a group ranks by the expected maximum from its history's mean log length, so one
    long outlier last iteration (group a: fifteen at 100 and one at 1000) does not put it ahead of
    a group whose every response was long (b: all 800). scaled/floor rank by the previous maximum."""
    core = make_core("seer_history", clock, workers=1, batch=1, estimate_quantile=0, history_estimate=mode)
    core.set_history("key-a", [100] * 15 + [1000])
    core.set_history("key-b", [800] * 16)
    add_group(core, "a", 16, max_tokens=4000)
    add_group(core, "b", 16, max_tokens=4000)
    first = core.next_dispatches()[0].request_id
    if mode == "scaled":
        assert first.startswith("a") and core.group_estimate("a") == 1000
    else:
        assert first.startswith("b")
        est_a, est_b = core.group_estimate("a"), core.group_estimate("b")
        assert 150 < est_a < 400 and est_b > 800 > est_a  # pooled log-sd 0.41: exp(mean log + 0.41 x 1.77)


def test_history_posterior_uses_finished_and_running_siblings() -> None:
    """Finished siblings are exact samples of the group's log-mean and running ones lower bounds
    (censored): both move the expected maximum; it is never below a finished or running length."""
    prior = [1000] * 4 + [1200] * 4
    base = posterior_max(prior, [], [], 8, 100_000, log_sd=0.25)
    assert posterior_max(prior, [2000, 2100], [], 8, 100_000, log_sd=0.25) > base
    assert posterior_max(prior, [500, 520], [], 8, 100_000, log_sd=0.25) < base
    assert posterior_max(prior, [], [3000], 8, 100_000, log_sd=0.25) > base  # one sibling ran past 3000
    assert posterior_max(prior, [], [9000], 8, 100_000, log_sd=0.25) >= 9000
    assert posterior_max(prior, [1000] * 8, [], 8, 100_000, log_sd=0.25) == 1000  # all finished: their max
    assert posterior_max(prior, [], [], 8, 1100, log_sd=0.25) == 1100  # capped at max_tokens


def test_history_recorded_when_a_group_finishes(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, chunk_size=1000)
    add_group(core, "g", 2, key="k")
    lengths = iter([37, 81])
    for d in core.next_dispatches():
        core.on_chunk_done(d.request_id, d.worker_id, next(lengths), finished=True)
    assert sorted(core.history("k") or []) == [37, 81]
    assert core.pending_count() == 0 and core.in_flight_count() == 0


def test_oracle_longest_true_length_first(clock: FakeClock) -> None:
    core = make_core("oracle", clock, workers=1, batch=1)
    add_group(core, "g", 3, lengths=[10, 500, 90])
    assert core.next_dispatches()[0].request_id == "g-1"


def test_admission_control_needs_pages_for_context_plus_chunk(clock: FakeClock) -> None:
    # 10 pages of 16 tokens; prompt 32 + chunk 100 = 132 tokens = 9 pages: one chunk at a time.
    core = make_core("divided", clock, workers=1, pages=10, page_size=16, chunk_size=100)
    add_group(core, "g", 2)
    ds = core.next_dispatches()
    assert len(ds) == 1
    assert core.next_dispatches() == []
    core.on_chunk_done(ds[0].request_id, "w0", 100, finished=True)
    assert len(core.next_dispatches()) == 1


def test_admission_skips_a_candidate_that_fits_nowhere_now(clock: FakeClock) -> None:
    # 40 pages (640 tokens); "first" holds 8 of them, so "big" (600 tokens, 38 pages) fits the
    # worker but not its free KV now: skipped (not failed: it runs once "first" is done).
    core = make_core("oracle", clock, workers=1, pages=40, page_size=16, chunk_size=100)
    core.add_request(RequestInfo("first", "first", "k0", 0, 1, 16, 1000, true_length=1000))
    assert [d.request_id for d in core.next_dispatches(limit=1)] == ["first"]
    core.add_request(RequestInfo("big", "big", "k1", 0, 1, 500, 1000, true_length=900))
    core.add_request(RequestInfo("small", "small", "k2", 0, 1, 16, 1000, true_length=10))
    assert [d.request_id for d in core.next_dispatches()] == ["small"]
    assert core.stats()["admission_skips"] >= 1 and core.pending_count() == 1
    assert core.take_unschedulable() == []


def test_batch_slots_bound_in_flight(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=2, batch=3)
    add_group(core, "g", 8)
    assert len(core.next_dispatches()) == 6
    assert core.in_flight_count() == 6


@pytest.mark.parametrize("threshold", [2, 10])
def test_cache_aware_placement_and_kv_pull(clock: FakeClock, threshold: int) -> None:
    core = make_core(
        "seer", clock, workers=1, batch=100, chunk_size=600, load_imbalance_threshold=threshold, prefix_gap_margin=512
    )
    add_group(core, "g", 1, max_tokens=5000)
    d = core.next_dispatches()[0]
    core.on_chunk_done(d.request_id, "w0", 600, finished=False)
    for i in range(4):  # fresh probes (0 generated) go before g-0 (600 generated): all onto w0
        core.add_request(RequestInfo(f"h{i}", f"h{i}", f"h{i}", 0, 1, 8, 5000))
    assert {x.worker_id for x in core.next_dispatches(limit=4)} == {"w0"}
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=100))
    (d2,) = core.next_dispatches()
    assert d2.request_id == "g-0"
    if threshold == 2:
        # In-flight counts differ by 4 > 2: load-first to w1; the prefix gap (632 tokens > 512)
        # makes w1 pull the KV from the store instead of re-prefilling.
        assert d2.worker_id == "w1" and d2.fetch_kv
        assert core.stats()["kv_fetch_dispatches"] == 1 and core.stats()["moved_dispatches"] == 1
    else:
        assert d2.worker_id == "w0" and not d2.fetch_kv  # stays where its KV is


def test_small_prefix_gap_reprefills_instead_of_pulling(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, chunk_size=100, load_imbalance_threshold=0)
    add_group(core, "g", 1)
    d = core.next_dispatches()[0]
    core.on_chunk_done(d.request_id, "w0", 100, finished=False)
    core.add_request(RequestInfo("h", "h", "h", 0, 1, 8, 1000))
    core.next_dispatches(limit=1)
    core.add_worker(WorkerSpec("w1", total_pages=10_000, page_size=16, max_batch_size=64))
    (d2,) = core.next_dispatches()
    assert d2.worker_id == "w1" and not d2.fetch_kv  # gap 132 tokens <= 512


def test_divided_least_loaded_even_when_the_cache_is_elsewhere(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=2, chunk_size=600)
    add_group(core, "g", 1)
    d = core.next_dispatches()[0]
    add_group(core, "x", 1)
    x = core.next_dispatches()[0]
    assert x.worker_id != d.worker_id
    core.on_chunk_done(d.request_id, d.worker_id, 600, finished=False)
    add_group(core, "y", 1)
    # The worker that held g is now idle and least loaded either way; both are at load 1 after y.
    ds = core.next_dispatches()
    assert {z.request_id for z in ds} == {"g-0", "y-0"}


def test_worker_lost_mid_chunk_is_redispatched_and_late_report_ignored(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=2, chunk_size=100)
    add_group(core, "g", 1)
    d = core.next_dispatches()[0]
    lost = core.remove_worker(d.worker_id)
    assert lost == [d.request_id]
    d2 = core.next_dispatches()[0]
    assert d2.request_id == d.request_id and d2.worker_id != d.worker_id and d2.max_new_tokens == 100
    core.add_worker(WorkerSpec(d.worker_id, 10_000, 16, 64))
    core.on_chunk_done(d.request_id, d.worker_id, 100, finished=False)  # late, from the dead worker
    assert core.stats()["stale_reports"] == 1 and core.in_flight_count() == 1
    core.on_chunk_done(d2.request_id, d2.worker_id, 100, finished=False)
    assert core.stats()["redispatched_chunks"] == 1


@pytest.mark.parametrize("policy", ["baseline", "divided", "seer", "seer_history", "oracle"])
def test_random_faults_lose_and_duplicate_nothing(policy: str, clock: FakeClock) -> None:
    """Random worker losses, failed chunks, duplicate and late reports: every request still ends
    with exactly its length (the sum of accepted chunk tokens), and nothing runs twice at once."""
    rng = random.Random(7)
    core = make_core(policy, clock, workers=3, chunk_size=64, batch=8)
    lengths: dict[str, int] = {}
    for g in range(12):
        ls = [rng.randint(1, 400) for _ in range(4)]
        for rid, n in zip(add_group(core, f"g{g}", 4, max_tokens=400, lengths=ls), ls, strict=True):
            lengths[rid] = n
    got = dict.fromkeys(lengths, 0)
    finished: set[str] = set()
    dead: set[str] = set()
    next_worker = 3
    for _ in range(5000):
        if len(finished) == len(lengths):
            break
        clock.t += 0.01
        running: dict[str, tuple[str, int]] = {}
        for d in core.next_dispatches():
            assert d.request_id not in running and d.request_id not in finished
            running[d.request_id] = (d.worker_id, d.max_new_tokens)
        for rid, (wid, max_new) in running.items():
            fate = rng.random()
            if wid in dead or fate < 0.05:
                if wid not in dead:  # the worker dies mid-chunk; a fresh one joins
                    core.remove_worker(wid)
                    dead.add(wid)
                    core.add_worker(WorkerSpec(f"w{next_worker}", 10_000, 16, 8))
                    next_worker += 1
                n = min(max_new, lengths[rid] - got[rid])
                core.on_chunk_done(rid, wid, n, finished=False)  # late report: must be ignored
                continue
            if fate < 0.1:
                core.on_chunk_failed(rid, wid)
                continue
            n = min(max_new, lengths[rid] - got[rid])
            done = got[rid] + n == lengths[rid]
            core.on_chunk_done(rid, wid, n, finished=done)
            got[rid] += n
            if done:
                finished.add(rid)
            if rng.random() < 0.1:
                core.on_chunk_done(rid, wid, n, finished=done)  # duplicate report: ignored
    assert finished == set(lengths)
    assert got == lengths
    # The core's own count per request (recorded as the group's history) matches exactly: no late
    # or duplicate report was counted.
    for g in range(12):
        assert sorted(core.history(f"key-g{g}") or []) == sorted(lengths[f"g{g}-{i}"] for i in range(4))
    assert core.stats()["stale_reports"] > 0
    assert core.pending_count() == 0 and core.in_flight_count() == 0


def test_impossible_telemetry_quarantines_with_a_log_line(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    core = make_core("divided", clock, workers=2, quarantine_clear_reports=2)
    with caplog.at_level(logging.WARNING):
        core.update_worker("w1", free_pages=20_000, running=0, waiting=0)  # free > total
    assert core.is_quarantined("w1")
    assert any("quarantined" in r.getMessage() for r in caplog.records)
    assert "exceeds total_pages" in core.stats()["workers"]["w1"]["quarantine_reason"]
    add_group(core, "g", 4)
    assert {d.worker_id for d in core.next_dispatches()} == {"w0"}
    for bad in (
        {"free_pages": -1, "running": 0, "waiting": 0},
        {"free_pages": 5, "running": 0, "waiting": 0, "tokens_per_second": float("nan")},
        {"free_pages": 5, "running": 10**6, "waiting": 0},
        {"free_pages": 9000, "running": 0, "waiting": 0, "used_pages": 5000},
    ):
        core.update_worker("w0", **bad)  # type: ignore[arg-type]
        assert core.is_quarantined("w0"), bad
        core.remove_worker("w0")
        core.add_worker(WorkerSpec("w0", 10_000, 16, 64))
    core.update_worker("w1", free_pages=100, running=0, waiting=0)
    assert core.is_quarantined("w1")  # one sane report is not enough
    core.update_worker("w1", free_pages=100, running=0, waiting=0)
    assert not core.is_quarantined("w1")


def test_reported_external_usage_limits_admission(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1, pages=100, page_size=16, chunk_size=100)
    core.update_worker("w0", free_pages=5, running=0, waiting=0)  # 95 pages used by something else
    add_group(core, "g", 1)
    assert core.next_dispatches() == []
    core.update_worker("w0", free_pages=100, running=0, waiting=0)
    assert len(core.next_dispatches()) == 1


def test_anti_starvation(clock: FakeClock) -> None:
    """An older submission's request postponed by a newer submission's for over starvation_seconds
    goes first (more in test_core_starvation_submissions)."""
    core = make_core("oracle", clock, workers=1, batch=1, chunk_size=10, starvation_seconds=30.0)
    core.add_request(RequestInfo("short", "s", "ks", 0, 1, 8, 100, true_length=5, incarnation=1))
    core.add_request(RequestInfo("long", "l", "kl", 0, 1, 8, 100, true_length=100, incarnation=2))
    clock.t = 1.0
    d = core.next_dispatches()[0]
    assert d.request_id == "long"
    # The long request keeps winning while the short one has been postponed under 30 s ...
    for _ in range(2):
        clock.t += 10
        core.on_chunk_done("long", "w0", 10, finished=False)
        assert core.next_dispatches()[0].request_id == "long"
    clock.t += 25  # ... then the short one has starved and goes first.
    core.on_chunk_done("long", "w0", 10, finished=False)
    assert core.next_dispatches()[0].request_id == "short"
    assert core.stats()["starvation_dispatches"] == 1


@pytest.mark.parametrize("chunks", [0.0, 1.0])
def test_paused_request_resumes_after_a_chunk_length_wait(clock: FakeClock, chunks: float) -> None:
    """starvation_chunks: a request paused mid-response is resumed ahead of the order once it has
    waited longer than that many measured chunk durations; a request never started is not."""
    core = make_core("oracle", clock, workers=1, batch=1, chunk_size=10, starvation_chunks=chunks)
    add_group(core, "g", 1, lengths=[50])
    # Never started, and of the same submission as the others: nothing newer postpones it, so its
    # starvation clock never runs (starvation_seconds does not apply), however long it waits.
    add_group(core, "f", 1, lengths=[5])
    assert core.next_dispatches()[0].request_id == "g-0"
    clock.t = 5.0
    add_group(core, "h", 1, lengths=[500])  # outranks g from now on
    clock.t = 10.0
    core.on_chunk_done("g-0", "w0", 10, finished=False)  # a full chunk: 1 s per token
    assert core.next_dispatches()[0].request_id == "h-0"  # g is paused at t = 10
    assert core.paused_threshold() == (None if chunks == 0 else pytest.approx(10.0))
    clock.t = 19.0
    core.on_chunk_done("h-0", "w0", 10, finished=False)  # 0.9 s per token: the EMA moves to 0.99 s
    assert core.next_dispatches()[0].request_id == "h-0"  # g waited 9 s, under the threshold
    clock.t = 29.0
    core.on_chunk_done("h-0", "w0", 10, finished=False)
    d = core.next_dispatches()[0]  # g waited 19 s; f (never started, one submission) is not starved
    if chunks == 0:
        assert d.request_id == "h-0" and core.stats()["starvation_dispatches"] == 0
    else:
        assert d.request_id == "g-0" and core.stats()["starvation_dispatches"] == 1


def test_cancel(clock: FakeClock) -> None:
    core = make_core("seer", clock, workers=1, batch=1)
    add_group(core, "g", 2)
    d = core.next_dispatches()[0]
    core.cancel_request("g-1")
    core.cancel_request(d.request_id)
    core.on_chunk_done(d.request_id, d.worker_id, 5, finished=False)  # late: ignored
    assert core.pending_count() == 0 and core.in_flight_count() == 0
    assert core.next_dispatches() == []
    with pytest.raises(NotFound):
        core.cancel_request("never")


def test_new_tokens_out_of_range_is_rejected(clock: FakeClock) -> None:
    core = make_core("divided", clock, chunk_size=10)
    add_group(core, "g", 1)
    d = core.next_dispatches()[0]
    with pytest.raises(InvalidArgument) as e:
        core.on_chunk_done(d.request_id, d.worker_id, 11, finished=False)
    assert e.value.field == "new_tokens"
    core.on_chunk_done(d.request_id, d.worker_id, 10, finished=True)  # still consistent after


def test_one_decision_under_a_millisecond_with_10k_pending() -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="seer", chunk_size=512))
    for k in range(32):
        core.add_worker(WorkerSpec(f"w{k}", 10**6, 16, 10**6))
    rng = random.Random(1)
    for p in range(1250):
        add_group(core, f"g{p}", 8, prompt_len=rng.randint(16, 2048), max_tokens=32_000)
    cpu = []
    for i in range(300):
        c0 = time.thread_time()
        d = core.next_dispatches(limit=1)[0]
        cpu.append(time.thread_time() - c0)
        core.on_chunk_done(d.request_id, d.worker_id, rng.randint(1, 512), finished=i % 3 == 0)
    assert core.pending_count() > 9000
    assert sum(cpu) / len(cpu) < 1e-3


def test_small_workers_cap_the_imbalance_threshold(clock: FakeClock) -> None:
    """With 16-slot workers the paper's threshold of 32 would put a whole group (its prompt cached
    where its probe ran) on one worker; the cap (16 // 8 = 2) keeps the two within 3 requests."""
    core = make_core("seer", clock, workers=2, batch=16, load_imbalance_threshold=32)
    add_group(core, "g", 12)
    ds = core.next_dispatches()
    loads = [sum(d.worker_id == w for d in ds) for w in ("w0", "w1")]
    assert sum(loads) == 12 and abs(loads[0] - loads[1]) <= 3


def test_a_batch_id_submitted_again_brings_new_requests_under_the_old_ids(clock: FakeClock) -> None:
    """The buffer lets a batch id be used again once retention deleted the batch; its request and
    group ids are then the old ones (found by review, session 18: the core took the new requests
    for re-deliveries of the settled ones, so the scheduler failed the whole resubmitted batch)."""
    core = make_core("seer", clock, workers=1)

    def req(i: int, incarnation: int, max_tokens: int = 100) -> RequestInfo:
        return RequestInfo(f"b/0/{i}", "b/0", "k", i, 2, 10, max_tokens, incarnation=incarnation)

    assert core.add_request(req(0, 1)) and core.add_request(req(1, 1))
    for d in core.next_dispatches():
        core.on_chunk_done(d.request_id, d.worker_id, 100, True)
    assert core.pending_count() == 0
    assert not core.add_request(req(0, 1))  # a re-delivery of the settled request: idempotent
    assert core.add_request(req(0, 2)) and core.add_request(req(1, 2))  # the batch submitted again
    assert core.pending_count() == 2
    assert not core.add_request(req(1, 2))  # and its own re-delivery is idempotent again
    # Submitted a third time while the second is still held here (its cancellation was missed):
    # the old group's requests are dropped, the new group stands alone (not "already has 2").
    running = core.next_dispatches()
    assert len(running) == 2
    assert core.add_request(req(0, 3, max_tokens=50)) and core.add_request(req(1, 3, max_tokens=50))
    assert core.pending_count() == 2 and core.group_estimate("b/0") == 50
    for x in running:  # late reports of the dropped group's chunks are ignored
        core.on_chunk_done(x.request_id, x.worker_id, 100, True)
    assert core.pending_count() == 2
