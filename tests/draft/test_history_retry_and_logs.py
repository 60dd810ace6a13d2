"""HistoryStore: a retry that adds nothing changes nothing (order, counts); rejected adds warn at
most once per key per minute; log records carry the iteration as an int with a `versioned` flag."""

from __future__ import annotations

import logging

import pytest

from services.draft import history
from services.draft.history import REJECTED_WARN_INTERVAL_S, HistoryStore, log_fields, unversioned
from services.draft.store import DraftStore, StoreLimits

_REJECTED = "older than every kept iteration"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_retried_seed_that_adds_nothing_does_not_reorder_its_iteration() -> None:
    h = HistoryStore(keep_iterations=2, iteration_responses=4)
    h.add("k", 7, [[1], [2]])  # SeedHistory of version 7: the oldest responses of the iteration
    h.add("k", 7, [[3], [4]], sources=[11, 12])  # a group of version 7 completes
    assert h.add("k", 7, [[1], [2]]) == []  # the SeedHistory retried: nothing new
    assert h.responses("k") == [(1,), (2,), (3,), (4,)]
    # The cap then trims the seed's oldest response, not the group's.
    h.add("k", 7, [[5]], sources=[13])
    assert h.responses("k") == [(2,), (3,), (4,), (5,)]
    assert h.evicted == 1


def test_a_rejected_retry_is_not_counted_again_and_warns_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    h = HistoryStore(keep_iterations=2, clock=clock)
    h.add("k", 98, [[98]])
    h.add("k", 99, [[99]])
    with caplog.at_level(logging.DEBUG, logger="services.draft.history"):
        assert h.add("k", 3, [[3, 3], [4]]) == []  # older than both kept: not kept, counted
        assert h.evicted == 2
        assert h.add("k", 3, [[3, 3], [4]]) == []  # the same SeedHistory retried: not counted again
        assert h.evicted == 2
        assert h.add("k", 4, [[5]]) == []  # another rejected add within the minute: counted, not warned
        assert h.evicted == 3
        h.add("other", 5, [[1]])
        h.add("other", 6, [[1, 2]])
        assert h.add("other", 2, [[7]]) == []  # another key warns on its own
        clock.t += REJECTED_WARN_INTERVAL_S
        assert h.add("k", 2, [[6]]) == []  # a minute later: warned again, with the count suppressed
    assert h.evicted == 5 and h.rejected_adds == 5
    rejected = [r for r in caplog.records if _REJECTED in r.getMessage()]
    warned = [r for r in rejected if r.levelno == logging.WARNING]
    assert [(r.fields["prompt_key"], r.fields["iteration"], r.fields["suppressed"])  # type: ignore[attr-defined]
            for r in warned] == [("k", 3, 0), ("other", 2, 0), ("k", 2, 2)]
    assert [r.levelno for r in rejected].count(logging.DEBUG) == 2
    assert [r.fields["retry"] for r in rejected if r.fields["prompt_key"] == "k"] == [  # type: ignore[attr-defined]
        False, True, False, False]


def test_log_fields_keep_an_int_iteration_and_say_whether_it_is_a_version() -> None:
    assert log_fields(5) == {"iteration": 5, "versioned": True}
    assert log_fields(0) == {"iteration": 0, "versioned": True}
    assert log_fields(unversioned(0)) == {"iteration": 0, "versioned": False}
    assert log_fields(unversioned(3)) == {"iteration": 3, "versioned": False}


def test_promotion_log_carries_the_int_iteration(caplog: pytest.LogCaptureFixture) -> None:
    s = DraftStore(StoreLimits())
    s.register_group("a", "k", [1, 2], group_size=1, policy_version=4)
    s.register_group("b", "k2", [1, 2], group_size=1)
    with caplog.at_level(logging.INFO, logger="services.draft.store"):
        s.append("a", "r", 0, [7], finished=True)
        s.append("b", "r", 0, [8], finished=True)
    promoted = [r.fields for r in caplog.records if "promoted to history" in r.getMessage()]  # type: ignore[attr-defined]
    assert [(f["prompt_key"], f["iteration"], f["versioned"]) for f in promoted] == [("k", 4, True), ("k2", 0, False)]


def _full_key(h: HistoryStore, key: str) -> None:
    h.add(key, 98, [[98]])
    h.add(key, 99, [[99]])


def test_the_warned_keys_are_bounded_and_forgotten_oldest_first(caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Once the per-key warning dict held 1,024 keys, every rejection scanned it whole and deleted
    # nothing while all warnings were younger than a minute: it grew with the keys rejected
    # (32,000 keys: 337 us a rejection, under the draft store's lock; review 4417). Now it is kept
    # in warning order, stale keys leave from its front, and its size is capped.
    monkeypatch.setattr(history, "_WARNED_REMEMBERED", 64, raising=False)
    clock = Clock()
    h = HistoryStore(keep_iterations=2, clock=clock)
    n = 3 * 1024
    for k in range(n):
        _full_key(h, f"k{k}")
    for k in range(n):
        assert h.add(f"k{k}", 1, [[7]]) == []
    assert h.rejected_adds == n
    assert len(h._warned) == 64  # the cap: the newest warnings kept
    assert list(h._warned)[-1] == f"k{n - 1}"
    # Warning order: "a" warned a minute ago (stale), "b" half a minute ago (within its minute).
    h = HistoryStore(keep_iterations=2, clock=clock)
    for key in ("a", "b", "c"):
        _full_key(h, key)
    h.add("a", 1, [[1]])
    clock.t += REJECTED_WARN_INTERVAL_S / 2
    h.add("b", 1, [[1]])
    clock.t += REJECTED_WARN_INTERVAL_S / 2
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="services.draft.history"):
        h.add("c", 1, [[1]])  # warns: "a", stale, leaves the front; "b" stays
        assert list(h._warned) == ["b", "c"]
        h.add("b", 2, [[2]])  # still within b's minute: debug only
        h.add("a", 2, [[2]])  # a minute after its warning: warns again, at the end
        assert list(h._warned) == ["b", "c", "a"]
    levels = [(r.fields["prompt_key"], r.levelno) for r in caplog.records  # type: ignore[attr-defined]
              if _REJECTED in r.getMessage()]
    assert levels == [("c", logging.WARNING), ("b", logging.DEBUG), ("a", logging.WARNING)]
