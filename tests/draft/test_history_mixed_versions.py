"""History iterations with old and new clients mixed, versions going backwards, and the iteration cap
(session 32 review of "a history iteration is a policy version").

- A rolling upgrade mixes clients that send RegisterGroupRequest.policy_version with old ones that do
  not. The old rule for the latter (the key's newest + 1) ran ahead of the real versions: version 3,
  then three old-client groups were iterations 4, 5, 6 ([5, 6] kept), and version 4's responses
  were then "older than everything kept" and silently not kept. Fallback numbers are now kept below
  every version, and an old client's group merges into the key's newest version.
- A promotion older than every kept iteration (a straggler, or versions that went backwards: a new
  run beside a draft server that kept the old run's {98, 99}) was dropped without a count or a log.
- The 64-response cap of one iteration trimmed a response of the very add that brought it when it
  matched a held copy in the same iteration (a group claiming the buffer refill's copy).
- seed_history reserved the new copies gross of what the cap drops at once, evicting other history.

Pure core (HistoryStore, DraftStore) and the service on loopback gRPC."""

from __future__ import annotations

import logging

import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.draft.history import (
    HistoryStore,
)
from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import complete_group, history_bytes_recounted


def _versions(s: DraftStore, key: str = "k") -> list[int | str]:
    """The key's kept iterations, oldest first: versions as numbers, fallback numbers (kept below
    every version, history.unversioned: negative) as "u"."""
    return ["u" if i < 0 else i for i in sorted(s._history._keys.get(key, {}))]


# ---- mixed old and new clients --------------------------------------------------------------------


def test_old_client_groups_after_a_version_do_not_run_ahead_of_the_next_version() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    complete_group(s, "v3", [[3, 3]], 3)
    for i in range(3):  # old clients, each registered after the last completed
        complete_group(s, f"old{i}", [[50 + i]], None)
    # They merged into version 3 (numbered 4, 5, 6 they pushed version 3 out).
    assert _versions(s) == [3]
    complete_group(s, "v4", [[4, 4]], 4)
    assert _versions(s) == [3, 4]
    assert (4, 4) in s._history.responses("k")  # was not kept: "older than everything kept"
    assert s.stats().evicted_history == 0
    assert s._history.memory_bytes == history_bytes_recounted(s._history)


def test_versions_after_an_old_client_only_history_are_newer_than_it() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    # Every client old: the old rule (newest + 1) still numbers them, three iterations, two kept.
    for i in range(3):
        complete_group(s, f"old{i}", [[60 + i]], None)
    assert _versions(s) == ["u", "u"] and sorted(s._history.responses("k")) == [(61,), (62,)]
    # The upgrade: version 0 is newer than every fallback number (numbered 0 it was the oldest and
    # not kept), and the next version pushes the old clients' out.
    complete_group(s, "v0", [[7, 0]], 0)
    assert _versions(s) == ["u", 0] and (7, 0) in s._history.responses("k")
    complete_group(s, "v1", [[7, 1]], 1)
    assert _versions(s) == [0, 1]
    # An old client's group now merges into the newest version.
    complete_group(s, "old-late", [[70]], None)
    assert _versions(s) == [0, 1] and len(s._history._keys["k"][1].responses) == 2
    assert s._history.memory_bytes == history_bytes_recounted(s._history)


def test_an_old_client_group_registered_before_the_versions_is_counted_when_not_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    # Registered on an empty key (fallback 0), it completes after two versions were kept: older
    # than both, not kept, but counted and logged.
    s.register_group("old", "k", [1, 2, 3], 60, 1)
    complete_group(s, "v5", [[5]], 5)
    complete_group(s, "v6", [[6]], 6)
    with caplog.at_level(logging.WARNING, logger="services.draft.history"):
        s.append("old", "r0", 0, [9, 9], finished=True)
    assert _versions(s) == [5, 6]
    assert s.stats().evicted_history == 1
    assert any("older than every kept iteration" in r.getMessage() for r in caplog.records)


