"""Review of the starvation hold (pure core): a held slot is not a free slot for the KV-bound
signal, and a hold or an anti-starvation entry never carries over to another request that reuses
the id (a batch id submitted again after a cancel)."""

from __future__ import annotations

import itertools

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec

from .conftest import FakeClock

PAGE, CHUNK = 16, 64


def _held(core: SchedulerCore) -> dict[str, tuple[str | None, int]]:
    return {w.worker_id: (w.held_for, w.held_pages) for w in core._workers.values() if w.held_for}


def _batch_bound_run(with_big: bool, rounds: int = 80) -> SchedulerCore:
    """2 workers x 4 slots, ample KV, a steady backlog of small requests (batch-bound); with_big adds
    one request needing 990 of a worker's 1,000 pages, which starves and takes a hold."""
    clock = FakeClock()
    core = SchedulerCore(SchedulerPolicyConfig(policy="seer", chunk_size=CHUNK, starvation_seconds=5.0), clock=clock)
    for k in range(2):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=1000, page_size=PAGE, max_batch_size=4))
    seq = itertools.count()

    def small() -> None:
        n = next(seq)
        core.add_request(RequestInfo(f"s{n}", f"g{n}", f"k{n}", 0, 1, 32, CHUNK))

    for _ in range(8):
        small()
    running = [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    assert len(running) == 8
    if with_big:
        core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, 990 * PAGE - CHUNK, 10_000))
    clock.t += 1.0
    for _ in range(4):
        small()
    clock.t += 10.0
    core.next_dispatches()
    for rid, wid in list(running):  # one chunk ends on w0 (its others run long); then only w1's turn over
        if wid == "w0":
            running.remove((rid, wid))
            core.on_chunk_done(rid, wid, CHUNK, True)
            break
    for _ in range(rounds):
        clock.t += 0.1
        rid, wid = next((r, w) for r, w in running if w == "w1")
        running.remove((rid, wid))
        core.on_chunk_done(rid, wid, CHUNK, True)
        small()
        running += [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    return core


def test_a_held_slot_does_not_make_a_batch_bound_cluster_kv_bound() -> None:
    assert not _batch_bound_run(with_big=False).kv_bound()
    core = _batch_bound_run(with_big=True)
    assert core.stats()["starvation_holds"] >= 1
    assert not core.kv_bound(), "one held slot read as 'a slot free, nothing fits': KV-bound"


def test_a_reused_request_id_neither_inherits_the_hold_nor_the_wait() -> None:
    clock = FakeClock()
    core = SchedulerCore(SchedulerPolicyConfig(policy="seer", chunk_size=CHUNK, starvation_seconds=5.0), clock=clock)
    for k in range(2):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=40, page_size=PAGE, max_batch_size=64))
    for n in range(12):
        core.add_request(RequestInfo(f"s{n}", f"g{n}", f"k{n}", 0, 1, 32, CHUNK))
    core.next_dispatches()
    core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, 400, 1000))
    clock.t += 10
    assert core.next_dispatches() == []
    assert _held(core), "the starved request took no hold"
    core.cancel_request("big")
    core.add_request(RequestInfo("big", "gbig2", "kbig", 0, 1, 400, 1000, incarnation=2))
    core.next_dispatches()
    # Added just now: not starved, so no hold (the old request's anti-starvation entry, with the same
    # id and per-request enqueue count, made it look starved since t = 0).
    assert _held(core) == {}
    assert core.stats()["starvation_holds"] == 1
