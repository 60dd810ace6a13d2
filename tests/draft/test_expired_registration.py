"""A completed group that expired (or was evicted), registered again (review of e61d6a5).

(1) The server refused every registration at an epoch at most the old run's largest as that run's,
also one of another prompt, key or group size (another run for sure, as the live-group path takes
it) at a low epoch (a scheduler restarted without its epoch_file behind a clock that went back):
the new run drafted from nothing. Now only the same prompt, key and size (0 agrees) is refused.
(2) A completed mirror kept for a retried chunk of its run stayed marked for release (released
before the retry) and was dropped at the next tick while the chunk ran on it.
(3) A new run's chunk ending at once on a stale mirror (it did not know the old group completed)
after the old group expired: its append met NOT_FOUND "expired", nothing ran here, the mirror was
released, and the new run's response never reached a new incarnation.

Real draft server on a loopback port, the real DraftClient (background ticks stopped; flush() drives
them), and for (3) also the real worker core on the real reference engine."""

from __future__ import annotations

import grpc
import pytest

from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from tests.draft.draft_helpers import PROMPT, finish, old_run, workers
from tests.draft.registration_helpers import Stub, expire, flush, register, stub_fixture  # noqa: F401 (the stub fixture)


@pytest.mark.parametrize("other", [{"key": "other"}, {"prompt": (1, 2, 4)}, {"size": 3}],
                         ids=["key", "prompt", "size"])
def test_another_registration_of_an_expired_completed_group_at_a_low_epoch_is_a_new_run(
        stub: Stub, other: dict[str, object]) -> None:
    """Epochs 1 and 2 completed the group; it expired. A new run's registration at epoch 1 with
    another prompt key, prompt or group size starts a new incarnation (was FAILED_PRECONDITION)."""
    s, store = stub
    assert register(s, "g", 1)
    store.append("g", "r0", 0, [5], finished=True, epoch=1)
    store.append("g", "r1", 0, [6], finished=True, epoch=2)
    assert store._groups["g"].completed
    expire(store)
    assert register(s, "g", 1, **other)  # type: ignore[arg-type]
    g = store._groups["g"]
    assert not g.epochs and not g.index.tokens("r0") and not g.completed


def test_the_same_registration_at_an_old_run_epoch_is_still_refused(stub: Stub) -> None:
    """The same prompt, key and size (or size 0: unknown, agrees) at an epoch of the old run: the old
    run's retry, refused naming epoch. (A new run with those at such a low epoch, after a scheduler
    restart without epoch_file and a clock behind, is refused too: services/draft/README.md.)"""
    s, store = stub
    assert register(s, "g", 1)
    store.append("g", "r0", 0, [5], finished=True, epoch=1)
    store.append("g", "r1", 0, [6], finished=True, epoch=2)
    expire(store)
    for size in (2, 0):
        with pytest.raises(grpc.RpcError) as err:
            register(s, "g", 2, size=size)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (err.value.details() or "").startswith("epoch:")
    assert "g" not in store._groups
    assert register(s, "g", 3)  # a newer epoch: another run


