"""Append with truncate=true: the store, its log and Sync deltas, over real gRPC, and a worker's
mirror (DraftClient) replaying a truncate made by another worker."""

from __future__ import annotations

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.server import RunningServer
from services.draft.index import GroupIndex
from services.draft.store import DraftStore, SeqDelta, _coalesce
from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import wait_until

A = draft_pb2.AppendRequest


def _mirror(store: DraftStore, gid: str, idx: GroupIndex | None, wm: int) -> tuple[GroupIndex, int]:
    (d,) = store.sync([(gid, wm)])
    if idx is None:
        idx = GroupIndex(d.prompt_token_ids)
    for a in d.appends:
        if a.truncate:
            idx.replace_from(a.request_id, a.offset, a.token_ids)
        else:
            idx.append(a.request_id, a.offset, a.token_ids)
    return idx, d.watermark


def test_store_truncate_idempotent_logged_and_replayed() -> None:
    s = DraftStore()
    s.register_group("g", "", [1, 2, 3], group_size=2)
    s.append("g", "r", 0, [4, 5, 6, 7, 8, 9])
    s.append("g", "s", 0, [4, 5, 20])
    early, wm_early = _mirror(s, "g", None, 0)  # a mirror that saw the dead attempt's tokens
    assert s.append("g", "r", 2, [30, 31], truncate=True) == (2, 0)
    wm = s.sync([("g", 0)])[0].watermark
    assert s.append("g", "r", 2, [30, 31], truncate=True) == (0, 2)  # retried: nothing changes
    assert s.append("g", "r", 0, [4, 5, 30, 31], truncate=True) == (0, 4)  # resume with the committed output
    assert s.sync([("g", 0)])[0].watermark == wm  # ... and nothing is logged
    assert s.index_of("g").tokens("r") == [4, 5, 30, 31]
    s.append("g", "r", 4, [32])  # the new attempt's own appends are accepted
    with pytest.raises(InvalidArgument) as e:
        s.append("g", "r", 9, [1], truncate=True)
    assert e.value.field == "offset"
    # A mirror from watermark 0 and one that had the stale tokens both end equal to the server.
    full, _ = _mirror(s, "g", None, 0)
    caught_up, _ = _mirror(s, "g", early, wm_early)
    for m in (full, caught_up):
        assert m.tokens("r") == [4, 5, 30, 31, 32] and m.tokens("s") == [4, 5, 20]
        assert m.entries == s.index_of("g").entries
        assert m.propose([1, 2, 3, 4, 5], 4) == s.index_of("g").propose([1, 2, 3, 4, 5], 4)
    # The coalesced log carries the truncate.
    (d,) = s.sync([("g", wm_early)])
    assert [(a.request_id, a.offset, a.token_ids, a.truncate) for a in d.appends] == [
        ("r", 2, (30, 31, 32), True)]


def test_truncate_reopens_a_finished_response_unless_promoted() -> None:
    s = DraftStore()
    s.register_group("g", "key", [1], group_size=2)
    s.append("g", "a", 0, [2, 3], finished=True)
    s.append("g", "a", 1, [9], truncate=True)  # a finished-but-uncommitted attempt was redone
    assert s.index_of("g").tokens("a") == [2, 9]
    s.append("g", "a", 2, [10], finished=True)  # not "already finished"
    with pytest.raises(FailedPrecondition):
        s.append("g", "a", 3, [11])  # a plain append after finished still is refused
    s.append("g", "a", 3, [11], truncate=True)  # a resumed attempt that goes on re-opens it
    assert s.index_of("g").tokens("a") == [2, 9, 10, 11]
    s.append("g", "a", 4, [12], finished=True)
    s.append("g", "b", 0, [4], finished=True)  # the group completes: history
    with pytest.raises(FailedPrecondition):
        s.append("g", "a", 0, [], truncate=True)


def test_coalesce_folds_a_truncate_into_the_previous_entry() -> None:
    entries = [SeqDelta("r", 0, (1, 2, 3)), SeqDelta("q", 0, (7,)), SeqDelta("r", 1, (5,), truncate=True),
               SeqDelta("r", 2, (6,), finished=True), SeqDelta("r", 0, (8,), truncate=True)]
    # After a finished entry nothing folds (the finish mark must stay where it was).
    assert _coalesce(entries) == (SeqDelta("r", 0, (1, 5, 6), True, truncate=True), SeqDelta("q", 0, (7,)),
                                  SeqDelta("r", 0, (8,), truncate=True))
    assert _coalesce([*entries[:2], entries[4]]) == (SeqDelta("r", 0, (8,), truncate=True), SeqDelta("q", 0, (7,)))
    idx1, idx2 = GroupIndex([0]), GroupIndex([0])
    for idx, seq in ((idx1, entries), (idx2, _coalesce(entries))):
        for e in seq:
            (idx.replace_from if e.truncate else idx.append)(e.request_id, e.offset, e.token_ids)
    assert idx1.tokens("r") == idx2.tokens("r") == [8] and idx1.entries == idx2.entries


