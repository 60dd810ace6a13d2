"""A draft group's new run told from the old run's retry by the buffer's submit_seq
(RegisterGroupRequest.submit_seq, RunChunkRequest.submit_seq).

Before it, a completed group's id registered again was judged by dispatch epochs alone, which fails
both ways: (a) a scheduler restarted without its epoch_file behind a clock that went back dispatches
the new run below the old run's epochs, and the new run was refused as the old run's retry (after
expiry: FAILED_PRECONDITION, it drafted from nothing) or joined the old run's completed group (while
it was still here); (b) a retry of the old run dispatched after its group completed (a lost commit)
has an epoch above every one the group took and was taken for another run: a lone new incarnation
that holds the retry alone and expires unfinished. With the submission known on both sides it alone
decides; 0 on either side keeps the epoch rule (old clients).

Real draft server on a loopback port; for the client tests the real DraftClient with its background
ticks stopped (flush() drives them)."""

from __future__ import annotations

import grpc
import pytest

from services.draft.store import _REUSED, _REUSED_ID_BYTES, _TOMBSTONE_BYTES, DraftStore
from tests.draft.draft_helpers import PROMPT, finish, workers
from tests.draft.registration_helpers import Stub, expire, flush, register, stub_fixture  # noqa: F401 (the stub fixture)

OLD, NEW = 100, 200  # the old run's and the new run's submit_seq


def _old_run(s: Stub, seq: int = OLD) -> None:
    """Group "g" (size 2) registered with `seq` and completed at epochs 5 and 6."""
    stub, store = s
    assert register(stub, "g", 5, seq=seq)
    store.append("g", "r0", 0, [5, 6], finished=True, epoch=5)
    store.append("g", "r1", 0, [7, 8], finished=True, epoch=6)
    assert store._groups["g"].completed


def _drafts_for_the_new_run(store: DraftStore) -> None:
    """The new run's group works: its appends land (no refusal) and it drafts from them."""
    store.append("g", "r0", 0, [40, 41, 42, 43], epoch=1)
    assert store.index_of("g").tokens("r0") == [40, 41, 42, 43]
    assert store.index_of("g").tokens("r1") == []  # the old run's response stays out
    draft = store.index_of("g").propose([40, 41], 2)
    assert draft is not None and list(draft.tokens)[:2] == [42, 43]


def test_an_expired_group_registered_by_a_new_submission_at_a_lower_epoch_is_a_new_run(stub: Stub) -> None:
    """(a) The clock went back: the new submission registers at epoch 1, below the old run's 5-6,
    with the same prompt, key and size. A new incarnation (was FAILED_PRECONDITION naming epoch)."""
    _old_run(stub)
    s, store = stub
    expire(store)
    assert register(s, "g", 1, seq=NEW)
    assert store._groups["g"].submit_seq == NEW
    _drafts_for_the_new_run(store)


def test_a_completed_group_registered_by_a_new_submission_at_a_lower_epoch_is_a_new_run(stub: Stub) -> None:
    """(a) As above with the completed group still here: a new incarnation (was idempotent: the new
    run joined the old run's completed group, whose responses are history, and its appends there
    were refused)."""
    _old_run(stub)
    s, store = stub
    old = store._groups["g"].incarnation
    assert register(s, "g", 1, seq=NEW)
    assert store._groups["g"].incarnation != old
    _drafts_for_the_new_run(store)


def test_a_retry_of_the_old_run_after_its_group_completed_is_not_a_new_run(stub: Stub) -> None:
    """(b) A lost commit's retry of the old run, dispatched after the group completed (epoch 9,
    above every epoch it took), with the old run's submit_seq: idempotent while the group is here
    (was a new incarnation), refused naming submit_seq once it expired (was a new incarnation)."""
    _old_run(stub)
    s, store = stub
    old = store._groups["g"].incarnation
    assert not register(s, "g", 9, seq=OLD)
    assert store._groups["g"].incarnation == old and store._groups["g"].completed
    expire(store)
    with pytest.raises(grpc.RpcError) as err:
        register(s, "g", 9, seq=OLD)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("submit_seq:")
    assert "g" not in store._groups


def test_an_older_remembered_run_is_matched_by_its_submit_seq(stub: Stub) -> None:
    """Every remembered incarnation is compared: run OLD completed and expired, then run NEW reused
    the id, completed and expired; a straggler of OLD is OLD's (refused), a third submission is
    another run."""
    _old_run(stub)
    s, store = stub
    expire(store)
    store._clock = lambda: 0.0  # type: ignore[method-assign]  # back before the TTLs
    assert register(s, "g", 1, seq=NEW)
    store.append("g", "r0", 0, [40], finished=True, epoch=1)
    store.append("g", "r1", 0, [41], finished=True, epoch=2)
    expire(store)
    with pytest.raises(grpc.RpcError) as err:
        register(s, "g", 50, seq=OLD)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert register(s, "g", 1, seq=300)


