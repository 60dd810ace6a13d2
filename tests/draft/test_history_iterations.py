"""One RL iteration is one history iteration (session 32, "several groups of one prompt key in one
RL iteration count as separate history iterations"): groups of a key at one policy version (a
prompt sampled twice in a batch, a batch split into two submissions) merge into one iteration, so
`history_iterations` counts versions and a genuinely earlier iteration is not pushed out early.
The store numbered a group's iteration "the key's newest + 1" at registration: a group registered
after a sibling group of its key and version completed became an iteration of its own.

Pure core (DraftStore, HistoryStore) and the service on loopback gRPC (RegisterGroupRequest.policy_version)."""

from __future__ import annotations

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.errors import InvalidArgument
from services.draft.config import DraftConfig
from services.draft.history import (
    HistoryStore,
)
from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import complete_group, history_bytes_recounted

IT1 = [[10, 11], [12, 13]]
IT2_A = [[20, 21], [22, 23]]
IT2_B = [[30, 31], [32, 33]]
IT3 = [[40, 41], [42, 43]]


def test_groups_of_one_key_and_version_merge_into_one_iteration() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    complete_group(s, "it1", IT1, 1)
    complete_group(s, "it2-a", IT2_A, 2)
    # The prompt sampled twice in iteration 2: its second group registers after the first completed.
    # It was numbered 3 then, and with 2 iterations kept, iteration 1 was dropped.
    assert complete_group(s, "it2-b", IT2_B, 2) == 4  # it drafts from iteration 1 and its sibling group
    assert sorted(s._history._keys["k"]) == [1, 2]
    assert sorted(s._history.responses("k")) == sorted(map(tuple, IT1 + IT2_A + IT2_B))
    assert s._history.memory_bytes == history_bytes_recounted(s._history)
    # The next iteration drops iteration 1 only; both groups of iteration 2 stay.
    assert complete_group(s, "it3", IT3, 3) == 6
    assert sorted(s._history._keys["k"]) == [2, 3]
    assert sorted(s._history.responses("k")) == sorted(map(tuple, IT2_A + IT2_B + IT3))
    assert s._history.memory_bytes == history_bytes_recounted(s._history)
    assert s.stats().evicted_history == 2


def test_version_zero_is_a_version_and_a_straggler_of_an_older_version_merges_into_its_own() -> None:
    s = DraftStore(StoreLimits(history_iterations=2))
    complete_group(s, "v0-a", IT1, 0)
    complete_group(s, "v0-b", IT2_A, 0)  # the first version is 0: merges too
    complete_group(s, "v1", IT2_B, 1)
    # A group of version 0 registered late (a retried submission) completes after version 1's.
    complete_group(s, "v0-late", IT3, 0)
    assert sorted(s._history._keys["k"]) == [0, 1]
    assert len(s._history._keys["k"][0].responses) == 6
    # Version 2 drops version 0 (the older), not version 1.
    complete_group(s, "v2", [[50]], 2)
    assert sorted(s._history._keys["k"]) == [1, 2]
    assert s._history.memory_bytes == history_bytes_recounted(s._history)


def test_registration_with_a_version_numbers_a_group_an_old_client_created() -> None:
    # A rolling update: the first worker of the group is an old client (no version), a later one sends it.
    s = DraftStore(StoreLimits(history_iterations=2))
    complete_group(s, "it1", IT1, 1)
    complete_group(s, "it2-a", IT2_A, 2)
    assert s.register_group("it2-b", "k", [1, 2, 3], 60, 2) == (True, 4)  # the key's newest version (2) for now
    assert s.register_group("it2-b", "k", [1, 2, 3], 60, 2, policy_version=2) == (False, 4)
    for i, r in enumerate(IT2_B):
        s.append("it2-b", f"r{i}", 0, r, finished=True)
    assert sorted(s._history._keys["k"]) == [1, 2]
    # Without any version, beside a key whose newest iteration is a version: it merges into that
    # version (newest + 1 ran ahead of the real versions; see the mixed-client tests below).
    complete_group(s, "legacy", IT3, None)
    assert sorted(s._history._keys["k"]) == [1, 2]
    assert len(s._history._keys["k"][2].responses) == 6


