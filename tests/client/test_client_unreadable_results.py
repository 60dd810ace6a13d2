"""A stored result the buffer cannot decode is left out of the stream, and the stream ends DATA_LOSS
once the batch is done and every other result was sent; the buffer marks that end (and the
RESOURCE_EXHAUSTED one for results over its message limit) with trailing metadata
`seer-results-left-out`. Before, both clients took the DATA_LOSS end for a failed stream: run_batch
cancelled the completed batch (a note saying so) and dropped the gaps it had counted, and the Node
client's rollout() likewise (it knew only RESOURCE_EXHAUSTED as "left out"). Real buffer (in process:
real gRPC and RocksDB), the result record corrupted while it is stopped; the Node client runs as a
library user would (node subprocess)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from client_helpers import Buffer, batch_submitted, finish_request
from seer_client import PromptGroup, SeerClient, SeerError
from test_node_client_library import _outcome, _start

from protos.seer.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.buffer import codec
from services.buffer.store import Store, result_key


def _corrupt_result(buffer: Buffer, batch_id: str, index: int) -> None:
    """Result `index` (in completion order) loses a required field: a RecordError when read."""
    buffer.stop()
    store = Store(buffer.cfg.data_dir)
    try:
        raw = store.get(result_key(batch_id, index))
        assert raw is not None
        meta, arrays = codec.decode(raw)
        meta.pop("policy_version")
        wb = store.new_batch()
        wb.put(result_key(batch_id, index), codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()
    buffer.start()


def test_run_batch_reports_an_undecodable_result_as_left_out_and_cancels_nothing(buffer: Buffer) -> None:
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=3, max_tokens=8, prompt_key="p")]
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("ul", groups, submission_token="tok-ul")
        for s in range(3):
            finish_request(buffer.address, f"ul/0/{s}")
    _corrupt_result(buffer, "ul", 1)
    seen: list[int] = []
    with SeerClient(buffer.address, retry_seconds=5) as client:
        client.wait_ready(10)
        with pytest.raises(SeerError) as info:
            client.run_batch("ul", groups, on_result=lambda r: seen.append(r.cursor), timeout=30,
                             submission_token="tok-ul")
        err = info.value
        # Before: the same DATA_LOSS, with a note "nothing to cancel: the batch had completed" (a
        # CancelBatch sent to a completed batch) and without the gap the client had counted.
        assert err.code == "DATA_LOSS" and "cannot be decoded" in err.message, err
        assert "left out of the stream by the buffer" in err.message and "cursor(s) 1" in err.message, err
        assert not getattr(err, "__notes__", []), err.__notes__
        assert seen == [1, 3]
        assert client.get_batch("ul").state == "completed"


def test_the_left_out_end_carries_the_mark_and_a_failure_does_not(buffer: Buffer) -> None:
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=8, prompt_key="p")]
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("mk", groups)
        for s in range(2):
            finish_request(buffer.address, f"mk/0/{s}")
    _corrupt_result(buffer, "mk", 0)
    with grpc.insecure_channel(buffer.address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        call = stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="mk"), timeout=10)
        with pytest.raises(grpc.RpcError):
            assert [m.cursor for m in call] == [2]
        assert call.code() == grpc.StatusCode.DATA_LOSS
        assert ("seer-results-left-out", "1") in tuple(call.trailing_metadata() or ())
        # An unknown batch's failure has no mark.
        other = stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="nope"), timeout=10)
        with pytest.raises(grpc.RpcError):
            list(other)
        assert other.code() == grpc.StatusCode.NOT_FOUND
        assert not any(k == "seer-results-left-out" for k, _ in other.trailing_metadata() or ())


def test_node_rollout_reports_an_undecodable_result_as_left_out_and_cancels_nothing(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    # The batch the library call submits (its G), stored and finished before the call: the call's
    # SubmitBatch is already_submitted and its stream meets the corrupted result.
    g = rollout_pb2.PromptGroup(prompt_key="k", prompt_token_ids=[1, 2, 3], group_size=2, max_tokens=8,
                                sampling=common_pb2.SamplingParams(temperature=1.0, seed=7))
    with grpc.insecure_channel(tok_buffer.address) as ch:
        rollout_pb2_grpc.RolloutServiceStub(ch).SubmitBatch(
            rollout_pb2.SubmitBatchRequest(batch_id="lib-dl", groups=[g]), timeout=10)
    assert batch_submitted(tok_buffer.address, "lib-dl")
    for s in range(2):
        finish_request(tok_buffer.address, f"lib-dl/0/{s}")
    _corrupt_result(tok_buffer, "lib-dl", 0)
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-dl",
                  "rollout({ address: ADDR, batchId: B, groups: G, retrySeconds: 5 })")
    kind, f, _, _ = _outcome(proc)
    # Before: FAILED DATA_LOSS without leftOut, and a cancel of the completed batch (f["cancel"]).
    assert kind == "FAILED" and f["code"] == grpc.StatusCode.DATA_LOSS.value[0] and f["leftOut"] == ["0"], f
    assert "cannot be decoded" in f["message"] and "cursor(s) 0" in f["message"], f
    assert f.get("cancel") is None, f


def _six_results_with_one_corrupted(buffer: Buffer, batch_id: str, bad: int, *, seed: int | None = None,
                                    token: str = "") -> list[PromptGroup]:
    """A batch of 6 finished results (completion order = sample order), result `bad` corrupted."""
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=6, max_tokens=8, prompt_key="p")]
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch(batch_id, groups, submission_token=token)
        for s in range(6):
            finish_request(buffer.address, f"{batch_id}/0/{s}")
    _corrupt_result(buffer, batch_id, bad)
    return groups


@pytest.mark.parametrize("bad", [0, 5])
def test_run_batch_names_a_corrupted_first_or_last_result_among_six(buffer: Buffer, bad: int) -> None:
    """The 2-result layout with cursor 0 corrupted hid both review findings. The last result has no
    later message whose cursor gap names it: the client's own list lacked it (only the buffer's text
    named it); the buffer now names the cursors in `seer-results-left-out-cursors` too."""
    groups = _six_results_with_one_corrupted(buffer, f"six{bad}", bad, token=f"tok-six{bad}")
    seen: list[int] = []

    def slow(r: object) -> None:  # a consumer slower than the stream
        seen.append(r.cursor)  # type: ignore[attr-defined]
        time.sleep(0.05)

    with SeerClient(buffer.address, retry_seconds=5) as client:
        client.wait_ready(10)
        with pytest.raises(SeerError) as info:
            client.run_batch(f"six{bad}", groups, on_result=slow, timeout=30, submission_token=f"tok-six{bad}")
        err = info.value
        assert err.code == "DATA_LOSS" and "cannot be decoded" in err.message, err
        # Before (bad=5): the buffer's text alone; the client's list ("left out of the stream by the
        # buffer ... cursor(s) 5") was missing.
        assert f"left out of the stream by the buffer (over its message size limit, or stored results it cannot decode: its log names each; every other result was delivered): cursor(s) {bad}" in err.message, err  # noqa: E501
        assert not getattr(err, "__notes__", []), err.__notes__
        assert seen == [c + 1 for c in range(6) if c != bad]
        assert client.get_batch(f"six{bad}").state == "completed"


def test_the_left_out_end_names_the_cursors(buffer: Buffer) -> None:
    _six_results_with_one_corrupted(buffer, "cur", 5)
    with grpc.insecure_channel(buffer.address) as ch:
        call = rollout_pb2_grpc.RolloutServiceStub(ch).StreamResults(
            rollout_pb2.StreamResultsRequest(batch_id="cur"), timeout=10)
        with pytest.raises(grpc.RpcError):
            assert [m.cursor for m in call] == [1, 2, 3, 4, 5]
        trailing = tuple(call.trailing_metadata() or ())
    assert call.code() == grpc.StatusCode.DATA_LOSS
    assert ("seer-results-left-out", "1") in trailing and ("seer-results-left-out-cursors", "5") in trailing, trailing


# An async onResult slower than the stream: the buffer's end arrives while results wait unread in
# the paused stream, the one layout where the Node client reopens the stream after the end.
_NODE_SIX = """rollout({ address: ADDR, batchId: B, retrySeconds: 5,
  groups: [{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 6, max_tokens: 8,
             sampling: { temperature: 1.0, seed: 7 } }] },
  async (r) => { console.log(`SEEN ${r.cursor}`); await sleep(150); })"""


@pytest.mark.parametrize("bad", [0, 5])
def test_node_rollout_reports_a_corrupted_first_or_last_result_among_six_with_an_async_on_result(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path, bad: int) -> None:
    batch_id = f"lib-six{bad}"
    g = rollout_pb2.PromptGroup(prompt_key="k", prompt_token_ids=[1, 2, 3], group_size=6, max_tokens=8,
                                sampling=common_pb2.SamplingParams(temperature=1.0, seed=7))
    with grpc.insecure_channel(tok_buffer.address) as ch:
        rollout_pb2_grpc.RolloutServiceStub(ch).SubmitBatch(
            rollout_pb2.SubmitBatchRequest(batch_id=batch_id, groups=[g]), timeout=10)
    assert batch_submitted(tok_buffer.address, batch_id)
    for s in range(6):
        finish_request(tok_buffer.address, f"{batch_id}/0/{s}")
    _corrupt_result(tok_buffer, batch_id, bad)
    proc = _start(node_client, tmp_path, tok_buffer.address, batch_id, _NODE_SIX)
    kind, f, out, _ = _outcome(proc)
    seen = [int(line.split()[1]) for line in out.splitlines() if line.startswith("SEEN ")]
    assert seen == [c + 1 for c in range(6) if c != bad], out
    # Before: bad=0 ended RESOURCE_EXHAUSTED without the buffer's words (its DATA_LOSS end, read
    # while results were unread, was dropped; the reopened stream ended OK); bad=5 had leftOut [].
    assert kind == "FAILED" and f["code"] == grpc.StatusCode.DATA_LOSS.value[0], f
    assert f["leftOut"] == [str(bad)], f
    assert f"cursor(s) {bad}" in f["message"] and "cannot be decoded" in f["message"], f
    assert f.get("cancel") is None, f
