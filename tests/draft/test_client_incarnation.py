"""The worker's DraftClient stamps its appends with the group incarnation its mirror follows
(AppendRequest.incarnation, session 25), against a real draft server on a loopback port: a late
append of an old incarnation stays out of the group id registered again by another run; a restarted
server (nothing held) still takes the worker's resent responses (incarnation 0 while the mirror has
none); and a refused append is not refused forever (the next Sync resets the mirror, even for a group
whose every response runs here). Background ticks are stopped; flush() drives them."""

from __future__ import annotations

from services.draft.store import DraftStore
from tests.draft.draft_helpers import finish, register, workers


def _incarnation(store: DraftStore, gid: str) -> int:
    return store._groups[gid].incarnation


def test_a_late_append_of_an_old_incarnation_stays_out_of_the_group_id_registered_again() -> None:
    """Worker A's abandoned attempt of r0 queued its tokens; the group completed elsewhere (B), then
    its id was registered again by another run (a resubmitted batch id: same group and request ids).
    A's late flush sent incarnation 0 and its tokens became the start of the new run's r0."""
    with workers(3) as (srv, (a, b, c)):
        register((a, b), group_size=2)
        old = _incarnation(srv.store, "g")
        assert a._groups["g"].incarnation == old
        a.resume("g", "r0", [], epoch=1)
        a.append("g", "r0", 0, [70, 71, 72])  # queued; worker A is slow ...
        a.end("g", "r0")  # ... its attempt was given up on
        a.release_group("g")  # kept until the queued appends are acknowledged
        for rid, toks in (("r0", [10, 11]), ("r1", [20, 21])):
            finish(b, rid, toks, epoch=2)
        b.flush()
        assert sorted(srv.store._history.responses("key")) == [(10, 11), (20, 21)]
        a._sync()  # A's background Sync ran before its queued appends went out: it saw the group complete
        # The group expires; the batch id comes back (same prompt) on worker C: a new incarnation.
        srv.store._groups["g"].expires_at = 0.0
        srv.store.expire_now()
        register((c,), group_size=2)
        new = _incarnation(srv.store, "g")
        assert new != old
        a.flush()  # A's late flush: refused as the old incarnation's
        assert srv.store.index_of("g").tokens("r0") == []
        assert a.stats().stale_incarnation_messages == 1
        assert "g" not in a._groups  # the reset released the completed mirror: nothing resent
        for _ in range(2):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == []
        c.resume("g", "r0", [], epoch=1)
        c.append("g", "r0", 0, [30, 31])
        c.flush()
        c.append("g", "r0", 2, [32], finished=True)
        c.end("g", "r0")
        c.flush()
        assert srv.store.index_of("g").tokens("r0") == [30, 31, 32]
        assert c.stats().append_errors == 0
        assert _incarnation(srv.store, "g") == new


def test_after_a_restart_the_resent_responses_land_under_the_new_incarnation() -> None:
    """The server restarted and holds nothing: the mirror starts over with incarnation 0, so the
    resend that re-creates the group is accepted, and later appends carry the new incarnation."""
    with workers(1) as (srv, (a,)):
        register((a,), group_size=2)
        finish(a, "r0", [10, 11, 12], epoch=1)
        a.resume("g", "r1", [], epoch=1)
        a.append("g", "r1", 0, [20, 21])
        a.flush()
        old = a._groups["g"].incarnation
        assert old == _incarnation(srv.store, "g")
        srv.restart()
        a.append("g", "r1", 2, [22, 23])  # queued under the old incarnation, which the server lost
        for _ in range(3):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 11, 12]
        assert srv.store.index_of("g").tokens("r1") == [20, 21, 22, 23]
        new = _incarnation(srv.store, "g")
        assert new != old and a._groups["g"].incarnation == new
        a.append("g", "r1", 4, [24], finished=True)
        a.end("g", "r1")
        a.flush()
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12), (20, 21, 22, 23, 24)]
        assert a.stats().stale_incarnation_messages == 0


def test_an_incarnation_refusal_recovers_through_sync_even_when_every_response_runs_here() -> None:
    """Worker B ran r1's first chunk; A runs both responses now, so A's group is left out of Sync
    (every delta would be an echo of its own tokens). The server restarts and B re-creates the group
    first: A's queued appends are of the old incarnation and refused. A must sync anyway (reset),
    resend its responses under the new incarnation, and have its later appends accepted, not
    refused one after another for the rest of the chunk."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        b.resume("g", "r1", [], epoch=1)
        b.append("g", "r1", 0, [20, 21])
        b.end("g", "r1")
        b.flush()
        a.resume("g", "r0", [], epoch=2)
        a.append("g", "r0", 0, [10, 11])
        a.resume("g", "r1", [20, 21], epoch=2)
        a.append("g", "r1", 2, [22])
        a.flush()
        a.flush()
        assert a.stats().skipped_group_syncs > 0  # every response runs here
        old = a._groups["g"].incarnation
        srv.restart()
        for _ in range(2):
            b.flush()  # B notices first: registers the group again and resends its r1
        assert _incarnation(srv.store, "g") != old
        a.append("g", "r0", 2, [12])
        a.append("g", "r1", 3, [23])
        a.flush()  # refused as the old incarnation's; the Sync resets the mirror
        refused = a.stats().stale_incarnation_messages
        assert refused > 0
        assert a._groups["g"].incarnation == _incarnation(srv.store, "g")
        a.flush()  # our responses, resent whole under the new incarnation
        assert srv.store.index_of("g").tokens("r0") == [10, 11, 12]
        assert srv.store.index_of("g").tokens("r1") == [20, 21, 22, 23]
        errors = a.stats().append_errors
        a.append("g", "r0", 3, [13], finished=True)
        a.append("g", "r1", 4, [24], finished=True)
        for rid in ("r0", "r1"):
            a.end("g", rid)
        a.flush()
        assert a.stats().append_errors == errors and a.stats().stale_incarnation_messages == refused
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12, 13), (20, 21, 22, 23, 24)]


def test_an_incarnation_refusal_of_a_finishing_append_keeps_it_finished() -> None:
    """The incarnation refusal is taken before the finished-refusal case: a finishing append of the
    old incarnation says nothing about the response in the new one, so the mirror keeps its finished
    flag (resent finished under the new incarnation, the group completes)."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        finish(b, "r1", [20, 21], epoch=1)
        b.flush()
        a.resume("g", "r0", [], epoch=1)
        a.append("g", "r0", 0, [10, 11])
        a.flush()
        srv.restart()
        for _ in range(2):
            b.flush()  # B re-creates the group with its finished r1
        a.append("g", "r0", 2, [12], finished=True)  # queued under the old incarnation
        a.end("g", "r0")
        for _ in range(3):
            a.flush()
        assert a.stats().stale_incarnation_messages == 1
        assert srv.store.index_of("g").tokens("r0") == [10, 11, 12]
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12), (20, 21)]
