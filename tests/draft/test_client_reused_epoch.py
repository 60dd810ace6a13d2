"""GroupDelta.reused_epoch: a reused reset (the worker's incarnation completed before another run
registered the group id again) tells the new run's requests from the old run's by dispatch epoch,
not by "running here now". A new run's chunk that ran on this worker's stale mirror (still following
the old incarnation) and ended before the reset (a chunk ending at once on a complete output, a
short chunk within one sync tick) had its appends refused as the old incarnation's; dropped on the
reset as "not running", the new run's finished response never reached the new incarnation and the
group never completed there (no history).

Real draft server on a loopback port + the real DraftClient (background ticks stopped; flush()
drives them); the at-once case runs through the real worker core on the real reference engine."""

from __future__ import annotations

import logging
import tracemalloc

from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.store import _REUSED, _REUSED_PER_ID, DraftStore
from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from tests.draft.draft_helpers import PROMPT, finish, old_run, register, sync_one, workers


def test_a_new_run_response_that_ended_on_a_stale_mirror_reaches_the_new_incarnation() -> None:
    with workers(2) as (srv, (a, b)):
        old_run(a, b)
        # The new run registers the id (another group size: a new incarnation of the live, completed
        # group). A does not know the old one completed: its mirror serves the new run's r1.
        srv.store.register_group("g", "key", [1, 2, 3], 60, 1)
        assert a.has_group("g")
        a.resume("g", "r1", [], epoch=5)
        a.append("g", "r1", 0, [40, 41], finished=True)
        a.end("g", "r1")  # over before the next tick: its appends go out under the old incarnation
        for _ in range(3):
            a.flush()
        g = srv.store._groups["g"]
        assert srv.store.index_of("g").tokens("r0") == []  # the old run's r0 stays out
        assert srv.store.index_of("g").tokens("r1") == [40, 41]
        assert g.finished == {"r1"} and g.completed  # the new run's group completed: history
        assert (40, 41) in srv.store._history.responses("key")
        assert a._groups["g"].own == {"r1"}


def test_a_new_run_chunk_ending_at_once_on_a_stale_mirror_completes_the_new_incarnation(
        ref_engine: ReferenceEngine) -> None:
    """Real worker core on the real engine: the new run's chunk resumes a complete output (it ends
    with the model's EOS: ends at once, no tokens)."""
    output = (4, 5, ref_engine.eos_token_ids[0])
    with workers(2) as (srv, (a, b)):
        w = Worker(ref_engine, draft=a).start()
        try:
            old_run(a, b)
            srv.store.register_group("g", "key", PROMPT, 60, 1)
            job = ChunkJob(request_id="r1", prompt_token_ids=tuple(PROMPT), max_new_tokens=4, max_tokens=40,
                           sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                           prompt_key="key", group_size=1, output_token_ids=output, dispatch_epoch=9)
            toks, _, done = w.run(job)
            assert toks == [] and done.finish == ChunkFinish.STOP
            for _ in range(3):
                a.flush()
            g = srv.store._groups["g"]
            assert srv.store.index_of("g").tokens("r1") == list(output)
            assert g.completed
            assert output in srv.store._history.responses("key")
        finally:
            w.close()
        assert not ref_engine.has_unfinished()


def test_an_old_run_attempt_still_running_here_stays_out_of_the_new_incarnation() -> None:
    """A's attempt of r0 (epoch 1) was abandoned (B's newer attempt finished r0) but still runs on
    A. The reset is reused: A's r0 is the old run's although it runs here, so neither its copy nor
    its later tokens go to the new run's group (they carried its incarnation: accepted there)."""
    with workers(3) as (srv, (a, b, c)):
        register((a, b), group_size=2)
        a.resume("g", "r0", [], epoch=1)
        a.append("g", "r0", 0, [70, 71])
        a.flush()
        finish(b, "r0", [10, 11], epoch=2)
        finish(b, "r1", [20, 21], epoch=3)
        b.flush()
        assert srv.store._groups["g"].completed
        srv.store.register_group("g", "key", [1, 2, 3], 60, 3)  # another size: a new incarnation
        for _ in range(2):
            a.flush()
        assert "g" in a._groups  # r0 still drafts from it
        a.append("g", "r0", 2, [72])  # the abandoned attempt goes on
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == []
        assert a.own_length("g", "r0") == 3  # its copy stays local
        # The new run's r0 is its own (C), and its later epoch is not refused.
        register((c,), group_size=3)
        finish(c, "r0", [30, 31], epoch=6)
        c.flush()
        a.end("g", "r0")
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [30, 31]


