"""GroupDelta.submit_seq / reused_submit_seq: a worker's mirror that followed a completed group's
old incarnation tells the new run's requests from the old run's by the buffer's submission
(RunChunkRequest.submit_seq, kept per request from its chunk), not by dispatch epoch. After a
scheduler restart without its epoch_file behind a clock that went back, the new run's epochs are at
most the old incarnation's largest (reused_epoch): judged by epochs, the new run's request on the
stale mirror was taken for the old run's, its appends were kept local and its response never
reached the new incarnation from that worker (also while its chunk ran: resume kept the old run's
larger epoch for the request).

Real draft server on a loopback port + the real DraftClient (background ticks stopped; flush()
drives them)."""

from __future__ import annotations

from collections.abc import Sequence

from seer.v1 import draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import PROMPT, sync_one, workers

OLD_SEQ, NEW_SEQ = 100, 200


def _attempt(c: DraftClient, rid: str, epoch: int, seq: int, size: int = 2) -> None:
    """A chunk of `rid` in group "g" starts on `c` (as the worker core calls it: register, resume)."""
    c.register_attempt("g", "key", PROMPT, size, 60, request_id=rid, epoch=epoch, submit_seq=seq)
    c.resume("g", rid, [], epoch=epoch)


def _finish(c: DraftClient, rid: str, tokens: Sequence[int], epoch: int, seq: int) -> None:
    _attempt(c, rid, epoch, seq)
    c.append("g", rid, 0, tokens, finished=True)
    c.end("g", rid)


def _old_run(a: DraftClient, b: DraftClient) -> None:
    """The old run (submission OLD_SEQ, epochs 50 and 60): A finishes r0, then B finishes r1 after
    A's last Sync, so A's mirror still follows the old incarnation, not knowing it completed."""
    _finish(a, "r0", [10, 11, 12], epoch=50, seq=OLD_SEQ)
    a.flush()
    _finish(b, "r1", [20, 21], epoch=60, seq=OLD_SEQ)
    b.flush()
    assert not a._groups["g"].completed


def test_a_new_run_after_the_clock_went_back_reaches_the_new_incarnation_from_a_stale_mirror() -> None:
    with workers(2) as (srv, (a, b)):
        _old_run(a, b)
        old_inc = a._groups["g"].incarnation
        # The scheduler restarted behind a clock gone back: the new run's epochs (5, 6) are below
        # the old run's. A's stale mirror serves the new run's r0 (the same request id, which ran
        # here at epoch 50 in the old run).
        _finish(a, "r0", [40, 41], epoch=5, seq=NEW_SEQ)
        for _ in range(3):
            a.flush()
        g = srv.store._groups["g"]
        assert g.incarnation != old_inc and g.submit_seq == NEW_SEQ
        assert srv.store.index_of("g").tokens("r0") == [40, 41]  # the new run's, from A
        assert g.finished == {"r0"}
        assert srv.store.index_of("g").tokens("r1") == []  # the old run's r1 stays out
        assert a._groups["g"].own == {"r0"}
        # Its appends were stamped with its own attempt's epoch, not the old run's 50 kept before.
        assert a._groups["g"].epochs["r0"] == 5
        # B's new-run r1 (epoch 6) completes the new incarnation: history.
        _finish(b, "r1", [30], epoch=6, seq=NEW_SEQ)
        for _ in range(3):
            b.flush()
        assert srv.store._groups["g"].completed
        assert (40, 41) in srv.store._history.responses("key")


def test_a_new_run_attempt_running_through_the_reset_keeps_sending() -> None:
    """The new run's r0 still runs on A when the reused reset comes: its copy goes to the new
    incarnation and its later tokens too (an epoch at most reused_epoch kept them local)."""
    with workers(2) as (srv, (a, b)):
        _old_run(a, b)
        _attempt(a, "r0", epoch=5, seq=NEW_SEQ)
        a.append("g", "r0", 0, [40])
        for _ in range(3):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == [40]
        a.append("g", "r0", 1, [41, 42], finished=True)
        a.end("g", "r0")
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [40, 41, 42]
        assert srv.store._groups["g"].finished == {"r0"}


def test_an_old_run_attempt_still_running_stays_out_whatever_its_epoch() -> None:
    """A's abandoned old-run attempt of r0 (submission OLD_SEQ) still runs when C's new run (a
    lower epoch) reused the id: its copy and its later tokens stay local (judged by submission)."""
    with workers(3) as (srv, (a, b, c)):
        _attempt(a, "r0", epoch=50, seq=OLD_SEQ)
        a.append("g", "r0", 0, [70, 71])
        a.flush()
        _finish(b, "r0", [10, 11], epoch=55, seq=OLD_SEQ)
        _finish(b, "r1", [20, 21], epoch=60, seq=OLD_SEQ)
        b.flush()
        assert srv.store._groups["g"].completed
        _finish(c, "r1", [30], epoch=3, seq=NEW_SEQ)  # the new run, registered by C
        for _ in range(3):
            c.flush()
        assert srv.store._groups["g"].submit_seq == NEW_SEQ
        for _ in range(2):
            a.flush()
        assert "g" in a._groups  # r0 still drafts from it
        a.append("g", "r0", 2, [72])
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == []
        assert a.own_length("g", "r0") == 3
        assert srv.store.index_of("g").tokens("r1") == [30]


def test_the_server_reports_both_incarnations_submissions(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    store, stub = draft_server[1], draft_stub
    store.register_group("g", "key", [1], 60, 1, epoch=9, submit_seq=OLD_SEQ)
    store.append("g", "r0", 0, [5], finished=True, epoch=9)
    first = store._groups["g"].incarnation
    store.register_group("g", "key", [1], 60, 1, epoch=2, submit_seq=NEW_SEQ)  # another run
    assert store._groups["g"].incarnation != first
    d = sync_one(stub, "g", first)
    assert d.reset and d.reused and d.reused_epoch == 9
    assert d.reused_submit_seq == OLD_SEQ and d.submit_seq == NEW_SEQ
    d = sync_one(stub, "g", 12345)  # never seen: not reused; the group's submission still told
    assert d.reset and not d.reused and d.reused_submit_seq == 0 and d.submit_seq == NEW_SEQ
    d = sync_one(stub, "g", store._groups["g"].incarnation, watermark=0)  # no reset: not sent
    assert not d.reset and d.submit_seq == 0
