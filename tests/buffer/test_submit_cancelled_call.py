"""SubmitBatch whose caller cancelled the call before the batch was stored: nothing is stored.

`seer rollout`'s Ctrl-C during a slow submission cancels the call and then the batch; that
CancelBatch can reach the buffer while the submission is still validated and built outside the
core's lock (NOT_FOUND: nothing to cancel), and the batch stored after it ran with nobody left to
cancel it. The race window is made certain here with a gate in the submission's validation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, group, snapshot
from seer.v1 import rollout_pb2

import services.buffer.core as core_mod
from services.buffer.core import BufferCore, SubmitCancelled
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.server import RolloutServicer
from services.buffer.store import Store

WAIT = 30.0  # bounds every wait on the gate: a broken test fails, it does not hang the suite


class Gate:
    """Holds a submission in its validation (outside the core's lock) until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = core_mod.validate_batch

        def gated(*a: Any, **kw: Any) -> Any:
            self.entered.set()
            assert self.release.wait(WAIT), "gate never released"
            return real(*a, **kw)

        monkeypatch.setattr(core_mod, "validate_batch", gated)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    g.install(monkeypatch)
    yield g
    g.release.set()  # a failed test must not leave a server thread parked in the gate


def test_a_submission_whose_call_is_gone_is_not_stored(tmp_path: Path) -> None:
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    spec = [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=4,
                      sampling=Sampling(temperature=1.0))]
    try:
        with pytest.raises(SubmitCancelled, match=r"batch_id: .*cancelled by its caller"):
            core.submit_batch("gone", spec, is_active=lambda: False)
        with pytest.raises(KeyError):  # NotFound
            core.get_batch("gone")
        # The id is free: the next submission is a new batch (not already_submitted) and the
        # refused one used no submission number.
        out = core.submit_batch("gone", spec)
        assert not out.already_submitted and out.num_requests == 2
        assert out.submission_id == 1
    finally:
        core.close()


def test_a_submission_cancelled_while_it_was_built_is_not_stored(
        make_buffer: Callable[..., BufferHandle], gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the buffer stored it (and its requests went to the workers) after the caller had
    gone, so the caller's CancelBatch, which had found nothing, never stopped it."""
    contexts: list[grpc.ServicerContext] = []
    outcomes: list[BaseException | None] = []
    handled = threading.Event()
    real = RolloutServicer.SubmitBatch

    def submit(self: RolloutServicer, request: Any, context: grpc.ServicerContext) -> Any:
        contexts.append(context)
        try:
            return real(self, request, context)
        except BaseException as e:  # context.abort's exception: the status went out
            outcomes.append(e)
            raise
        finally:
            handled.set()

    # Before the server starts: it binds the servicer's methods when it registers them.
    monkeypatch.setattr(RolloutServicer, "SubmitBatch", submit)
    buf = make_buffer()
    call = buf.rollout.SubmitBatch.future(rollout_pb2.SubmitBatchRequest(batch_id="gone", groups=[group()]))
    assert gate.entered.wait(WAIT)
    call.cancel()  # the submitter's Ctrl-C (its channel closed) while the buffer validates
    deadline = time.monotonic() + WAIT
    while contexts[0].is_active():  # the cancellation reached the server: the race window is certain
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.01)
    # The caller's CancelBatch, arriving now, finds nothing: the state `seer rollout` saw.
    expect_error(lambda: buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="gone")),
                 grpc.StatusCode.NOT_FOUND, "batch_id")
    gate.release.set()
    assert handled.wait(WAIT)
    assert outcomes, "the cancelled submission was answered as if stored"
    expect_error(lambda: buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="gone")),
                 grpc.StatusCode.NOT_FOUND, "batch_id")
    assert snapshot(buf.internal) == []  # no request went to the workers
    # Submitted again (the caller's retry): a new batch, stored.
    resp = buf.rollout.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id="gone", groups=[group()]))
    assert not resp.already_submitted and resp.num_requests == 2


def test_a_submission_that_outlasts_its_callers_deadline_is_stored(
        make_buffer: Callable[..., BufferHandle], gate: Gate) -> None:
    """A call ended by its own deadline is not a cancellation: the caller's idempotent retry finds
    the batch stored (already_submitted). Refused too, every retry of a submission slower than the
    caller's timeout failed the same way."""
    buf = make_buffer()
    call = buf.rollout.SubmitBatch.future(rollout_pb2.SubmitBatchRequest(batch_id="slow", groups=[group()]),
                                          timeout=0.3)
    assert gate.entered.wait(WAIT)
    with pytest.raises(grpc.RpcError) as e:
        call.result(timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.release.set()
    deadline = time.monotonic() + WAIT
    while True:  # the server thread goes on with the submission after the caller's deadline
        try:
            buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="slow"))
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            assert time.monotonic() < deadline, "a submission past its deadline was never stored"
            time.sleep(0.05)
    resp = buf.rollout.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id="slow", groups=[group()]))
    assert resp.already_submitted
