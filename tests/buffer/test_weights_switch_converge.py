"""UpdateWeights when the switch's outcome is unknown to the buffer: the scheduler (and its workers)
may have moved to the new version while the buffer did not record it (the SwitchWeights reply was
lost to the deadline, or the buffer's own write failed). The buffer records the update's intent
before it calls the scheduler and refuses submissions while it is unresolved (a batch labelled with
the old version would be refused by every worker at the new one); a retry of the update resolves
it, also after a restart. A switch the scheduler refused outright leaves the old version in force."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import expect_error
from rocksdict import WriteBatch
from seer.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from services.buffer.app import start as start_buffer
from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.server import start_server
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import add_to_server
from services.scheduler.service import Dispatcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_fake_worker import FakeWorker

LENGTH = common_pb2.FINISH_REASON_LENGTH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlowFirstLoadWorker(FakeWorker):
    """Its first weight load takes longer than the buffer's SwitchWeights deadline (it succeeds)."""

    slow_first_load = 1.0

    def LoadWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        delay, self.slow_first_load = self.slow_first_load, 0.0
        time.sleep(delay)
        return super().LoadWeights(request, context)


def _batch(batch_id: str) -> rollout_pb2.SubmitBatchRequest:
    return rollout_pb2.SubmitBatchRequest(batch_id=batch_id, groups=[rollout_pb2.PromptGroup(
        prompt_key="p", prompt_token_ids=[1, 2, 3], group_size=2, max_tokens=8,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=1))])


def test_a_lost_switch_reply_is_resolved_by_the_retry_before_any_batch_runs(tmp_path: Path) -> None:
    """Real buffer, real scheduler, a worker that refuses chunks of another version: SwitchWeights
    outlives the buffer's deadline (the workers do load version 1). Before: the buffer stayed at 0,
    accepted the next batch at 0 and every worker refused its chunks (the responses ended ABORTED)."""
    port = _free_port()
    # The default heartbeat (2 s; 3 missed = removed): no worker dies here, and 0.3 s removed a
    # worker whose beats a loaded machine held up for 0.9 s mid-test.
    dispatcher = Dispatcher(SchedulerConfig(port=0, buffer_address=f"127.0.0.1:{port}", policy="divided",
                                            chunk_size=8, heartbeat_interval=2.0, grace_seconds=0.0))
    sched = start_server("scheduler", dispatcher.cfg, lambda s: add_to_server(dispatcher, s), on_stop=dispatcher.stop)
    dispatcher.start()
    running, core = start_buffer(BufferConfig(port=port, data_dir=str(tmp_path / "db"), model_dir="",
                                              grace_seconds=0.0, scheduler_address=sched.address,
                                              switch_timeout_seconds=0.3))
    worker = SlowFirstLoadWorker("w0", sched.address, strict_version=True)
    ch = grpc.insecure_channel(running.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(ch)
    try:
        _wait(lambda: any(w.healthy for w in dispatcher.stats().workers))
        update = rollout_pb2.UpdateWeightsRequest(version=1, source="/ckpt/1")
        expect_error(lambda: stub.UpdateWeights(update, timeout=10), grpc.StatusCode.UNAVAILABLE)
        _wait(lambda: worker.version == 1)  # the switch went on and succeeded behind the deadline
        _wait(lambda: dispatcher.stats().policy_version == 1)
        assert core.policy() == (0, "")
        # The next submission asks the scheduler (GetSchedulerStats.policy_version), which serves
        # version 1: the update is settled without the trainer's retry, and the batch runs at 1.
        assert stub.SubmitBatch(_batch("b1"), timeout=10).policy_version == 1
        assert core.policy() == (1, "/ckpt/1")
        assert stub.UpdateWeights(update, timeout=10).version == 1  # the trainer's retry: already current
        results = list(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="b1"), timeout=20))
        assert [(r.result.finish_reason, r.result.policy_version) for r in results] == [(LENGTH, 1)] * 2
    finally:
        ch.close()
        worker.close()
        running.stop(0)
        sched.stop(0)


class FailingStore(Store):
    """A real store whose next write can be made to fail (a disk error)."""

    fail_next = False

    def write(self, wb: WriteBatch) -> None:
        if self.fail_next:
            self.fail_next = False
            raise OSError("injected: the write failed")
        super().write(wb)


def _core(path: Path) -> tuple[BufferCore, FailingStore]:
    store = FailingStore(path)
    return BufferCore(store, ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None)), store


def _groups() -> list[GroupSpec]:
    return [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2), group_size=1, max_tokens=4, sampling=Sampling(seed=1))]


