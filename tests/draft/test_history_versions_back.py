"""A group at a lower policy version never drops the key's newer history (session 33 follow-up).

adfa8ed dropped a key's newer versions when a new group at a lower version came with a dispatch
epoch above every epoch promoted into them (HistoryStore.drop_newer, "a rollback"). The epoch
cannot tell a rollback from normal runs, and the rule dropped current history in each:
(1) a slow v5 group that expired between chunks, re-created by its worker with its newest epoch
    after a v6 group of its key completed;
(2) seeded or refilled iterations (epoch 0) beside any positive epoch, an epoch-10 straggler too;
(3) iterations promoted by old clients without epochs (0).
Versions that really went backwards keep the newer history: the lower version's adds are refused
while the key is full, counted (rejected_history_adds, evicted_history) and logged, as before
adfa8ed (services/draft/README.md)."""

from __future__ import annotations

import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import history_bytes_recounted
from tests.draft.registration_helpers import Stub, expire, stub_fixture  # noqa: F401 (the stub fixture)


def _register(stub: draft_pb2_grpc.DraftServiceStub, gid: str, version: int, epoch: int) -> int:
    """RegisterGroup of one request at `version` by an attempt of `epoch`; the history it loaded."""
    resp = stub.RegisterGroup(draft_pb2.RegisterGroupRequest(
        group_id=gid, prompt_key="k", prompt_token_ids=[1, 2, 3], ttl_seconds=60, group_size=1, epoch=epoch,
        policy_version=version), timeout=10)
    return int(resp.history_responses)


def _append(stub: draft_pb2_grpc.DraftServiceStub, gid: str, offset: int, tokens: list[int], epoch: int,
            finished: bool) -> None:
    stub.Append(iter([draft_pb2.AppendRequest(group_id=gid, request_id="r", offset=offset, token_ids=tokens,
                                              finished=finished, epoch=epoch)]), timeout=10)


def _iterations(s: DraftStore) -> dict[int, int]:
    return {i: len(it.responses) for i, it in s._history._keys.get("k", {}).items()}


def test_a_slow_group_recreated_after_its_expiry_keeps_the_newer_version(stub: Stub) -> None:
    # (1) A normal async run: v5's group is slow, v6's completes, the v5 group expires between chunks
    # and its worker re-creates it with its newest epoch, above v6's.
    draft, store = stub
    assert _register(draft, "g5", 5, epoch=100) == 0
    _append(draft, "g5", 0, [50, 51], epoch=100, finished=False)
    assert _register(draft, "g6", 6, epoch=200) == 0
    _append(draft, "g6", 0, [60, 61], epoch=200, finished=True)
    expire(store)
    assert _iterations(store) == {6: 1}
    store._clock = lambda: 1e12 + 1  # type: ignore[method-assign]  # the re-created group's TTL runs from now
    # With drop_newer: 0 (version 6's history dropped as a "rollback"), and {5: 1} after it completed.
    assert _register(draft, "g5", 5, epoch=300) == 1
    _append(draft, "g5", 0, [50, 51, 52], epoch=300, finished=True)
    assert _iterations(store) == {5: 1, 6: 1}
    assert store.stats().evicted_history == 0


@pytest.mark.parametrize("newer", ["seeded", "old client"])
def test_an_epoch_less_newer_version_is_kept_beside_any_epoch(newer: str) -> None:
    # (2) A seeded (SeedHistory, refill) v6 iteration beside a live v6 group at epoch 500, or (3) v6
    # promoted by an old client without epochs: an epoch-10 straggler at v5 dropped it.
    s = DraftStore(StoreLimits(history_iterations=2))
    if newer == "seeded":
        s.seed_history("k", 6, [[60, 61]])
        s.register("live6", "k", [1, 2, 3], 60, 1, epoch=500, policy_version=6)
    else:
        s.register("old6", "k", [1, 2, 3], 60, 1, epoch=0, policy_version=6)
        s.append("old6", "r", 0, [60, 61], finished=True, epoch=0)
    assert _iterations(s) == {6: 1}
    assert s.register("s5", "k", [1, 2, 3], 60, 1, epoch=10, policy_version=5).history_responses == 1
    assert _iterations(s) == {6: 1}
    assert s.stats().evicted_history == 0


def test_versions_gone_back_keep_the_newer_history_and_count_the_refused_adds(
        stub: Stub, caplog: pytest.LogCaptureFixture) -> None:
    # A new run at version 3 beside this server's versions 5 and 6 (kept: history_iterations 2), its
    # attempts dispatched after theirs: it drafts from them, and its adds are refused while the key is
    # full, counted and logged (restarting the draft service with the new buffer drops them).
    draft, store = stub
    for gid, version, epoch, tokens in (("v5", 5, 100, [50]), ("v6", 6, 200, [60])):
        _register(draft, gid, version, epoch)
        _append(draft, gid, 0, tokens, epoch=epoch, finished=True)
    assert _iterations(store) == {5: 1, 6: 1}
    caplog.set_level("WARNING", logger="services.draft.history")
    assert _register(draft, "v3", 3, epoch=300) == 2  # the newer history stays its drafts
    _append(draft, "v3", 0, [30, 31], epoch=300, finished=True)
    assert _iterations(store) == {5: 1, 6: 1}
    st = store.stats()
    assert (st.rejected_history_adds, st.evicted_history) == (1, 1)
    assert draft.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 1
    assert [r.getMessage() for r in caplog.records] == [
        "history add older than every kept iteration of its key: not kept"]
    assert store._history.memory_bytes == history_bytes_recounted(store._history)
