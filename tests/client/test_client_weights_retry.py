"""SeerClient.update_weights: a timed-out update that the buffer went on to record can be retried,
and the default deadline outlasts the buffer's own switch deadline."""

from __future__ import annotations

import time

import pytest
from client_helpers import Buffer
from seer.v1 import rollout_pb2_grpc
from seer_client import SeerClient, SeerError
from seer_client.client import UPDATE_WEIGHTS_TIMEOUT

from services.buffer.config import BufferConfig
from services.buffer.server import RolloutServicer
from tests.common.grpc_server import loopback_server


def test_default_timeout_outlasts_the_buffers_switch() -> None:
    assert BufferConfig().switch_timeout_seconds < UPDATE_WEIGHTS_TIMEOUT


def test_retry_after_a_client_timeout_is_success(buffer: Buffer) -> None:
    assert buffer.core is not None

    def slow_switch(version: int, source: str) -> int:
        time.sleep(1.0)
        return 2

    servicer = RolloutServicer(buffer.core, slow_switch)
    with (loopback_server(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer) as address,
          SeerClient(address) as client):
        with pytest.raises(SeerError) as e:
            client.update_weights(1, "/ckpt/1", timeout=0.3)
        # A SeerTimeout, a TimeoutError too (before: a plain SeerError, unlike iter_results').
        assert e.value.code == "DEADLINE_EXCEEDED" and isinstance(e.value, TimeoutError)
        deadline = time.monotonic() + 5
        while buffer.core.policy_version != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        up = client.update_weights(1, "/ckpt/1", timeout=5)  # before: INVALID_ARGUMENT, not newer
        assert (up.version, up.num_workers) == (1, 2)