def test_a_failed_write_after_the_scheduler_switched_is_resolved_after_a_restart(tmp_path: Path) -> None:
    """The real scheduler's switch succeeds, then the buffer's write of the version fails and it
    restarts: the intent survives, submissions wait for the retry, and the two versions converge."""
    scheduler = Dispatcher(SchedulerConfig(port=0, grace_seconds=0.0))  # no workers: the switch records only
    core, store = _core(tmp_path / "db")

    injected = [True]

    def switch(version: int, source: str) -> int:
        workers, _seconds = scheduler.switch_weights(version, source)
        if injected:  # once: the buffer's own commit of the version fails after the switch
            store.fail_next = injected.pop()
        return workers

    with pytest.raises(OSError):
        core.update_weights(1, "/ckpt/1", switch)
    assert scheduler._version == 1 and core.policy() == (0, "")
    with pytest.raises(FailedPrecondition) as e:
        core.submit_batch("b1", _groups())  # before: accepted at version 0
    assert "version 1" in str(e.value)
    core.close()
    core, store = _core(tmp_path / "db")  # restart
    with pytest.raises(FailedPrecondition):
        core.submit_batch("b1", _groups())
    with pytest.raises(FailedPrecondition) as e:
        core.update_weights(0, "", switch)  # not behind the update that may have happened
    assert e.value.field == "version"
    # A repeat with source "" completes the pending update (its source), as a caller's retry would.
    assert core.update_weights(1, "", switch).version == 1
    assert core.policy() == (1, "/ckpt/1") == (scheduler._version, scheduler._source)
    assert core.submit_batch("b1", _groups()).policy_version == 1
    core.close()
    core, _store = _core(tmp_path / "db")
    assert core.policy() == (1, "/ckpt/1") and core.submit_batch("b2", _groups()).policy_version == 1
    core.close()


@pytest.mark.parametrize("refusal", [FailedPrecondition, InvalidArgument])
def test_a_switch_the_scheduler_refused_leaves_the_old_version_in_force(
        tmp_path: Path, refusal: Callable[[str], Exception]) -> None:
    """The scheduler answered with a refusal made before it loaded anything (drain timeout, bad
    version): nothing is pending, batches keep running at the old version."""
    core, _store = _core(tmp_path / "db")

    def refuse(version: int, source: str) -> int:
        raise refusal("scheduler SwitchWeights failed: drain timeout")

    with pytest.raises(refusal):  # type: ignore[call-overload]
        core.update_weights(1, "/ckpt/1", refuse)
    assert core.submit_batch("b1", _groups()).policy_version == 0
    core.close()


def test_a_newer_update_replaces_an_unresolved_one(tmp_path: Path) -> None:
    core, _store = _core(tmp_path / "db")

    def lost(version: int, source: str) -> int:
        raise Unavailable("scheduler SwitchWeights failed: DEADLINE_EXCEEDED")

    with pytest.raises(Unavailable) as e:
        core.update_weights(1, "/ckpt/1", lost)
    assert "unknown" in str(e.value)
    with pytest.raises(Unavailable):
        core.update_weights(2, "/ckpt/2", lost)
    # Refused outright (e.g. the drain timed out): version 1's update may still have happened.
    with pytest.raises(FailedPrecondition):
        core.update_weights(3, "/ckpt/3", lambda v, s: (_ for _ in ()).throw(FailedPrecondition("drain")))
    with pytest.raises(FailedPrecondition):
        core.submit_batch("b1", _groups())
    assert core.update_weights(3, "/ckpt/3", lambda v, s: 1).version == 3
    assert core.submit_batch("b1", _groups()).policy_version == 3
    core.close()


def _wait(cond: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_an_unknown_outcome_is_settled_only_by_a_scheduler_at_the_new_version(tmp_path: Path) -> None:
    """reconcile_intent: the scheduler's version settles the intent only when it is the intended
    one. The old version (a restarted scheduler adopts the buffer's, while workers may have loaded
    the new one), no version, or no answer leave submissions refused until the update is retried."""
    core, _store = _core(tmp_path / "db")

    def lost(version: int, source: str) -> int:
        raise Unavailable("the reply was lost")

    with pytest.raises(Unavailable):
        core.update_weights(1, "/ckpt/1", lost)

    def down() -> int | None:
        raise Unavailable("scheduler unreachable")

    for probe in (lambda: 0, lambda: None, down):
        assert not core.reconcile_intent(probe)
        with pytest.raises(FailedPrecondition):
            core.submit_batch("b1", _groups())
    assert core.reconcile_intent(lambda: 1)
    assert core.policy() == (1, "/ckpt/1") and core.pending_intent() is None
    assert core.submit_batch("b1", _groups()).policy_version == 1
    core.close()
    core, _store = _core(tmp_path / "db")  # the settled version was stored
    assert core.policy() == (1, "/ckpt/1") and core.pending_intent() is None
    core.close()
