"""The submission anti-starvation counts by comes from the wire: WorkItem.submit_seq of the real
buffer (over loopback gRPC), one per SubmitBatch, the same on every item of a batch, increasing
with each submission. The Dispatcher hands it to the core as RequestInfo.incarnation."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import grpc
from seer.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc

from services.buffer.app import start as start_buffer
from services.buffer.config import BufferConfig

from .test_dispatcher_faults import Rig


def _submit_and_watch(tmp_path: Path) -> list[buffer_pb2.WorkItem]:
    """Two batches (an older and a newer submission) into a real buffer; the work feed's items."""
    running, _core = start_buffer(BufferConfig(port=0, data_dir=str(tmp_path / "buffer"), model_dir="",
                                               grace_seconds=0.0))
    ch = grpc.insecure_channel(running.address)
    try:
        rollout = rollout_pb2_grpc.RolloutServiceStub(ch)
        for batch in ("older", "newer"):
            rollout.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id=batch, groups=[
                rollout_pb2.PromptGroup(prompt_key=f"{batch}-{g}", prompt_token_ids=[1, 2, 3], group_size=2,
                                        max_tokens=16) for g in range(2)]), timeout=10)
        feed = buffer_pb2_grpc.BufferInternalServiceStub(ch).WatchWork(
            buffer_pb2.WatchWorkRequest(watcher_id="test"), timeout=10)
        items = [i for ev in itertools.takewhile(lambda ev: not ev.HasField("snapshot_done"), feed)
                 for i in ev.added.items]
        feed.cancel()
        return items
    finally:
        ch.close()
        running.stop(0)


def test_each_batch_is_one_submission_in_submission_order(
        make_rig: Callable[..., Rig], tmp_path: Path) -> None:
    items = _submit_and_watch(tmp_path)
    seqs = {b: {i.submit_seq for i in items if i.batch_id == b} for b in ("older", "newer")}
    assert all(len(s) == 1 for s in seqs.values()), seqs  # one per batch
    (older,), (newer,) = seqs["older"], seqs["newer"]
    assert 0 < older < newer
    t = make_rig(policy="seer")
    # Delivered in pieces (one item at a time): still one submission per batch.
    for it in items:
        t.d._add_items([it])
    subs = t.d.core._starvation._subs
    assert sorted(subs) == [older, newer]
    assert subs[older].requests == subs[newer].requests == 4
