"""The buffer refill's history iteration follows the group's version however the registrations come.

A worker whose draft mirror moved to a run it has no attempt of registers the group without a
version (cf78322), and another worker of the same run then registers it with the run's version
(DraftStore.register gives the running group that version). The refill of the key, queued by the
first registration, was numbered then as fallback 0 (below every version) and stayed so: it was
dropped one version early (counted in evicted_history) instead of living as the buffer's version.
Now the store numbers it when it is seeded (refill_history) and renumbers a fallback-0 refill when
a group of its key takes a version (_renumber_refill).

Real parts: a buffer (RocksDB in a temp dir) with the key's history, and a draft server started
from its app with --buffer-address (gRPC on loopback); for the order "version before the refill
ran", a DraftStore and HistoryBackfill whose fetch is the real BufferHistoryLink held at a gate.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.buffer.config import BufferConfig
from services.draft.app import start as start_draft
from services.draft.backfill import BufferIteration, HistoryBackfill
from services.draft.buffer_link import BufferHistoryLink
from services.draft.config import DraftConfig
from services.draft.history import (
    unversioned,
)
from services.draft.store import DraftStore, StoreLimits
from tests.draft.draft_helpers import history_bytes_recounted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))
from buffer_helpers import BufferHandle, finish_all, group, snapshot, start_buffer, submit, write_tiny_model


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BufferHandle]:
    """A buffer whose history of key "p" is version 0's three responses (4 tokens each)."""
    tmp = tmp_path_factory.mktemp("refill-renumber")
    (tmp / "model").mkdir()
    model = write_tiny_model(tmp / "model")
    h = start_buffer(BufferConfig(port=0, data_dir=str(tmp / "db"), model_dir=str(model), grace_seconds=0.0))
    submit(h.rollout, "b1", [group(prompt_key="p", group_size=3)])
    finish_all(h.internal, snapshot(h.internal), length=4)
    yield h
    h.stop()


DraftRig = tuple[draft_pb2_grpc.DraftServiceStub, DraftStore]


@pytest.fixture
def draft(buffer: BufferHandle) -> Iterator[DraftRig]:
    """A real draft server refilling from the buffer, over loopback gRPC: (its stub, its store)."""
    running, store = start_draft(DraftConfig(port=0, grace_seconds=0.0, buffer_address=buffer.address))
    ch = grpc.insecure_channel(running.address)
    try:
        yield draft_pb2_grpc.DraftServiceStub(ch), store
    finally:
        ch.close()
        running.stop(0)


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)



def _iterations(store: DraftStore, key: str = "p") -> dict[int, int]:
    return {i: len(it.responses) for i, it in store._history._keys.get(key, {}).items()}


def _register(stub: draft_pb2_grpc.DraftServiceStub, gid: str, version: int | None, submit_seq: int,
              size: int) -> draft_pb2.RegisterGroupResponse:
    req = draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key="p", prompt_token_ids=[1, 2, 3],
                                         group_size=size, submit_seq=submit_seq)
    if version is not None:
        req.policy_version = version
    resp: draft_pb2.RegisterGroupResponse = stub.RegisterGroup(req, timeout=10)
    return resp


def _finish(stub: draft_pb2_grpc.DraftServiceStub, gid: str, responses: list[list[int]]) -> None:
    stub.Append(iter([draft_pb2.AppendRequest(group_id=gid, request_id=f"r{i}", offset=0, token_ids=tok,
                                              finished=True) for i, tok in enumerate(responses)]), timeout=10)


def test_refill_seeded_before_the_version_is_renumbered_when_the_group_takes_it(draft: DraftRig) -> None:
    stub, store = draft
    # Worker A's mirror (no attempt of this run): no version. The refill runs and is seeded
    # under fallback 0, the group's own number.
    _register(stub, "g", None, 7, 2)
    _wait(lambda: _iterations(store) == {unversioned(0): 3})
    # Worker B, same run, version 0: the group takes it, and the refill becomes version 0 (the
    # buffer's version), as if it had been known when seeded.
    assert not _register(stub, "g", 0, 7, 2).created
    assert _iterations(store) == {0: 3}
    _finish(stub, "g", [[50, 51], [52, 53]])
    # A version 1 group completes: with two iterations kept, version 0 (refill + group) stays.
    _register(stub, "h", 1, 8, 1)
    _finish(stub, "h", [[60]])
    assert _iterations(store) == {0: 5, 1: 1}
    assert stub.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 0
    assert store._history.memory_bytes == history_bytes_recounted(store._history)


def test_a_version_that_comes_after_the_keys_groups_completed_renumbers_the_refill(draft: DraftRig) -> None:
    # The refill is seeded beside group A (no version), and A completes before any registration of
    # the key brings a version. The buffer version was kept on A while it ran only, so the version
    # B then brought left the refill at fallback 0: it was dropped at version 1's completion, one
    # version early (3 responses counted evicted), instead of living on as version 0.
    stub, store = draft
    _register(stub, "A", None, 7, 2)
    _wait(lambda: _iterations(store) == {unversioned(0): 3})
    _finish(stub, "A", [[50, 51], [52, 53]])
    assert _iterations(store) == {unversioned(0): 5}  # A's promotion merged with the refill
    # B, the key's first registration with a version (the buffer's, 0): the refill takes it;
    # A's own responses keep their fallback number (as when A completes after a version came).
    assert _register(stub, "B", 0, 8, 1).created
    assert _iterations(store) == {unversioned(0): 2, 0: 3}
    _finish(stub, "B", [[60]])
    assert _iterations(store) == {unversioned(0): 2, 0: 4}
    # Version 1 completes: two iterations kept, version 0 (refill + B) and 1; A's fallback
    # iteration, below every version, goes (2 evicted; before: the refill and A, 5).
    _register(stub, "C", 1, 9, 1)
    _finish(stub, "C", [[70]])
    assert _iterations(store) == {0: 4, 1: 1}
    assert stub.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 2
    assert store._history.memory_bytes == history_bytes_recounted(store._history)


