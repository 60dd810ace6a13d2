"""BufferHistoryLink.fetch_iteration (services/draft/buffer_link.py) and a reply that names its key
in `omitted_prompt_keys`: HistoryOmitted, not "no history" (buffer review, session 33).

The buffer omits whole keys only after an earlier key of the same reply, so with the link's one key
a call it does not happen today; read as an empty history it would lose the key's refill silently
(the backfill takes an empty reply as nothing to seed and counts no error). A scripted buffer
servicer on real loopback gRPC stands in for a buffer that omits it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from seer.v1 import buffer_pb2, buffer_pb2_grpc

from services.common.errors import ResourceExhausted
from services.draft.backfill import HistoryBackfill
from services.draft.buffer_link import BufferHistoryLink
from services.draft.store import DraftStore, StoreLimits


class _ScriptedBuffer(buffer_pb2_grpc.BufferInternalServiceServicer):
    """GetHistory: "kept" has one response at version 4, "omitted" is left out, the rest have none."""

    def GetHistory(self, request: buffer_pb2.GetHistoryRequest,
                   context: grpc.ServicerContext) -> buffer_pb2.GetHistoryResponse:
        resp = buffer_pb2.GetHistoryResponse()
        for key in request.prompt_keys:
            if key == "kept":
                h = resp.histories.add(prompt_key=key, policy_version=4)
                h.responses.add(token_ids=[7, 8, 9])
            elif key == "omitted":
                resp.omitted_prompt_keys.append(key)
        return resp


@pytest.fixture
def link() -> Iterator[BufferHistoryLink]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    buffer_pb2_grpc.add_BufferInternalServiceServicer_to_server(_ScriptedBuffer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    link = BufferHistoryLink(f"127.0.0.1:{port}")
    try:
        yield link
    finally:
        link.close()
        server.stop(None)


def test_an_omitted_key_is_an_error_not_an_empty_history(link: BufferHistoryLink) -> None:
    with pytest.raises(ResourceExhausted, match=r"prompt_keys\[0\]: .*omitted_prompt_keys") as e:
        link.fetch_iteration("omitted")  # before: BufferIteration(0, []), taken for no history
    assert type(e.value).__name__ == "HistoryOmitted"  # (looked up by name: the test runs on HEAD too)
    # A key the reply holds, and one the buffer has no history for, read as before.
    kept = link.fetch_iteration("kept")
    assert (kept.policy_version, [list(r) for r in kept.responses]) == (4, [[7, 8, 9]])
    assert link.fetch_iteration("none").responses == []


def test_backfill_counts_an_omitted_key_as_a_failed_refill(link: BufferHistoryLink) -> None:
    store = DraftStore(StoreLimits())
    b = HistoryBackfill(store, link.fetch_iteration, retry_after_s=60.0).start()
    try:
        _created, history = store.register_group("g", "omitted", [1, 2])
        b.on_register("omitted", history)
        deadline = time.monotonic() + 10
        while not b.idle():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert (b.errors, b.refilled_keys) == (1, 0)  # logged and asked again later, not "none"
    finally:
        b.close()
