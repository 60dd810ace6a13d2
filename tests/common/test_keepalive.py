"""Internal channels (services.common.grpcutil) notice a quiet stream whose connection was cut
without FIN or RST, through their keepalive pings: a real buffer, a result stream with nothing to
send, and a proxy that freezes the connection. Without `grpc.http2.ping_timeout_ms` among the
options the stream waits a minute for its unacknowledged ping, and without
`grpc.http2.max_pings_without_data` 0 the channel stops pinging a quiet stream after two pings; in
both cases the call's deadline ends the test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from netfault import FreezingProxy
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc

from services.buffer.app import start
from services.buffer.config import BufferConfig
from services.common.grpcutil import CHANNEL_OPTIONS, keepalive_options
from tests.conftest import free_port


@pytest.fixture
def buffer_port(tmp_path: Path) -> Iterator[int]:
    cfg = BufferConfig(port=free_port(), data_dir=str(tmp_path / "db"), model_dir="", grace_seconds=0.0)
    running, _ = start(cfg)
    yield cfg.port
    running.stop(0)


def test_internal_channels_ping_often_enough() -> None:
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.keepalive_time_ms"] <= 30_000
    assert opts["grpc.http2.ping_timeout_ms"] == opts["grpc.keepalive_timeout_ms"] <= 10_000
    assert opts["grpc.http2.max_pings_without_data"] == 0


def test_a_cut_quiet_stream_fails_fast_with_unavailable(buffer_port: int) -> None:
    proxy = FreezingProxy(("127.0.0.1", buffer_port))
    options = [o for o in CHANNEL_OPTIONS if "keepalive" not in o[0] and "ping" not in o[0]]
    ch = grpc.insecure_channel(proxy.address, options=options + keepalive_options(500, 1000))
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        stub.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id="b", groups=[rollout_pb2.PromptGroup(
            prompt_token_ids=[1, 2], group_size=2, max_tokens=4, sampling=common_pb2.SamplingParams(temperature=1.0))]),
            timeout=10)
        stream = stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="b"), timeout=30)
        _finish(buffer_port, "b/0/0")
        assert next(stream).result.request_id == "b/0/0"
        time.sleep(2.5)  # quiet for five ping intervals after the last message
        assert proxy.freeze() >= 1
        _finish(buffer_port, "b/0/1")  # committed, but the cut connection cannot deliver it
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert time.monotonic() - t0 < 10
    finally:
        ch.close()
        proxy.close()


def _finish(port: int, request_id: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        buffer_pb2_grpc.BufferInternalServiceStub(ch).CommitChunk(buffer_pb2.CommitChunkRequest(
            request_id=request_id, seq=0, token_ids=[7], logprobs=[-0.5], finish_reason=common_pb2.FINISH_REASON_STOP),
            timeout=5)
