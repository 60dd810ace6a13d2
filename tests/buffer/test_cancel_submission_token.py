"""CancelBatch naming a submission (CancelBatchRequest.submission_token): it cancels only the batch
that submission stored.

Before, CancelBatch carried the batch id alone: a `seer rollout` interrupted before SubmitBatch's
reply, whose --batch-id named another run's live batch, cancelled that run's batch. And a cancel
that found nothing could not tell the submitter whether its submission would still be stored (the
CLI waited 3 s and said "may still be stored"): now a token the cancel found no batch of is refused
by SubmitBatch from then on, so "not stored" is final. Real buffer: gRPC on loopback, RocksDB."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, group
from seer.v1 import rollout_pb2

from services.buffer.core import BufferCore

TOKEN = "run-a.1"


def _submit(buf: BufferHandle, batch_id: str, token: str = "", prompt: tuple[int, ...] = (1, 2, 3)
            ) -> rollout_pb2.SubmitBatchResponse:
    return buf.rollout.SubmitBatch(rollout_pb2.SubmitBatchRequest(
        batch_id=batch_id, groups=[group(prompt_token_ids=list(prompt))], submission_token=token), timeout=10)


def _cancel(buf: BufferHandle, batch_id: str, token: str = "") -> rollout_pb2.CancelBatchResponse:
    return buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id=batch_id, submission_token=token),
                                   timeout=10)


def _state(buf: BufferHandle, batch_id: str) -> int:
    return buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id=batch_id), timeout=10).state


def test_the_token_of_the_submission_cancels_its_batch(buf: BufferHandle) -> None:
    _submit(buf, "b", TOKEN)
    assert _cancel(buf, "b", TOKEN).num_cancelled == 2
    assert _cancel(buf, "b", TOKEN).num_cancelled == 2  # a repeat answers the same
    assert _state(buf, "b") == rollout_pb2.BATCH_STATE_CANCELLED


@pytest.mark.parametrize("stored_with", [
    pytest.param("run-b", id="another-token"),
    pytest.param("", id="no-token"),
])
@pytest.mark.parametrize("content", ["same", "other"])
def test_another_submissions_batch_is_left_running(stored_with: str, content: str, buf: BufferHandle) -> None:
    """The id names a batch another submission stored (the same content: this submission was
    already_submitted; other content: ALREADY_EXISTS): FAILED_PRECONDITION naming the token, the
    batch untouched. Before: the request had no token, and the batch was cancelled."""
    _submit(buf, "shared", stored_with)
    mine = (1, 2, 3) if content == "same" else (4, 5, 6)
    if content == "same":
        assert _submit(buf, "shared", TOKEN, mine).already_submitted
    else:
        expect_error(lambda: _submit(buf, "shared", TOKEN, mine), grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    details = expect_error(lambda: _cancel(buf, "shared", TOKEN), grpc.StatusCode.FAILED_PRECONDITION)
    assert details.startswith("submission_token: ") and "not cancelled" in details, details
    assert _state(buf, "shared") == rollout_pb2.BATCH_STATE_RUNNING
    # Without a token, CancelBatch still cancels whatever the id names (other callers).
    assert _cancel(buf, "shared").num_cancelled == 2
    assert _state(buf, "shared") == rollout_pb2.BATCH_STATE_CANCELLED


def test_a_token_the_cancel_found_nothing_of_is_never_stored(buf: BufferHandle) -> None:
    """NOT_FOUND naming the token, and that answer is final: the submission arriving after it (still
    in flight when its submitter cancelled) is refused, nothing stored. Another token stores."""
    details = expect_error(lambda: _cancel(buf, "late", TOKEN), grpc.StatusCode.NOT_FOUND)
    assert details.startswith("submission_token: "), details
    details = expect_error(lambda: _submit(buf, "late", TOKEN), grpc.StatusCode.CANCELLED)
    assert details.startswith("submission_token: "), details
    expect_error(lambda: _state(buf, "late"), grpc.StatusCode.NOT_FOUND, "batch_id")
    assert not _submit(buf, "late", "run-b").already_submitted


def test_a_cancel_during_the_submissions_validation_is_final(buf: BufferHandle,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The race itself: the cancel arrives while the submission is validated outside the core's
    lock, the submitter's call still active as far as the buffer knows. Either the cancel finds the
    batch stored, or the submission is refused; here the cancel comes first."""
    entered, release = threading.Event(), threading.Event()
    real: Callable[..., Any] = BufferCore.submit_batch

    def gated(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return real(core, bid, *a, **kw)

    monkeypatch.setattr(BufferCore, "submit_batch", gated)
    outcome: list[Any] = []

    def submit() -> None:
        try:
            outcome.append(_submit(buf, "race", TOKEN))
        except grpc.RpcError as e:
            outcome.append(e.code())

    t = threading.Thread(target=submit)
    t.start()
    try:
        assert entered.wait(30)
        expect_error(lambda: _cancel(buf, "race", TOKEN), grpc.StatusCode.NOT_FOUND, "submission_token")
    finally:
        release.set()
        t.join(30)
    assert outcome == [grpc.StatusCode.CANCELLED]
    expect_error(lambda: _state(buf, "race"), grpc.StatusCode.NOT_FOUND, "batch_id")


def test_the_token_survives_a_restart(make_buffer: Callable[..., BufferHandle]) -> None:
    """Stored with the batch record: after a restart the token still names the batch."""
    buf = make_buffer()
    _submit(buf, "kept", TOKEN)
    buf.stop()
    buf = make_buffer()
    expect_error(lambda: _cancel(buf, "kept", "run-b"), grpc.StatusCode.FAILED_PRECONDITION, "submission_token")
    assert _cancel(buf, "kept", TOKEN).num_cancelled == 2


@pytest.mark.parametrize("call", ["submit", "cancel"])
def test_a_malformed_token_is_refused_by_name(call: str, buf: BufferHandle) -> None:
    bad = "has space"
    fn = (lambda: _submit(buf, "b", bad)) if call == "submit" else (lambda: _cancel(buf, "b", bad))
    details = expect_error(fn, grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith("submission_token: "), details


def test_a_retention_deleted_batch_is_answered_as_deleted(make_buffer: Callable[..., BufferHandle]) -> None:
    """The run's own batch, stored, finished and deleted by retention, then cancelled with its
    token: "deleted by retention", as without a token. Before: "no submission with token ...:
    nothing was cancelled" (the CLI said "this run's submission was not stored": it was, and ran).
    The token is refused from then on all the same (the deletion does not keep it)."""
    buf = make_buffer(retain_batches=1)
    _submit(buf, "mine", TOKEN)
    _cancel(buf, "mine")
    _submit(buf, "other", "run-b")
    _cancel(buf, "other")  # finishes the second batch: retention deletes "mine"
    plain = expect_error(lambda: _cancel(buf, "mine"), grpc.StatusCode.NOT_FOUND, "batch_id")
    details = expect_error(lambda: _cancel(buf, "mine", TOKEN), grpc.StatusCode.NOT_FOUND, "batch_id")
    assert "deleted by retention" in details and details == plain, (details, plain)
    expect_error(lambda: _submit(buf, "mine", TOKEN), grpc.StatusCode.CANCELLED, "submission_token")


def test_a_malformed_batch_id_does_not_refuse_the_token(buf: BufferHandle) -> None:
    """INVALID_ARGUMENT naming batch_id, and nothing else happened: the token still stores. Before:
    the token was remembered as cancelled before the id was checked, so the caller, told its
    request was invalid, had its later valid submission refused (CANCELLED)."""
    details = expect_error(lambda: _cancel(buf, "bad id", TOKEN), grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith("batch_id: "), details
    assert not _submit(buf, "good", TOKEN).already_submitted


def test_a_refused_token_stays_refused_across_a_restart(make_buffer: Callable[..., BufferHandle]) -> None:
    """"Not stored" is final across a buffer restart: SeerClient retries a SubmitBatch that failed
    UNAVAILABLE (the buffer going down), so the submission in flight at the cancel reaches the
    restarted buffer. Before: the refused tokens were in memory only, and that retry was stored."""
    buf = make_buffer()
    expect_error(lambda: _cancel(buf, "late", TOKEN), grpc.StatusCode.NOT_FOUND, "submission_token")
    expect_error(lambda: _cancel(buf, "taken", "run-c"), grpc.StatusCode.NOT_FOUND, "submission_token")
    buf.stop()
    buf = make_buffer()
    expect_error(lambda: _submit(buf, "late", TOKEN), grpc.StatusCode.CANCELLED, "submission_token")
    expect_error(lambda: _submit(buf, "taken", "run-c"), grpc.StatusCode.CANCELLED, "submission_token")
    expect_error(lambda: _state(buf, "late"), grpc.StatusCode.NOT_FOUND, "batch_id")
    assert not _submit(buf, "late", "run-b").already_submitted


def test_the_oldest_refused_tokens_are_forgotten_in_the_store_too(make_buffer: Callable[..., BufferHandle],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded as the remembered deletions are: beyond MAX_CANCELLED_TOKENS the oldest goes, from
    memory and store in one write, so a restart remembers exactly the same tokens (the newest)."""
    import services.buffer.core as core_mod

    monkeypatch.setattr(core_mod, "MAX_CANCELLED_TOKENS", 2)
    buf = make_buffer()
    for t in ("t1", "t2", "t1", "t3"):  # t1 cancelled again: the newest then, t2 is the oldest
        expect_error(lambda t=t: _cancel(buf, "x", t), grpc.StatusCode.NOT_FOUND, "submission_token")
    assert list(buf.core._cancelled_tokens) == ["t1", "t3"]
    assert sorted(k for k, _v in buf.core._store.scan(b"t/")) == [b"t/t1", b"t/t3"]
    buf.stop()
    buf = make_buffer()
    assert list(buf.core._cancelled_tokens) == ["t1", "t3"]
    assert not _submit(buf, "y", "t2").already_submitted
    expect_error(lambda: _submit(buf, "z", "t3"), grpc.StatusCode.CANCELLED, "submission_token")
