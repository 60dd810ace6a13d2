"""Retention never cuts a connected reader: a finished batch that a StreamResults reader is still
reading is kept (deleted once the reader is gone), and a reader that comes back after its batch was
deleted gets an error naming the lost results, never a silent gap."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, finish_all, group, snapshot, submit
from seer.v1 import common_pb2, rollout_pb2

from services.buffer.core import BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, Sampling
from services.buffer.store import Store
from services.common.errors import NotFound


def _core(path: Path, retain: int) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None), retain_batches=retain)


def _run(core: BufferCore, batch_id: str, groups: int, size: int) -> None:
    core.submit_batch(batch_id, [GroupSpec(prompt_key=f"{batch_id}-{g}", prompt_token_ids=(1, 2), group_size=size,
                                           max_tokens=4, sampling=Sampling(seed=g)) for g in range(groups)])
    for g in range(groups):
        for s in range(size):
            assert core.commit_chunk(Commit(f"{batch_id}/{g}/{s}", 0, [7], [-0.5], FinishReason.STOP, 0)).accepted


def test_a_slow_reader_gets_every_result_of_a_batch_retention_would_delete(tmp_path: Path) -> None:
    core = _core(tmp_path / "db", retain=1)
    _run(core, "a", 3, 100)  # 300 results: more than one page (256) of the reader
    it = core.iter_results("a")
    first = next(it)
    assert first[0] == 0
    _run(core, "b", 1, 1)  # "a" is now beyond retain_batches=1, but its reader is connected
    rest = [idx for idx, _r in it]  # before: NotFound "unknown batch 'a'" after the first page
    assert [first[0], *rest] == list(range(300))
    it.close()
    # The reader is gone: the next finished batch applies retention to "a" as usual.
    _run(core, "c", 1, 1)
    with pytest.raises(NotFound) as e:
        core.read_results("a", 256)
    assert "deleted by retention" in str(e.value) and "300 results" in str(e.value) and e.value.field == "batch_id"
    assert core.get_batch("c").num_requests == 1
    core.close()


def test_a_reader_cut_between_pages_is_told_what_was_lost(tmp_path: Path) -> None:
    """A reader that reconnects (cursor 256) after retention deleted its batch learns which results
    it lost, not just "unknown batch"."""
    core = _core(tmp_path / "db", retain=1)
    _run(core, "a", 3, 100)
    page, done = core.read_results("a", 0)
    assert len(page) == 256 and not done
    _run(core, "b", 1, 1)  # no reader connected: "a" is deleted
    with pytest.raises(NotFound) as e:
        core.read_results("a", 256)
    msg = str(e.value)
    assert "'a'" in msg and "deleted by retention" in msg and "[256, 300)" in msg, msg
    core.close()


def test_a_reader_that_had_every_result_may_come_back_after_the_deletion(tmp_path: Path) -> None:
    core = _core(tmp_path / "db", retain=1)
    _run(core, "a", 1, 2)
    assert [i for i, _r in core.iter_results("a")] == [0, 1]
    _run(core, "b", 1, 1)
    assert core.read_results("a", 2) == ([], True)  # it lost nothing: the stream just ends
    core.close()


def test_a_cancelled_stream_releases_its_batch_to_retention(make_buffer: Callable[..., BufferHandle]) -> None:
    """Over gRPC: a reader waiting for results holds its batch; once it goes away (cancel), the
    batch is subject to retention again."""
    h = make_buffer(retain_batches=1)
    submit(h.rollout, "a", [group(group_size=2)])
    items = snapshot(h.internal)
    finish_all(h.internal, items[:1])
    stream = h.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="a"), timeout=10)
    next(stream)  # the server now waits for a's second result, holding the batch
    assert h.core._readers == {"a": 1}
    stream.cancel()
    deadline = time.monotonic() + 5
    while h.core._readers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not h.core._readers  # released (no leak that would keep "a" forever)
    finish_all(h.internal, items[1:])
    submit(h.rollout, "b", [group(group_size=1)])
    finish_all(h.internal, snapshot(h.internal))
    msg = expect_error(lambda: h.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="a")),
                       grpc.StatusCode.NOT_FOUND, "batch_id")
    assert "deleted by retention with its 2 results" in msg


def test_a_deletion_is_remembered_across_a_restart(tmp_path: Path) -> None:
    """A reader coming back after the buffer restarted is still told what retention took (before:
    the deletions were kept in memory only, and the restart turned them into "unknown batch")."""
    core = _core(tmp_path / "db", retain=1)
    _run(core, "a", 1, 3)
    _run(core, "b", 1, 1)  # "a" deleted
    core.close()
    core = _core(tmp_path / "db", retain=1)
    with pytest.raises(NotFound) as e:
        core.read_results("a", 1)
    assert "deleted by retention with its 3 results" in str(e.value) and "[1, 3)" in str(e.value)
    # The id used again is a new batch, and stays one after another restart.
    _run(core, "a", 1, 2)  # this finishes "a" again: "b" is deleted now
    core.close()
    core = _core(tmp_path / "db", retain=1)
    assert core.get_batch("a").num_requests == 2
    with pytest.raises(NotFound) as e:
        core.get_batch("b")
    assert "deleted by retention with its 1 results" in str(e.value)
    core.close()


def test_the_oldest_remembered_deletions_are_evicted_in_the_store_too(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import services.buffer.core as core_module

    monkeypatch.setattr(core_module, "MAX_REMEMBERED_DELETIONS", 2)
    core = _core(tmp_path / "db", retain=1)
    for bid in ("a", "b", "c", "d"):
        _run(core, bid, 1, 1)  # a, b and c deleted in that order; only b and c remembered
    assert list(core._deleted) == ["b", "c"]
    core.close()
    core = _core(tmp_path / "db", retain=1)
    assert list(core._deleted) == ["b", "c"]  # the same ones, in the same order
    _run(core, "e", 1, 1)  # d deleted: b, the oldest, is evicted
    assert list(core._deleted) == ["c", "d"]
    core.close()
    core = _core(tmp_path / "db", retain=1)
    assert list(core._deleted) == ["c", "d"]
    with pytest.raises(NotFound) as e:
        core.get_batch("a")
    assert "deleted by retention" not in str(e.value)  # forgotten: plain unknown batch
    core.close()


def test_a_batch_id_reused_after_retention_is_fed_with_its_new_content(
    make_buffer: Callable[..., BufferHandle],
) -> None:
    """The scheduler's WatchWork stream outlives batches. A batch id resubmitted after retention
    deleted it has new groups under the old group ids; the stream's encoder cached the old groups'
    prompt, max_tokens, sampling and version by group id and sent those (found by review, session
    17: the responses answered the old prompt under the new batch's ids)."""
    import queue
    import threading

    from seer.v1 import buffer_pb2

    h = make_buffer(retain_batches=1)
    stream = h.internal.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="sched"), timeout=60)
    events: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        try:
            for ev in stream:
                events.put(ev)
        except grpc.RpcError as e:  # the test cancels the stream when it is done
            if e.code() != grpc.StatusCode.CANCELLED:
                raise

    threading.Thread(target=read, daemon=True).start()

    def added(n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            ev = events.get(timeout=10)
            if ev.HasField("added"):
                out.extend(ev.added.items)
        return out

    try:
        submit(h.rollout, "x", [group(prompt_token_ids=[1, 2, 3], max_tokens=8, group_size=2)])
        first = added(2)
        assert [list(i.prompt_token_ids) for i in first] == [[1, 2, 3]] * 2
        finish_all(h.internal, first)
        submit(h.rollout, "y", [group(prompt_token_ids=[4, 4], max_tokens=6, group_size=1)])
        finish_all(h.internal, added(1))  # y completes: retention deletes x
        expect_error(lambda: h.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="x")), grpc.StatusCode.NOT_FOUND)
        submit(h.rollout, "x", [group(prompt_token_ids=[9, 9, 9, 9, 9], max_tokens=3, group_size=2,
                                      sampling=common_pb2.SamplingParams(temperature=0.5))])
        again = added(2)
        assert [(list(i.prompt_token_ids), i.max_tokens, round(i.sampling.temperature, 3)) for i in again] == [
            ([9, 9, 9, 9, 9], 3, 0.5)] * 2
    finally:
        stream.cancel()


