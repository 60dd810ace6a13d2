"""Final read of the worker's submit_seq logic (DraftClient resets, old_run_seqs, older attempts):

- F1: a plain reset (not reused) to the mirror's own submission counted every request of the run as
  the new run's: a worker that knew its group completed re-created it on a restarted server, and the
  group completed (and became history) a second time. The submit_seq version of session 17's
  test_a_group_completed_here_is_not_re_created_on_a_restarted_server.
- F2: a reset put the mirror's own run (a plain reset to an older run's incarnation) or a newer one
  queued meanwhile into old_run_seqs, and dropped the running request's local copy: the request's
  appends stayed local for good and its response never reached the group.
- F3: an older submission's chunk of a request with no recorded submission yet overwrote the
  mirror's copy (the newer run's, through Sync) with the old output.

Real draft server on a loopback port and real DraftClients (background ticks stopped; flush()
drives them)."""

from __future__ import annotations

from typing import Any

from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import PROMPT, workers
from tests.draft.registration_helpers import flush


def _attempt(c: DraftClient, rid: str, epoch: int, seq: int, output: tuple[int, ...] = ()) -> None:
    """A chunk of `rid` in group "g" (size 2) starts on `c`, as the worker core starts one."""
    c.register_attempt("g", "key", PROMPT, 2, 60, request_id=rid, epoch=epoch, submit_seq=seq)
    c.resume("g", rid, list(output), epoch=epoch)


def _finish(c: DraftClient, rid: str, toks: list[int], epoch: int, seq: int) -> None:
    _attempt(c, rid, epoch, seq)
    c.append("g", rid, 0, toks, finished=True)
    c.end("g", rid)


def test_f1_a_group_completed_here_is_not_re_created_by_a_plain_reset_of_its_own_submission() -> None:
    with workers(2) as (srv, (a, b)):
        _finish(b, "r1", [20, 21], 2, 7)
        b.flush()
        _finish(a, "r0", [10, 11, 12], 1, 7)
        a.flush()
        assert a._groups["g"].completed and not b._groups["g"].completed  # B's mirror is stale
        assert srv.store.stats().history_keys == 1
        srv.restart()
        flush(b, times=3)  # B's stale mirror re-creates the group (same run, submission 7)
        assert srv.store._groups["g"].finished == {"r1"}
        flush(a, times=3)  # A's next Sync: a plain reset carrying submit_seq 7, its own run's
        g = srv.store._groups["g"]
        # Was: r0 resent, the group completed again and became history a second time.
        assert g.finished == {"r1"} and not g.completed
        assert srv.store.stats().history_keys == 0
        assert not a.has_group("g") and "g" not in a._groups


def test_f2_a_plain_reset_to_an_older_runs_incarnation_keeps_the_running_request_of_the_mirrors_run() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(b, "r1", 40, 5)  # a mirror of the older run 5 on B
        b.append("g", "r1", 0, [1])
        b.flush()
        srv.restart()  # the server forgets run 5
        _finish(a, "r0", [10], 50, 7)
        _finish(a, "r1", [20], 51, 7)
        flush(a, times=2)
        assert a._groups["g"].completed
        _attempt(a, "r0", 52, 7)  # a retry of run 7's r0 (a lost commit) on the completed mirror
        a.append("g", "r0", 0, [10, 11])
        srv.restart()
        flush(b, times=3)  # run 5's straggler re-creates the id on the restarted server
        assert srv.store._groups["g"].submit_seq == 5
        flush(a, times=4)  # plain reset to run 5's incarnation; A registers run 7 again
        m = a._groups["g"]
        assert m.submit_seq == 7 and 7 not in m.old_run_seqs  # was {5, 7}: r0's appends kept local
        assert m.index.tokens("r0") == [10, 11] and "r0" in m.own  # was [] and not ours
        assert srv.store._groups["g"].submit_seq == 7
        assert srv.store.index_of("g").tokens("r0") == [10, 11]
        a.append("g", "r0", 2, [12], finished=True)
        a.end("g", "r0")
        flush(a, times=3)
        assert srv.store.index_of("g").tokens("r0") == [10, 11, 12]  # was [] (a gap, dropped)
        assert "r0" in srv.store._groups["g"].finished