def test_service_mixed_clients_keep_the_next_versions_responses(
        draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    def complete(gid: str, version: int | None, tokens: list[int]) -> int:
        req = draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key="B", prompt_token_ids=[1, 2, 3], group_size=1)
        if version is not None:
            req.policy_version = version
        loaded: int = draft_stub.RegisterGroup(req, timeout=10).history_responses
        draft_stub.Append(iter([draft_pb2.AppendRequest(group_id=gid, request_id="r", offset=0, token_ids=tokens,
                                                        finished=True)]), timeout=10)
        return loaded

    complete("b3", 3, [3, 3])
    for i in range(3):
        complete(f"b-old{i}", None, [50 + i])
    complete("b4", 4, [4, 4])
    # A group of version 5 drafts from versions 3 (with the old clients' responses) and 4.
    assert complete("b5", 5, [5, 5]) == 5
    # Then version 5 completing pushes version 3 (its four responses) out, and nothing else went.
    assert draft_stub.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 4


# ---- versions going backwards: never silent -------------------------------------------------------


def test_promotions_older_than_every_kept_version_are_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    complete_group(s, "a98", [[98, 98]], 98)
    complete_group(s, "a99", [[99, 99]], 99)
    with caplog.at_level(logging.WARNING, logger="services.draft.history"):
        for v in range(5):  # a new run from version 0 beside a server that kept the old run's
            complete_group(s, f"new{v}", [[v, v, v], [v, 1]], v)
    assert _versions(s) == [98, 99]
    assert s.stats().evicted_history == 10
    # Logged once for the key within the minute (the rest at debug: counted above, not warned).
    warned = [r for r in caplog.records if "older than every kept iteration" in r.getMessage()]
    assert len(warned) == 1
    # A repeat of responses held newer is not a loss: not counted (a seed of an old iteration).
    assert s.seed_history("k", 0, [[99, 99]]) == 0
    assert s.stats().evicted_history == 10
    assert s._history.memory_bytes == history_bytes_recounted(s._history)


# ---- the iteration cap never trims the add's own responses ---------------------------------------


def test_cap_keeps_a_response_that_matched_a_held_copy_in_its_own_iteration() -> None:
    h = HistoryStore(keep_iterations=2, iteration_responses=4)
    h.add("k", 7, [[1, 1], [2, 2], [3, 3], [4, 4]])  # the buffer's refill of version 7 (unknown sources)
    h.add("k", 7, [[1, 1], [5, 5]], sources=[11, 12])  # a group of version 7: [1, 1] claims the seeded copy
    assert sorted(h.responses("k")) == [(1, 1), (3, 3), (4, 4), (5, 5)]  # (2, 2), the oldest other, goes
    it = h._keys["k"][7]
    assert dict(zip(map(tuple, it.responses), it.sources, strict=True))[(1, 1)] == 11
    assert h.evicted == 1 and h.memory_bytes == history_bytes_recounted(h)


def test_a_group_claiming_the_refill_keeps_all_its_responses() -> None:
    s = DraftStore(StoreLimits(history_iterations=2, history_iteration_responses=3))
    s.seed_history("k", 7, [[1, 1], [2, 2], [3, 3]])
    complete_group(s, "g", [[1, 1], [4, 4]], 7)  # (1, 1): the refill's copy, at the front of version 7
    assert sorted(s._history.responses("k")) == [(1, 1), (3, 3), (4, 4)]
    assert s.stats().evicted_history == 1


# ---- seed_history reserves net of what the cap drops --------------------------------------------


def test_seed_into_an_iteration_at_its_cap_evicts_no_other_history() -> None:
    probe = DraftStore(StoreLimits(history_iteration_responses=4))
    probe.seed_history("other", 1, [[9] * 20])
    probe.seed_history("k", 1, [[i] * 20 for i in range(4)])
    used = probe.stats().memory_bytes
    # A budget with room for the net growth (none: two responses in, two of the same size out), not
    # for two more responses gross.
    s = DraftStore(StoreLimits(memory_budget_bytes=used + 64, history_iteration_responses=4))
    s.seed_history("other", 1, [[9] * 20])
    s.seed_history("k", 1, [[i] * 20 for i in range(4)])
    assert s.seed_history("k", 1, [[10] * 20, [11] * 20]) == 2
    assert s._history.responses("other") == [(9,) * 20]  # was evicted making room for a gross 2 responses
    assert sorted(s._history.responses("k")) == sorted([(2,) * 20, (3,) * 20, (10,) * 20, (11,) * 20])
    assert s.stats().memory_bytes <= used + 64
    assert s._history.memory_bytes == history_bytes_recounted(s._history)
