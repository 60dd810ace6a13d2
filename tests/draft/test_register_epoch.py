"""RegisterGroupRequest.epoch: a group id reused by a new run (a resubmitted batch id: the same
prompt, key, size, group and request ids) gets a new incarnation when the registering attempt's
dispatch epoch is above every epoch the completed group took; the client registers again when its
mirror may follow a completed group (it knows, or a new attempt's append is refused by it).

(a) a new run's chunk ending at once on a stale mirror before anyone registered the new
incarnation: its appends were refused by the completed group and nothing re-created it for the new
run; (b) a resubmission with the same prompt, key and size re-attached to the completed group
(RegisterGroup was idempotent). Real draft server on a loopback port, the real DraftClient
(background ticks stopped; flush() drives them), the real worker core on the real reference engine."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from tests.draft.draft_helpers import finish, old_run, workers
from tests.draft.registration_helpers import Stub, expire, flush, register, stub_fixture  # noqa: F401 (the stub fixture)


def _at_once(rid: str, output: tuple[int, ...], epoch: int) -> ChunkJob:
    """A new run's chunk resuming a complete output: ends at once (STOP), finishing the response."""
    return ChunkJob(request_id=rid, prompt_token_ids=(1, 2, 3), max_new_tokens=4, max_tokens=40,
                    sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                    prompt_key="key", group_size=2, output_token_ids=output, dispatch_epoch=epoch)


def test_a_new_run_chunk_ending_at_once_on_a_stale_mirror_before_the_new_incarnation_exists(
        ref_engine: ReferenceEngine) -> None:
    """(a) A's mirror follows the old run's group, and does not know it completed (B's finish of r1
    came after A's last Sync). The new run (same prompt, key and size) sends its r1 to A, where it
    ends at once; nobody has registered the id for the new run. A's append is refused by the
    completed group; A registers again with the attempt's epoch, the server starts the new
    incarnation, and A's reused reset resends r1 into it. Then the new run's r0 completes it."""
    eos = ref_engine.eos_token_ids[0]
    with workers(2) as (srv, (a, b)):
        w = Worker(ref_engine, draft=a).start()
        try:
            old_run(a, b)
            old = srv.store._groups["g"]
            assert old.completed and not a._groups["g"].completed  # A's mirror is stale
            toks, _, done = w.run(_at_once("r1", (4, 5, eos), epoch=9))
            assert toks == [] and done.finish == ChunkFinish.STOP
            flush(a)
            g = srv.store._groups["g"]
            assert g is not old and g.incarnation != old.incarnation
            assert srv.store.index_of("g").tokens("r1") == [4, 5, eos] and g.finished == {"r1"}
            assert srv.store.index_of("g").tokens("r0") == []  # the old run's r0 stays out
            toks, _, done = w.run(_at_once("r0", (6, eos), epoch=10))
            assert done.finish == ChunkFinish.STOP
            flush(a)
            assert srv.store._groups["g"] is g and g.completed
            assert srv.store.index_of("g").tokens("r0") == [6, eos]
            assert {(4, 5, eos), (6, eos)} <= set(srv.store._history.responses("key"))
        finally:
            w.close()


def test_a_known_finished_response_dispatched_again_registers_before_appending(
        ref_engine: ReferenceEngine) -> None:
    """(a), the mirror knows the request finished (its own acknowledged finish): the new run's
    attempt registers again before its appends go out, also when its response equals the old
    run's (the same seeds: nothing is refused, so nothing else would tell)."""
    with workers(2) as (srv, (a, b)):
        w = Worker(ref_engine, draft=a).start()
        try:
            old_run(a, b)
            old = srv.store._groups["g"]
            assert "r0" in a._groups["g"].done
            # The old run's r0 token for token, complete at max_tokens.
            _, _, done = w.run(replace(_at_once("r0", (10, 11, 12), epoch=9), max_tokens=3))
            assert done.finish == ChunkFinish.LENGTH
            flush(a)
            g = srv.store._groups["g"]
            assert g is not old
            assert srv.store.index_of("g").tokens("r0") == [10, 11, 12] and g.finished == {"r0"}
            assert old.epochs == {"r0": 1, "r1": 2}  # the old group took nothing of the new run
        finally:
            w.close()


