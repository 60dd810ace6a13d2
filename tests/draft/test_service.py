"""DraftService over real gRPC: protocol, bad input -> status codes naming the field, index intact."""

from __future__ import annotations

import time

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

A = draft_pb2.AppendRequest


def _code(fn) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), str(e.value.details())


def test_append_sync_register_stats(draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    s = draft_stub
    r = s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="k", prompt_token_ids=[1, 2, 3],
                                                       ttl_seconds=60, group_size=2))
    assert r.created
    resp = s.Append(iter([A(group_id="g", request_id="a", offset=0, token_ids=[4, 5]),
                          A(group_id="g", request_id="a", offset=2, token_ids=[6]),
                          A(group_id="g", request_id="a", offset=0, token_ids=[4, 5, 6, 7])]))
    assert (resp.appended_tokens, resp.duplicate_tokens) == (4, 3)
    sync = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g", watermark=0)]))
    (d,) = sync.groups
    assert list(d.prompt_token_ids) == [1, 2, 3]
    assert [(a.request_id, a.offset, list(a.token_ids)) for a in d.appends] == [("a", 0, [4, 5, 6, 7])]
    wm = d.watermark
    s.Append(iter([A(group_id="g", request_id="b", offset=0, token_ids=[9], finished=True)]))
    (d2,) = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g", watermark=wm)])).groups
    assert [(a.request_id, list(a.token_ids), a.finished) for a in d2.appends] == [("b", [9], True)]
    assert not d2.prompt_token_ids
    st = s.GetDraftStats(draft_pb2.GetDraftStatsRequest())
    assert st.groups == 1 and st.indexed_tokens > 0 and st.bytes_per_token > 0
    assert st.memory_budget_bytes == 2048 << 20
    n = s.SeedHistory(draft_pb2.SeedHistoryRequest(prompt_key="k2", iteration=3,
                                                   responses=[draft_pb2.TokenSequence(token_ids=[1, 2])]))
    assert n.num_responses == 1
    r2 = s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="g2", prompt_key="k2", prompt_token_ids=[1],
                                                        ttl_seconds=60, group_size=1))
    assert r2.history_responses == 1


