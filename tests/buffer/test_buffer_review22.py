"""Regressions of the session-22 buffer review (helper 63): a group's stop tokens are bounded and
count toward the size of a WatchWork message (each work item repeats them: one small SubmitBatch made
a message over gRPC's limit, and the scheduler's feed failed for every batch), and a cancelled
request's chunk records are deleted with the cancellation."""

from __future__ import annotations

from pathlib import Path

import grpc
from buffer_helpers import BufferHandle, expect_error, group, snapshot, submit
from seer.v1 import common_pb2

from services.buffer.core import BufferCore, Commit
from services.buffer.events import batches
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, Sampling
from services.buffer.store import Store
from services.buffer.validation import MAX_STOP_TOKENS


def test_too_many_stop_tokens_are_refused_naming_the_field(buf: BufferHandle) -> None:
    many = common_pb2.SamplingParams(temperature=1.0, stop_token_ids=[5] * (MAX_STOP_TOKENS + 1))
    expect_error(lambda: submit(buf.rollout, "b-many", [group(), group(sampling=many)]),
                 grpc.StatusCode.INVALID_ARGUMENT, "groups[1].sampling.stop_token_ids")
    # The limit itself is fine, and the work feed carries it.
    most = common_pb2.SamplingParams(temperature=1.0, stop_token_ids=[5] * MAX_STOP_TOKENS)
    submit(buf.rollout, "b-most", [group(group_size=4, sampling=most)])
    items = snapshot(buf.internal)
    assert len(items) == 4 and all(len(it.sampling.stop_token_ids) == MAX_STOP_TOKENS for it in items)


def test_stop_tokens_count_toward_a_feed_message(tmp_path: Path) -> None:
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    spec = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=8, max_tokens=4,
                     sampling=Sampling(temperature=1.0, stop_token_ids=tuple(range(1000))))
    core.submit_batch("b", [spec])
    items, sub = core.watch("test")
    core.unwatch(sub)
    # 8 items of 3 prompt + 1,000 stop tokens: at most 2 per message of 2,500 token ids.
    sizes = [len(b) for b in batches(items, max_items=512, max_tokens=2500)]
    assert sizes == [2, 2, 2, 2]


def test_cancelling_a_batch_deletes_its_requests_chunk_records(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    core = BufferCore(store, ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    core.submit_batch("b1", [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=16,
                                       sampling=Sampling(temperature=1.0))])
    for rid in ("b1/0/0", "b1/0/1"):
        core.commit_chunk(Commit(rid, 0, [5, 6], [-0.5, -0.5], FinishReason.CHUNK, 0))
    assert [k for k, _v in store.scan(b"c/")]  # one record per committed chunk
    core.cancel_batch("b1")
    assert [k for k, _v in store.scan(b"c/")] == []
