"""DraftStore: watermark deltas, TTL expiry, history promotion and the memory budget."""

from __future__ import annotations

import pytest

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.draft.index import GroupIndex
from services.draft.store import DraftStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _replay(store_delta_groups: list, idx: GroupIndex | None) -> GroupIndex:
    """Applies sync deltas to a mirror the way the worker's client does."""
    (d,) = store_delta_groups
    if idx is None:
        idx = GroupIndex(d.prompt_token_ids)
        for h in d.history:
            idx.add_history(h)
    for a in d.appends:
        if a.request_id:
            idx.append(a.request_id, a.offset, a.token_ids)
        else:
            idx.add_history(a.token_ids)
    return idx


def test_sync_deltas_rebuild_identical_mirror() -> None:
    s = DraftStore()
    assert s.register_group("g", "k", [1, 2, 3], 60, 2) == (True, 0)
    assert s.register_group("g", "k", [1, 2, 3], 60, 2) == (False, 0)
    with pytest.raises(AlreadyExists):
        s.register_group("g", "k", [9], 60, 2)
    s.append("g", "a", 0, [4, 5])
    (d0,) = s.sync([("g", 0)])
    assert d0.prompt_token_ids == (1, 2, 3) and d0.watermark == 2
    mirror = _replay([d0], None)
    s.append("g", "a", 2, [6])
    s.append("g", "a", 3, [7])
    s.append("g", "b", 0, [4, 5, 9])
    s.append("g", "a", 0, [4, 5, 6])  # duplicate: no log entry
    (d1,) = s.sync([("g", d0.watermark)])
    # Consecutive appends of "a" are coalesced into one delta.
    assert [(a.request_id, a.offset, a.token_ids) for a in d1.appends] == [("a", 2, (6, 7)), ("b", 0, (4, 5, 9))]
    mirror = _replay([d1], mirror)
    server = s.index_of("g")
    for r in ("a", "b"):
        assert mirror.tokens(r) == server.tokens(r)
    assert mirror.propose([4, 5], 4) == server.propose([4, 5], 4)
    (d2,) = s.sync([("g", d1.watermark)])
    assert d2.appends == () and d2.watermark == d1.watermark
    # A retried sync from an older watermark replays idempotently.
    mirror = _replay(s.sync([("g", d0.watermark)]), mirror)
    assert mirror.tokens("a") == [4, 5, 6, 7]


def test_bad_sync_and_append_input() -> None:
    s = DraftStore(StoreLimits(max_append_tokens=8))
    s.register_group("g", "k", [1], 60, 2)
    with pytest.raises(InvalidArgument) as e:
        s.sync([("g", 99)])
    assert e.value.field == "groups[0].watermark"
    with pytest.raises(InvalidArgument) as e:
        s.sync([("g", 0), ("g", 0)])
    assert e.value.field == "groups[1].group_id"
    with pytest.raises(InvalidArgument) as e:
        s.sync([("", 0)])
    assert e.value.field == "groups[0].group_id"
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "a", 0, list(range(9)))
    assert e.value.field == "token_ids"
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "a", 0, [1, -5])
    assert e.value.field == "token_ids[1]"
    s.append("g", "a", 0, [1, 2, 3])
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "a", 5, [1])
    assert e.value.field == "offset"
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "a", 1, [7])
    assert e.value.field == "token_ids"
    with pytest.raises(NotFound) as e2:
        s.append("nope", "a", 0, [1])
    assert e2.value.field == "group_id"
    s.append("g", "a", 3, [4], finished=True)
    with pytest.raises(FailedPrecondition):
        s.append("g", "a", 4, [5])
    assert s.index_of("g").tokens("a") == [1, 2, 3, 4]
    (d,) = s.sync([("unknown", 3)])
    assert d.gone


def test_ttl_expiry() -> None:
    clock = Clock()
    s = DraftStore(clock=clock)
    s.register_group("g", "k", [1], 10, 2)
    clock.t += 5
    s.append("g", "a", 0, [1])  # activity refreshes the TTL
    clock.t += 8
    assert s.expire_now() == 1
    clock.t += 11
    assert s.expire_now() == 0
    with pytest.raises(NotFound, match="not registered"):  # unfinished: registered again by its workers
        s.append("g", "a", 1, [2])
    assert s.sync([("g", 2)])[0].gone and not s.sync([("g", 2)])[0].expired
    assert s.stats().expired_groups == 1
    s.register_group("c", "k", [1], 10, 1)
    s.append("c", "a", 0, [1], finished=True)  # completed
    clock.t += 11
    assert s.expire_now() == 0
    with pytest.raises(NotFound, match="expired"):
        s.append("c", "b", 0, [2])
    assert s.sync([("c", 1)])[0].expired


def test_history_promotion_and_seed() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    s.register_group("g1", "key", [1, 2], 60, 2)
    s.append("g1", "a", 0, [5, 6, 7], finished=True)
    s.append("g1", "b", 0, [5, 6, 8], finished=True)
    created, hist = s.register_group("g2", "key", [1, 2], 60, 2)
    assert created and hist == 2
    assert s.index_of("g2").propose([1, 2, 5], 2).tokens[:1] == (6,)
    # Seeding into a live group reaches mirrors as a history log entry.
    (d0,) = s.sync([("g2", 0)])
    assert len(d0.history) == 2
    assert s.seed_history("key", 7, [[40, 41, 42]]) == 1
    (d1,) = s.sync([("g2", d0.watermark)])
    assert [(a.request_id, a.token_ids) for a in d1.appends] == [("", (40, 41, 42))]
    # keep 2 iterations per key: iterations 0 (promoted) and 7; a third pushes out the oldest.
    s.seed_history("key", 8, [[50]])
    created, hist = s.register_group("g3", "key", [1, 2], 60, 2)
    assert hist == 2  # iterations 7 and 8
    assert s.stats().evicted_history == 2


def test_memory_budget_evicts_history_first_then_refuses() -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=200_000))
    s.seed_history("old", 0, [list(range(10_000))])
    s.seed_history("new", 0, [list(range(10_000))])
    s.register_group("g", "k", [1], 60, 1)
    s.append("g", "a", 0, list(range(300)))
    st = s.stats()
    assert st.memory_bytes <= st.memory_budget_bytes
    assert st.evicted_history >= 1
    with pytest.raises(ResourceExhausted):
        for i in range(100):
            s.append("g", "a", 300 + i * 50, list(range(50)))
    assert s.stats().memory_bytes <= 200_000
    assert s.stats().bytes_per_token > 0
