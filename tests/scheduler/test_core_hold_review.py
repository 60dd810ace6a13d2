"""Review of the starvation hold (pure core): a held slot is not a free slot for the KV-bound
signal, and a hold or an anti-starvation entry never carries over to another request that reuses
the id (a batch id submitted again after a cancel)."""

from __future__ import annotations

import itertools

from services.scheduler.core import RequestInfo, SchedulerCore

from .conftest import HOLD_CHUNK as CHUNK
from .conftest import HOLD_PAGE as PAGE
from .conftest import FakeClock, add_big, add_small, held, hold_core, starve_big


def _batch_bound_run(with_big: bool, rounds: int = 80) -> SchedulerCore:
    """2 workers x 4 slots, ample KV, a steady backlog of small requests (batch-bound); with_big adds
    one request needing 990 of a worker's 1,000 pages, which starves and takes a hold."""
    clock = FakeClock()
    core = hold_core(clock, "seer", workers=2, pages=1000, batch=4, starvation_seconds=5.0)
    seq = itertools.count()
    for _ in range(8):
        add_small(core, next(seq))
    running = [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    assert len(running) == 8
    if with_big:
        core.add_request(RequestInfo("big", "gbig", "kbig", 0, 1, 990 * PAGE - CHUNK, 10_000))
    clock.t += 1.0
    for _ in range(4):
        add_small(core, next(seq))
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
        add_small(core, next(seq))
        running += [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    return core


def test_a_held_slot_does_not_make_a_batch_bound_cluster_kv_bound() -> None:
    assert not _batch_bound_run(with_big=False).kv_bound()
    core = _batch_bound_run(with_big=True)
    assert core.stats()["starvation_holds"] >= 1
    assert not core.kv_bound(), "one held slot read as 'a slot free, nothing fits': KV-bound"


def test_a_reused_request_id_neither_inherits_the_hold_nor_the_wait(clock: FakeClock) -> None:
    core = hold_core(clock, "seer", workers=2, starvation_seconds=5.0)
    starve_big(core, clock)
    # Submission 0 stays tracked (another request of it), so the cancelled "big"'s stale wait stays
    # in an age queue that is still read: a per-request enqueue count would match the new one's.
    core.add_request(RequestInfo("keep", "gkeep", "kkeep", 0, 1, 16, 64, incarnation=0))
    assert held(core), "the starved request took no hold"
    core.cancel_request("big")
    add_big(core, incarnation=2)
    core.next_dispatches()
    # Added just now: not starved, so no hold (the old request's anti-starvation entry, with the same
    # id and per-request enqueue count, made it look starved since t = 0).
    assert held(core) == {}
    assert core.stats()["starvation_holds"] == 1