def test_f2_a_newer_submission_queued_during_a_reused_reset_is_no_old_run() -> None:
    with workers(3) as (srv, (a, b, c)):
        _finish(a, "r0", [10, 11, 12], 50, 5)
        a.flush()
        _finish(b, "r1", [20, 21], 60, 5)
        b.flush()
        assert not a._groups["g"].completed and srv.store._groups["g"].completed
        _finish(c, "r1", [30], 70, 7)  # run 7 registers the id again (on C)
        flush(c, times=3)
        assert srv.store._groups["g"].submit_seq == 7
        stub = a._stub
        assert stub is not None
        real = stub.Sync

        def racing_sync(req: Any, timeout: float | None = None) -> Any:
            resp = real(req, timeout=timeout)
            _attempt(a, "r0", 80, 8)  # run 8's chunk of r0 starts while the reused reset is on its way
            a.append("g", "r0", 0, [90])
            stub.Sync = real
            return resp

        stub.Sync = racing_sync
        a.flush()
        m = a._groups["g"]
        assert 8 not in m.old_run_seqs  # was {5, 8}: run 8's request taken for an old run's
        assert m.index.tokens("r0") == [90]
        flush(a, times=4)  # A registers run 8; the server replaces run 7's group (a reused reset)
        g = srv.store._groups["g"]
        assert g.submit_seq == 8 and m.submit_seq == 8
        assert 8 not in m.old_run_seqs and "r0" in m.own
        assert not a._old_run_locked(m, "r0")
        assert srv.store.index_of("g").tokens("r0") == [90]  # resent with the reset (was [])
        a.append("g", "r0", 1, [91, 92], finished=True)
        a.end("g", "r0")
        flush(a, times=3)
        assert srv.store.index_of("g").tokens("r0") == [90, 91, 92]  # was [] (appends kept local)
        assert "r0" in srv.store._groups["g"].finished


def test_f3_an_older_submissions_chunk_of_a_request_with_no_recorded_one_leaves_the_copy_alone() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(b, "r0", 10, 7)
        b.append("g", "r0", 0, [5, 6])
        b.flush()
        _attempt(a, "r1", 11, 7)  # A's mirror is run 7's
        flush(a, times=2)
        assert a._groups["g"].index.tokens("r0") == [5, 6]  # B's copy, through Sync
        _attempt(a, "r0", 3, 5, output=(1,))  # a late chunk of r0 of the older run 5
        a.append("g", "r0", 1, [1])
        m = a._groups["g"]
        assert "r0" in m.older_attempts and "r0" not in m.active
        assert m.index.tokens("r0") == [5, 6]  # was [1, 1]: the old output over run 7's copy
        a.end("g", "r0")
        flush(a, times=2)
        assert srv.store.index_of("g").tokens("r0") == [5, 6]


def test_a_group_lost_on_the_server_keeps_the_local_copy_of_a_request_running_here() -> None:
    """A server restart (the group gone): the mirror started over with its own responses only, so
    a chunk running here that is not one of them (a late chunk of an older submission) lost its
    copy, and its next append was dropped as a gap: it drafted without its own tokens (review).
    The copy stays local; only our own responses are resent."""
    with workers(1) as (srv, (a,)):
        _attempt(a, "r0", 1, 5)
        a.append("g", "r0", 0, [1])
        a.end("g", "r0")
        flush(a, times=2)
        _attempt(a, "r1", 2, 7)
        a.append("g", "r1", 0, [9])
        a.end("g", "r1")
        flush(a, times=3)
        m = a._groups["g"]
        assert m.submit_seq == 7
        _attempt(a, "r0", 3, 5, output=(1,))  # run 5's straggler chunk
        a.append("g", "r0", 1, [2])
        assert "r0" in m.active and "r0" not in m.own and m.index.tokens("r0") == [1, 2]
        srv.restart()
        flush(a, times=3)
        m = a._groups["g"]
        assert m.index.tokens("r0") == [1, 2]
        a.append("g", "r0", 2, [3])
        assert m.index.tokens("r0") == [1, 2, 3]
        flush(a, times=2)
        group = srv.store._groups["g"]
        assert group.submit_seq == 7 and "r0" not in group.index.request_ids()  # not resent
