"""The clients resume a result stream with the submission their cursor belongs to. While a trainer's
stream was down (a buffer restart here), retention deleted its batch and the batch id was submitted
again; resuming at its cursor must fail (FAILED_PRECONDITION naming submission_id), not go on with
the second submission's results as if they were the first one's. The deletion and resubmission are
done on the buffer's own store while it is stopped (a real core on the same RocksDB), so they
surely happen before the client reconnects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from client_helpers import Buffer, finish_request
from seer_client import PromptGroup, SeerClient, SeerError
from test_node_client_retry import Node

from services.buffer.core import BufferCore, Commit
from services.buffer.model import load_model_info
from services.buffer.records import FinishReason, GroupSpec, Sampling
from services.buffer.store import Store


def _retaining_one(buffer: Buffer) -> None:
    buffer.stop()
    buffer.cfg = dataclasses.replace(buffer.cfg, retain_batches=1)
    buffer.start()


def _replace_offline(buffer: Buffer, batch_id: str, unfinished: list[str], new_size: int) -> None:
    """With the buffer stopped: finish `unfinished`, let retention delete `batch_id` (another batch
    finishes after it), submit `batch_id` again (new content) and finish it; then start the buffer."""
    buffer.stop()
    core = BufferCore(Store(buffer.cfg.data_dir), load_model_info(buffer.cfg), retain_batches=1)
    try:
        for rid in unfinished:
            core.commit_chunk(Commit(rid, 0, [7], [-0.5], FinishReason.STOP, 0))
        for bid, size in (("other", 1), (batch_id, new_size)):
            core.submit_batch(bid, [GroupSpec(prompt_key=f"{bid}-new", prompt_token_ids=(1, 2), group_size=size,
                                              max_tokens=4, sampling=Sampling(seed=3))])
            for s in range(size):
                core.commit_chunk(Commit(f"{bid}/0/{s}", 0, [9], [-0.25], FinishReason.STOP, 0))
        assert core.get_batch(batch_id).num_finished == new_size
    finally:
        core.close()
    buffer.start()


@pytest.mark.parametrize("named", [True, False], ids=["submission_id-given", "pinned-at-first-result"])
def test_the_python_client_does_not_resume_into_another_submission(buffer: Buffer, named: bool) -> None:
    _retaining_one(buffer)
    with SeerClient(buffer.address, retry_seconds=20) as client:
        sub = client.submit_batch("a", [PromptGroup(prompt=[1, 2, 3], group_size=3, max_tokens=4)])
        assert sub.submission_id > 0
        assert client.submit_batch("a", [PromptGroup(prompt=[1, 2, 3], group_size=3, max_tokens=4)]
                                    ).submission_id == sub.submission_id
        finish_request(buffer.address, "a/0/0")
        it = client.iter_results("a", submission_id=sub.submission_id if named else 0)
        first = next(it)
        assert first.cursor == 1 and first.submission_id == sub.submission_id
        _replace_offline(buffer, "a", ["a/0/1", "a/0/2"], new_size=4)
        # Before: results 1..3 of the second submission (token 9), after the first one's result 0.
        with pytest.raises(SeerError) as e:
            next(it)
        assert e.value.code == "FAILED_PRECONDITION" and "submission_id" in e.value.message, e.value
        status = client.get_batch("a")
        assert status.submission_id not in (0, sub.submission_id) and status.num_finished == 4


def test_the_node_client_does_not_resume_into_another_submission(node_client: Path, tok_buffer: Buffer) -> None:
    _retaining_one(tok_buffer)
    n = Node(node_client, tok_buffer, "node-sub", "--retry-seconds", "30")
    finish_request(tok_buffer.address, "node-sub/0/0")
    n.wait_results(1)
    _replace_offline(tok_buffer, "node-sub", ["node-sub/0/1", "node-sub/1/0", "node-sub/1/1"], new_size=4)
    rc, out = n.finish()
    # Before: it went on at cursor 1 with the second submission's results.
    assert sum(line.startswith("result ") for line in out) == 1, "\n".join(out)
    assert rc == 1 and any(line.startswith("error: 9 ") and "submission_id" in line for line in out), "\n".join(out)
    assert not json.loads(out[-1].removeprefix("RESULT "))["ok"]
