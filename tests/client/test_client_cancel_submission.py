"""SeerClient.cancel_submission: the buffer's final answer about one submission (CancelBatch with
its submission_token) as a CancelOutcome. Before, the client had no API for it: run_batch and
`seer rollout` each read the NOT_FOUND / FAILED_PRECONDITION "submission_token: ..." errors of
cancel_batch themselves, and a trainer had to as well. Real buffer (in process: real gRPC and
RocksDB) with no scheduler: a batch never finishes by itself."""

from __future__ import annotations

import dataclasses

import pytest
from client_helpers import Buffer
from seer_client import CancelOutcome, PromptGroup, SeerClient, SeerError

GROUPS = [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)]


def test_the_submissions_batch_is_cancelled(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("b", GROUPS, submission_token="run-a")
        outcome = client.cancel_submission("b", "run-a")
        assert outcome == CancelOutcome("b", "cancelled", 2) and outcome.cancelled
        assert outcome.description == "cancelled (2 unfinished responses)"
        assert client.cancel_submission("b", "run-a") == outcome  # a repeat answers the same
        assert client.get_batch("b").state == "cancelled"
        with pytest.raises(dataclasses.FrozenInstanceError):
            outcome.num_cancelled = 3  # type: ignore[misc]


def test_a_submission_not_stored_is_refused_from_then_on(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        outcome = client.cancel_submission("late", "run-a")
        assert (outcome.kind, outcome.num_cancelled, outcome.cancelled) == ("not_stored", 0, False)
        assert "this submission was not stored" in outcome.description
        assert "refuses it from now on" in outcome.description
        # The answer is final: the submission arriving after it is refused, nothing stored.
        with pytest.raises(SeerError) as refused:
            client.submit_batch("late", GROUPS, submission_token="run-a")
        assert refused.value.code == "CANCELLED" and refused.value.message.startswith("submission_token:")
        with pytest.raises(SeerError) as missing:
            client.get_batch("late")
        assert missing.value.code == "NOT_FOUND"


def test_another_submissions_batch_is_left_running(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("shared", GROUPS, submission_token="other-run")
        assert client.submit_batch("shared", GROUPS, submission_token="run-a").already_submitted
        outcome = client.cancel_submission("shared", "run-a")
        assert (outcome.kind, outcome.cancelled) == ("other_submission", False)
        assert outcome.description == ("not cancelled: the batch id names another submission than this one "
                                       "(left running; cancel_batch('shared') cancels it)")
        assert client.get_batch("shared").state == "running"


def test_other_failures_are_seer_errors(buffer: Buffer) -> None:
    """Not an answer about the submission: raised. An empty token is refused before anything is
    sent (sent empty it would cancel whatever batch the id names: another run's)."""
    with SeerClient(buffer.address, retry_seconds=0.5) as client:
        client.submit_batch("mine", GROUPS, submission_token="other-run")
        with pytest.raises(SeerError) as empty:
            client.cancel_submission("mine", "")
        assert empty.value.code == "INVALID_ARGUMENT" and empty.value.message.startswith("submission_token:")
        assert client.get_batch("mine").state == "running"
        with pytest.raises(SeerError) as malformed:
            client.cancel_submission("mine", "has space")
        assert malformed.value.code == "INVALID_ARGUMENT" and malformed.value.message.startswith("submission_token:")
        with pytest.raises(SeerError) as bad_id:
            client.cancel_submission("bad id", "run-a")
        assert bad_id.value.code == "INVALID_ARGUMENT" and bad_id.value.message.startswith("batch_id:")
        buffer.stop()
        with pytest.raises(SeerError) as down:
            client.cancel_submission("mine", "other-run")
        assert down.value.code == "UNAVAILABLE"