def test_a_straggler_of_an_older_run_is_refused_after_another_prompt_reused_the_id(stub: Stub) -> None:
    """Run A (prompt 1,2,3; epochs 1-2) completed and expired; run B reused the id with another prompt
    (epochs 10-11), completed and expired. A straggler of A at epoch 2 is A's: refused, though only
    B's record is the newest (every remembered incarnation is compared; it got a lone incarnation of
    A's prompt, which then refused the next real run with AlreadyExists; review, session 27)."""
    s, store = stub
    now = [0.0]
    store._clock = lambda: now[0]  # type: ignore[method-assign]
    assert register(s, "g", 1)
    store.append("g", "r0", 0, [5], finished=True, epoch=1)
    store.append("g", "r1", 0, [6], finished=True, epoch=2)
    now[0] += 1e6
    store.expire_now()
    assert register(s, "g", 10, prompt=(1, 2, 4))
    store.append("g", "r0", 0, [7], finished=True, epoch=10)
    store.append("g", "r1", 0, [8], finished=True, epoch=11)
    now[0] += 1e6
    store.expire_now()
    with pytest.raises(grpc.RpcError) as err:
        register(s, "g", 2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "g" not in store._groups
    assert register(s, "g", 30, prompt=(1, 2, 4))  # the next real run


def test_a_new_run_of_another_size_on_a_stale_mirror_after_expiry_gets_its_group() -> None:
    """The review's scenario through the client: the old run (epochs 1, 2) completed and expired
    without A's mirror knowing; the new run (the batch resubmitted with another group size, by a
    scheduler whose epochs start over low) registers on A at epoch 1. Its group is created."""
    with workers(2) as (srv, (a, b)):
        old_run(a, b)
        old_incarnation = a._groups["g"].incarnation
        expire(srv.store)
        a.register_attempt("g", "key", PROMPT, 3, 60, request_id="r1", epoch=1)
        a.resume("g", "r1", [], epoch=1)
        a.append("g", "r1", 0, [40, 41])
        flush(a)
        g = srv.store._groups["g"]
        assert g.group_size == 3 and g.incarnation != old_incarnation
        assert srv.store.index_of("g").tokens("r0") == []  # the old run's response stays out
        assert a._groups["g"].incarnation == g.incarnation


def test_a_completed_mirror_kept_for_a_retried_chunk_is_no_longer_released() -> None:
    """Released (a queued append held it), then a chunk of its run retried here: the mirror is kept
    (same incarnation) and stays while the chunk runs; it was dropped at the next tick."""
    with workers(1) as (_srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=4)
        finish(a, "r0", [10], epoch=4)
        flush(a)
        mirror = a._groups["g"]
        assert mirror.completed
        a.append("g", "r0", 1, [], finished=True)  # queued: the release below waits for it
        a.release_group("g")
        assert mirror.releasing
        a.register_attempt("g", "key", PROMPT, 1, 60, request_id="r0", epoch=4)  # the retried chunk
        a.resume("g", "r0", [10], epoch=4)
        assert a.has_group("g")
        flush(a)
        assert a._groups.get("g") is mirror
        assert a.propose("g", "r1", [1, 2, 3], 4) is not None  # still drafting from it


def test_a_new_run_chunk_ending_at_once_on_a_stale_mirror_after_expiry_reaches_its_group(
        ref_engine: ReferenceEngine) -> None:
    """The old run (epochs 1, 2) completed and expired; A's mirror did not know it completed. The
    new run's r1 (epoch 9) resumes a complete output on A and ends at once, before any tick. Its
    append meets the expired group; A registers again with epoch 9 (a new incarnation), and the
    reused reset resends r1, finished, and only r1 (the old run's r0 of A stays out)."""
    eos = ref_engine.eos_token_ids[0]
    with workers(2) as (srv, (a, b)):
        w = Worker(ref_engine, draft=a).start()
        try:
            old_run(a, b)
            old_incarnation = a._groups["g"].incarnation
            expire(srv.store)
            job = ChunkJob(request_id="r1", prompt_token_ids=tuple(PROMPT), max_new_tokens=4, max_tokens=40,
                           sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                           prompt_key="key", group_size=2, output_token_ids=(40, 41, eos), dispatch_epoch=9)
            toks, _, done = w.run(job)
            assert toks == [] and done.finish == ChunkFinish.STOP
            flush(a)
            g = srv.store._groups["g"]
            assert g.incarnation != old_incarnation
            assert srv.store.index_of("g").tokens("r1") == [40, 41, eos] and g.finished == {"r1"}
            assert srv.store.index_of("g").tokens("r0") == []
            assert a._groups["g"].own == {"r1"}
        finally:
            w.close()


def test_a_stale_mirror_of_the_old_run_is_still_released_after_expiry() -> None:
    """The old run's mirrors after the group expired: A (it did not know the group completed) and
    B are released, and nothing is created: A's own response is finished there, so it registers
    nothing; with one of its responses not known finished there, its registration at the old run's
    epoch is refused, and then released."""
    with workers(3) as (srv, (a, b, c)):
        c.register_group("g", "key", PROMPT, group_size=2, ttl_seconds=60)
        c.flush()  # C's mirror follows the group from before it completed: stale, as A's
        old_run(a, b)
        c.resume("g", "r0", [], epoch=1)  # an old-run attempt of r0 that lost to A's
        c.append("g", "r0", 0, [10])
        c.end("g", "r0")
        expire(srv.store)
        rpcs = a.stats().register_rpcs
        assert not a._groups["g"].completed and not c._groups["g"].completed
        flush(a, b, c)
        assert not a._groups and not b._groups and not c._groups
        assert a.stats().register_rpcs == rpcs
        assert "g" not in srv.store._groups and srv.store.stats().groups == 0
