"""SeedHistory / promotion never hold a response of a key twice (session 25, "duplicate history on
re-seed"): the rule is per response (a multiset union), not per add, so subsets, supersets, a
group's responses refilled within its whole buffer iteration, and the same responses of a newer
iteration all load once."""

from __future__ import annotations

from services.draft.history import (
    HISTORY_ITERATION_BYTES,
    HISTORY_KEY_BYTES,
    HISTORY_RESPONSE_BYTES,
    HISTORY_TOKEN_BYTES,
)
from services.draft.store import DraftStore, StoreLimits

A, B, C, D = [10, 11, 12], [20, 21], [30, 31, 32, 33], [40]


def _held(s: DraftStore, key: str) -> list[tuple[int, ...]]:
    return sorted(s._history.responses(key))


def _accounted(s: DraftStore) -> int:
    keys = s._history._keys
    return (sum(len(r) * HISTORY_TOKEN_BYTES + HISTORY_RESPONSE_BYTES for k in keys for r in s._history.responses(k))
            + len(keys) * HISTORY_KEY_BYTES + sum(len(its) for its in keys.values()) * HISTORY_ITERATION_BYTES)


def test_subset_and_superset_of_an_earlier_seed_load_only_what_is_new() -> None:
    s = DraftStore()
    s.register_group("live", "k", [1, 2, 3])
    assert s.seed_history("k", 0, [A, B, C]) == 3
    assert s.seed_history("k", 0, [B, A]) == 0  # a subset: held already
    assert s.seed_history("k", 3, [C, A, B, D]) == 1  # a superset, another iteration: only D is new
    assert _held(s, "k") == sorted(map(tuple, [A, B, C, D]))
    assert s.index_of("live").num_history == 4  # the live group got each once too
    assert s.register_group("next", "k", [1, 2, 3]) == (True, 4)
    assert s._history.memory_bytes == _accounted(s)


def test_promoted_group_then_refill_of_its_whole_iteration_adds_only_the_other_groups() -> None:
    # Iteration n of key k had two groups of the prompt; one completed here and was promoted, then
    # (e.g. the backfill, or the trainer) seeds the buffer's whole iteration.
    s = DraftStore()
    s.register_group("g1", "k", [1, 2, 3], 60, 2)
    s.append("g1", "r0", 0, A, finished=True)
    s.append("g1", "r1", 0, B, finished=True)
    assert _held(s, "k") == sorted(map(tuple, [A, B]))
    assert s.seed_history("k", 0, [A, B, C, D]) == 2
    assert _held(s, "k") == sorted(map(tuple, [A, B, C, D]))
    # The other way round: a group completing with responses seeded already adds nothing.
    s.register_group("g2", "k", [1, 2, 3], 60, 2)
    s.append("g2", "r0", 0, C, finished=True)
    s.append("g2", "r1", 0, D, finished=True)
    assert len(s._history.responses("k")) == 4
    assert s._history.memory_bytes == _accounted(s)


def test_equal_responses_of_one_add_are_kept_as_many_times() -> None:
    # At a low temperature a group's samples can be identical: those are real counts, not repeats.
    s = DraftStore()
    assert s.seed_history("k", 0, [A, A]) == 2
    assert s.seed_history("k", 0, [A]) == 0
    assert s.seed_history("k", 0, [A, A, A]) == 1
    assert len(s._history.responses("k")) == 3


def test_a_response_brought_again_by_a_newer_iteration_lives_with_it() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    assert s.seed_history("k", 1, [A, B]) == 2
    assert s.seed_history("k", 2, [A, C]) == 1  # A is held: it moves to iteration 2
    assert s.seed_history("k", 3, [D]) == 1  # iteration 1 (B only now) leaves
    assert _held(s, "k") == sorted(map(tuple, [A, C, D]))
    assert s.stats().evicted_history == 1  # B; A moved on, it was not evicted
    assert s._history.memory_bytes == _accounted(s)


def test_seeding_after_eviction_loads_again() -> None:
    s = DraftStore(StoreLimits(history_iterations=1))
    assert s.seed_history("k", 0, [A]) == 1
    assert s.seed_history("k", 1, [B]) == 1  # iteration 0 leaves
    assert s.seed_history("k", 2, [A]) == 1  # not held any more: loads again (once)
    assert _held(s, "k") == [tuple(A)]
    assert s._history.memory_bytes == _accounted(s)


def test_a_held_response_evicted_while_making_room_is_made_room_for_too() -> None:
    # Making room for the new response evicts the iteration that held the other one: it is new
    # again, so room is made for it as well, and the budget holds.
    big_a, big_b, big_c = list(range(1000)), list(range(1000, 2000)), list(range(2000, 3000))
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 30))
    assert s.seed_history("k", 0, [big_a]) == 1
    assert s.seed_history("k2", 0, [big_c]) == 1
    one = 1000 * HISTORY_TOKEN_BYTES + HISTORY_RESPONSE_BYTES
    s.limits = StoreLimits(memory_budget_bytes=2 * one + one // 2)
    assert s.seed_history("k", 1, [big_a, big_b]) == 2  # A (evicted making room for B) loads again
    st = s.stats()
    assert st.memory_bytes <= st.memory_budget_bytes
    assert _held(s, "k") == sorted([tuple(big_a), tuple(big_b)]) and s._history.responses("k2") == []
    assert s._history.memory_bytes == _accounted(s)


def test_equal_responses_of_two_groups_are_two_samples() -> None:
    """Two groups of one prompt key complete with a token-equal response: two samples, held twice
    (as the buffer holds them). The per-response dedup kept one. A group completing again (a
    straggler re-creating it) and a seed of the buffer's iteration still load nothing new."""
    s = DraftStore()
    for g in ("g1", "g2"):
        s.register_group(g, "k", [1, 2, 3], 60, 2)
    for g in ("g1", "g2"):
        s.append(g, "r0", 0, A, finished=True)
    s.append("g1", "r1", 0, B, finished=True)
    s.append("g2", "r1", 0, C, finished=True)
    assert _held(s, "k") == sorted(map(tuple, [A, A, B, C]))
    # The buffer's whole iteration seeded afterwards: everything held already.
    assert s.seed_history("k", 0, [A, B, A, C]) == 0
    # g1 completes again under a new incarnation (expired, re-created by a straggler): nothing new.
    s._groups["g1"].expires_at = 0.0
    s.expire_now()
    s.register_group("g1", "k", [1, 2, 3], 60, 2)
    s.append("g1", "r0", 0, A, finished=True)
    s.append("g1", "r1", 0, B, finished=True)
    assert _held(s, "k") == sorted(map(tuple, [A, A, B, C]))
    assert s._history.memory_bytes == _accounted(s)


def test_a_seeded_copy_is_claimed_by_the_group_that_completes_with_it() -> None:
    """Seeded first (the backfill after a restart: the buffer had g1's r0), then both groups
    complete with that response: g1's claims the seeded copy, g2's is a second sample."""
    s = DraftStore()
    for g in ("g1", "g2"):
        s.register_group(g, "k", [1, 2, 3], 60, 1)
    assert s.seed_history("k", 0, [A]) == 1
    s.append("g1", "r0", 0, A, finished=True)
    assert _held(s, "k") == [tuple(A)]
    s.append("g2", "r0", 0, A, finished=True)
    assert _held(s, "k") == [tuple(A), tuple(A)]
    assert s._history.memory_bytes == _accounted(s)
