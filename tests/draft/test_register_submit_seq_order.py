"""The order of the buffer's submit_seq (strictly increasing per buffer store) decides a draft group's
runs, in the live and the remembered paths alike, completed or running (review of a3369f3/a77f14c).

- B1: a late registration of an older run (a retried RegisterGroup, a worker re-creating what it
  lost) while a newer run's completed group is live started a new incarnation and reset the newer
  run's workers (taken for "another run": any other submit_seq was); after that group expired the
  same registration was refused. Now an older submit_seq is refused (FAILED_PRECONDITION naming
  submit_seq) in both.
- B3: a running group was never judged by submit_seq: a cancelled run's unfinished group made the
  resubmission's registration idempotent, and its appends (epochs below the old run's after a clock
  gone back) were refused as stale attempts until the TTL ran out. Now a newer submit_seq starts a
  new incarnation of a running group too; the same one, or 0 (an old client), stays idempotent.
- The worker's mirror never moves to an older submission: an old run's chunk still in flight runs
  on the newer run's mirror with its appends kept local (it registered for the old run, was refused
  and lost the mirror, or, before the server refused, swapped it back and forth, each swap holding
  the group's appends until answered); its register_epoch never goes down.

Real draft server on a loopback port; the real DraftClient with its background ticks stopped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tests.draft.draft_helpers import PROMPT, sync_one, workers
from tests.draft.registration_helpers import Stub, expire, flush, register, stub_fixture  # noqa: F401 (the stub fixture)

OLD, NEW = 100, 200  # the old run's and the new run's submit_seq


def _refused_naming_submit_seq(call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("submit_seq:")


def _completed_runs(s: Stub) -> int:
    """Run OLD completes group "g" at epochs 5-6, run NEW reuses the id and completes at 10-11;
    returns NEW's incarnation."""
    stub, store = s
    assert register(stub, "g", 5, seq=OLD)
    store.append("g", "r0", 0, [5, 6], finished=True, epoch=5)
    store.append("g", "r1", 0, [7, 8], finished=True, epoch=6)
    assert register(stub, "g", 10, seq=NEW)
    store.append("g", "r0", 0, [9, 9], finished=True, epoch=10)
    store.append("g", "r1", 0, [8, 8], finished=True, epoch=11)
    assert store._groups["g"].completed
    return store._groups["g"].incarnation


def test_an_older_runs_late_registration_is_refused_while_the_newer_runs_completed_group_is_live(stub: Stub) -> None:
    """B1: was created=True, a new incarnation (NEW's workers reset as if their run were another)."""
    inc = _completed_runs(stub)
    s, store = stub
    _refused_naming_submit_seq(lambda: register(s, "g", 6, seq=OLD))
    _refused_naming_submit_seq(lambda: register(s, "g", 6, seq=OLD, prompt=(1, 2, 4)))  # whatever its prompt
    g = store._groups["g"]
    assert g.incarnation == inc and g.completed and g.submit_seq == NEW
    # The same registration after the group expired: refused the same way (the paths agree).
    expire(store)
    _refused_naming_submit_seq(lambda: register(s, "g", 6, seq=OLD))
    _refused_naming_submit_seq(lambda: register(s, "g", 6, seq=OLD, prompt=(1, 2, 4)))
    assert "g" not in store._groups
    assert register(s, "g", 1, seq=NEW + 1)  # a newer submission still starts one


def test_an_older_runs_registration_is_refused_while_the_newer_run_runs(stub: Stub) -> None:
    s, store = stub
    assert register(s, "g", 3, seq=NEW)
    store.append("g", "r0", 0, [1], epoch=3)
    inc = store._groups["g"].incarnation
    _refused_naming_submit_seq(lambda: register(s, "g", 60, seq=OLD))
    assert store._groups["g"].incarnation == inc and store.index_of("g").tokens("r0") == [1]


def test_a_running_group_registered_by_a_newer_submission_is_a_new_incarnation(stub: Stub) -> None:
    """B3: run OLD's group was left unfinished (its batch cancelled) at epoch 50; the resubmission
    registers at epoch 3 (the clock went back). A new incarnation whose appends land (was
    idempotent, and the appends refused "stale attempt ... epoch 3 < 50" until the TTL ended); the
    old incarnation's workers are told by a reused reset not to resend their responses."""
    s, store = stub
    assert register(s, "g", 50, seq=OLD)
    store.append("g", "r0", 0, [5, 6], epoch=50)
    old = store._groups["g"].incarnation
    assert register(s, "g", 3, seq=NEW)
    g = store._groups["g"]
    assert g.incarnation != old and g.submit_seq == NEW
    store.append("g", "r0", 0, [7, 7, 7], epoch=3)
    assert store.index_of("g").tokens("r0") == [7, 7, 7]
    d = sync_one(s, "g", old, watermark=2)
    assert d.reset and d.reused and d.reused_submit_seq == OLD and d.submit_seq == NEW and d.reused_epoch == 50
    _refused_naming_submit_seq(lambda: register(s, "g", 50, seq=OLD))


