"""The worker's draft client: attempts of one request that overlap here, a chunk of the mirror's
run while a newer submission's registration is queued, and an expired group's mirror that
registered but never synced (review of the session 29 closing notes).

(1) Two attempts of one request running at once on one worker (SGLang's plugin: the re-dispatched
chunk's rid starts while the abandoned rid is still in SGLang's batch): the older attempt's end
cleared the request's "active" mark while the newer one ran, so Sync deltas (another writer's
tokens) overwrote the running attempt's copy, the copy it drafts from.
(2) While a newer submission's registration was queued, a chunk of the mirror's own run for a
request with no recorded submission was taken for an older run's: its resume and appends left the
mirror alone, so its own tokens never reached the index (no drafts from them, for it or a sibling
running here) and its copy kept what a failed attempt had streamed.
(3) A mirror that registered and never synced took the expired branch of _lost_locked as a stale
mirror: registered again with an epoch above the completed group's (submit_seq 0), the server
re-created the completed, expired group as a new run, and its responses would become history twice.

Real draft server on a loopback port and the real DraftClient (background ticks stopped; flush()
drives them); (1) also through SGLang's DraftBridge (no SGLang needed)."""

from __future__ import annotations

from services.worker.engines.sglang.plugin import DraftBridge, custom_params, request_meta
from tests.draft.draft_helpers import PROMPT, register, workers
from tests.draft.registration_helpers import expire


def test_an_older_attempts_end_leaves_the_newer_attempt_of_the_request_active() -> None:
    """A's attempt of r0 at epoch 1 streamed [10, 11]; the chunk is re-dispatched to A at epoch 2
    from the committed [10] while the first attempt is still finishing, and that one ends first.
    The newer attempt runs on: its copy stays its own ([10, 12]) although another writer (epoch 0,
    unordered) put more tokens into r0 on the server; they come in when it ends."""
    with workers(2) as (srv, (a, b)):
        register((a, b), group_size=2)
        a.resume("g", "r0", [], epoch=1)
        a.append("g", "r0", 0, [10, 11])
        a.resume("g", "r0", [10], epoch=2)  # the re-dispatched chunk starts while the first still runs
        a.end("g", "r0")  # the abandoned attempt ends
        assert "r0" in a._groups["g"].active
        a.append("g", "r0", 1, [12])
        a.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 12]
        b.flush()  # B's mirror learns r0 first (an append must continue its copy)
        b.append("g", "r0", 2, [99, 98])  # another writer's tokens, unordered (epoch 0)
        b.flush()
        assert srv.store.index_of("g").tokens("r0") == [10, 12, 99, 98]
        a.flush()
        assert a._groups["g"].index.tokens("r0") == [10, 12]  # the running attempt's copy
        a.end("g", "r0")
        assert "r0" not in a._groups["g"].active
        a.flush()
        assert a._groups["g"].index.tokens("r0") == [10, 12, 99, 98]  # the server's, once it ended


def test_an_older_rids_forget_in_sglang_leaves_the_newer_rid_drafting_from_its_own_copy() -> None:
    """The same through SGLang's plugin: r0#1 (epoch 1) and r0#2 (epoch 2) both in SGLang's batch,
    r0#1 leaves it first (forget); r0#2's request stays active on the mirror."""
    with workers(2) as (_srv, (a, b)):
        register((a, b), group_size=2)
        bridge = DraftBridge(a)
        input_ids = [*PROMPT]
        old = request_meta(custom_params("g", "key", 2, False, request_id="r0", output_offset=0, epoch=1))
        new = request_meta(custom_params("g", "key", 2, False, request_id="r0", output_offset=1, epoch=2))
        bridge.verified("r0#1", old, input_ids, [10, 11], False)
        bridge.verified("r0#2", new, [*input_ids, 10], [12], False)
        bridge.forget("r0#1")
        assert len(bridge) == 1 and "r0" in a._groups["g"].active
        a.flush()
        b.flush()
        b.append("g", "r0", 2, [99])
        b.flush()
        a.flush()
        assert a._groups["g"].index.tokens("r0") == [10, 12]
        bridge.forget("r0#2")
        assert "r0" not in a._groups["g"].active


