"""A batch id deleted by retention and submitted again names a new submission: a reader holding a
cursor into the first one must never resume into the second one's results. SubmitBatch, GetBatch and
every StreamResults message say which submission they are about (SubmitBatchResponse.submission_id:
unique per submission, the same for an idempotent re-submit); a StreamResults request naming another
submission than the batch id's current one is FAILED_PRECONDITION naming submission_id, and a stream
is pinned to the submission it started on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from buffer_helpers import STOP, BufferHandle, commit, expect_error, group, submit, wait_for
from seer.v1 import rollout_pb2

from services.buffer.core import BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, Sampling
from services.buffer.store import Store
from services.common.errors import FailedPrecondition, NotFound


def _finish(buf: BufferHandle, batch_id: str, n: int, tokens: list[int]) -> None:
    for s in range(n):
        commit(buf.internal, f"{batch_id}/0/{s}", 0, tokens, STOP)


def _stream(buf: BufferHandle, batch_id: str, cursor: int = 0, submission_id: int = 0
            ) -> list[rollout_pb2.StreamResultsResponse]:
    return list(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(
        batch_id=batch_id, cursor=cursor, submission_id=submission_id), timeout=10))


def test_a_resumed_cursor_never_reads_the_next_submission_of_its_batch_id(
        make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer(retain_batches=1)
    first = submit(buf.rollout, "a", [group(group_size=3)])
    again = submit(buf.rollout, "a", [group(group_size=3)])
    assert first.submission_id > 0 and not first.already_submitted
    assert again.already_submitted and again.submission_id == first.submission_id  # idempotent
    _finish(buf, "a", 3, [4, 5])
    # A trainer reads one result of the first submission, then goes away.
    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="a"), timeout=10)
    head = next(stream)
    stream.cancel()
    assert head.cursor == 1 and head.submission_id == first.submission_id
    # The server lets go of "a" once its handler sees the cancel (retention keeps a batch with a
    # reader): on a loaded machine that came after "b" completed, "a" was kept, and the stream
    # below got results instead of NOT_FOUND.
    assert wait_for(lambda: not buf.core._readers, 10.0), buf.core._readers
    # Meanwhile retention deletes "a" and the id is submitted again (other content: a new batch).
    submit(buf.rollout, "b", [group(group_size=1)])
    _finish(buf, "b", 1, [6])
    expect_error(lambda: _stream(buf, "a", 1, first.submission_id), grpc.StatusCode.NOT_FOUND, "batch_id")
    second = submit(buf.rollout, "a", [group(group_size=3, max_tokens=4)])
    assert not second.already_submitted and second.submission_id not in (0, first.submission_id)
    _finish(buf, "a", 3, [7, 8, 9])

    # Before: results 1 and 2 of the second submission, as if they were the first one's.
    details = expect_error(lambda: _stream(buf, "a", 1, first.submission_id), grpc.StatusCode.FAILED_PRECONDITION,
                           "submission_id")
    assert f"now names submission {second.submission_id}, not {first.submission_id}" in details
    # The new submission, named or not; every message carries it.
    for sub in (second.submission_id, 0):
        got = _stream(buf, "a", 0, sub)
        assert [m.cursor for m in got] == [1, 2, 3]
        assert {m.submission_id for m in got} == {second.submission_id}
        assert all(list(m.result.token_ids) == [7, 8, 9] for m in got)
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="a"), timeout=10)
    assert status.submission_id == second.submission_id


def test_a_deleted_batch_names_its_submission(tmp_path: Path) -> None:
    """A reader whose cursor is at the end of a deleted batch just ends (nothing was lost), but only
    if it is that batch's reader: remembered with the deletion, also across a restart."""
    model = ModelInfo(vocab_size=100, max_context=64, tokenizer=None)

    def run(core: BufferCore, batch_id: str, size: int) -> int:
        out = core.submit_batch(batch_id, [GroupSpec(prompt_key=batch_id, prompt_token_ids=(1,), group_size=size,
                                                     max_tokens=4, sampling=Sampling(seed=size))])
        for s in range(size):
            core.commit_chunk(Commit(f"{batch_id}/0/{s}", 0, [3], [-0.5], FinishReason.STOP, 0))
        return out.submission_id

    core = BufferCore(Store(tmp_path / "db"), model, retain_batches=1)
    a1 = run(core, "a", 2)
    other = run(core, "x", 1)  # deletes "a"
    core.close()
    core = BufferCore(Store(tmp_path / "db"), model, retain_batches=1)
    try:
        assert core.read_results("a", 2, submission_id=a1) == ([], True)
        assert core.read_results("a", 2) == ([], True)
        with pytest.raises(FailedPrecondition) as e:
            core.read_results("a", 2, submission_id=other)
        assert e.value.field == "submission_id" and "deleted by retention" in str(e.value)
        with pytest.raises(NotFound):
            core.read_results("a", 1, submission_id=a1)
    finally:
        core.close()


def test_a_stream_open_while_its_batch_id_changes_submission_ends_with_a_status(tmp_path: Path) -> None:
    """An open reader keeps its batch from retention; should the id still come to name another
    submission under it (here retention is forced past the reader), its next page is an error
    naming submission_id, never the other submission's results."""
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=100, max_context=64, tokenizer=None),
                      retain_batches=1)
    try:
        def spec(size: int) -> list[GroupSpec]:
            return [GroupSpec(prompt_key="k", prompt_token_ids=(1,), group_size=size, max_tokens=4,
                              sampling=Sampling(seed=1))]

        core.submit_batch("a", spec(3))
        core.commit_chunk(Commit("a/0/0", 0, [3], [-0.5], FinishReason.STOP, 0))
        it = core.iter_results("a", poll_seconds=0.05)
        assert next(it)[0] == 0
        core.commit_chunk(Commit("a/0/1", 0, [3], [-0.5], FinishReason.STOP, 0))
        core.commit_chunk(Commit("a/0/2", 0, [3], [-0.5], FinishReason.STOP, 0))
        core._readers.pop("a")  # what an open reader prevents: its batch deleted under it
        core.submit_batch("x", spec(1))
        core.commit_chunk(Commit("x/0/0", 0, [3], [-0.5], FinishReason.STOP, 0))
        core.submit_batch("a", spec(4))
        for s in range(4):
            core.commit_chunk(Commit(f"a/0/{s}", 0, [9], [-0.5], FinishReason.STOP, 0))
        with pytest.raises(FailedPrecondition) as e:
            next(it)
        assert e.value.field == "submission_id"
    finally:
        core.close()
