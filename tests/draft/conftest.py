"""A real draft server on a loopback port (port 0 + the bound port), and the worker tests' real
reference engine on the embedded model (for the draft tests that run the real worker core)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from seer.v1 import draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.app import start
from services.draft.config import DraftConfig
from services.draft.store import DraftStore
from tests.worker.conftest import ref_engine  # noqa: F401  (one definition of the shared engine fixture)


@pytest.fixture()
def draft_server() -> Iterator[tuple[RunningServer, DraftStore]]:
    running, store = start(DraftConfig(port=0, grace_seconds=0.5, max_append_tokens=4096))
    try:
        yield running, store
    finally:
        running.stop(0.2)


@pytest.fixture()
def draft_stub(draft_server: tuple[RunningServer, DraftStore]) -> Iterator[draft_pb2_grpc.DraftServiceStub]:
    ch = grpc.insecure_channel(draft_server[0].address)
    try:
        yield draft_pb2_grpc.DraftServiceStub(ch)
    finally:
        ch.close()
