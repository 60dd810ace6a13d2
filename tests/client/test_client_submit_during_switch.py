"""A batch submitted while another thread's update_weights runs waits for the switch to end and runs
at the new version. The buffer refuses it meanwhile (UNAVAILABLE with the retry reason
"weight-switch"); before, the client gave up after retry_seconds although a switch may take the
buffer's switch timeout (600 s)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from client_helpers import Buffer
from seer.v1 import rollout_pb2, rollout_pb2_grpc
from seer_client import PromptGroup, SeerClient, SeerError

SWITCH_SECONDS = 2.0


@contextlib.contextmanager
def _switching(buffer: Buffer, version: int, source: str = "") -> Iterator[None]:
    """Runs buffer.core.update_weights(version) in a thread with a switch that takes SWITCH_SECONDS;
    yields once the switch is in progress and joins the update on exit."""
    assert buffer.core is not None
    entered = threading.Event()

    def switch(version: int, source: str) -> int:
        entered.set()
        time.sleep(SWITCH_SECONDS)
        return 2

    t = threading.Thread(target=buffer.core.update_weights, args=(version, source, switch))
    t.start()
    try:
        assert entered.wait(5)
        yield
    finally:
        t.join(10)


def test_a_submission_during_a_switch_waits_for_it(buffer: Buffer) -> None:
    with _switching(buffer, 1, "/ckpt/1"):
        t0 = time.monotonic()
        # retry_seconds far below the switch: a buffer that is away is still given up on that fast.
        with SeerClient(buffer.address, retry_seconds=0.3) as client:
            out = client.submit_batch("s", [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)])
    assert out.policy_version == 1 and out.num_requests == 2 and not out.already_submitted
    assert time.monotonic() - t0 >= SWITCH_SECONDS * 0.5


def test_the_refusal_names_its_reason(buffer: Buffer) -> None:
    with _switching(buffer, 1), grpc.insecure_channel(buffer.address) as ch, pytest.raises(grpc.RpcError) as e:
        rollout_pb2_grpc.RolloutServiceStub(ch).SubmitBatch(rollout_pb2.SubmitBatchRequest(
            batch_id="r", groups=[rollout_pb2.PromptGroup(prompt_token_ids=[1], group_size=1, max_tokens=2)]),
            timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "version 1 is in progress" in (e.value.details() or "")
    assert ("seer-retry-reason", "weight-switch") in tuple(e.value.trailing_metadata() or ())


def test_a_buffer_that_is_away_is_still_given_up_after_retry_seconds(buffer: Buffer) -> None:
    buffer.stop()
    t0 = time.monotonic()
    with SeerClient(buffer.address, retry_seconds=0.5) as client, pytest.raises(SeerError) as e:
        client.submit_batch("a", [PromptGroup(prompt=[1], group_size=1, max_tokens=2)])
    assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 5


def test_retry_seconds_0_does_not_wait_out_a_weight_switch(buffer: Buffer) -> None:
    # retry_seconds=0 is "no retries", as the Node client's --retry-seconds 0: the switch's refusal
    # is final too. Before: waited out (up to 660 s; here until the switch ended).
    with _switching(buffer, 1):
        t0 = time.monotonic()
        with SeerClient(buffer.address, retry_seconds=0) as client, pytest.raises(SeerError) as e:
            client.submit_batch("b0", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 1.0, e.value
