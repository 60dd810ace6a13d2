"""GroupDelta.reused: a reset tells a draft-server restart (the new incarnation is the same run,
re-created: workers resend their responses) from the group id used again by another run after the
old incarnation completed (a resubmitted batch id: the old responses are history and must not be
resent into the new run's group). Real draft server on a loopback port + the real DraftClient
(background ticks stopped; flush() drives them)."""

from __future__ import annotations

from seer.v1 import draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.store import DraftStore
from tests.draft.draft_helpers import finish, old_run, register, sync_one, workers


def test_a_mirror_of_a_completed_incarnation_does_not_resend_into_the_id_used_again() -> None:
    """Worker A finished r0; B finished r1 after A's last Sync, so A's mirror does not know the group
    completed. The batch id is resubmitted (worker C registers it again: a new incarnation). A's
    next Sync is answered reset: without `reused` A took it for a restart and resent its old r0,
    finished, as the new run's r0 (the new run's own appends of r0 were then refused as overlaps
    with different tokens, and the new group could complete with the old run's response)."""
    with workers(3) as (srv, (a, b, c)):
        old_run(a, b)
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12), (20, 21)]
        assert not a._groups["g"].completed  # A never saw r1's finish
        old = srv.store._groups["g"].incarnation
        srv.store._groups["g"].expires_at = 0.0
        srv.store.expire_now()
        register((c,), group_size=2)
        assert srv.store._groups["g"].incarnation != old
        for _ in range(2):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == []  # nothing of the old run came back
        assert "g" not in a._groups  # released: none of it belongs to the new run
        # The new run's r0 is its own.
        finish(c, "r0", [30, 31], epoch=1)
        c.flush()
        assert srv.store.index_of("g").tokens("r0") == [30, 31]
        assert c.stats().append_errors == 0


def test_a_request_running_in_the_id_used_again_keeps_its_tokens_and_only_they_are_resent() -> None:
    """A's mirror of the old incarnation serves a request of the new run (its chunk started before
    A synced): only that request goes to the new incarnation, not A's old finished response."""
    with workers(2) as (srv, (a, b)):
        old_run(a, b)
        # Registered again with another group size while it is live and completed: a new incarnation.
        srv.store.register_group("g", "key", [1, 2, 3], 60, 3)
        a.resume("g", "r1", [], epoch=5)  # the new run's r1 starts on A, on the old mirror
        a.append("g", "r1", 0, [40, 41])
        for _ in range(3):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == []
        assert srv.store.index_of("g").tokens("r1") == [40, 41]
        assert a._groups["g"].own == {"r1"}


def test_the_server_says_reused_only_for_an_incarnation_it_saw_complete(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    store, stub = draft_server[1], draft_stub
    # An unfinished group that expired and was re-created: the same run (resend).
    store.register_group("u", "key", [1], 60, 2)
    unfinished = store._groups["u"].incarnation
    store._groups["u"].expires_at = 0.0
    store.expire_now()
    store.register_group("u", "key", [1], 60, 2)
    d = sync_one(stub, "u", watermark=1, incarnation=unfinished)
    assert d.reset and not d.reused
    # A completed group, expired, its id registered again: another run.
    store.register_group("c", "key", [1], 60, 1)
    store.append("c", "r", 0, [5], finished=True)
    done = store._groups["c"].incarnation
    store._groups["c"].expires_at = 0.0
    store.expire_now()
    store.register_group("c", "key", [1], 60, 1)
    d = sync_one(stub, "c", watermark=2, incarnation=done)
    assert d.reset and d.reused
    # An incarnation the server never saw (it restarted): the same run as far as it knows.
    d = sync_one(stub, "c", watermark=2, incarnation=12345)
    assert d.reset and not d.reused
    # The current incarnation: no reset at all.
    d = sync_one(stub, "c", watermark=1, incarnation=store._groups["c"].incarnation)
    assert not d.reset and not d.reused


def test_after_a_restart_an_unfinished_group_is_still_resent() -> None:
    """The restarted server knows nothing of the old incarnation: not reused, the worker resends."""
    with workers(1) as (srv, (a,)):
        register((a,), group_size=2)
        finish(a, "r0", [10, 11], epoch=1)
        a.flush()
        srv.restart()
        for _ in range(3):
            a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 11]