def test_without_epochs_only_the_requests_running_here_are_the_new_runs() -> None:
    """reused_epoch 0 (the old run's appends carried no epoch): the rule before epochs, the
    requests running here now."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        for w, rid, toks in ((a, "r0", [10, 11]), (b, "r1", [20])):
            finish(w, rid, toks)
            w.flush()
        srv.store.register_group("g", "key", [1, 2, 3], 60, 3)
        a.resume("g", "r2", [])
        a.append("g", "r2", 0, [50])
        for _ in range(3):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == []
        assert srv.store.index_of("g").tokens("r2") == [50]


def test_the_server_reports_the_old_incarnations_largest_epoch(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    store, stub = draft_server[1], draft_stub
    store.register_group("g", "key", [1], 60, 2)
    store.append("g", "r0", 0, [5], epoch=7)
    store.append("g", "r0", 0, [5], finished=True, epoch=11, truncate=True)
    store.append("g", "r1", 0, [6], finished=True, epoch=9)
    first = store._groups["g"].incarnation
    store.register_group("g", "key", [1], 60, 1)  # completed: the id used again
    store.append("g", "r0", 0, [8], finished=True)  # no epochs: unknown
    second = store._groups["g"].incarnation
    store._groups["g"].expires_at = 0.0
    store.expire_now()
    store.register_group("g", "key", [1], 60, 1)
    d = sync_one(stub, "g", first)
    assert d.reset and d.reused and d.reused_epoch == 11
    d = sync_one(stub, "g", second)
    assert d.reset and d.reused and d.reused_epoch == 0
    d = sync_one(stub, "g", 12345)  # never seen: not reused, no epoch
    assert d.reset and not d.reused and d.reused_epoch == 0
    assert stub.GetDraftStats(draft_pb2.GetDraftStatsRequest()).remembered_ids_bytes > 0


def test_remembered_ids_are_reported_and_bounded() -> None:
    """Tombstones and completed incarnations per id (outside the memory budget) are reported in
    DraftStats.remembered_ids_bytes close to what they take (tracemalloc), the incarnations capped
    per id, and a tombstone's share goes when its id is registered again."""
    store = DraftStore()
    n = 2000
    ids = [f"batch-{i:06d}/group-{i % 16}" for i in range(n)]
    # Only what the draft store's own code allocates, with its info lines off: the process-wide
    # total also counts other threads' allocations, and log records the store makes (and a
    # capturing handler keeps) when an earlier test left the root logger at INFO.
    only_store = [tracemalloc.Filter(True, "*/services/draft/*")]
    logging.disable(logging.INFO)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(only_store)
        for gid in ids:
            for inc in range(5):  # a fifth incarnation pushes the first out
                store.register_group(gid, "", [1], 60, 1 + inc)
                store.append(gid, "r", 0, [5], finished=True, epoch=1 + inc)
                with store._lock:
                    g = store._groups[gid]
                    g.completed = True  # no prompt key (no history to measure): completed by hand
                    store._remove_group(g)
                    store._tombstone(gid, True)
        after = tracemalloc.take_snapshot().filter_traces(only_store)
        taken = sum(d.size_diff for d in after.compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    assert not store._groups
    reported = store.stats().remembered_ids_bytes
    assert all(len(v) == _REUSED_PER_ID * _REUSED.size for v in store._reused.values())
    assert taken * 0.9 <= reported <= taken * 1.5, (reported, taken)
    for gid in ids:
        store.register_group(gid, "", [1], 60, 99)
    # The tombstones went; the remembered incarnations stay (a worker may still follow one).
    assert 0 < store.stats().remembered_ids_bytes < reported


def test_an_old_run_response_synced_over_a_new_run_attempt_is_not_resent_as_the_new_runs() -> None:
    """The new run's r1 (epoch 5) ended on A's stale mirror before anyone registered the id again,
    and A's Sync of the old, completed incarnation brought the old run's finished r1 over A's copy
    before A's appends went out. Refused by the completed group, they make A register again with
    epoch 5 (a new incarnation: the same prompt, key and size), and the reused reset must not take
    the copy A holds now, by its epoch, for the new run's: the new incarnation would complete with
    the old run's response. (The new run's r1 is then lost to the draft server: see the README.)"""
    with workers(3) as (srv, (a, b, c)):
        old_run(a, b)
        old = srv.store._groups["g"].incarnation
        finish(a, "r1", [40, 41], epoch=5)
        a._sync()  # before the appends: the old run's r1 comes over A's copy
        for _ in range(3):
            a.flush()
        g = srv.store._groups["g"]
        assert g.incarnation != old  # A's re-registration (epoch 5) started the new run's group
        c.register_attempt("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60, request_id="r0", epoch=6)
        c.flush()
        assert srv.store._groups["g"] is g  # idempotent: the new run's own group
        assert srv.store.index_of("g").tokens("r1") == [] and not g.completed