def test_bad_input_statuses_and_index_stays_correct(draft_server, draft_stub) -> None:  # type: ignore[no-untyped-def]
    s = draft_stub
    store = draft_server[1]
    s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="k", prompt_token_ids=[1, 2],
                                                   ttl_seconds=60, group_size=4))
    s.Append(iter([A(group_id="g", request_id="a", offset=0, token_ids=[10, 11, 12])]))
    # gap
    code, msg = _code(lambda: s.Append(iter([A(group_id="g", request_id="a", offset=5, token_ids=[1])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].offset" in msg
    # overlap with different tokens, as the second message of a stream: the first one stays applied
    code, msg = _code(lambda: s.Append(iter([A(group_id="g", request_id="a", offset=3, token_ids=[13]),
                                             A(group_id="g", request_id="a", offset=1, token_ids=[99])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[1].token_ids" in msg
    # unknown group
    code, msg = _code(lambda: s.Append(iter([A(group_id="nope", request_id="a", offset=0, token_ids=[1])])))
    assert code == grpc.StatusCode.NOT_FOUND and "messages[0].group_id" in msg
    # oversized append (limit 4096 in the fixture)
    code, msg = _code(lambda: s.Append(iter([A(group_id="g", request_id="a", offset=4, token_ids=[1] * 5000)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].token_ids" in msg
    # negative token id
    code, msg = _code(lambda: s.Append(iter([A(group_id="g", request_id="a", offset=4, token_ids=[5, -1])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].token_ids[1]" in msg
    # malformed watermarks
    wm = draft_pb2.GroupWatermark
    code, msg = _code(lambda: s.Sync(draft_pb2.SyncRequest(groups=[wm(group_id="g", watermark=10**6)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "groups[0].watermark" in msg
    code, msg = _code(lambda: s.Sync(draft_pb2.SyncRequest(groups=[wm(group_id="g"), wm(group_id="g")])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "groups[1].group_id" in msg
    code, msg = _code(lambda: s.Sync(draft_pb2.SyncRequest(groups=[wm(group_id="")])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "groups[0].group_id" in msg
    # bad register
    code, msg = _code(lambda: s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="", prompt_key="k")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "group_id" in msg
    code, msg = _code(lambda: s.RegisterGroup(draft_pb2.RegisterGroupRequest(
        group_id="g", prompt_key="other", prompt_token_ids=[1, 2])))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    code, msg = _code(lambda: s.SeedHistory(draft_pb2.SeedHistoryRequest(prompt_key="", iteration=1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_key" in msg
    # the service kept serving and the index is exactly the good appends
    assert store.index_of("g").tokens("a") == [10, 11, 12, 13]
    (d,) = s.Sync(draft_pb2.SyncRequest(groups=[wm(group_id="g", watermark=0)])).groups
    assert [list(a.token_ids) for a in d.appends] == [[10, 11, 12, 13]]


def test_expired_group(draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    """A completed group that expired is gone for good (expired: workers drop their mirrors). An
    unfinished one (a request paused between chunks past the TTL) is reported like one lost in a
    restart, so its workers register it again with the finished siblings they hold (review, session
    17: they dropped them, and the group never completed)."""
    s = draft_stub
    for gid in ("done", "open"):
        s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key="k", prompt_token_ids=[1],
                                                       ttl_seconds=1, group_size=1 if gid == "done" else 2))
        s.Append(iter([A(group_id=gid, request_id="a", offset=0, token_ids=[1], finished=True)]))
    time.sleep(1.6)
    code, msg = _code(lambda: s.Append(iter([A(group_id="done", request_id="b", offset=0, token_ids=[2])])))
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in msg
    code, msg = _code(lambda: s.Append(iter([A(group_id="open", request_id="b", offset=0, token_ids=[2])])))
    assert code == grpc.StatusCode.NOT_FOUND and "not registered" in msg
    done, open_ = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="done", watermark=1),
                                                       draft_pb2.GroupWatermark(group_id="open", watermark=1)])).groups
    assert done.gone and done.expired
    assert open_.gone and not open_.expired
    assert s.GetDraftStats(draft_pb2.GetDraftStatsRequest()).expired_groups == 2
    # Both register again: the unfinished one to complete, the completed one as its id used again
    # (a new incarnation; its old responses are history, and are not promoted a second time).
    s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="open", prompt_key="k", prompt_token_ids=[1],
                                                   ttl_seconds=60, group_size=2))
    assert s.RegisterGroup(draft_pb2.RegisterGroupRequest(
        group_id="done", prompt_key="k", prompt_token_ids=[1], ttl_seconds=60, group_size=1)).created
    s.Append(iter([A(group_id="done", request_id="a", offset=0, token_ids=[1], finished=True)]))
    assert s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="new", prompt_key="k", prompt_token_ids=[1],
                                                          ttl_seconds=60, group_size=1)).history_responses == 1
    code, msg = _code(lambda: s.Append(iter([A(group_id="", request_id="b", offset=0, token_ids=[2])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "group_id" in msg


def test_stats_report_groups_evicted_for_memory() -> None:
    # A completed group evicted to fit a new one must show in GetDraftStats (it was counted in the
    # store but never reported, so an operator could not tell eviction from expiry).
    from services.draft.app import start
    from services.draft.config import DraftConfig

    running, store = start(DraftConfig(port=0, grace_seconds=0.5, memory_budget_mb=1))
    ch = grpc.insecure_channel(running.address)
    try:
        s = draft_pb2_grpc.DraftServiceStub(ch)
        n = 0
        while s.GetDraftStats(draft_pb2.GetDraftStatsRequest()).evicted_groups == 0:
            gid = f"g{n}"
            s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key=f"k{n}", prompt_token_ids=[1, 2],
                                                           ttl_seconds=600, group_size=1))
            s.Append(iter([A(group_id=gid, request_id="a", offset=0, token_ids=list(range(1000)), finished=True)]))
            n += 1
            assert n < 200, "a 1 MB budget never evicted a completed group"
        st = s.GetDraftStats(draft_pb2.GetDraftStatsRequest())
        assert st.evicted_groups == store.stats().evicted_groups >= 1
        assert st.memory_bytes <= st.memory_budget_bytes
    finally:
        ch.close()
        running.stop(0.2)
