"""History drafts survive a draft-server restart: the draft server refills a prompt key's history
from the buffer's durable history (GetHistory with tokens) when a group registers without any.

Real parts: a buffer (RocksDB in a temp dir) and a draft server, both on loopback gRPC; the draft
server is started from its app with --buffer-address, as `seer up`, compose and Helm do."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, finish_all, group, snapshot, submit, token_for
from seer.v1 import buffer_pb2, draft_pb2, draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.app import start as start_draft
from services.draft.config import DraftConfig


def _history_tokens(buf: BufferHandle, *keys: str) -> dict[str, list[list[int]]]:
    resp = buf.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=list(keys), include_tokens=True),
                                   timeout=10)
    return {h.prompt_key: [list(r.token_ids) for r in h.responses] for h in resp.histories}


def test_get_history_with_tokens(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer()
    submit(h.rollout, "it1", [group(prompt_key="p", group_size=3)])
    items = snapshot(h.internal)
    finish_all(h.internal, items, length=lambda it: 2 + it.sample_index)
    want = [[token_for(it.request_id, i) for i in range(2 + it.sample_index)] for it in items]
    assert _history_tokens(h, "p", "unknown") == {"p": want}
    # Without include_tokens the reply stays lengths only (the scheduler's priors).
    (plain,) = h.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=["p"]), timeout=10).histories
    assert (list(plain.lengths), len(plain.responses)) == ([2, 3, 4], 0)
    # Tokens for many keys at once would make one huge reply: the key count is bounded, by name.
    expect_error(lambda: _history_tokens(h, *[f"k{i}" for i in range(65)]), grpc.StatusCode.INVALID_ARGUMENT,
                 "prompt_keys")


@pytest.fixture
def draft_factory() -> Iterator[Callable[[str], tuple[RunningServer, draft_pb2_grpc.DraftServiceStub]]]:
    started: list[tuple[RunningServer, grpc.Channel]] = []

    def make(buffer_address: str) -> tuple[RunningServer, draft_pb2_grpc.DraftServiceStub]:
        running, _store = start_draft(DraftConfig(port=0, grace_seconds=0.0, buffer_address=buffer_address))
        ch = grpc.insecure_channel(running.address)
        started.append((running, ch))
        return running, draft_pb2_grpc.DraftServiceStub(ch)

    yield make
    for running, ch in started:
        ch.close()
        running.stop(0)


def _history_seen(stub: draft_pb2_grpc.DraftServiceStub, group_id: str, timeout_s: float = 15.0) -> list[list[int]]:
    """History responses a worker's Sync gets for the group (at creation or as history entries later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = stub.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id=group_id, watermark=0)]),
                         timeout=10)
        (g,) = resp.groups
        seen = [list(r.token_ids) for r in g.history]
        seen += [list(a.token_ids) for a in g.appends if not a.request_id]
        if seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def _register(stub: draft_pb2_grpc.DraftServiceStub, group_id: str, key: str) -> draft_pb2.RegisterGroupResponse:
    return stub.RegisterGroup(draft_pb2.RegisterGroupRequest(group_id=group_id, prompt_key=key,
                                                             prompt_token_ids=[1, 2, 3], group_size=3), timeout=10)


def test_restarted_draft_server_refills_history_from_the_buffer(
        make_buffer: Callable[..., BufferHandle],
        draft_factory: Callable[[str], tuple[RunningServer, draft_pb2_grpc.DraftServiceStub]]) -> None:
    buf = make_buffer()
    submit(buf.rollout, "it1", [group(prompt_key="p", group_size=3)])
    items = snapshot(buf.internal)
    finish_all(buf.internal, items, length=lambda it: 3 + it.sample_index)
    want = sorted([token_for(it.request_id, i) for i in range(3 + it.sample_index)] for it in items)

    # A fresh draft server (as after a restart) knows nothing of "p"; the first group of the key
    # registers without history, and the refill brings the buffer's responses to it.
    _running, stub = draft_factory(buf.address)
    assert _register(stub, "it2/0", "p").history_responses == 0
    assert sorted(_history_seen(stub, "it2/0")) == want
    # Later groups of the key get the history at registration; no second refill is needed.
    assert _register(stub, "it2/1", "p").history_responses == len(want)
    # A key the buffer has no history for: nothing arrives, and the server keeps serving.
    assert _register(stub, "it2/2", "new-key").history_responses == 0
    assert _history_seen(stub, "it2/2", timeout_s=1.0) == []


def test_refill_with_the_buffer_down_degrades_to_sibling_drafts(
        draft_factory: Callable[[str], tuple[RunningServer, draft_pb2_grpc.DraftServiceStub]]) -> None:
    _running, stub = draft_factory("127.0.0.1:1")  # nothing listens there
    assert _register(stub, "g", "p").history_responses == 0
    stub.Append(iter([draft_pb2.AppendRequest(group_id="g", request_id="g/0", offset=0, token_ids=[7, 8, 9])]),
                timeout=10)
    (g,) = stub.Sync(draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id="g", watermark=0)]),
                     timeout=10).groups
    assert [list(a.token_ids) for a in g.appends if a.request_id] == [[7, 8, 9]]