def test_a_late_commit_of_the_old_submission_never_lands_in_the_new_one(
    make_buffer: Callable[..., BufferHandle],
) -> None:
    """A chunk generated for a request of a batch that retention deleted, committed after the batch
    id was submitted again, would land in the new request of the same id (at seq 0, in order). The
    commit names the submission it was generated for (WorkItem.submit_seq)."""
    from seer.v1 import buffer_pb2

    h = make_buffer(retain_batches=1)
    submit(h.rollout, "x", [group(prompt_token_ids=[1, 2, 3], max_tokens=4, group_size=1)])
    (old,) = snapshot(h.internal)
    finish_all(h.internal, [old], length=4)
    submit(h.rollout, "y", [group(prompt_token_ids=[4, 4], max_tokens=4, group_size=1)])
    finish_all(h.internal, snapshot(h.internal), length=4)  # y completes: retention deletes x
    submit(h.rollout, "x", [group(prompt_token_ids=[9, 9], max_tokens=4, group_size=1)])
    (new,) = snapshot(h.internal)
    assert new.request_id == old.request_id and 0 < old.submit_seq < new.submit_seq

    def commit_for(item: buffer_pb2.WorkItem) -> Any:
        return h.internal.CommitChunk(buffer_pb2.CommitChunkRequest(
            request_id=item.request_id, seq=0, token_ids=[7, 7], logprobs=[-0.5, -0.5],
            finish_reason=common_pb2.FINISH_REASON_CHUNK, policy_version=item.policy_version,
            submit_seq=item.submit_seq), timeout=10)

    expect_error(lambda: commit_for(old), grpc.StatusCode.NOT_FOUND, "submit_seq")
    assert commit_for(new).accepted
