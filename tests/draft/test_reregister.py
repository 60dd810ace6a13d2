"""A group id registered again (a new incarnation: a resubmitted batch id brings the same group and
request ids): the old incarnation's late appends stay out of it (AppendRequest.incarnation), and a
re-registration with another group_size is not taken as a retry (session 25)."""

from __future__ import annotations

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.errors import AlreadyExists, FailedPrecondition
from services.draft.store import DraftStore, StoreLimits

A = draft_pb2.AppendRequest


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _register(s: draft_pb2_grpc.DraftServiceStub, prompt: list[int], size: int = 2) -> None:
    s.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="k", prompt_token_ids=prompt,
                                                   ttl_seconds=60, group_size=size))


def _whole(s: draft_pb2_grpc.DraftServiceStub) -> draft_pb2.GroupDelta:
    (d,) = s.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g", watermark=0)])).groups
    return d


def test_old_incarnation_appends_stay_out_of_the_new_one(draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    s = draft_stub
    _register(s, [1, 2, 3])
    old = _whole(s).incarnation
    s.Append(iter([A(group_id="g", request_id="r0", offset=0, token_ids=[7, 7, 7], finished=True, epoch=50,
                     incarnation=old),
                   A(group_id="g", request_id="r1", offset=0, token_ids=[8, 8], epoch=50, incarnation=old)]))
    s.Append(iter([A(group_id="g", request_id="r1", offset=2, token_ids=[8], finished=True, epoch=50,
                     incarnation=old)]))
    # Complete; the batch id is resubmitted with another prompt: a new incarnation, same request ids.
    _register(s, [4, 5, 6])
    new = _whole(s).incarnation
    assert new != old
    s.Append(iter([A(group_id="g", request_id="r1", offset=0, token_ids=[9], epoch=60, incarnation=new)]))
    # A late message of the old run's worker: at offset 0 of a response the new run has not started,
    # and extending the new run's shorter r1. Neither may land.
    for msg in (A(group_id="g", request_id="r0", offset=0, token_ids=[7, 7, 7], epoch=50, incarnation=old),
                A(group_id="g", request_id="r1", offset=1, token_ids=[8, 8], epoch=70, incarnation=old)):
        with pytest.raises(grpc.RpcError) as e:
            s.Append(iter([msg]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "messages[0].incarnation" in str(e.value.details())
    d = _whole(s)
    assert [(a.request_id, list(a.token_ids)) for a in d.appends] == [("r1", [9])]
    # The new run's own appends still apply, with its incarnation or none (0: as before the field).
    s.Append(iter([A(group_id="g", request_id="r0", offset=0, token_ids=[1], epoch=61, incarnation=new),
                   A(group_id="g", request_id="r1", offset=1, token_ids=[2], epoch=60)]))
    d = _whole(s)
    assert [(a.request_id, list(a.token_ids)) for a in d.appends] == [("r1", [9, 2]), ("r0", [1])]


def test_old_incarnation_append_after_the_group_expired_and_was_registered_again() -> None:
    clock = Clock()
    s = DraftStore(StoreLimits(), clock=clock)
    s.register_group("g", "k", [1, 2, 3], 60, 1)
    (d,) = s.sync([("g", 0)])
    old = d.incarnation
    s.append("g", "r0", 0, [7, 7], True, epoch=5, incarnation=old)
    clock.t += 61
    s.expire_now()
    assert s.register_group("g", "k", [1, 2, 3], 60, 1)[0]  # the same prompt again: a new incarnation
    with pytest.raises(FailedPrecondition) as e:
        s.append("g", "r0", 0, [7, 7], True, epoch=5, incarnation=old, where="messages[0].")
    assert e.value.field == "messages[0].incarnation"
    assert s.index_of("g").length("r0") == 0
    (d,) = s.sync([("g", 0)])
    assert d.appends == ()
    s.append("g", "r0", 0, [3], epoch=6, incarnation=d.incarnation)
    assert s.index_of("g").tokens("r0") == [3]


def test_re_registration_with_another_group_size_while_running_is_refused() -> None:
    s = DraftStore()
    s.register_group("g", "k", [1, 2, 3], 60, 4)
    with pytest.raises(AlreadyExists) as e:
        s.register_group("g", "k", [1, 2, 3], 60, 2)
    assert e.value.field == "group_size"
    # Unknown (0) agrees with any size.
    assert s.register_group("g", "k", [1, 2, 3], 60, 0) == (False, 0)
    # Still size 4: two finished responses do not complete it.
    s.append("g", "a", 0, [5], True)
    s.append("g", "b", 0, [6], True)
    assert s._history.responses("k") == []


def test_a_completed_group_registered_with_another_group_size_is_a_new_incarnation() -> None:
    s = DraftStore()
    s.register_group("g", "k", [1, 2, 3], 60, 1)
    (d,) = s.sync([("g", 0)])
    s.append("g", "a", 0, [5], True)  # complete: promoted
    assert s.register_group("g", "k", [1, 2, 3], 60, 1) == (False, 0)  # a sibling's late registration
    created, history = s.register_group("g", "k", [1, 2, 3], 60, 2)  # the id used again, G = 2
    assert created and history == 1
    (d2,) = s.sync([("g", 0)])
    assert d2.incarnation != d.incarnation and d2.appends == ()
    s.append("g", "a", 0, [8], True)
    assert sorted(s._history.responses("k")) == [(5,)]  # size 2: one finished is not complete
    s.append("g", "b", 0, [9], True)
    assert sorted(s._history.responses("k")) == [(5,), (8,), (9,)]


def test_a_group_registered_without_a_size_takes_it_from_a_later_registration() -> None:
    s = DraftStore()
    s.register_group("g", "k", [1, 2, 3], 60, 0)
    s.append("g", "a", 0, [5], True)
    s.append("g", "b", 0, [6], True)
    assert s._history.responses("k") == []  # size unknown: never completes
    assert s.register_group("g", "k", [1, 2, 3], 60, 2) == (False, 0)
    assert sorted(s._history.responses("k")) == [(5,), (6,)]  # complete on the size now known
    # More finished responses than the size given later: not the same group.
    s.register_group("g2", "k2", [1], 60, 0)
    for r in ("a", "b", "c"):
        s.append("g2", r, 0, [1], True)
    with pytest.raises(AlreadyExists) as e:
        s.register_group("g2", "k2", [1], 60, 2)
    assert e.value.field == "group_size"
