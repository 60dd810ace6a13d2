"""Helpers shared by the draft tests of registrations over a group's runs and their expiry
(test_register_epoch.py, test_expired_registration.py): the server's stub with its store, a
RegisterGroup of group "g"-like ids, an expiry of everything, and flushing DraftClients."""

from __future__ import annotations

import pytest
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient

Stub = tuple[draft_pb2_grpc.DraftServiceStub, DraftStore]


@pytest.fixture(name="stub")
def stub_fixture(draft_server: tuple[RunningServer, DraftStore], draft_stub: draft_pb2_grpc.DraftServiceStub) -> Stub:
    """`stub`: the real draft server's stub and its store (for appends and expiry without a client).
    A test module imports stub_fixture to use it (named apart, so a test's `stub` parameter does not
    shadow the import)."""
    return draft_stub, draft_server[1]


def register(s: draft_pb2_grpc.DraftServiceStub, gid: str, epoch: int, *, key: str = "key",
             prompt: tuple[int, ...] = (1, 2, 3), size: int = 2, seq: int = 0) -> bool:
    """RegisterGroup (TTL 60 s; `seq`: its submit_seq, 0 = unknown); whether it created the group
    (a new incarnation)."""
    return s.RegisterGroup(draft_pb2.RegisterGroupRequest(
        group_id=gid, prompt_key=key, prompt_token_ids=prompt, ttl_seconds=60, group_size=size,
        epoch=epoch, submit_seq=seq)).created


def expire(store: DraftStore) -> None:
    """Expires every group now."""
    store._clock = lambda: 1e12  # type: ignore[method-assign]  # far past every TTL
    store.expire_now()


def flush(*clients: DraftClient, times: int = 3) -> None:
    """Drives the clients' background ticks (stopped in these tests) a few rounds."""
    for _ in range(times):
        for c in clients:
            c.flush()
