"""The draft store under retries, reordering, restarts and memory pressure (issue 4, items 2 and 8):
attempt epochs, group incarnations, the memory budget on every path, idempotent history seeding.
Pure core, no server."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, SeerError
from services.draft.store import DraftStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_stale_attempt_cannot_overwrite_a_newer_one() -> None:
    s = DraftStore()
    s.register_group("g", "k", [1, 2, 3])
    s.append("g", "r", 0, [10, 11, 12], truncate=True, epoch=5)  # attempt 5 (worker A)
    s.append("g", "r", 0, [10, 11, 12], truncate=True, epoch=9)  # attempt 9 resumes (worker B) ...
    s.append("g", "r", 3, [23, 24], truncate=True, epoch=9)
    with pytest.raises(FailedPrecondition) as e:  # ... and A's late message arrives
        s.append("g", "r", 3, [13, 14], truncate=True, epoch=5)
    assert e.value.field == "epoch" and "stale attempt" in str(e.value)
    with pytest.raises(FailedPrecondition):
        s.append("g", "r", 5, [15], epoch=5)  # plain appends of the old attempt too
    assert s.index_of("g").tokens("r") == [10, 11, 12, 23, 24]
    # The log replays B's version only: a mirror syncing from 0 sees no trace of A's late message.
    (d,) = s.sync([("g", 0)])
    assert [(a.offset, a.token_ids) for a in d.appends] == [(0, (10, 11, 12, 23, 24))]
    s.append("g", "r", 5, [25], truncate=True, epoch=9)
    assert s.index_of("g").tokens("r") == [10, 11, 12, 23, 24, 25]


def test_watermark_of_another_incarnation_gets_the_whole_group() -> None:
    clock = Clock()
    s = DraftStore(clock=clock)
    s.register_group("g", "k", [1, 2, 3], ttl_seconds=10)
    for i in range(5):
        s.append("g", "a", i, [100 + i])
    (d,) = s.sync([("g", 0)])
    wm, inc = d.watermark, d.incarnation
    assert inc != 0
    clock.t += 11
    s.expire_now()
    (gone,) = s.sync([("g", wm)], [inc])
    assert gone.gone and not gone.expired  # not completed: its workers register it again
    s.register_group("g", "k", [1, 2, 3], ttl_seconds=10)  # created again (not completed: allowed)
    for i in range(8):
        s.append("g", "b", i, [200 + i])
    (d2,) = s.sync([("g", wm)], [inc])  # the old mirror's watermark 6 is inside the new log of 9
    assert d2.reset and d2.incarnation not in (0, inc)
    assert d2.prompt_token_ids == (1, 2, 3) and [a.offset for a in d2.appends] == [0]
    (d3,) = s.sync([("g", d2.watermark)], [d2.incarnation])
    assert not d3.reset and d3.appends == ()
    # A watermark ahead of the log is a reset too (not an error) when the incarnation differs.
    (d4,) = s.sync([("g", 50)], [inc])
    assert d4.reset


def test_gone_tells_expired_from_unknown() -> None:
    s = DraftStore()
    (d,) = s.sync([("never", 3)])
    assert d.gone and not d.expired


def test_completed_group_registered_again_after_expiry_never_doubles_its_history() -> None:
    """The id of a completed group that expired starts a new incarnation (a batch id used again);
    a straggler that re-creates it with the old responses adds nothing to history."""
    clock = Clock()
    s = DraftStore(clock=clock)
    s.register_group("g", "key", [1, 2, 3], ttl_seconds=1, group_size=1)
    s.append("g", "r0", 0, [10, 11, 12, 13], finished=True)
    assert s._history.responses("key") == [(10, 11, 12, 13)]
    clock.t += 2
    s.expire_now()
    assert s.register_group("g", "key", [1, 2, 3], ttl_seconds=1, group_size=1) == (True, 1)
    s.append("g", "r0", 0, [10, 11, 12, 13], finished=True)
    assert s._history.responses("key") == [(10, 11, 12, 13)]  # one iteration, not two
    clock.t += 2
    s.expire_now()
    s.register_group("g", "key", [1, 2, 3], ttl_seconds=1, group_size=1)
    s.append("g", "r0", 0, [20], finished=True)  # new responses: the next iteration
    assert s._history.responses("key") == [(20,), (10, 11, 12, 13)]


def test_append_never_evicts_its_own_group() -> None:
    # A completed group (evictable) still takes a straggler's appends (beyond group_size); under
    # memory pressure the append must be refused or fit, never index into an evicted orphan.
    for budget in range(20_000, 120_000, 5_000):
        s = DraftStore(StoreLimits(memory_budget_bytes=budget))
        try:
            s.register_group("g", "k", [1, 2, 3], group_size=1)
            s.append("g", "r0", 0, list(range(10, 40)), finished=True)
            s.append("g", "r1", 0, list(range(10, 20)))
        except ResourceExhausted:
            continue
        try:
            s.append("g", "r1", 10, list(range(20, 120)))
        except ResourceExhausted:
            continue
        assert s.stats().groups == 1
        assert s.index_of("g").tokens("r1") == list(range(10, 120))


def test_register_group_is_bounded_by_the_budget() -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 20))
    with pytest.raises(ResourceExhausted):
        s.register_group("g", "k", list(range(50_000)))
    assert s.stats().memory_bytes <= 1 << 20 and s.stats().groups == 0


def test_seed_history_into_live_groups_is_bounded() -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=4 << 20))
    for i in range(8):
        s.register_group(f"g{i}", "k", [1, 2, 3])
    with pytest.raises(ResourceExhausted):
        s.seed_history("k", 0, [list(range(5000)) for _ in range(4)])
    st = s.stats()
    assert st.memory_bytes <= st.memory_budget_bytes
    assert all(s.index_of(f"g{i}").num_history == 0 for i in range(8))  # nothing half-seeded


def test_seed_history_is_idempotent_and_ignores_empty_seeds() -> None:
    s = DraftStore(StoreLimits(history_iterations=1))
    s.register_group("g", "k", [1, 2, 3])
    assert s.seed_history("k", 0, [[5, 6, 7]]) == 1
    assert s.seed_history("k", 0, [[5, 6, 7]]) == 0  # a retry after a deadline
    assert s._history.responses("k") == [(5, 6, 7)]
    assert s.index_of("g").num_history == 1
    assert s.seed_history("k", 1, []) == 0  # nothing: no empty iteration pushes out iteration 0
    assert s._history.responses("k") == [(5, 6, 7)]
    # A superset: the responses not held load, the held one does not load twice.
    assert s.seed_history("k", 0, [[5, 6, 7], [8]]) == 1
    assert sorted(s._history.responses("k")) == [(5, 6, 7), (8,)]


def test_evicted_history_frees_what_it_was_accounted() -> None:
    tracemalloc.start()
    try:
        s = DraftStore(StoreLimits(memory_budget_bytes=1 << 30))
        s.seed_history("k", 0, [list(range(1000, 6_000)) for _ in range(4)])
        s.register_group("g", "k", [1, 2, 3])  # its index shares nothing with the stored history
        gc.collect()
        rep0, b0 = s.stats().memory_bytes, tracemalloc.get_traced_memory()[0]
        with s._lock:
            assert s._history.evict_oldest()
        gc.collect()
        freed = b0 - tracemalloc.get_traced_memory()[0]
        reported = rep0 - s.stats().memory_bytes
    finally:
        tracemalloc.stop()
    assert reported > 0 and 0.5 * reported <= freed <= 2 * reported


def test_final_append_must_end_at_the_response_end() -> None:
    s = DraftStore()
    s.register_group("g", "k", [1])
    s.append("g", "r", 0, [5, 6, 7, 8])
    with pytest.raises(FailedPrecondition) as e:
        s.append("g", "r", 0, [5, 6], finished=True)  # a reordered old message, not the end
    assert e.value.field == "finished"
    s.append("g", "r", 2, [7, 8], finished=True)
    assert "r" in s._groups["g"].finished


def test_truncate_not_finished_reopens_a_finished_response() -> None:
    # "cut, then re-append the same tokens" coalesced into one truncate message must re-open.
    s = DraftStore()
    s.register_group("g", "k", [1], group_size=2)
    s.append("g", "r", 0, [5, 6, 7], finished=True)
    s.append("g", "r", 1, [6, 7], truncate=True)
    assert "r" not in s._groups["g"].finished


def test_registration_that_evicts_its_own_history_is_not_refused() -> None:
    """Eviction (oldest history first) may take the key's own history; the need is taken again
    after it, so the group registers with what is left instead of being refused for history gone."""
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 20))
    s.seed_history("K", 0, [[(i * 7 + j) % 1000 for j in range(1000)] for i in range(4)])
    s.register_group("live0", "other", list(range(400)), group_size=4)
    s.register_group("live1", "other", list(range(400)), group_size=4)
    created, _history = s.register_group("g", "K", list(range(10)), group_size=4)
    assert created and s.stats().evicted_history >= 1
    assert s.stats().memory_bytes <= 1 << 20


def test_a_refused_reregistration_leaves_the_old_group_expired_not_lost() -> None:
    # A completed group's id registered again with another prompt (a reused batch id) when the budget
    # has no room for it: the registration is refused, and the old group's workers are told it
    # expired (before: it was deleted with no tombstone, so Sync said "lost" and appends NOT_FOUND).
    s = DraftStore(StoreLimits(memory_budget_bytes=400_000, history_iterations=1))
    s.register_group("live", "", [7])
    i = 0
    with pytest.raises(SeerError):
        while True:  # fill the budget with a live group (never evicted)
            s.append("live", f"f{i}", 0, list(range(50)))
            i += 1
    s.register_group("done", "k", [1, 2, 3], group_size=1)
    s.append("done", "r", 0, list(range(5)), finished=True)
    inc = s.sync([("done", 0)])[0].incarnation
    with pytest.raises(ResourceExhausted):
        s.register_group("done", "k", list(range(5000)))
    d = s.sync([("done", 2)], [inc])[0]
    assert d.gone and d.expired


def test_an_overlap_mismatch_is_refused_before_any_room_is_made() -> None:
    # A bad append (its overlap differs from the stored tokens) must not evict other data to make
    # room for its new tokens, nor be answered RESOURCE_EXHAUSTED (retried by the worker) when the
    # budget is full: INVALID_ARGUMENT naming token_ids.
    s = DraftStore(StoreLimits(memory_budget_bytes=2_000_000))
    s.register_group("g", "k", [1, 2, 3])
    s.append("g", "r", 0, list(range(10)))
    s.seed_history("other", 0, [list(range(1000)), list(range(1000, 2000))])
    before = s.stats()
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "r", 0, [99] * 7000)  # needs room for 6,990 new tokens
    assert e.value.field == "token_ids"
    after = s.stats()
    assert (after.history_keys, after.evicted_history, after.evicted_groups) == (
        before.history_keys, before.evicted_history, before.evicted_groups)
    full = DraftStore(StoreLimits(memory_budget_bytes=300_000))
    full.register_group("g", "k", [1, 2, 3])
    full.append("g", "r", 0, list(range(10)))
    i = 0
    with pytest.raises(ResourceExhausted):
        while True:
            full.append("g", f"f{i}", 0, list(range(50)))
            i += 1
    with pytest.raises(InvalidArgument):
        full.append("g", "r", 0, [99] * 200)
