"""The worker's draft client names the attempt a resume, append or end is of (review of be89e51).

(1) Two attempts of one request overlapping in a mirror were told apart by start order only: an end
ended the earliest, wrong whenever the later-started one ends first (SGLang drops rids from its
batch in any order). Through SGLang's DraftBridge: r0#2 (epoch 2) finished and left the batch before
the aborted r0#1 (epoch 1); r0 stayed active, so r0#1's late token went out as truncate=True under
epoch 2, the server took it, re-opened the finished response, and the group never completed. Also a
newer submission's attempt lost its active mark (and its appends) when an older submission's
attempt that started after it ended first. Now resume, append and end take the attempt's dispatch
epoch and submission (the worker core and the bridge pass them): an end ends that attempt, an
attempt superseded by a newer one of the request appends nothing, and only an attempt not
superseded keeps the request active. (Review of a17dd1d: only an attempt running alongside
supersedes, not one that ended before, and a named end of an attempt not running here ends nothing.)
(2) _lost_locked's expired branch tested history_loaded, which end()'s whole-group restart clears: a
mirror that followed the group through Sync looked never-synced, and a new run's response that
ended on it was lost. Now a `synced` flag, kept across that restart.
(3) Worker.stats() copied the per-position proposed and accepted counts one after the other while
the step thread updated them: the pair could be torn (accepted above proposed at a position, or
lengths differing), which the scheduler quarantines a worker for; and it mixed the engine's list of
one with the worker's of the other. Now one immutable pair, and the engine's only when it keeps both.

Real draft server on a loopback port and the real DraftClient (background ticks stopped; flush()
drives them); the bridge without SGLang; the core over the fake engine (glue)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from draft_fakes import FixedPlanner, RecordingDraft
from worker_fake_engine import FakeEngine

from services.worker.core import ChunkJob, Worker
from services.worker.engine import Draft, EngineStats, SamplingParams, StepOutput
from services.worker.engines.sglang.plugin import DraftBridge, custom_params, request_meta
from tests.draft.draft_helpers import PROMPT, register, workers
from tests.draft.registration_helpers import expire, flush

# -- (1) attempts named by epoch and submission --------------------------------------------------


def test_an_older_submissions_attempt_started_later_and_ending_first_leaves_the_newer_one_active() -> None:
    """N (submission 2) of r0 starts first; then O (submission 1, older: left alone) starts; O ends
    first. N still runs: r0 stays active and N's appends reach the mirror."""
    with workers(1) as (_srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=5, submit_seq=2)
        a.flush()
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=6, submit_seq=2)
        a.resume("g", "r0", [], epoch=6, submit_seq=2)  # N
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=1, submit_seq=1)
        a.resume("g", "r0", [7], epoch=1, submit_seq=1)  # O: older submission, left alone
        m = a._groups["g"]
        a.append("g", "r0", 0, [8], epoch=1, submit_seq=1)  # O's token: dropped
        assert m.index.tokens("r0") == []
        a.end("g", "r0", epoch=1, submit_seq=1)  # O ends
        assert "r0" in m.active, "N still runs but r0 was deactivated"
        a.append("g", "r0", 0, [30, 31], epoch=6, submit_seq=2)
        a.append("g", "r0", 2, [32])  # unnamed (an older caller): the request's registration decides
        assert m.index.tokens("r0") == [30, 31, 32], "N's appends dropped"
        a.end("g", "r0", epoch=6, submit_seq=2)
        assert "r0" not in m.active and not m.attempts


def test_a_newer_attempt_ending_before_an_older_submissions_one_started_earlier_ends_the_mark() -> None:
    """O (submission 1, left alone) of r0 starts; then N (submission 2) starts; N ends first.
    Nothing that made r0 active runs any more: r0 is not active."""
    with workers(1) as (_srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=5, submit_seq=2)
        a.flush()
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=1, submit_seq=1)
        a.resume("g", "r0", [7], epoch=1, submit_seq=1)  # O
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=6, submit_seq=2)
        a.resume("g", "r0", [], epoch=6, submit_seq=2)  # N
        m = a._groups["g"]
        a.end("g", "r0", epoch=6, submit_seq=2)  # N ends first
        assert "r0" not in m.active, "r0 stays active after the only active-making attempt ended"
        a.end("g", "r0", epoch=1, submit_seq=1)
        assert not m.attempts


