"""Second review of the draft groups' run identity by the buffer's submit_seq (a3369f3, a77f14c,
d40ca76): a newer run's mirror, group and requests never take an older run's registration, appends
or output.

- B1: a registration refused as an older run's (FAILED_PRECONDITION) released the mirror even when a
  newer run's registration was queued while it was out: the newer run's appends were lost.
- B2: once a newer run's group that replaced a running one expired unfinished (tombstone False), an
  older run's straggler registration was accepted and created a group of the old run.
- B3: a new mirror's appends carried incarnation 0 until its first Sync: an old run's first appends
  landed in a newer run's incarnation registered in between, and at the old run's larger epoch
  locked the new run's attempt of the request out. RegisterGroupResponse.incarnation stamps them.
- B4: an older submission's chunk set the request's recorded submission back and its resume
  overwrote the newer run's copy with the old output, which a re-created group took as the newer
  run's response.
- S1: an append refused as re-opening a completed group re-registered the mirror with its own
  (older) submission over a newer one queued meanwhile: the newer run never registered.
- S2: after a reused reset the mirror kept the old run's submit_seq: every chunk of the new run on
  it registered again (holding the group's appends until answered).
- S3: a plain reset ignored the new incarnation's submit_seq: after a restart a newer run's group
  got the older run's responses resent into it (and an older run's group kept a newer mirror's).

Real draft server on a loopback port and real DraftClients (background ticks stopped; flush() drives
them); B2 on the store directly."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.errors import FailedPrecondition
from services.draft.store import DraftStore, StoreLimits
from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import PROMPT, workers
from tests.draft.registration_helpers import flush

OLD, NEW = 1, 2  # the older and the newer run's submit_seq


def _attempt(c: DraftClient, rid: str, epoch: int, seq: int, output: tuple[int, ...] = ()) -> None:
    """A chunk of `rid` in group "g" (size 2) starts on `c`, as the worker core starts one."""
    c.register_attempt("g", "key", PROMPT, 2, 60, request_id=rid, epoch=epoch, submit_seq=seq)
    c.resume("g", rid, list(output), epoch=epoch)


def test_b2_an_older_runs_straggler_is_refused_after_the_newer_runs_group_expired_unfinished() -> None:
    now = [0.0]
    st = DraftStore(StoreLimits(), clock=lambda: now[0])
    assert st.register_group("g", "k", PROMPT, ttl_seconds=10, group_size=2, epoch=5, submit_seq=OLD)[0]
    st.append("g", "r0", 0, [7, 8], epoch=5)
    assert st.register_group("g", "k", PROMPT, ttl_seconds=10, group_size=2, epoch=9, submit_seq=NEW)[0]
    st.append("g", "r0", 0, [9], epoch=9)
    now[0] = 100.0
    assert st.expire_now() == 0 and st._expired.get("g") is False  # unfinished: re-created by its workers
    with pytest.raises(FailedPrecondition) as err:  # was created (True, 0): a group of the old run
        st.register_group("g", "k", PROMPT, ttl_seconds=10, group_size=2, epoch=5, submit_seq=OLD)
    assert err.value.field == "submit_seq"
    assert "g" not in st._groups
    # The newer run's own workers re-create it, and an old client (no submit_seq) is judged as before.
    assert st.register_group("g", "k", PROMPT, ttl_seconds=10, group_size=2, epoch=9, submit_seq=NEW)[0]
    assert st._groups["g"].submit_seq == NEW
    now[0] = 200.0
    st.expire_now()
    assert st.register_group("g", "k", PROMPT, ttl_seconds=10, group_size=2, epoch=1)[0]


def test_b1_a_refused_older_registration_keeps_the_mirror_for_the_newer_one_queued() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(b, "r1", 20, NEW)  # the new run registers the group on B
        b.flush()
        _attempt(a, "r0", 10, OLD)  # an old-run straggler's chunk comes first on A: a mirror of OLD
        real = a._stub.RegisterGroup  # type: ignore[union-attr]
        sent: list[int] = []

        def register(req: draft_pb2.RegisterGroupRequest, timeout: float | None = None) -> Any:
            sent.append(req.submit_seq)
            if len(sent) == 1:
                # While OLD's registration is out, the new run's chunk of r2 starts here.
                _attempt(a, "r2", 21, NEW)
            return real(req, timeout=timeout)

        a._stub.RegisterGroup = register  # type: ignore[union-attr,method-assign]
        a.flush()
        assert "g" in a._groups  # was released with the newer run's registration queued in it
        a.append("g", "r2", 0, [40, 41, 42], finished=True)
        flush(a)
        assert sent[:2] == [OLD, NEW]
        assert srv.store.index_of("g").tokens("r2") == [40, 41, 42]
        assert srv.store.index_of("g").tokens("r0") == []  # the old run's chunk stays local
        assert srv.store._groups["g"].submit_seq == NEW


def test_b3_an_old_runs_first_appends_never_land_in_a_newer_incarnation_registered_in_between() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(a, "r0", 50, OLD)
        a.append("g", "r0", 0, [1, 1, 1])
        real = a._stub.Append  # type: ignore[union-attr]

        def append(it: Any, timeout: float | None = None) -> Any:
            # A registered OLD's group; before its appends arrive the new run (clock gone back:
            # lower epochs) replaces the running group from B.
            msgs = list(it)
            _attempt(b, "r0", 5, NEW)
            b._register_pending()
            a._stub.Append = real  # type: ignore[union-attr,method-assign]
            return real(iter(msgs), timeout=timeout)

        a._stub.Append = append  # type: ignore[union-attr,method-assign]
        a.flush()
        g = srv.store._groups["g"]
        assert g.submit_seq == NEW
        assert srv.store.index_of("g").tokens("r0") == [] and "r0" not in g.epochs  # was [1, 1, 1] at 50
        b.append("g", "r0", 0, [9, 9])
        flush(b)
        assert srv.store.index_of("g").tokens("r0") == [9, 9]  # was refused as a stale attempt (5 < 50)
        assert b.stats().stale_messages == 0


def test_b3_a_new_mirrors_appends_carry_the_registrations_incarnation() -> None:
    with workers(1) as (srv, (a,)):
        _attempt(a, "r0", 3, NEW)
        a.append("g", "r0", 0, [4, 5])
        seen: list[int] = []
        real = a._stub.Append  # type: ignore[union-attr]

        def append(it: Any, timeout: float | None = None) -> Any:
            msgs = list(it)
            seen.extend(m.incarnation for m in msgs)
            return real(iter(msgs), timeout=timeout)

        a._stub.Append = append  # type: ignore[union-attr,method-assign]
        a.flush()
        inc = srv.store._groups["g"].incarnation
        assert seen and set(seen) == {inc}  # were 0 (not synced yet)
        assert a._groups["g"].incarnation == inc
        assert srv.store.index_of("g").tokens("r0") == [4, 5]


def test_b4_an_older_submissions_chunk_leaves_the_newer_runs_copy_alone() -> None:
    with workers(1) as (srv, (a,)):
        _attempt(a, "r0", 5, NEW)
        a.append("g", "r0", 0, [9, 9, 9], finished=True)
        a.end("g", "r0")
        flush(a, times=2)
        # A late chunk of r0 of the older run (committed output [1, 1]) runs here.
        _attempt(a, "r0", 50, OLD, output=(1, 1))
        a.append("g", "r0", 2, [1])
        a.end("g", "r0")
        m = a._groups["g"]
        assert m.index.tokens("r0") == [9, 9, 9] and "r0" in m.finished  # was [1, 1, 1], not finished
        assert m.seqs["r0"] == NEW and m.epochs["r0"] == 5
        # The server loses the group: the mirror re-creates it with the newer run's response.
        with srv.store._lock:
            srv.store._remove_group(srv.store._groups["g"])
        flush(a)
        g = srv.store._groups["g"]
        assert g.submit_seq == NEW
        assert srv.store.index_of("g").tokens("r0") == [9, 9, 9] and "r0" in g.finished
        # A chunk of the newer run again is the request's own: it runs as before.
        _attempt(a, "r0", 6, NEW, output=(9, 9, 9))
        assert "r0" in a._groups["g"].active


def test_s1_a_complete_refusal_keeps_a_newer_registration_queued_meanwhile() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(a, "r0", 10, OLD)
        a.append("g", "r0", 0, [1], finished=True)
        a.end("g", "r0")
        a.flush()
        _attempt(b, "r1", 11, OLD)
        b.append("g", "r1", 0, [2], finished=True)
        b.end("g", "r1")
        b.flush()
        assert srv.store._groups["g"].completed and not a._groups["g"].completed  # A's mirror is stale
        # A retry of r0 of the same run (a lost commit) re-opens r0: refused, the group completed.
        _attempt(a, "r0", 30, OLD)
        real = a._stub.Append  # type: ignore[union-attr]

        def append(it: Any, timeout: float | None = None) -> Any:
            if a._groups["g"].reregister is None:
                _attempt(a, "r2", 3, NEW)  # meanwhile the new run's chunk of r2 starts here
            return real(it, timeout=timeout)

        a._stub.Append = append  # type: ignore[union-attr,method-assign]
        a.flush()
        reregister = a._groups["g"].reregister
        assert reregister is not None and reregister[4] == NEW  # was OLD's registration
        flush(a)
        assert srv.store._groups["g"].submit_seq == NEW


def test_s2_after_a_reused_reset_the_mirror_follows_the_new_runs_submission() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(a, "r0", 50, OLD)  # a chunk of the old run, still running on A
        a.flush()
        _attempt(b, "r1", 3, NEW)  # the new run replaces the running group
        b.flush()
        a.flush()  # A's Sync: a reused reset (OLD's incarnation was replaced while running)
        m = a._groups["g"]
        assert m.incarnation == srv.store._groups["g"].incarnation
        assert m.submit_seq == NEW  # was OLD
        rpcs = a.stats().register_rpcs
        _attempt(a, "r2", 4, NEW)  # the new run's chunk here: its run's mirror, nothing to register
        a.append("g", "r2", 0, [7])
        a.flush()
        assert a.stats().register_rpcs == rpcs
        assert srv.store.index_of("g").tokens("r2") == [7]


def test_s3_a_plain_reset_to_a_newer_run_does_not_resend_the_older_runs_responses() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(a, "r0", 50, OLD)
        a.append("g", "r0", 0, [1, 1, 1], finished=True)
        a.end("g", "r0")
        flush(a, times=2)
        srv.restart()  # nothing remembered: the next reset is a plain one
        _attempt(b, "r1", 5, NEW)
        b.flush()
        flush(a)
        g = srv.store._groups["g"]
        assert g.submit_seq == NEW
        assert srv.store.index_of("g").tokens("r0") == [] and "r0" not in g.epochs  # was [1, 1, 1] at 50
        assert "g" not in a._groups  # nothing of the new run here


def test_s3_a_plain_reset_to_an_older_run_registers_the_newer_run_again() -> None:
    with workers(2) as (srv, (a, b)):
        _attempt(a, "r1", 5, NEW)
        a.append("g", "r1", 0, [4, 4])
        flush(a, times=2)
        srv.restart()
        # An old run's straggler re-creates the id first (nothing remembered after the restart).
        _attempt(b, "r0", 50, OLD)
        b.append("g", "r0", 0, [1])
        b.flush()
        assert srv.store._groups["g"].submit_seq == OLD
        flush(a, times=4)
        g = srv.store._groups["g"]
        assert g.submit_seq == NEW  # was OLD's group, with the newer run's r1 resent into it
        assert srv.store.index_of("g").tokens("r1") == [4, 4]
        assert srv.store.index_of("g").tokens("r0") == []


def test_registration_answers_its_incarnation_and_submit_seq() -> None:
    with workers(0) as (srv, _):
        with grpc.insecure_channel(srv.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            req = draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="key", prompt_token_ids=PROMPT,
                                                 ttl_seconds=60, group_size=2, epoch=1, submit_seq=NEW)
            first, again = stub.RegisterGroup(req), stub.RegisterGroup(req)
        g = srv.store._groups["g"]
        assert first.created and not again.created
        assert first.incarnation == again.incarnation == g.incarnation and first.submit_seq == NEW