class _GatedFetch:
    """The real buffer link, held until the gate opens (the refill thread runs late)."""

    def __init__(self, link: BufferHistoryLink) -> None:
        self.link = link
        self.gate = threading.Event()

    def __call__(self, key: str) -> BufferIteration:
        assert self.gate.wait(10)
        return self.link.fetch_iteration(key)


def test_refill_queued_without_a_version_is_numbered_when_seeded(buffer: BufferHandle) -> None:
    store = DraftStore(StoreLimits())
    link = BufferHistoryLink(buffer.address)
    fetch = _GatedFetch(link)
    backfill = HistoryBackfill(store, fetch, retry_after_s=60.0).start()
    try:
        r = store.register("g", "p", [1, 2, 3], group_size=2, submit_seq=7)
        backfill.on_register("p", r.history_responses, None)  # queued by a registration without a version
        assert not store.register("g", "p", [1, 2, 3], group_size=2, submit_seq=7, policy_version=0).created
        fetch.gate.set()  # the refill runs after the group took version 0
        _wait(backfill.idle)
        assert _iterations(store) == {0: 3}
        for i, tok in enumerate(([50, 51], [52, 53])):
            store.append("g", f"r{i}", 0, tok, finished=True)
        store.register("h", "p", [1, 2, 3], group_size=1, submit_seq=8, policy_version=1)
        store.append("h", "r0", 0, [60], finished=True)
        assert _iterations(store) == {0: 5, 1: 1}
        assert store.stats().evicted_history == 0
    finally:
        backfill.close()
        link.close()


def test_a_group_that_never_takes_a_version_keeps_the_refill_as_its_fallback(buffer: BufferHandle) -> None:
    # Every client old: the refill stands in for the group's own fallback iteration, as before.
    store = DraftStore(StoreLimits())
    link = BufferHistoryLink(buffer.address)
    backfill = HistoryBackfill(store, link.fetch_iteration, retry_after_s=60.0).start()
    try:
        r = store.register("g", "p", [1, 2, 3], group_size=2)
        backfill.on_register("p", r.history_responses, None)
        _wait(backfill.idle)
        assert _iterations(store) == {unversioned(0): 3}
        for i, tok in enumerate(([50, 51], [52, 53])):
            store.append("g", f"r{i}", 0, tok, finished=True)
        assert _iterations(store) == {unversioned(0): 5}
        # Completed: a late registration with a version still makes the refill the buffer's
        # version (0: the key has versions now); the group's own promotion keeps its fallback number.
        store.register("g", "p", [1, 2, 3], group_size=2, policy_version=3)
        assert _iterations(store) == {unversioned(0): 2, 0: 3}
        assert store._history.memory_bytes == history_bytes_recounted(store._history)
    finally:
        backfill.close()
        link.close()



def _seed_refill(store: DraftStore, buffer: BufferHandle) -> tuple[int, int]:
    """The buffer's newest iteration of "p" (version 0, three responses), seeded as the backfill does."""
    link = BufferHistoryLink(buffer.address)
    try:
        it = link.fetch_iteration("p")
    finally:
        link.close()
    assert it.policy_version == 0 and len(it.responses) == 3
    return store.refill_history("p", it.policy_version, it.responses)


@pytest.mark.parametrize("order", ["refill, then another group's version", "another group's version, then refill"])
def test_a_version_another_group_of_the_key_brings_renumbers_the_refill(buffer: BufferHandle, order: str) -> None:
    # Group A (a mirror without an attempt) registers without a version; group B of the same key,
    # another group id, registers with version 0. Whichever comes first, the refill lives as version
    # 0: renumbered only when A itself took a version, it stayed fallback 0 when B brought it and
    # was dropped (counted evicted) at the next version's completion, one version early (review 4417).
    store = DraftStore(StoreLimits())
    store.register("A", "p", [1, 2, 3], group_size=2, submit_seq=7)
    if order.startswith("refill"):
        assert _seed_refill(store, buffer) == (3, unversioned(0))
        assert store.register("B", "p", [1, 2, 3], group_size=1, submit_seq=7, policy_version=0).created
    else:
        assert store.register("B", "p", [1, 2, 3], group_size=1, submit_seq=7, policy_version=0).created
        assert _seed_refill(store, buffer) == (3, 0)
    assert _iterations(store) == {0: 3}
    store.append("B", "r0", 0, [50, 51], finished=True)  # version 0's own promotion merges with the refill
    assert _iterations(store) == {0: 4}
    store.register("C", "p", [1, 2, 3], group_size=1, submit_seq=8, policy_version=1)
    store.append("C", "r0", 0, [60], finished=True)
    # Two iterations kept: version 0 (refill + B) stays beside version 1.
    assert _iterations(store) == {0: 4, 1: 1}
    assert store.stats().evicted_history == 0
    assert store._history.memory_bytes == history_bytes_recounted(store._history)