def test_a_newer_epoch_ending_first_ends_the_mark_and_the_abandoned_attempts_late_token_is_dropped() -> None:
    """A1 (epoch 1) streamed [10, 11]; A2 (epoch 2), re-dispatched here from [10], appends [12]
    finished and ends first (a short last chunk), while A1 is still in SGLang's batch. r0 is no longer
    active, and A1's late token does not go out as truncate+append re-opening the finished response."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        a.resume("g", "r0", [], epoch=1)  # A1
        a.append("g", "r0", 0, [10, 11], epoch=1)
        a.resume("g", "r0", [10], epoch=2)  # A2
        a.append("g", "r0", 1, [12], finished=True, epoch=2)
        a.end("g", "r0", epoch=2)  # A2 ends first
        m = a._groups["g"]
        assert "r0" not in m.active, "r0 stayed active after the newer attempt ended"
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 12] and "r0" in srv.store._groups["g"].finished
        a.append("g", "r0", 2, [13], epoch=1)  # A1's late token (aborted, still in the batch)
        assert not a._pending and m.index.tokens("r0") == [10, 12]  # neither sent nor indexed
        a.flush()
        a.end("g", "r0", epoch=1)  # A1 ends
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 12], "the newer attempt's finished response was re-opened"
        assert "r0" in srv.store._groups["g"].finished and not m.attempts


def test_an_unnamed_end_still_ends_the_earliest_attempt() -> None:
    """A caller that names no attempt (an older one): start order decides, as before."""
    with workers(1) as (_srv, (a,)):
        register((a,), group_size=2)
        a.resume("g", "r0", [], epoch=1)
        a.resume("g", "r0", [10], epoch=2)
        m = a._groups["g"]
        a.end("g", "r0")  # the earliest (epoch 1)
        assert "r0" in m.active and [r.epoch for r in m.attempts["r0"]] == [2]
        a.end("g", "r0")
        assert "r0" not in m.active and not m.attempts


def test_a_lower_epoch_after_an_ended_attempt_of_the_same_submission_is_the_requests_attempt() -> None:
    """(Review of a17dd1d, F1.) A scheduler restarted without its epoch_file behind the clock sends the
    same submission's next chunk of r0 at a LOWER epoch than r0's earlier chunk here, which ended. It
    was taken for superseded (the newest epoch that ever resumed r0 here): its resume kept the failed
    attempt's streamed token, r0 was not active, and its appends were dropped (the group never
    completed). Only an attempt running alongside supersedes; its appends carry the request's newest
    epoch here (the server took 100 and refuses 50)."""
    with workers(2) as (srv, (a, b)):
        for c in (a, b):
            c.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=100, submit_seq=1)
        a.flush()
        b.flush()
        a.resume("g", "r0", [], epoch=100, submit_seq=1)
        a.append("g", "r0", 0, [10, 11, 99], epoch=100, submit_seq=1)  # 99: streamed, never committed
        a.end("g", "r0", epoch=100, submit_seq=1)
        a.flush()
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=50, submit_seq=1)
        a.resume("g", "r0", [10, 11], epoch=50, submit_seq=1)
        m = a._groups["g"]
        assert m.index.tokens("r0") == [10, 11], "resume kept the failed attempt's uncommitted token"
        assert "r0" in m.active
        a.append("g", "r0", 2, [12, 13], finished=True, epoch=50, submit_seq=1)
        assert m.index.tokens("r0") == [10, 11, 12, 13], "the request's attempt's appends were dropped"
        a.end("g", "r0", epoch=50, submit_seq=1)
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 11, 12, 13]
        assert "r0" in srv.store._groups["g"].finished and "r0" not in m.active and not m.attempts


def test_a_lower_epoch_resuming_while_a_newer_attempt_runs_is_superseded() -> None:
    """Attempts running alongside are still ordered by epoch, whichever resumed first: the older one
    (a late resume) leaves the copy alone and appends nothing, and its end leaves the newer active."""
    with workers(1) as (_srv, (a,)):
        register((a,), group_size=2)
        a.resume("g", "r0", [10], epoch=2)
        a.resume("g", "r0", [], epoch=1)  # the abandoned attempt's late resume
        m = a._groups["g"]
        assert m.index.tokens("r0") == [10]
        queued = len(a._pending)
        a.append("g", "r0", 0, [7, 8], epoch=1)
        assert m.index.tokens("r0") == [10] and len(a._pending) == queued
        a.end("g", "r0", epoch=1)
        assert "r0" in m.active
        a.append("g", "r0", 1, [11], epoch=2)
        assert m.index.tokens("r0") == [10, 11]


def test_a_named_end_of_an_attempt_not_running_here_leaves_the_replacing_mirrors_attempt_alone() -> None:
    """(Review of a17dd1d, F2.) A (epoch 1) of r0 is superseded by B (epoch 2); B finishes, the group
    completes and a new run's attempt C of r0 (epoch 10) replaces the mirror while A's rid is still in
    SGLang's batch. A's late end matched nothing on the new mirror and fell back to the earliest
    entry: it ended C, which lost its active mark (Sync deltas then overwrote its copy)."""
    with workers(1) as (_srv, (a,)):
        register((a,), group_size=1)
        a.resume("g", "r0", [], epoch=1)  # A
        a.resume("g", "r0", [], epoch=2)  # B
        a.append("g", "r0", 0, [10], finished=True, epoch=2)
        a.end("g", "r0", epoch=2)
        a.flush()
        a.flush()
        m1 = a._groups["g"]
        assert m1.completed and not m1.active
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=10)  # a new run: replaced
        m2 = a._groups["g"]
        assert m2 is not m1
        a.resume("g", "r0", [], epoch=10)  # C
        a.end("g", "r0", epoch=1)  # A's late end
        assert "r0" in m2.active, "C still runs but lost its active mark to A's end"
        assert [r.epoch for r in m2.attempts["r0"]] == [10]
        a.end("g", "r0", epoch=10)
        assert "r0" not in m2.active and not m2.attempts


def test_a_named_end_still_ends_an_attempt_started_unnamed() -> None:
    """A caller that resumed without naming the attempt and ends it by name (its epoch known by then)
    ends that unnamed attempt."""
    with workers(1) as (_srv, (a,)):
        register((a,), group_size=2)
        a.resume("g", "r0", [])
        m = a._groups["g"]
        a.end("g", "r0", epoch=3)
        assert "r0" not in m.active and not m.attempts


def test_through_the_bridge_a_newer_rid_finishing_first_leaves_the_response_finished() -> None:
    """Through SGLang's DraftBridge: r0#2 (epoch 2) finishes and leaves the batch first; r0#1 (epoch
    1, aborted but still in the batch) verifies one more token, then leaves."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        bridge = DraftBridge(a)
        inp = [*PROMPT]
        old = request_meta(custom_params("g", "key", 2, False, request_id="r0", output_offset=0, epoch=1))
        new = request_meta(custom_params("g", "key", 2, False, request_id="r0", output_offset=1, epoch=2))
        bridge.verified("r0#1", old, inp, [10, 11], False)
        bridge.verified("r0#2", new, [*inp, 10], [12], True)  # finishes: ends r0#2
        a.flush()
        assert "r0" in srv.store._groups["g"].finished
        assert "r0" not in a._groups["g"].active
        bridge.verified("r0#1", old, inp, [10, 11, 13], False)  # the abandoned rid's late token
        a.flush()
        bridge.forget("r0#1")
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 12] and "r0" in srv.store._groups["g"].finished


