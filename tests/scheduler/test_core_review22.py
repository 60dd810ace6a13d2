"""Core regressions of the session-22 review: the baseline keeps no per-request queue entries after
its requests finish, and a group cut by cancellation leaves no history (its finished members are its
shortest: as the next iteration's prior they would rank the prompt too low)."""

from __future__ import annotations

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec

from .conftest import FakeClock


def _group(core: SchedulerCore, gid: str, key: str, size: int = 4, max_tokens: int = 1000) -> None:
    for s in range(size):
        core.add_request(RequestInfo(f"{gid}-{s}", gid, key, s, size, 10, max_tokens, incarnation=1))


def test_the_baseline_keeps_nothing_per_finished_request(clock: FakeClock) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="baseline"), clock=clock)
    core.add_worker(WorkerSpec("w0", total_pages=100_000, page_size=16, max_batch_size=64))
    for it in range(20):
        for g in range(10):
            _group(core, f"i{it}-g{g}", f"k{g}", max_tokens=100)
        for d in core.next_dispatches():
            core.on_chunk_done(d.request_id, d.worker_id, 50, finished=True)
    assert core.pending_count() == 0 and core.in_flight_count() == 0
    # Was one entry per request ever enqueued (800 here), for the scheduler's life.
    assert core._starvation._subs == {} and len(core._paused_q.items) == 0


def test_a_group_cut_by_cancellation_leaves_no_history(clock: FakeClock) -> None:
    core = SchedulerCore(SchedulerPolicyConfig(policy="seer_history", chunk_size=100), clock=clock)
    core.add_worker(WorkerSpec("w0", total_pages=100_000, page_size=16, max_batch_size=64))
    core.set_history("key", [300, 400, 500, 900])  # the previous iteration
    _group(core, "ga", "key")
    first, *rest = core.next_dispatches()
    core.on_chunk_done(first.request_id, first.worker_id, 20, finished=True)  # the short one finishes
    for d in rest:
        core.on_chunk_done(d.request_id, d.worker_id, 100, finished=False)
    for d in rest:
        core.cancel_request(d.request_id)  # the batch is cancelled
    assert core.history("key") == [300, 400, 500, 900]  # not [20]
    # A group whose every member finished is the prompt's newest iteration.
    _group(core, "gb", "key")
    while core.pending_count() or core.in_flight_count():
        for d in core.next_dispatches():
            core.on_chunk_done(d.request_id, d.worker_id, 100, finished=True)
    assert core.history("key") == [100, 100, 100, 100]
