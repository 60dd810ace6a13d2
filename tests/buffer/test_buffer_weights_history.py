"""UpdateWeights rules (version pinning, running batches, scheduler call) and history for priors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferHandle, commit, expect_error, finish_all, group, policy_event, snapshot, submit
from seer.v1 import buffer_pb2, rollout_pb2, scheduler_pb2, scheduler_pb2_grpc

from tests.common.grpc_server import loopback_server

FP = grpc.StatusCode.FAILED_PRECONDITION


def _update(buf: BufferHandle, version: int, source: str = "") -> rollout_pb2.UpdateWeightsResponse:
    return buf.rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=version, source=source), timeout=10)


def test_update_weights_rules(buf: BufferHandle) -> None:
    expect_error(lambda: _update(buf, 0), grpc.StatusCode.INVALID_ARGUMENT, "version")
    submit(buf.rollout, "v0", [group(group_size=1)])
    msg = expect_error(lambda: _update(buf, 1), FP, "version")
    assert "'v0'" in msg
    commit(buf.internal, "v0/0/0", 0, [5], reason=1)
    assert _update(buf, 1).version == 1
    # Repeating the current version is a retry, so success (tests/buffer/test_weights_retry.py).
    assert _update(buf, 1).version == 1
    # Later batches are pinned to the new version; commits must carry it.
    assert submit(buf.rollout, "v1", [group(group_size=1)]).policy_version == 1
    assert snapshot(buf.internal)[0].policy_version == 1
    expect_error(lambda: commit(buf.internal, "v1/0/0", 0, [5], version=0), FP, "policy_version")
    commit(buf.internal, "v1/0/0", 0, [5], reason=1, version=1)
    r = next(iter(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="v1"), timeout=10)))
    assert r.result.policy_version == 1
    # A cancelled batch no longer blocks an update.
    submit(buf.rollout, "v1b", [group(group_size=1)])
    buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="v1b"))
    assert _update(buf, 5).version == 5


def test_policy_version_survives_restart(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer()
    assert (policy_event(h.internal).version, policy_event(h.internal).source) == (0, "")
    _update(h, 3, "/ckpt/3")
    _update(h, 4)  # an empty source relabels the same weights: the source stays
    assert (policy_event(h.internal).version, policy_event(h.internal).source) == (4, "/ckpt/3")
    h.stop()
    h2 = make_buffer()
    assert submit(h2.rollout, "after", [group()]).policy_version == 4
    # A scheduler restarting after this learns where version 4's weights come from.
    assert (policy_event(h2.internal).version, policy_event(h2.internal).source) == (4, "/ckpt/3")


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Only SwitchWeights, recording calls (the buffer's side of the weight-update glue)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.fail: grpc.StatusCode | None = None

    def SwitchWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append((request.version, request.source))
        if self.fail is not None:
            context.abort(self.fail, "workers could not load")
        return scheduler_pb2.SwitchWeightsResponse(num_workers=3, seconds=0.1)


@pytest.fixture
def scheduler() -> Iterator[tuple[FakeScheduler, str]]:
    fake = FakeScheduler()
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, fake, max_workers=2) as address:
        yield fake, address


def test_update_weights_asks_the_scheduler(make_buffer: Callable[..., BufferHandle],
                                            scheduler: tuple[FakeScheduler, str]) -> None:
    fake, address = scheduler
    h = make_buffer(scheduler_address=address)
    resp = _update(h, 2, "/weights/step2")
    assert (resp.version, resp.num_workers, fake.calls) == (2, 3, [(2, "/weights/step2")])
    # Refused by the scheduler before any load (drain timeout; another switch in progress): the
    # version is unchanged and batches go on at it.
    for code, expect in ((FP, FP), (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)):
        fake.fail = code
        expect_error(lambda: _update(h, 3), expect, "SwitchWeights")
        assert policy_event(h.internal).version == 2
        submit(h.rollout, f"b-{code.name}", [group(group_size=1)])
        h.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id=f"b-{code.name}"))
    # A failure that may have come after the workers loaded it (INTERNAL, a lost reply): the outcome
    # is unknown, so batches wait for the update's retry (tests/buffer/test_weights_switch_converge.py).
    fake.fail = grpc.StatusCode.INTERNAL
    msg = expect_error(lambda: _update(h, 3, "/weights/step3"), grpc.StatusCode.UNAVAILABLE, "SwitchWeights")
    assert "outcome is unknown" in msg
    expect_error(lambda: submit(h.rollout, "b", [group()]), FP)
    fake.fail = None
    assert _update(h, 3).version == 3  # "" = the pending update's source
    assert fake.calls[-1] == (3, "/weights/step3")
    assert submit(h.rollout, "b", [group()]).policy_version == 3


def test_unreachable_scheduler_is_unavailable(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer(scheduler_address="127.0.0.1:1", switch_timeout_seconds=2.0)
    expect_error(lambda: _update(h, 1), grpc.StatusCode.UNAVAILABLE)
    assert submit(h.rollout, "b", [group()]).policy_version == 0


def _history(buf: BufferHandle, *keys: str) -> dict[str, tuple[list[int], int]]:
    resp = buf.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=list(keys)), timeout=10)
    return {h.prompt_key: (list(h.lengths), h.policy_version) for h in resp.histories}


def test_completed_batch_becomes_history(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer(history_iterations=2)
    submit(h.rollout, "it1", [group(prompt_key="p", group_size=3), group(prompt_key="q", group_size=1)])
    items = snapshot(h.internal)
    finish_all(h.internal, items[:3], length=lambda it: 2 + it.sample_index)
    assert _history(h, "p", "q") == {}  # not before the batch completes
    finish_all(h.internal, items[3:], length=6)
    assert _history(h, "p", "q", "unknown") == {"p": ([2, 3, 4], 0), "q": ([6], 0)}
    # Tokens are kept too (history drafts), newest iteration first, at most history_iterations. An
    # iteration is a policy version: two batches at version 1 are one iteration (the older
    # responses first), and version 0's stays kept beside it.
    _update(h, 1)
    for n, bid in enumerate(["it2", "it3"]):
        submit(h.rollout, bid, [group(prompt_key="p", group_size=2)])
        finish_all(h.internal, snapshot(h.internal), length=3 + n)
    assert _history(h, "p") == {"p": ([3, 3, 4, 4], 1)}
    its = h.core.history("p")
    assert [(it.batch_id, it.policy_version) for it in its] == [("it3", 1), ("it1", 0)]
    assert [len(t) for t in its[0].token_ids] == [3, 3, 4, 4]
    # A cancelled batch does not become history.
    submit(h.rollout, "it4", [group(prompt_key="p", group_size=1)])
    h.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="it4"))
    assert _history(h, "p") == {"p": ([3, 3, 4, 4], 1)}
    # History survives a restart.
    h.stop()
    h2 = make_buffer()
    assert _history(h2, "p", "q") == {"p": ([3, 3, 4, 4], 1), "q": ([6], 0)}


def test_old_finished_batches_are_deleted_beyond_retention(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer(retain_batches=2)
    for n in range(3):
        submit(h.rollout, f"r{n}", [group(prompt_key="p", group_size=1)])
        finish_all(h.internal, snapshot(h.internal), length=2 + n)
    running = submit(h.rollout, "live", [group(group_size=1)])
    assert running.num_requests == 1
    expect_error(lambda: h.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="r0")), grpc.StatusCode.NOT_FOUND,
                 "batch_id")
    for b in ("r1", "r2"):
        (only,) = h.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=b), timeout=10)
        assert only.result.request_id == f"{b}/0/0"
    assert not list(h.core._store.scan(b"r/r0/")) and not list(h.core._store.scan(b"l/r0/"))
    assert _history(h, "p") == {"p": ([2, 3, 4], 0)}  # history outlives the batches (one version: merged)
    # A cancel also counts as finishing a batch; running batches are never deleted.
    h.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="live"))
    expect_error(lambda: h.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="r1")), grpc.StatusCode.NOT_FOUND)
    h.stop()
    h2 = make_buffer(retain_batches=2)
    assert {b: h2.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id=b)).state for b in ("r2", "live")} == {
        "r2": rollout_pb2.BATCH_STATE_COMPLETED, "live": rollout_pb2.BATCH_STATE_CANCELLED}