def test_the_bridge_names_every_call_of_an_attempt_by_its_epoch_and_submission() -> None:
    sink = RecordingDraft()  # takes attempt names, as DraftClient does
    bridge = DraftBridge(sink)
    meta = request_meta(custom_params("g", "key", 2, False, request_id="r0", epoch=4, submit_seq=9))
    bridge.verified("r0#1", meta, [*PROMPT], [10], False)
    bridge.forget("r0#1")
    assert sink.named() == [("resume", "r0", 4, 9), ("append", "r0", 4, 9), ("end", "r0", 4, 9)]


def _job(**kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id="r0", prompt_token_ids=(1, 2, 3), max_new_tokens=3, max_tokens=20,
                                sampling=SamplingParams(temperature=0.0), policy_version=0, group_id="g0",
                                prompt_key="k0", group_size=2, dispatch_epoch=7, submit_seq=3)
    base.update(kw)
    return ChunkJob(**base)


def test_the_worker_core_names_every_draft_call_of_a_chunk_by_its_epoch_and_submission() -> None:
    draft = RecordingDraft()
    w = Worker(FakeEngine(), draft=draft, planner=FixedPlanner(2), gamma_max=4).start()
    try:
        w.run(_job())
        w.run(_job(request_id="r1", output_token_ids=tuple(range(4, 24)), dispatch_epoch=8))  # complete: at once
    finally:
        w.close()
    named = draft.named()
    r0 = [c for c in named if c[1] == "r0"]
    assert r0[0] == ("resume", "r0", 7, 3) and r0[-1] == ("end", "r0", 7, 3)
    assert {c for c in r0[1:-1]} == {("append", "r0", 7, 3)}
    assert [c for c in named if c[1] == "r1"] == [("resume", "r1", 8, 3), ("append", "r1", 8, 3),
                                                  ("end", "r1", 8, 3)]


# -- (2) a synced mirror stays synced across end()'s restart -------------------------------------