def test_an_older_submissions_attempt_overlapping_a_newer_one_does_not_end_it() -> None:
    """An older submission's attempt of r0 (it leaves the mirror alone) runs while the newer run's
    attempt of r0 starts here; the older one ends first: the newer one stays active, and its
    appends reach the mirror."""
    with workers(1) as (_srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=5, submit_seq=2)
        a.flush()
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=1, submit_seq=1)
        a.resume("g", "r0", [7], epoch=1)  # older than the mirror's run: left alone
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=6, submit_seq=2)
        a.resume("g", "r0", [], epoch=6)
        a.end("g", "r0")  # the older submission's attempt ends
        m = a._groups["g"]
        assert "r0" in m.active and "r0" not in m.older_attempts
        a.append("g", "r0", 0, [30, 31])
        assert m.index.tokens("r0") == [30, 31]
        a.end("g", "r0")
        assert "r0" not in m.active and not m.attempts


def test_a_chunk_of_the_mirrors_run_indexes_its_tokens_while_a_newer_registration_is_queued() -> None:
    """A's mirror follows submission 1. A chunk of submission 2 (r0) starts here: its registration
    is queued. Then a chunk of submission 1's r1 (no attempt of r1 here before) starts: it is the
    mirror's run's, so its resume and appends go into the index (local only: the id is moving on
    to submission 2), and it drafts from its own tokens."""
    with workers(1) as (srv, (a,)):
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=1, submit_seq=1)
        a.flush()
        assert a._groups["g"].submit_seq == 1
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=5, submit_seq=2)
        assert a._groups["g"].reregister is not None  # submission 2's registration, not sent yet
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=2, submit_seq=1)
        a.resume("g", "r1", [40, 41], epoch=2)
        a.append("g", "r1", 2, [42, 43, 40, 41])
        m = a._groups["g"]
        assert "r1" not in m.older_attempts and "r1" in m.active
        assert m.index.tokens("r1") == [40, 41, 42, 43, 40, 41]
        d = a.propose("g", "r1", [*PROMPT, 40, 41, 42, 43, 40, 41], 2)
        assert d is not None and list(d.tokens) == [42, 43]
        a.flush()
        assert "r1" not in m.own  # submission 1's appends stay local: the group moved to 2
        assert srv.store.index_of("g").tokens("r1") == []
        a.end("g", "r1")


def test_an_expired_completed_group_is_not_re_created_by_a_mirror_that_never_synced() -> None:
    """A registers group g (size 2, submit_seq 0) for its attempt of r0 at epoch 9, and the
    registration is answered, but A's appends and first Sync have not gone out yet. Meanwhile B
    finishes both responses (epochs 1 and 2: r0 by a lost commit's earlier attempt), the group
    completes and expires. A's append meets the expired group: its run's incarnation completed, so
    A's mirror is released, and nothing is created on the server."""
    with workers(2) as (srv, (a, b)):
        register((b,), group_size=2)
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r0", epoch=9)
        a.resume("g", "r0", [], epoch=9)
        a.append("g", "r0", 0, [10, 11], finished=True)
        a.end("g", "r0")
        a._register_pending()  # registered (the group's incarnation), nothing sent or synced yet
        m = a._groups["g"]
        assert m.registered and m.incarnation and not m.history_loaded
        for rid, toks, epoch in (("r0", [10, 11], 1), ("r1", [20], 2)):
            b.resume("g", rid, [], epoch=epoch)
            b.append("g", rid, 0, toks, finished=True)
            b.end("g", rid)
        b.flush()
        assert srv.store._groups["g"].completed
        expire(srv.store)
        for _ in range(3):
            a.flush()
        assert "g" not in a._groups
        assert "g" not in srv.store._groups and srv.store.stats().groups == 0
