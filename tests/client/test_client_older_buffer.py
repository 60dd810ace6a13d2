"""Both clients against an older buffer whose stream ends without the left-out mark
(`seer-results-left-out`, rollout.proto StreamResults) when it left the batch's last result out (over
its message limit): the real buffer (in process: real gRPC and RocksDB) behind a servicer that drops
that trailer, and, for a buffer older still, the headers it sends when it accepts a stream. Nothing
else tells such an end from a failed stream but the buffer's words ("... were left out of the stream
(every other result was sent): request 'b/0/0' (cursor 0) ...").

Before: the end that came without headers (here: a stream with no result before it) was taken for
the buffer's stream limit (RESOURCE_EXHAUSTED before the stream was accepted) and retried until the
retry window ran out; one with headers was taken for a failed stream, and the complete batch was
"cancelled" ("nothing to cancel: the batch had completed"). A buffer with the mark's count but no
cursors made the Node client say "cursor(s)  and 1 more"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from client_helpers import Buffer
from seer.v1 import rollout_pb2, rollout_pb2_grpc
from seer_client import PromptGroup, SeerClient, SeerError
from test_node_client_api import _commit
from test_node_client_library import _outcome, _start, _wait_submitted

from services.buffer.server import RESULTS_LEFT_OUT_CURSORS_KEY, RESULTS_LEFT_OUT_KEY, RolloutServicer
from services.common import server as common_server
from tests.common.grpc_server import loopback_server

WINDOW = 20.0  # the clients' retry window: a retried end would take this long


class _OlderContext:
    """A servicer context that drops what an older buffer did not send."""

    def __init__(self, context: grpc.ServicerContext, headers: bool, count: bool) -> None:
        self._context, self._headers, self._count = context, headers, count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def send_initial_metadata(self, metadata: Any) -> None:
        if self._headers:
            self._context.send_initial_metadata(metadata)

    def set_trailing_metadata(self, metadata: Any) -> None:
        dropped = {RESULTS_LEFT_OUT_CURSORS_KEY} | (set() if self._count else {RESULTS_LEFT_OUT_KEY})
        kept = tuple((k, v) for k, v in metadata if k not in dropped)
        if kept:
            self._context.set_trailing_metadata(kept)


class _OlderServicer(RolloutServicer):
    headers = True  # headers as soon as a stream is accepted (buffers since the stream limit)
    count = False  # the mark with its count but without the cursors (between the two)

    def StreamResults(self, request: rollout_pb2.StreamResultsRequest, context: grpc.ServicerContext
                      ) -> Iterator[rollout_pb2.StreamResultsResponse]:
        return super().StreamResults(request, _OlderContext(context, self.headers, self.count))  # type: ignore[arg-type]


def _older(buffer: Buffer, headers: bool, count: bool = False) -> _OlderServicer:
    assert buffer.core is not None
    servicer = _OlderServicer(buffer.core, None)
    servicer.headers, servicer.count = headers, count
    return servicer


def _too_large(buffer: Buffer, request_id: str) -> None:
    """The request's result: 2000 tokens, over the 4096-byte limit (committed in chunks under it)."""
    for seq in range(8):
        _commit(buffer.address, request_id, seq, [4 + (i % 14) for i in range(250)], last=seq == 7)


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", 4096)  # StreamResults reads it per call


@pytest.mark.parametrize("headers", [True, False], ids=["headers", "no-headers"])
def test_run_batch_ends_at_once_naming_the_last_result(headers: bool, buffer: Buffer, small_limit: None) -> None:
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=1, max_tokens=2000, prompt_key="k")]
    with loopback_server(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, _older(buffer, headers)) as address, \
            SeerClient(address, retry_seconds=WINDOW) as client:
        client.submit_batch("older", groups, submission_token="tok-older")
        _too_large(buffer, "older/0/0")
        t0 = time.monotonic()
        with pytest.raises(SeerError) as info:
            client.run_batch("older", groups, timeout=60, submission_token="tok-older")
        err = info.value
        assert time.monotonic() - t0 < 5, err  # before, without headers: WINDOW s of retries
        assert err.code == "RESOURCE_EXHAUSTED", err
        assert "request 'older/0/0' (cursor 0)" in err.message and "left out of the stream" in err.message, err
        # The batch is complete: nothing cancelled (before, with headers: a note "nothing to cancel").
        assert not getattr(err, "__notes__", []), err.__notes__
        assert client.get_batch("older").state == "completed"


@pytest.mark.parametrize("headers, count", [(True, False), (False, False), (True, True)],
                         ids=["headers", "no-headers", "count-only"])
def test_node_rollout_ends_at_once_naming_the_last_result(headers: bool, count: bool, node_client: Path,
                                                          buffer: Buffer, tmp_path: Path, small_limit: None) -> None:
    groups = "[{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 1, max_tokens: 2000 }]"
    with loopback_server(rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                         _older(buffer, headers, count)) as address:
        proc = _start(node_client, tmp_path, address, "older-n",
                      f"rollout({{ address: ADDR, batchId: B, groups: {groups}, retrySeconds: {WINDOW} }})")
        _wait_submitted(buffer.address, "older-n", proc)
        _too_large(buffer, "older-n/0/0")
        t0 = time.monotonic()
        kind, f, _, _ = _outcome(proc, timeout=60)
    assert time.monotonic() - t0 < 5, f  # before, without headers: WINDOW s of retries
    assert kind == "FAILED" and f["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f
    # The buffer's words name the request and its cursor; the batch is complete: nothing cancelled
    # (before: "nothing to cancel: the batch had completed"), err.leftOut set (its gaps: none).
    assert "request 'older-n/0/0' (cursor 0)" in f["message"], f
    assert f.get("cancel") is None and f["leftOut"] == [], f
    assert "cursor(s)  and" not in f["message"], f
    if count:
        assert "1 result(s) were left out" in f["message"] and "not named by this buffer" in f["message"], f