@pytest.mark.parametrize("old_seq,new_seq", [(0, NEW), (OLD, 0)], ids=["old-unknown", "new-unknown"])
def test_an_unknown_submit_seq_on_either_side_keeps_the_epoch_rule(
        stub: Stub, old_seq: int, new_seq: int) -> None:
    """0 (an old client) on either side: at an epoch of the old run, the same prompt, key and size
    is that run's (refused after expiry, idempotent while here); above it, another run."""
    _old_run(stub, old_seq)
    s, store = stub
    assert not register(s, "g", 6, seq=new_seq)
    expire(store)
    with pytest.raises(grpc.RpcError) as err:
        register(s, "g", 6, seq=new_seq)
    assert (err.value.details() or "").startswith("epoch:")
    assert register(s, "g", 7, seq=new_seq)


def test_another_prompt_with_the_same_submit_seq_is_still_another_run(stub: Stub) -> None:
    """The digest check stays first: another prompt under the id is another run whatever else."""
    _old_run(stub)
    s, store = stub
    expire(store)
    assert register(s, "g", 9, seq=OLD, prompt=(1, 2, 4))


def test_a_running_group_registered_by_an_old_client_takes_the_submission_of_a_later_registration(
        stub: Stub) -> None:
    """Registered without a submit_seq (an old worker), then by a worker of the same run with one:
    the running group keeps it, and judges later registrations by it (a newer submission is a new
    run even while it runs: test_register_submit_seq_order.py)."""
    s, store = stub
    assert register(s, "g", 1)
    assert not register(s, "g", 1, seq=OLD)
    assert store._groups["g"].submit_seq == OLD
    assert not register(s, "g", 2)  # an old client's: idempotent
    assert store._groups["g"].submit_seq == OLD


def test_a_negative_submit_seq_is_refused_naming_the_field() -> None:
    store = DraftStore()
    with pytest.raises(Exception) as err:
        store.register_group("g", "key", [1, 2, 3], submit_seq=-1)
    assert getattr(err.value, "field", None) == "submit_seq"


def test_the_remembered_record_keeps_the_submit_seq_and_its_bytes_are_counted(stub: Stub) -> None:
    """One more uint64 per remembered incarnation (36 bytes), counted in remembered_ids_bytes."""
    _old_run(stub)
    _s, store = stub
    expire(store)
    records = list(_REUSED.iter_unpack(store._reused["g"]))
    assert _REUSED.size == 36 and len(records) == 1 and records[0][4] == OLD
    assert store.stats().remembered_ids_bytes == _TOMBSTONE_BYTES + _REUSED_ID_BYTES + 2 * len("g") + _REUSED.size


# ---- the worker's client (its mirror follows the same rule) ---------------------------------------


def test_a_completed_mirror_is_replaced_for_a_new_submission_at_a_lower_epoch() -> None:
    """A's mirror knows the group completed (epochs 5-6, submission OLD). The new submission's chunk
    comes at epoch 1 (the clock went back): the mirror is replaced and registers with NEW, a new
    incarnation whose appends land. (Was kept as the old run's, an epoch it already ran: the new
    run's appends met the completed group.)"""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=5, submit_seq=OLD)
        finish(a, "r0", [10, 11], epoch=5)
        flush(a)
        mirror = a._groups["g"]
        assert mirror.completed
        old = srv.store._groups["g"].incarnation
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=1, submit_seq=NEW)
        assert a._groups["g"] is not mirror
        finish(a, "r0", [30, 31], epoch=1)
        flush(a)
        g = srv.store._groups["g"]
        assert g.incarnation != old and g.submit_seq == NEW
        assert srv.store.index_of("g").tokens("r0") == [30, 31]


def test_a_completed_mirror_is_kept_for_a_retry_of_its_submission_at_a_newer_epoch() -> None:
    """A lost commit's retry (the same submission, epoch 9 above every one the mirror ran): the
    mirror is kept and nothing is sent (was replaced and registered again, and the server started a
    lone incarnation for the retry)."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=5, submit_seq=OLD)
        finish(a, "r0", [10, 11], epoch=5)
        flush(a)
        mirror = a._groups["g"]
        rpcs = a.stats().register_rpcs
        old = srv.store._groups["g"].incarnation
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=9, submit_seq=OLD)
        assert a._groups["g"] is mirror
        flush(a)
        assert a.stats().register_rpcs == rpcs
        assert srv.store._groups["g"].incarnation == old


def test_a_stale_mirror_registers_again_for_a_new_submission_at_a_lower_epoch() -> None:
    """B's mirror does not know the group completed (A finished the last response after B's last
    Sync). The new submission's chunk on B at epoch 1: B registers again at once with NEW (was
    nothing: an epoch at most the one it registered for), so the server starts the new run's
    incarnation before B's appends go out."""
    with workers(2) as (srv, (a, b)):
        for c in (a, b):
            c.register_attempt("g", "key", PROMPT, 2, 60, request_id="", epoch=5, submit_seq=OLD)
            c.flush()
        finish(b, "r1", [20], epoch=5)
        b.flush()
        finish(a, "r0", [10], epoch=6)
        a.flush()
        assert srv.store._groups["g"].completed and not b._groups["g"].completed
        old = srv.store._groups["g"].incarnation
        b.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=1, submit_seq=NEW)
        assert b._groups["g"].reregister is not None
        flush(b)
        g = srv.store._groups["g"]
        assert g.incarnation != old and g.submit_seq == NEW