def test_the_same_submission_and_an_old_client_stay_idempotent_on_a_running_group(stub: Stub) -> None:
    s, store = stub
    assert register(s, "g", 5, seq=OLD)
    inc = store._groups["g"].incarnation
    assert not register(s, "g", 9, seq=OLD)  # another worker of the same run, a newer epoch
    assert not register(s, "g", 1, seq=OLD)
    assert not register(s, "g", 9)  # an old client (0 = unknown)
    assert store._groups["g"].incarnation == inc and store._groups["g"].submit_seq == OLD


def test_workers_of_a_resubmitted_running_group_reach_the_new_incarnation() -> None:
    """B3 end to end: worker A ran r0 of the cancelled run OLD at epoch 50; worker B runs r0 of the
    resubmission NEW at epoch 3. B's response lands; A's copy is never resent into NEW's group."""
    with workers(2) as (srv, (a, b)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=50, submit_seq=OLD)
        a.resume("g", "r0", [], epoch=50)
        a.append("g", "r0", 0, [5, 6])
        a.end("g", "r0")
        flush(a)
        assert srv.store.index_of("g").tokens("r0") == [5, 6]
        b.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=3, submit_seq=NEW)
        b.resume("g", "r0", [], epoch=3)
        b.append("g", "r0", 0, [7, 7, 7])
        flush(b)
        assert srv.store._groups["g"].submit_seq == NEW
        assert srv.store.index_of("g").tokens("r0") == [7, 7, 7]
        flush(a, b)
        assert srv.store.index_of("g").tokens("r0") == [7, 7, 7]
        assert b.stats().stale_messages == 0


def test_an_older_runs_chunk_in_flight_keeps_the_newer_runs_mirror() -> None:
    """The mirror follows NEW; a chunk of OLD (r1, still in flight) starts on this worker. Nothing
    is registered for OLD (was: RegisterGroup with OLD, refused, and the NEW mirror dropped; or,
    before the refusal, the mirror moved to OLD and back at NEW's next chunk, its appends held each
    time), OLD's tokens stay local, and NEW's appends keep flowing."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=10, submit_seq=NEW)
        a.resume("g", "r0", [], epoch=10)
        a.append("g", "r0", 0, [1, 2])
        flush(a)
        m = a._groups["g"]
        rpcs = a.stats().register_rpcs
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=5, submit_seq=OLD)
        assert a._groups["g"] is m and m.reregister is None and m.submit_seq == NEW and m.register_epoch == 10
        a.resume("g", "r1", [], epoch=5)
        a.append("g", "r1", 0, [50, 51])
        a.append("g", "r0", 2, [3])
        flush(a)
        assert a._groups.get("g") is m and a.stats().register_rpcs == rpcs
        assert srv.store.index_of("g").tokens("r0") == [1, 2, 3]
        assert srv.store.index_of("g").tokens("r1") == []  # the old run's tokens stayed local
        assert srv.store._groups["g"].submit_seq == NEW
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=11, submit_seq=NEW)
        assert m.reregister is None


def _during_register(client: Any, action: Callable[[], None]) -> None:
    """Runs `action` while the client's next RegisterGroup is in flight (once)."""
    orig = client._stub.RegisterGroup
    done: list[bool] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            action()
        return orig(*args, **kwargs)

    client._stub.RegisterGroup = wrapper


def test_a_newer_submissions_registration_never_lowers_register_epoch_nor_repeats() -> None:
    """The mirror registered for OLD at epoch 10; NEW's chunks come at epochs 3, then 2 (the clock
    went back), the second while the first's RegisterGroup is in flight. register_epoch stays 10
    and RegisterGroup goes once (was lowered 10 -> 3 -> 2, and the answered registration was sent
    again since the epoch it was sent at was no longer the mirror's)."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=10, submit_seq=OLD)
        flush(a)
        m = a._groups["g"]
        rpcs = a.stats().register_rpcs
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=3, submit_seq=NEW)
        assert m.reregister is not None and m.register_epoch == 10
        _during_register(a, lambda: a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=2,
                                                       submit_seq=NEW))
        flush(a)
        assert m.register_epoch == 10 and m.reregister is None and m.submit_seq == NEW
        assert a.stats().register_rpcs == rpcs + 1
        assert srv.store._groups["g"].submit_seq == NEW


def test_a_newer_submission_asked_while_a_registration_is_in_flight_is_sent_next() -> None:
    """The registration answered is not the one queued meanwhile (a third submission at a lower
    epoch): it stays queued and goes next (compared by registration, not by epoch alone)."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=10, submit_seq=OLD)
        flush(a)
        m = a._groups["g"]
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=12, submit_seq=NEW)
        _during_register(a, lambda: a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=2,
                                                       submit_seq=NEW + 1))
        a.flush()
        assert m.reregister is not None and m.reregister[4] == NEW + 1
        flush(a)
        assert m.reregister is None and m.submit_seq == NEW + 1
        assert srv.store._groups["g"].submit_seq == NEW + 1