def test_a_resubmission_with_the_same_prompt_key_and_size_starts_a_new_incarnation() -> None:
    """(b) Worker C (no mirror) registers the resubmitted batch's group with the same prompt, key
    and size while the old, completed group is live: a new incarnation, which takes neither the old
    run's responses nor A's stale resends; the old run's worker A is told so (reused) on its next
    Sync and releases its mirror."""
    with workers(3) as (srv, (a, b, c)):
        old_run(a, b)
        old = srv.store._groups["g"]
        c.register_attempt("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60, request_id="r0", epoch=7)
        finish(c, "r0", [30, 31], epoch=7)
        flush(c)
        g = srv.store._groups["g"]
        assert g is not old and g.incarnation != old.incarnation
        assert c._groups["g"].incarnation == g.incarnation
        flush(a, b)
        assert srv.store.index_of("g").tokens("r0") == [30, 31]
        assert srv.store.index_of("g").tokens("r1") == [] and g.finished == {"r0"} and not g.completed
        assert "g" not in a._groups and "g" not in b._groups  # old run's mirrors released (reused)


def test_a_straggler_registration_and_an_epochless_one_stay_idempotent(stub: Stub) -> None:
    """(b) over gRPC: once the group completed, a registration of the old run (epoch at most the
    largest its group took) and one without an epoch get today's idempotent answer; only a newer
    epoch starts a new incarnation. A running group is never started over by an epoch."""
    s, store = stub
    assert register(s, "g", 3)
    store.append("g", "r0", 0, [5], finished=True, epoch=3)
    assert not register(s, "g", 8)  # running: the same run's later attempt
    store.append("g", "r1", 0, [6], finished=True, epoch=5)
    first = store._groups["g"]
    assert first.completed
    assert not register(s, "g", 5)  # the old run's straggler
    assert not register(s, "g", 0)  # unknown
    assert store._groups["g"] is first
    assert register(s, "g", 6)  # a newer run
    second = store._groups["g"]
    assert second is not first and not second.index.tokens("r0")
    assert not register(s, "g", 9)  # the new run's group is running: idempotent


def test_a_completed_group_that_took_no_epoch_is_not_ordered_against(stub: Stub) -> None:
    """epoch 0 appends (an old worker): the group's largest epoch is unknown, so a registration
    with an epoch keeps today's answer."""
    s, store = stub
    assert register(s, "g", 0)
    store.append("g", "r0", 0, [5], finished=True)
    store.append("g", "r1", 0, [6], finished=True)
    first = store._groups["g"]
    assert first.completed
    assert not register(s, "g", 50)
    assert store._groups["g"] is first


def test_a_later_chunk_of_the_same_run_sends_no_registration(ref_engine: ReferenceEngine) -> None:
    """The common path: a group this worker registered for the run costs no RegisterGroup per
    chunk, however new the chunk's epoch."""
    with workers(1) as (_srv, (a,)):
        w = Worker(ref_engine, draft=a).start()
        try:
            job = replace(_at_once("r0", (), epoch=3), max_new_tokens=2, group_size=8)
            w.run(job)
            flush(a)
            assert a.stats().register_rpcs == 1
            for epoch in (4, 5, 6):
                w.run(replace(job, request_id=f"r{epoch}", dispatch_epoch=epoch))
                flush(a)
            assert a.stats().register_rpcs == 1
        finally:
            w.close()


def test_the_same_run_registering_an_expired_completed_group_starts_no_new_incarnation(stub: Stub) -> None:
    """A completed group that expired, registered again at an epoch of its own run (a retried
    RegisterGroup, a straggler): refused, naming epoch, and nothing is created; was a new
    incarnation (the run's workers still following the old one then got reset + reused). A newer
    epoch, or none, is still the id used again."""
    s, store = stub
    assert register(s, "g", 3, size=1)
    store.append("g", "r0", 0, [5], finished=True, epoch=3)
    assert store._groups["g"].completed
    expire(store)
    for same_run in (3, 2):
        with pytest.raises(grpc.RpcError) as err:
            register(s, "g", same_run, size=1)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert details is not None and details.startswith("epoch:")
        assert "g" not in store._groups
    assert register(s, "g", 4, size=1)  # another run


def test_a_same_run_retry_after_the_group_completed_and_expired_is_not_a_new_run() -> None:
    """Worker B's attempt of r1 (epoch 2) finished the group; it expired. The scheduler retries
    B's chunk at the same epoch (its RunChunk answer was lost): B's mirror registers again, and
    the server answered with a new incarnation holding nothing but that retry, which A's mirror
    (epoch 1, the same run) then took for another run's (reset + reused)."""
    with workers(2) as (srv, (a, b)):
        for w in (a, b):
            w.register_group("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60)
        flush(a, b)
        for w, rid, epoch in ((a, "r0", 1), (b, "r1", 2)):
            w.register_attempt("g", "key", [1, 2, 3], 2, 60, request_id=rid, epoch=epoch)
            finish(w, rid, [10 + epoch], epoch=epoch)
        flush(a, b)
        assert srv.store._groups["g"].completed
        expire(srv.store)
        b.register_attempt("g", "key", [1, 2, 3], 2, 60, request_id="r1", epoch=2)
        b.resume("g", "r1", [12], epoch=2)
        flush(b, a)
        assert "g" not in srv.store._groups  # no lone incarnation of the retry
        assert srv.store.stats().groups == 0
        assert a.stats().resets == 0  # A was never told its run is another's


def test_a_same_run_retry_keeps_the_completed_mirror() -> None:
    """The client side: a chunk retried at an epoch its completed mirror already ran is the same
    run: the mirror is kept (no RegisterGroup), not replaced as for the id used again."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", [1, 2, 3], 1, 60, request_id="r0", epoch=4)
        finish(a, "r0", [10], epoch=4)
        flush(a)
        mirror, rpcs = a._groups["g"], a.stats().register_rpcs
        assert mirror.completed
        a.register_attempt("g", "key", [1, 2, 3], 1, 60, request_id="r0", epoch=4)
        flush(a)
        assert a._groups["g"] is mirror and a.stats().register_rpcs == rpcs
        a.register_attempt("g", "key", [1, 2, 3], 1, 60, request_id="r0", epoch=5)  # another run
        flush(a)
        assert a._groups["g"] is not mirror and srv.store._groups["g"].incarnation != mirror.incarnation