def test_truncate_over_grpc(draft_stub: draft_pb2_grpc.DraftServiceStub,
                            draft_server: tuple[RunningServer, DraftStore]) -> None:
    s = draft_stub
    s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="g", prompt_token_ids=[1, 2], group_size=2))
    s.Append(iter([A(group_id="g", request_id="r", offset=0, token_ids=[3, 4, 5, 6, 7])]))
    wm = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g")])).groups[0].watermark
    resp = s.Append(iter([A(group_id="g", request_id="r", offset=0, token_ids=[3, 4], truncate=True),
                          A(group_id="g", request_id="r", offset=2, token_ids=[9, 10])]))
    assert (resp.appended_tokens, resp.duplicate_tokens) == (2, 2)
    assert draft_server[1].index_of("g").tokens("r") == [3, 4, 9, 10]
    (d,) = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g", watermark=wm)])).groups
    assert [(a.request_id, a.offset, list(a.token_ids), a.truncate) for a in d.appends] == [
        ("r", 2, [9, 10], True)]
    with pytest.raises(grpc.RpcError) as e:
        s.Append(iter([A(group_id="g", request_id="r", offset=7, truncate=True)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].offset" in str(e.value.details())


def test_mirror_replays_another_workers_truncate(draft_server: tuple[RunningServer, DraftStore]) -> None:
    running, store = draft_server
    dead = DraftClient(running.address, sync_interval_s=0.02)  # the worker whose attempt dies
    other = DraftClient(running.address, sync_interval_s=0.02)  # serves a sibling
    new = DraftClient(running.address, sync_interval_s=0.02)  # runs the re-dispatched chunk
    prompt = [1, 2, 3]
    try:
        for c in (dead, other, new):
            c.register_group("g", "", prompt, group_size=2)
        dead.append("g", "r", 0, [4, 5])  # committed chunk
        dead.append("g", "r", 2, [40, 41, 42, 43])  # streamed, then the worker died
        dead.flush()
        wait_until(lambda: other.own_length("g", "r") == 6 and new.own_length("g", "r") == 6)
        assert other.propose("g", "s", [*prompt, 4, 5], 3) is not None
        new.resume("g", "r", [4, 5])
        # Locally at once: no stale draft, even before any RPC.
        assert new.own_length("g", "r") == 2 and new.propose("g", "r", [*prompt, 4, 5], 3) is None
        new.append("g", "r", 2, [6, 7])
        wait_until(lambda: store.index_of("g").tokens("r") == [4, 5, 6, 7])
        # The sibling's mirror replays the truncate: the dead attempt's tokens are gone there too.
        wait_until(lambda: (d := other.propose("g", "s", [*prompt, 4, 5], 3)) is not None and d.tokens == (6, 7))
        assert other.own_length("g", "r") == 4
        # While the request runs on `new`, deltas for it (echoes) are not applied; after end they are.
        new.end("g", "r")
        assert new.stats().append_errors == 0
    finally:
        for c in (dead, other, new):
            c.close()


def test_client_coalesces_truncates_in_order() -> None:
    from services.worker.draft_client import _coalesce as client_coalesce

    msgs = [A(group_id="g", request_id="r", offset=0, token_ids=[1, 2, 3]),
            A(group_id="g", request_id="r", offset=1, token_ids=[], truncate=True),
            A(group_id="g", request_id="r", offset=1, token_ids=[8])]
    (m,) = client_coalesce(msgs)
    assert (m.offset, list(m.token_ids), m.truncate) == (0, [1, 8], True)


def test_active_request_overwrites_a_late_stale_append(draft_server: tuple[RunningServer, DraftStore]) -> None:
    """A cancelled attempt elsewhere flushes its tokens after the new attempt's resume reached the
    server: the running worker's next append (sent as truncate+append) puts the truth back."""
    running, store = draft_server
    c = DraftClient(running.address, sync_interval_s=10)  # ticks only when flushed
    try:
        c.register_group("g", "", [1, 2, 3], group_size=2)
        c.append("g", "r", 0, [4, 5])
        c.flush()
        c.resume("g", "r", [4, 5])
        c.flush()
        store.append("g", "r", 2, [40, 41])  # the late, stale, plain append of the other worker
        c.append("g", "r", 2, [6, 7])
        c.flush()
        assert store.index_of("g").tokens("r") == [4, 5, 6, 7]
        assert c.own_length("g", "r") == 4 and c.propose("g", "r", [1, 2, 3, 4, 5, 6, 7], 3) is None
        assert c.stats().append_errors == 0
        c.end("g", "r")
        c.append("g", "r", 4, [8])  # not running here any more: a plain append
        c.flush()
        assert store.index_of("g").tokens("r") == [4, 5, 6, 7, 8]
    finally:
        c.close()
