"""Review of the RegisterGroup epoch rule (session 26): two new-run finishes refused in one batch
keep their finished state, and a group of unknown size (0) stays one incarnation."""

from __future__ import annotations

from dataclasses import replace

from services.worker.core import ChunkJob, Worker
from services.worker.draft_client import DraftClient
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from tests.draft.draft_helpers import finish, register, workers


def _old_run3(a: DraftClient, b: DraftClient) -> None:
    """Old run, group of 3: A finishes r0; B finishes r1, r2 after A's last Sync (A stale)."""
    register((a, b), group_size=3)
    finish(a, "r0", [10, 11], epoch=1)
    a.flush()
    for rid, e in (("r1", 2), ("r2", 3)):
        finish(b, rid, [20 + e, 21], epoch=e)
    b.flush()
    assert not a._groups["g"].completed


def test_two_new_run_finishes_refused_in_one_batch_both_stay_finished() -> None:
    """r1 (epoch 9) and r2 (epoch 8: dispatched earlier, ended later) end on A's stale mirror in one
    batch; the completed old group refuses both. Before: r2's refusal fell through to 'our finish did
    not apply' (its epoch was below the re-registration's), so it was resent unfinished and the new
    incarnation never completed."""
    with workers(2) as (srv, (a, b)):
        _old_run3(a, b)
        old = srv.store._groups["g"]
        for rid, e, toks in (("r1", 9, [40, 41]), ("r2", 8, [50, 51])):
            a.register_attempt("g", "key", [1, 2, 3], 3, 60, request_id=rid, epoch=e)
            finish(a, rid, toks, epoch=e)
        for _ in range(4):
            a.flush()
        g = srv.store._groups["g"]
        assert g is not old
        assert srv.store.index_of("g").tokens("r1") == [40, 41]
        assert srv.store.index_of("g").tokens("r2") == [50, 51]
        assert g.finished == {"r1", "r2"}, g.finished


def test_a_group_of_unknown_size_stays_one_incarnation(ref_engine: ReferenceEngine) -> None:
    """group_size 0 (unknown) was registered as 1: the group completed at its first finish, and the
    next request of the same run (a later epoch) started a new incarnation, dropping its sibling."""
    with workers(1) as (srv, (a,)):
        w = Worker(ref_engine, draft=a).start()
        try:
            base = ChunkJob(request_id="r0", prompt_token_ids=(1, 2, 3), max_new_tokens=3, max_tokens=3,
                            sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                            prompt_key="key", group_size=0, dispatch_epoch=1)
            w.run(base)
            a.flush()
            a.flush()
            inc0 = srv.store._groups["g"].incarnation
            w.run(replace(base, request_id="r1", dispatch_epoch=2))
            a.flush()
            a.flush()
            g = srv.store._groups["g"]
            assert g.incarnation == inc0, "the same run's second request started a new incarnation"
            assert not g.completed
        finally:
            w.close()
