"""A mirror whose only attempts running here are of an OLDER submission of its group is not kept
for them: their resume leaves the request inactive (_Running.made_active False), so memory-budget
eviction, the server's expiry and a reset release it as if nothing of it ran here. This pins that
this is harmless (see DraftClient._enforce_budget_locked): such an attempt's appends are dropped
(_superseded) whether the mirror is kept or not, its output never lands in the newer run (the
buffer refuses an older submission's commit), a later chunk of the newer run re-creates the mirror
from the server and the old attempt's late appends stay dropped there, and its decode-path calls on
a released mirror do nothing (no drafts, no exception). Kept for it, an expired group of the newer
run would be re-created on behalf of an attempt that writes nothing to it, and memory held for
drafts of a discarded chunk.

Real draft server on a loopback port and the real DraftClient (background ticks stopped; flush()
drives them)."""

from __future__ import annotations

import pytest

from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import PROMPT, DraftServer, workers
from tests.draft.registration_helpers import expire

# O: the old submission's chunk of r0 (epoch 1, submit_seq 1), still in SGLang's batch; N: the
# resubmitted batch's chunk of r0 (epoch 2, submit_seq 2), dispatched here too.


def _only_an_older_submissions_attempt_runs(srv: DraftServer, a: DraftClient, size: int = 2,
                                            old_first: bool = True) -> None:
    """Group "g" of `size` responses. old_first: O streams [10, 11]; the batch is resubmitted and N
    of r0 starts here alongside O (superseding it). Else N starts first and O's chunk comes later
    (its resume leaves the mirror alone). N finishes r0 as [30, 31, 32] and ends; O still runs, and
    is now the mirror's only running attempt."""
    if old_first:
        a.register_attempt("g", "key", PROMPT, size, 60, request_id="r0", epoch=1, submit_seq=1)
        a.flush()
        a.resume("g", "r0", [], epoch=1, submit_seq=1)
        a.append("g", "r0", 0, [10, 11], epoch=1, submit_seq=1)
        a.flush()
    # Another submission than the mirror's: registered again (or first).
    a.register_attempt("g", "key", PROMPT, size, 60, request_id="r0", epoch=2, submit_seq=2)
    a.resume("g", "r0", [], epoch=2, submit_seq=2)  # supersedes O (old_first)
    if not old_first:
        a.flush()
        a.register_attempt("g", "key", PROMPT, size, 60, request_id="r0", epoch=1, submit_seq=1)
        a.resume("g", "r0", [10], epoch=1, submit_seq=1)  # left alone: r0's copy stays N's
        a.append("g", "r0", 1, [11], epoch=1, submit_seq=1)
    a.append("g", "r0", 0, [30, 31, 32], finished=True, epoch=2, submit_seq=2)
    a.end("g", "r0", epoch=2, submit_seq=2)
    a.flush()
    a.flush()
    m = a._groups["g"]
    assert m.submit_seq == 2 and not m.active
    assert [(r.epoch, r.made_active, r.superseded) for r in m.attempts["r0"]] == [(1, old_first, True)]
    assert srv.store.index_of("g").tokens("r0") == [30, 31, 32]


def _old_attempt_goes_on(a: DraftClient) -> None:
    """O's decode path after its mirror was released: nothing to draft from, nothing kept, no error."""
    assert a.propose("g", "r0", [10, 11], 4) is None
    a.append("g", "r0", 2, [12, 13], epoch=1, submit_seq=1)
    a.append("g", "r0", 4, [14], finished=True, epoch=1, submit_seq=1)
    assert not a._pending


@pytest.mark.parametrize("old_first", [True, False])
def test_memory_eviction_of_a_mirror_only_an_older_submissions_attempt_runs_on_is_harmless(old_first: bool) -> None:
    with workers(1) as (srv, (a,)):
        _only_an_older_submissions_attempt_runs(srv, a, old_first=old_first)
        assert a.propose("g", "r0", [30], 2) is not None  # kept, O drafts from N's copy (the newer run's)
        a.memory_budget_bytes = 1
        with a._lock:
            a._enforce_budget_locked()
        assert "g" not in a._groups and a.stats().evicted_mirrors == 1
        _old_attempt_goes_on(a)
        a.flush()
        # A chunk of the newer run (r1) starts here: the mirror comes back from the server's group.
        a.memory_budget_bytes = 1 << 30
        a.register_attempt("g", "key", PROMPT, 2, 60, request_id="r1", epoch=3, submit_seq=2)
        a.flush()
        m = a._groups["g"]
        assert m.index.tokens("r0") == [30, 31, 32]  # the newer run's text, as before the eviction
        a.append("g", "r0", 5, [15], epoch=1, submit_seq=1)  # O's late token: dropped on the new mirror too
        a.end("g", "r0", epoch=1, submit_seq=1)  # ends nothing of the new mirror's
        a.resume("g", "r1", [], epoch=3, submit_seq=2)
        a.append("g", "r1", 0, [40, 41], finished=True, epoch=3, submit_seq=2)
        a.end("g", "r1", epoch=3, submit_seq=2)
        a.flush()
        a.flush()
        g = srv.store._groups["g"]
        assert srv.store.index_of("g").tokens("r0") == [30, 31, 32], "the old submission's tokens reached the group"
        assert srv.store.index_of("g").tokens("r1") == [40, 41]
        assert {"r0", "r1"} <= g.finished and m.completed and not m.attempts


def test_expiry_of_a_completed_group_while_only_an_older_submissions_attempt_runs_releases_the_mirror() -> None:
    """The newer run completed the group (one response) and the server expired it while O still runs
    here: released as for an idle mirror (Sync: gone + expired), nothing registered again for O (its
    appends are dropped either way); O's calls go on harmlessly."""
    with workers(1) as (srv, (a,)):
        _only_an_older_submissions_attempt_runs(srv, a, size=1)
        assert a._groups["g"].completed and not a.has_group("g")
        expire(srv.store)
        a.flush()
        assert "g" not in a._groups
        _old_attempt_goes_on(a)
        a.end("g", "r0", epoch=1, submit_seq=1)
        a.flush()
        a.flush()
        assert "g" not in srv.store._groups, "the expired group was re-created for an older submission's attempt"
