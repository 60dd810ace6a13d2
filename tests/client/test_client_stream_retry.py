"""SeerClient.iter_results: the retry window counts the time spent failing since the last result
(not the time in accepted streams), a buffer at its stream limit is retried, and an optional
timeout bounds the whole iteration."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
from client_helpers import Buffer
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc
from seer_client import PromptGroup, SeerClient, SeerError, SeerTimeout

STOP = common_pb2.FINISH_REASON_STOP


def _finish(address: str, request_id: str) -> None:
    with grpc.insecure_channel(address) as ch:
        buffer_pb2_grpc.BufferInternalServiceStub(ch).CommitChunk(buffer_pb2.CommitChunkRequest(
            request_id=request_id, seq=0, token_ids=[7], logprobs=[-0.5], finish_reason=STOP), timeout=5)


def test_a_restart_after_a_quiet_spell_is_retried(buffer: Buffer) -> None:
    # retry_seconds leaves room for both outages as the client sees them (stop, 0.2 s, a buffer
    # start, a reconnect) with the backoff the client has reached by then (0.05 s doubling, not
    # reset by an accepted stream: 5 failures had slept 1.55 s); 1.5 s was too tight on a loaded CI
    # machine. Each quiet spell is still longer than the window.
    with SeerClient(buffer.address, retry_seconds=4.0) as client:
        client.submit_batch("q", [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)])
        _finish(buffer.address, "q/0/0")
        it = client.iter_results("q")
        assert next(it).request_id == "q/0/0"

        def restarts() -> None:
            # Two quiet spells longer than retry_seconds, each ended by a restart, and no result
            # between them: only the short outages count towards the window, not the time in the
            # accepted streams.
            for _ in range(2):
                time.sleep(4.4)
                buffer.stop()
                time.sleep(0.2)
                buffer.start()
            time.sleep(0.3)
            _finish(buffer.address, "q/0/1")

        t = threading.Thread(target=restarts, daemon=True)
        t.start()
        # Before: SeerError UNAVAILABLE at the first restart (the window ran from the last result).
        assert [r.request_id for r in it] == ["q/0/1"]
        t.join(10)


def test_a_buffer_down_for_longer_than_retry_seconds_still_ends_the_iteration(buffer: Buffer) -> None:
    with SeerClient(buffer.address, retry_seconds=0.5) as client:
        client.submit_batch("d", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        it = client.iter_results("d")
        threading.Timer(0.3, buffer.stop).start()
        t0 = time.monotonic()
        with pytest.raises(SeerError) as e:
            next(it)
        assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 5


def test_a_stream_refused_at_the_limit_is_retried(buffer: Buffer) -> None:
    buffer.stop()
    # max_streams 2 with 1 kept for WatchWork: one StreamResults at a time.
    buffer.cfg = dataclasses.replace(buffer.cfg, max_workers=4, max_streams=2)
    buffer.start()
    with SeerClient(buffer.address, retry_seconds=5.0) as client:
        client.submit_batch("a", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        client.submit_batch("b", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        ch = grpc.insecure_channel(buffer.address)
        holder = rollout_pb2_grpc.RolloutServiceStub(ch).StreamResults(
            rollout_pb2.StreamResultsRequest(batch_id="a"), timeout=10)
        holder.initial_metadata()  # it holds the one slot

        def later() -> None:
            time.sleep(0.5)
            holder.cancel()
            _finish(buffer.address, "b/0/0")

        threading.Thread(target=later, daemon=True).start()
        # Before: SeerError RESOURCE_EXHAUSTED at once.
        assert [r.request_id for r in client.iter_results("b")] == ["b/0/0"]
        ch.close()


def test_iter_results_timeout_ends_a_stream_without_results(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("t", [PromptGroup(prompt=[1], group_size=2, max_tokens=4)])
        _finish(buffer.address, "t/0/0")
        got: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(SeerTimeout) as e:
            got.extend(r.request_id for r in client.iter_results("t", timeout=0.5))
        assert got == ["t/0/0"] and 0.4 < time.monotonic() - t0 < 3
        err = e.value
        assert isinstance(err, TimeoutError)  # before the SeerError check, which narrows further
        assert isinstance(err, SeerError) and err.code == "DEADLINE_EXCEEDED"
        assert client.get_batch("t").state == "running"  # the client does not cancel on its own
