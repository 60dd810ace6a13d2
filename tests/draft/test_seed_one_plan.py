"""A seed plans its history add once (DraftStore._seed_locked).

The seed's cost (the new responses, the fixed structures it creates, what the iteration cap trims)
and the add itself each matched the seed's responses against every held response of the key
(HistoryStore._plan), three or four times a seed, under the draft store's lock. Now one plan per
pass gives all of them and is the one add() applies (a pass again only after making room evicted
history, which can make held responses new again). The trace test pins the outcome (what is
added, memory, evictions, iterations) to what it was before the change, over merges, the cap, a
move to a newer iteration, a rejected add, a fallback number, budget eviction that makes held
responses new again, and a seed that does not fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from services.common.errors import ResourceExhausted
from services.draft.history import HistoryStore
from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import complete_group, history_bytes_recounted

Row = tuple[str, object, int, int, int, tuple[tuple[str, int, int], ...]]

# (step, seed's return, memory_bytes, evicted_history, evicted_groups, (key, iteration, responses)),
# recorded with the store as it was before planning once (HEAD 9581347).
_EXPECTED: list[Row] = [
    ("a0", None, 8168, 0, 0, (("a", 0, 2),)),
    ("live", None, 14808, 0, 0, (("a", 0, 2),)),
    ("new iteration", 2, 18874, 0, 0, (("a", 0, 2), ("a", 1, 2))),
    ("retry", 0, 18874, 0, 0, (("a", 0, 2), ("a", 1, 2))),
    ("merge over the cap", 3, 23300, 1, 0, (("a", 0, 2), ("a", 1, 4))),
    ("move older to newer", 1, 24388, 2, 0, (("a", 1, 4), ("a", 2, 2))),
    ("rejected", 0, 24388, 3, 0, (("a", 1, 4), ("a", 2, 2))),
    ("fallback", 0, 24388, 4, 0, (("a", 1, 4), ("a", 2, 2))),
    ("other key", 6, 26532, 4, 0, (("a", 1, 4), ("a", 2, 2), ("b", 3, 6))),
    ("other key bigger", 8, 30084, 4, 0, (("a", 1, 4), ("a", 2, 2), ("b", 3, 6), ("c", 3, 8))),
    ("back to a", 3, 28466, 24, 1, (("a", 5, 3),)),
    ("b again after eviction", 3, 29938, 24, 1, (("a", 5, 3), ("b", 4, 3))),
    ("too big", "exhausted", 27210, 30, 1, ()),
    ("d first", 4, 28746, 30, 1, (("d", 1, 4),)),
    ("e fills", 6, 39770, 30, 1, (("d", 1, 4), ("e", 1, 6))),
    ("d again, its old iteration evicted", 7, 29538, 40, 1, (("d", 2, 7),)),
]

_STEPS: list[tuple[str, str, int, list[list[int]], bool]] = [
    ("new iteration", "a", 1, [[20, 21, 22], [20, 21, 23, 24]], True),
    ("retry", "a", 1, [[20, 21, 22], [20, 21, 23, 24]], True),
    ("merge over the cap", "a", 1, [[30 + i, 31, 32] for i in range(3)], True),
    ("move older to newer", "a", 2, [[10, 11, 12, 13], [40, 41]], True),
    ("rejected", "a", 0, [[50, 51]], True),
    ("fallback", "a", 0, [[60, 61]], False),
    ("other key", "b", 3, [[70 + i] * 30 for i in range(6)], True),
    ("other key bigger", "c", 3, [[90 + i] * 60 for i in range(8)], True),
    ("back to a", "a", 5, [[100 + i] * 12 for i in range(3)], True),
    ("b again after eviction", "b", 4, [[70 + i] * 30 for i in range(3)], True),
    ("too big", "a", 6, [[100 + i] * 40 for i in range(5)], True),
    ("d first", "d", 1, [[5, i] * 10 for i in range(4)], True),
    ("e fills", "e", 1, [[6, i] * 200 for i in range(6)], True),
    # d's iteration 1 is the oldest stored: making room evicts it, and its responses are new again.
    ("d again, its old iteration evicted", "d", 2,
     [[5, i] * 10 for i in range(4)] + [[7, i] * 20 for i in range(3)], True),
]


def _trace() -> list[Row]:
    s = DraftStore(StoreLimits(memory_budget_bytes=40_000, history_iterations=2, history_iteration_responses=4))
    out: list[Row] = []

    def snap(tag: str, ret: object) -> None:
        st = s.stats()
        its = tuple(sorted((k, i, len(it.responses)) for k in s._history for i, it in s._history._keys[k].items()))
        assert s._history.memory_bytes == history_bytes_recounted(s._history)
        assert st.memory_bytes <= s.limits.memory_budget_bytes
        out.append((tag, ret, st.memory_bytes, st.evicted_history, st.evicted_groups, its))

    complete_group(s, "a0", [[10, 11, 12, 13], [10, 11, 14]], 0, key="a")
    snap("a0", None)
    # A live group of key a: every seed of a is indexed (and logged) by it too, and made room for.
    s.register_group("live", "a", [1, 2, 3], 60, 4, policy_version=1)
    snap("live", None)
    for tag, key, iteration, responses, versioned in _STEPS:
        try:
            ret: object = s.seed_history(key, iteration, responses, versioned=versioned)
        except ResourceExhausted:
            ret = "exhausted"
        snap(tag, ret)
    return out


def test_seed_outcomes_are_as_before_planning_once() -> None:
    assert _trace() == _EXPECTED


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts HistoryStore._plan calls (one entry per call)."""
    calls: list[int] = []
    real = HistoryStore._plan

    def counted(self: HistoryStore, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HistoryStore, "_plan", counted)
    yield calls


@pytest.mark.parametrize("case", ["a key's first seed", "a new iteration of a key", "a merge into an iteration"])
def test_a_seed_plans_its_add_once(plans: list[int], case: str) -> None:
    s = DraftStore(StoreLimits(history_iteration_responses=4))
    s.register_group("live", "k", [1, 2, 3], 60, 2, policy_version=1)
    if case != "a key's first seed":
        s.seed_history("k", 0, [[1, 2], [3, 4]])
    iteration = 0 if case == "a merge into an iteration" else 1
    plans.clear()
    assert s.seed_history("k", iteration, [[5, 6, 7], [8, 9]]) == 2
    assert len(plans) == 1
    plans.clear()
    assert s.refill_history("k", iteration, [[5, 6, 7], [10]]) == (1, iteration)
    assert len(plans) == 1
