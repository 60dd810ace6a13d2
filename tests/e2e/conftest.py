"""Fixtures of the end-to-end tests: the suite as real subprocesses on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from seer.v1 import rollout_pb2_grpc


@pytest.fixture
def rollout_stub_factory() -> Iterator[object]:
    channels: list[grpc.Channel] = []

    def make(address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        ch = grpc.insecure_channel(address)
        channels.append(ch)
        return rollout_pb2_grpc.RolloutServiceStub(ch)

    yield make
    for ch in channels:
        ch.close()