def test_negative_version_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as e:
        DraftStore().register_group("g", "k", [1], policy_version=-1)
    assert e.value.field == "policy_version"


def test_budget_eviction_takes_a_keys_oldest_version_first() -> None:
    # A straggler of an older version is stored after a newer one of its key: it is still the older.
    h = HistoryStore(keep_iterations=2)
    h.add("k", 5, [[1, 2]])
    h.add("other", 1, [[3]])
    h.add("k", 4, [[4, 5]])
    assert h.evict_oldest()  # the first stored belongs to "k": its oldest version goes
    assert sorted(h._keys["k"]) == [5]
    assert h.evict_oldest() and h.evict_oldest()
    assert not h.evict_oldest()
    assert (h.num_keys, h.memory_bytes) == (0, 0)


def test_one_iteration_holds_a_bounded_number_of_responses() -> None:
    # A loop that never updates the weights runs every batch at one version: its iteration keeps the
    # newest responses only, not every batch's (each new group of the key indexes them all).
    h = HistoryStore(keep_iterations=2, iteration_responses=4)
    for b in range(3):
        h.add("k", 0, [[b, 1], [b, 2]], sources=[10 * b + 1, 10 * b + 2])
        assert h.memory_bytes == history_bytes_recounted(h)
    assert sorted(h.responses("k")) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert list(h._keys["k"][0].sources) == [11, 12, 21, 22]
    assert h.evicted == 2
    # One add over the cap (a group larger than it) is kept whole.
    h.add("k", 0, [[9, i] for i in range(6)])
    assert len(h.responses("k")) == 6 and h.memory_bytes == history_bytes_recounted(h)
    # A merge needs no new structure: seed_history reserves no iteration for it.
    assert h.structure_bytes_bound("k", 0, [[7, 7]]) == 0


def test_store_memory_stays_within_budget_with_merged_iterations() -> None:
    budget = 64 << 10
    s = DraftStore(StoreLimits(memory_budget_bytes=budget, history_iterations=2))
    for it in range(30):
        for part in range(3):  # three groups per key and version, each registered after the last completed
            for key in ("a", "b"):
                complete_group(s, f"{key}-{it}-{part}", [[it, part, j, 7, 8, 9] for j in range(4)], it, key=key)
                assert s.stats().memory_bytes <= budget
                assert s._history.memory_bytes == history_bytes_recounted(s._history)
                kept = sorted(s._history._keys.get(key, {}))
                assert len(kept) <= 2 and kept == sorted(kept)


def test_service_merges_groups_of_one_version(draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    def register(gid: str, version: int | None) -> draft_pb2.RegisterGroupResponse:
        req = draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key="k", prompt_token_ids=[1, 2, 3], group_size=1)
        if version is not None:
            req.policy_version = version
        resp: draft_pb2.RegisterGroupResponse = draft_stub.RegisterGroup(req, timeout=10)
        return resp

    def complete(gid: str, version: int, tokens: list[int]) -> int:
        loaded = register(gid, version).history_responses
        draft_stub.Append(iter([draft_pb2.AppendRequest(group_id=gid, request_id="r", offset=0, token_ids=tokens,
                                                        finished=True)]), timeout=10)
        return loaded

    assert complete("v0-a", 0, [5, 5]) == 0
    assert complete("v0-b", 0, [6, 6]) == 1  # version 0, set: merges into iteration 0
    assert complete("v1", 1, [7, 7]) == 2
    assert complete("v2", 2, [8, 8]) == 3  # versions 0 and 1 kept (history_iterations = 2)
    assert register("v3", 3).history_responses == 2  # versions 1 and 2
    try:
        register("bad", -1)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "policy_version" in (e.details() or "")
    else:
        raise AssertionError("a negative policy_version was accepted")


def test_config_passes_the_iteration_cap_and_refuses_zero() -> None:
    assert DraftConfig(history_iteration_responses=8).limits().history_iteration_responses == 8
    with pytest.raises(ValueError, match="history_iteration_responses"):
        DraftConfig(history_iteration_responses=0).validate()
    with pytest.raises(InvalidArgument):
        HistoryStore(iteration_responses=0)
