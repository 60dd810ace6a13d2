"""Policy versions that go back: the abandoned policy's newer history is dropped (DraftStore.register,
HistoryStore.drop_newer).

A trainer restarted from a checkpoint (or a new run on a buffer that starts its versions over)
registers groups at a version below the newest the draft server keeps for the key. Before, the
newer versions stayed: every group of the rollback drafted from the abandoned policy's responses,
and its own responses were not kept (an add older than every kept iteration of a full key), which
lasted until the versions passed the abandoned ones again. A group created at a lower version by
an attempt dispatched after every group of the newer versions (its epoch above theirs) now drops
them; a straggler of an older version (its epoch below) or an unknown epoch changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.draft.history import HistoryStore
from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import history_bytes_recounted


def _complete(s: DraftStore, gid: str, responses: Sequence[Sequence[int]], version: int, epoch: int) -> int:
    """Registers a group at `version` by an attempt of dispatch `epoch` and finishes its responses at
    that epoch; returns the history responses it loaded."""
    r = s.register(gid, "k", [1, 2, 3], 60, len(responses), epoch=epoch, policy_version=version)
    for i, tok in enumerate(responses):
        s.append(gid, f"r{i}", 0, tok, finished=True, epoch=epoch)
    return r.history_responses


def _iterations(s: DraftStore) -> dict[int, int]:
    return {i: len(it.responses) for i, it in s._history._keys.get("k", {}).items()}


def _store_with_versions_5_and_6() -> DraftStore:
    s = DraftStore(StoreLimits(history_iterations=2))
    _complete(s, "v5", [[50, 51], [52, 53]], 5, epoch=100)
    _complete(s, "v6", [[60, 61]], 6, epoch=200)
    assert _iterations(s) == {5: 2, 6: 1}
    return s


def test_a_rollback_drops_the_abandoned_versions_and_keeps_its_own_responses() -> None:
    s = _store_with_versions_5_and_6()
    # Restarted from the version 3 checkpoint: dispatched after everything above (epoch 300).
    assert _complete(s, "v3", [[30, 31]], 3, epoch=300) == 0  # no draft from the abandoned policy
    assert _iterations(s) == {3: 1}  # its own responses kept (before: rejected, {5: 2, 6: 1} stayed)
    assert s.stats().evicted_history == 3
    assert _complete(s, "v4", [[40]], 4, epoch=400) == 1
    assert _iterations(s) == {3: 1, 4: 1}
    assert s._history.memory_bytes == history_bytes_recounted(s._history)


def test_a_rollback_to_a_kept_version_keeps_it() -> None:
    s = _store_with_versions_5_and_6()
    # Back to version 5 (its checkpoint): version 5's responses are of that very policy.
    assert _complete(s, "v5-again", [[54]], 5, epoch=300) == 2
    assert _iterations(s) == {5: 3}
    assert s.stats().evicted_history == 1


@pytest.mark.parametrize("epoch", [150, 200, 0], ids=["straggler", "same epoch", "unknown epoch"])
def test_an_older_version_dispatched_before_the_newer_ones_drops_nothing(epoch: int) -> None:
    # A straggler (a worker re-creating a version-3 group it lost, with its mirror's epoch) or an old
    # client: versions did not go back; the newer history stays, and the older add is not kept.
    s = _store_with_versions_5_and_6()
    assert _complete(s, "v3", [[30, 31]], 3, epoch=epoch) == 3
    assert _iterations(s) == {5: 2, 6: 1}
    assert s.stats().evicted_history == 1  # the straggler's response, not kept (as before)


def test_a_running_groups_late_registration_drops_nothing() -> None:
    # Only a new group is judged: a group of the newer version registering again is not a rollback,
    # and neither is another registration of a group created before the newer versions completed.
    s = DraftStore(StoreLimits(history_iterations=2))
    s.register("old", "k", [1, 2, 3], 60, 1, epoch=50, policy_version=4)
    _complete(s, "v5", [[50]], 5, epoch=100)
    s.register("old", "k", [1, 2, 3], 60, 1, epoch=300, policy_version=4)
    assert _iterations(s) == {5: 1}


def test_rollback_warnings_are_one_a_minute_for_the_whole_store(caplog: pytest.LogCaptureFixture) -> None:
    # A rollback reaches every prompt key of the dataset: one warning, the rest at debug, counted.
    now = [0.0]
    h = HistoryStore(keep_iterations=2, clock=lambda: now[0])
    for key in ("a", "b", "c"):
        h.add(key, 5, [[1, 2]])
    caplog.set_level("DEBUG", logger="services.draft.history")
    assert h.drop_newer("a", 3, epoch=10) == [5]
    assert h.drop_newer("b", 3, epoch=10) == [5]
    now[0] = 61.0
    assert h.drop_newer("c", 3, epoch=10) == [5]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [(r.fields["prompt_key"], r.fields["suppressed"]) for r in warnings] == [("a", 0), ("c", 1)]  # type: ignore[attr-defined]
    assert h.rolled_back_keys == 3 and h.evicted == 3 and h.num_keys == 0


def test_service_drops_the_abandoned_versions_on_a_rollback(draft_stub: draft_pb2_grpc.DraftServiceStub) -> None:
    def complete(gid: str, version: int, epoch: int, tokens: list[int]) -> int:
        resp = draft_stub.RegisterGroup(draft_pb2.RegisterGroupRequest(
            group_id=gid, prompt_key="k", prompt_token_ids=[1, 2, 3], group_size=1, epoch=epoch,
            policy_version=version), timeout=10)
        draft_stub.Append(iter([draft_pb2.AppendRequest(group_id=gid, request_id="r", offset=0, token_ids=tokens,
                                                        finished=True, epoch=epoch)]), timeout=10)
        return int(resp.history_responses)

    assert complete("v5", 5, 100, [50]) == 0
    assert complete("v6", 6, 200, [60]) == 1
    assert complete("v2", 2, 300, [20]) == 0  # the rollback drafts from nothing of versions 5 and 6
    assert complete("v3", 3, 400, [30]) == 1  # version 2's own response was kept
    assert draft_stub.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 2