def test_a_synced_mirror_restarted_by_end_is_still_stale_for_an_expired_group() -> None:
    """A followed g through Sync; an end() with resync restarted its mirror (history_loaded False,
    incarnation kept). Before A's next Sync, the old run completes on B and the group expires; a new
    run's r1 (epoch 9) ends at once on A. A registers again (a stale mirror), and r1 reaches the new
    run's incarnation (was: taken for never synced, the mirror was released and r1 lost)."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        a.resume("g", "r0", [], epoch=1)
        a.append("g", "r0", 0, [10], epoch=1)
        a.flush()
        b.flush()
        b.resume("g", "r0", [10], epoch=2)  # r0 taken over by B
        b.append("g", "r0", 1, [11, 12], finished=True, epoch=2)
        b.end("g", "r0", epoch=2)
        b.flush()
        a.flush()  # A's Sync: another writer changed r0 while it ran here
        m = a._groups["g"]
        assert "r0" in m.resync and m.synced
        a.end("g", "r0", epoch=1)  # restart: history_loaded False, incarnation and synced kept
        assert m.incarnation and not m.history_loaded and m.synced
        b.resume("g", "r1", [], epoch=3)
        b.append("g", "r1", 0, [20], finished=True, epoch=3)
        b.end("g", "r1", epoch=3)
        b.flush()
        assert srv.store._groups["g"].completed
        expire(srv.store)
        # the new run's r1 ends at once on A's stale mirror
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=9)
        a.resume("g", "r1", [40, 41], epoch=9)
        a.append("g", "r1", 2, [], finished=True, epoch=9)
        a.end("g", "r1", epoch=9)
        flush(a)
        assert "g" in srv.store._groups and srv.store.index_of("g").tokens("r1") == [40, 41]


def test_a_mirror_is_synced_only_once_a_sync_reply_applied() -> None:
    with workers(1) as (_srv, (a,)):
        a.register_group("g", "key", PROMPT, group_size=2, ttl_seconds=60)
        a._register_pending()
        m = a._groups["g"]
        assert m.registered and m.incarnation and not m.synced  # the registration's answer only
        a.flush()
        assert m.synced


# -- (3) per-position draft counts: one consistent pair ------------------------------------------


class _StepsWhileRead:
    """An engine's empty per-position list whose reading runs a step's acceptance update first:
    the step thread updating the worker's counts between stats()'s reads, deterministically."""

    def __init__(self, step: Any) -> None:
        self.step = step

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[int]:
        self.step()
        return iter(())


def _observe(w: Worker) -> None:
    out = StepOutput("r0", [5, 6, 7], [0.0] * 3, num_draft_tokens=2, num_accepted=2)
    w._observe_acceptance([out], {"r0": Draft.chain([5, 6])})


def test_stats_per_position_counts_are_one_pair_when_a_step_updates_them_during_the_read() -> None:
    engine = FakeEngine()
    w = Worker(engine, draft=RecordingDraft(), planner=FixedPlanner(2), gamma_max=4)
    stats = engine.stats()
    stats.accepted_per_position = _StepsWhileRead(lambda: _observe(w))  # type: ignore[assignment]
    engine.stats = lambda: stats  # type: ignore[method-assign]
    st = w.stats()
    # Was proposed [] with accepted [1, 1, 0, 0]: the update landed between the two reads.
    assert len(st.proposed_per_position) == len(st.accepted_per_position)
    assert all(a <= p for p, a in zip(st.proposed_per_position, st.accepted_per_position, strict=True))
    assert w.stats().proposed_per_position == [1, 1, 0, 0]


def test_stats_never_mix_the_engines_counts_of_one_kind_with_the_workers_of_the_other() -> None:
    engine = FakeEngine()
    w = Worker(engine, draft=RecordingDraft(), planner=FixedPlanner(2), gamma_max=4)
    _observe(w)
    stats = engine.stats()
    stats.proposed_per_position = [9, 9]  # the engine keeps proposed only
    engine.stats = lambda: stats  # type: ignore[method-assign]
    st = w.stats()
    assert (st.proposed_per_position, st.accepted_per_position) == ([1, 1, 0, 0], [1, 1, 0, 0])


def test_position_counts_take_the_engines_pair_only_when_it_keeps_both() -> None:
    from services.worker.core import _position_counts  # (imported here: the other tests run on any core)

    es = EngineStats(total_pages=1, free_pages=1, page_size=1, running=0, waiting=0, tokens_per_second=0.0,
                     model_version="v", proposed_per_position=[4, 2], accepted_per_position=[3, 1])
    assert _position_counts(es, ((1,), (1,))) == ([4, 2], [3, 1])
    es.accepted_per_position = []
    assert _position_counts(es, ((1,), (0,))) == ([1], [0])
