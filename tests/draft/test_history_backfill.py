"""HistoryBackfill (services/draft/backfill.py): when it asks the buffer, and what it seeds.

Glue logic with a scripted fetch function (the real buffer + draft server path is tested in
tests/buffer/test_buffer_draft_refill.py)."""

from __future__ import annotations

import threading
import time

from services.draft.backfill import BufferIteration, HistoryBackfill
from services.draft.store import DraftStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Fetch:
    def __init__(self, answers: dict[str, list[list[int]]], version: int = 0) -> None:
        self.answers = answers
        self.version = version
        self.calls: list[str] = []
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, key: str) -> BufferIteration:
        self.gate.wait(10)
        self.calls.append(key)
        if self.fail:
            raise ConnectionError("buffer down")
        return BufferIteration(self.version, self.answers.get(key, []))


def _wait_idle(b: HistoryBackfill) -> None:
    deadline = time.monotonic() + 10
    while not b.idle():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _setup(answers: dict[str, list[list[int]]]) -> tuple[DraftStore, Fetch, Clock, HistoryBackfill]:
    store = DraftStore(StoreLimits())
    fetch, clock = Fetch(answers), Clock()
    return store, fetch, clock, HistoryBackfill(store, fetch, retry_after_s=60.0, clock=clock).start()


def test_refill_once_per_key_and_only_without_history() -> None:
    store, fetch, _clock, b = _setup({"p": [[5, 6, 7], [5, 6, 8]]})
    try:
        fetch.gate.clear()  # hold the first fetch: registrations meanwhile must not queue the key again
        for gid in ("g0", "g1", "g2"):
            _created, history = store.register_group(gid, "p", [1, 2])
            b.on_register("p", history)
        fetch.gate.set()
        _wait_idle(b)
        assert fetch.calls == ["p"]
        assert (b.refilled_keys, b.refilled_responses) == (1, 2)
        # Live groups of the key got the responses; a new group gets them at registration.
        assert store.register_group("g3", "p", [1, 2]) == (True, 2)
        b.on_register("p", 2)
        _wait_idle(b)
        assert fetch.calls == ["p"]
    finally:
        b.close()


def test_unknown_key_and_errors_are_asked_again_only_after_the_retry_delay() -> None:
    store, fetch, clock, b = _setup({})
    try:
        b.on_register("q", 0)
        _wait_idle(b)
        b.on_register("q", 0)  # within the delay: no second call for a key without history
        _wait_idle(b)
        assert fetch.calls == ["q"]
        clock.t += 61.0
        fetch.fail = True
        b.on_register("q", 0)
        _wait_idle(b)
        assert (fetch.calls, b.errors) == (["q", "q"], 1)
        # The store is untouched by a failed refill and keeps serving.
        assert store.register_group("g", "q", [1]) == (True, 0)
        # Empty keys (no prompt key given) are never asked for.
        b.on_register("", 0)
        _wait_idle(b)
        assert len(fetch.calls) == 2
    finally:
        b.close()


def test_refilled_iteration_leaves_with_the_one_it_stood_in_for() -> None:
    # The refill takes iteration 0, the number the first group on the empty key got: once that group
    # completes, its responses join the same iteration, and with history_iterations = 1 the next
    # completed iteration replaces both (a refill never outlives real, newer history).
    store = DraftStore(StoreLimits(history_iterations=1))
    fetch = Fetch({"p": [[9, 9, 9]]})
    b = HistoryBackfill(store, fetch).start()
    try:
        _created, history = store.register_group("it2", "p", [1], group_size=1)
        b.on_register("p", history)
        _wait_idle(b)
        store.append("it2", "it2/0", 0, [4, 4], True)
        assert store.register_group("it3", "p", [1], group_size=1) == (True, 2)
        store.append("it3", "it3/0", 0, [6], True)
        assert store.register_group("it4", "p", [1], group_size=1) == (True, 1)
    finally:
        b.close()


def test_refill_for_a_versioned_group_is_the_buffers_version() -> None:
    # Iterations are policy versions when the registration brings one: the buffer's iteration of
    # version 1 is seeded as iteration 1, older than the registering group's 2, and with
    # history_iterations = 1 leaves when version 2 completes (as iteration 0 it merged into it).
    store = DraftStore(StoreLimits(history_iterations=1))
    b = HistoryBackfill(store, Fetch({"p": [[9, 9, 9]]}, version=1)).start()
    try:
        _created, history = store.register_group("v2", "p", [1], group_size=1, policy_version=2)
        b.on_register("p", history, 2)
        _wait_idle(b)
        assert sorted(store._history._keys["p"]) == [1]
        store.append("v2", "v2/0", 0, [4, 4], True)
        assert store.register_group("v3", "p", [1], group_size=1, policy_version=3) == (True, 1)
    finally:
        b.close()


def test_refill_of_the_same_version_merges_with_the_group() -> None:
    # A batch of version 2 split into two submissions, the first completed before this server
    # restarted: the buffer's newest iteration is version 2, the second submission's group's too.
    store = DraftStore(StoreLimits(history_iterations=1))
    b = HistoryBackfill(store, Fetch({"p": [[9, 9, 9]]}, version=2)).start()
    try:
        _created, history = store.register_group("v2-b", "p", [1], group_size=1, policy_version=2)
        b.on_register("p", history, 2)
        _wait_idle(b)
        store.append("v2-b", "v2-b/0", 0, [4, 4], True)
        assert sorted(store._history._keys["p"]) == [2]
        assert store.register_group("v3", "p", [1], group_size=1, policy_version=3) == (True, 2)
    finally:
        b.close()
