"""The draft server's /metrics over real gRPC: the store's state as of the scrape, and Append counters
that count what a refused stream applied before the refusal."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import REGISTRY
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.store import DraftStore

A = draft_pb2.AppendRequest


def _sample(name: str) -> float:
    v = REGISTRY.get_sample_value(name)
    assert v is not None, f"{name} is not exported"
    return v


def _register(stub: draft_pb2_grpc.DraftServiceStub, gid: str, size: int = 1) -> None:
    stub.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key="k", prompt_token_ids=[1, 2, 3],
                                                      ttl_seconds=60, group_size=size))


def test_store_gauges_follow_the_store_without_get_draft_stats(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    # Nothing in a deployment calls GetDraftStats: the gauges were set only there, so /metrics
    # said 0 groups and 0 bytes (or a test's stale value) for the server's whole life.
    store = draft_server[1]
    for n in (1, 2, 3):
        _register(draft_stub, f"g{n}")
        assert _sample("seer_draft_groups") == n
        assert _sample("seer_draft_memory_bytes") == store.stats().memory_bytes > 0
    assert _sample("seer_draft_memory_budget_bytes") == store.limits.memory_budget_bytes
    draft_stub.Append(iter([A(group_id="g1", request_id="a", offset=0, token_ids=[4, 5, 6], finished=True)]))
    assert _sample("seer_draft_history_keys") == 1  # g1 completed: its response is history for "k"
    assert _sample("seer_draft_indexed_tokens") == store.stats().indexed_tokens
    expired = _sample("seer_draft_expired_groups_total")
    for gid in ("g2", "g3"):
        store._groups[gid].expires_at = 0.0  # due now
    store.expire_now()
    assert _sample("seer_draft_expired_groups_total") == expired + 2
    assert _sample("seer_draft_groups") == 1
    assert _sample("seer_draft_evicted_groups_total") >= 0
    assert _sample("seer_draft_evicted_history_responses_total") >= 0


def test_append_counters_count_the_messages_applied_before_a_refused_one(
        draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    _register(draft_stub, "g", size=2)
    appended = _sample("seer_draft_appended_tokens_total")
    duplicates = _sample("seer_draft_duplicate_tokens_total")
    with pytest.raises(grpc.RpcError) as e:
        draft_stub.Append(iter([A(group_id="g", request_id="a", offset=0, token_ids=[7, 8, 9]),
                                A(group_id="g", request_id="a", offset=1, token_ids=[8]),  # a duplicate
                                A(group_id="g", request_id="a", offset=9, token_ids=[1])]))  # a gap
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[2].offset" in str(e.value.details())
    # The first two messages are applied (the index holds them): so are they counted.
    assert _sample("seer_draft_appended_tokens_total") == appended + 3
    assert _sample("seer_draft_duplicate_tokens_total") == duplicates + 1


def test_rejected_history_adds_are_exported(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    # Counted by the history store (its warnings are limited to one per key a minute) but exported
    # nowhere: a flood of stale adds showed only in evicted_history (review 4417). GetDraftStats has
    # no field for it, so /metrics.
    store = draft_server[1]
    keep = store.limits.history_iterations
    for v in range(10, 10 + keep):  # the key full: its kept iterations are all newer than 1
        draft_stub.SeedHistory(draft_pb2.SeedHistoryRequest(
            prompt_key="old", iteration=v, responses=[draft_pb2.TokenSequence(token_ids=[v])]))
    before = _sample("seer_draft_rejected_history_adds_total")
    stale = draft_pb2.SeedHistoryRequest(prompt_key="old", iteration=1,
                                         responses=[draft_pb2.TokenSequence(token_ids=[1, 2])])
    for _ in range(2):  # a retry is a rejected add too (its responses are evicted_history once)
        assert draft_stub.SeedHistory(stale).num_responses == 0
    assert _sample("seer_draft_rejected_history_adds_total") == before + 2
    assert store.stats().rejected_history_adds == store._history.rejected_adds
