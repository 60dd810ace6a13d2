"""Helpers shared by the draft tests and the worker tests that run a real draft server: a server on
a loopback port that can restart on that port, DraftClients whose background ticks are stopped
(flush() drives them), the usual group setups, a one-group Sync and a wait for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.server import RunningServer
from services.draft.app import start
from services.draft.config import DraftConfig
from services.draft.history import (
    HISTORY_ITERATION_BYTES,
    HISTORY_KEY_BYTES,
    HISTORY_RESPONSE_BYTES,
    HISTORY_TOKEN_BYTES,
    HistoryStore,
)
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient

GRACE_S = 0.2  # a test server's stop grace: nothing in flight is worth waiting for longer
PROMPT = [1, 2, 3]  # the prompt of the groups these helpers register (prompt key "key")


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Polls `cond` until it holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def restart(running: RunningServer) -> tuple[RunningServer, DraftStore]:
    """The draft server restarts on the same port and loses everything (no tombstones either)."""
    port = running.port
    running.stop(GRACE_S)
    return start(DraftConfig(port=port, grace_seconds=GRACE_S))


class DraftServer:
    """A real draft server on a loopback port (port 0, then the bound port) that can restart on its
    port, losing everything; `running` and `store` are replaced by a restart."""

    def __init__(self) -> None:
        self.running, self.store = start(DraftConfig(port=0, grace_seconds=GRACE_S))

    @property
    def address(self) -> str:
        return self.running.address

    def restart(self) -> None:
        self.running, self.store = restart(self.running)

    def stop(self) -> None:
        self.running.stop(GRACE_S)


def manual(address: str) -> DraftClient:
    """A DraftClient whose background thread is stopped: the test drives every tick with flush()."""
    c = DraftClient(address, sync_interval_s=3600)
    c._stop.set()
    c._wake.set()
    assert c._thread is not None
    c._thread.join()
    return c


@contextmanager
def workers(n: int) -> Iterator[tuple[DraftServer, list[DraftClient]]]:
    """A draft server and the manual clients of `n` workers."""
    srv = DraftServer()
    clients = [manual(srv.address) for _ in range(n)]
    try:
        yield srv, clients
    finally:
        for c in clients:
            c.close()
        srv.stop()


def register(clients: Sequence[DraftClient], group_size: int) -> None:
    """Group "g" (prompt key "key") registered on each client, one tick each."""
    for c in clients:
        c.register_group("g", "key", PROMPT, group_size=group_size, ttl_seconds=60)
        c.flush()


def finish(c: DraftClient, request_id: str, tokens: Sequence[int], epoch: int = 0) -> None:
    """An attempt of `request_id` in group "g" that generates the whole response and ends."""
    c.resume("g", request_id, [], epoch=epoch)
    c.append("g", request_id, 0, tokens, finished=True)
    c.end("g", request_id)


def old_run(a: DraftClient, b: DraftClient) -> None:
    """The old run of group "g" (size 2): A finishes r0, then B finishes r1 after A's last Sync (A's
    mirror never learns the group completed). Old-run epochs 1 and 2."""
    register((a, b), group_size=2)
    finish(a, "r0", [10, 11, 12], epoch=1)
    a.flush()
    finish(b, "r1", [20, 21], epoch=2)
    b.flush()
    assert not a._groups["g"].completed


def sync_one(stub: draft_pb2_grpc.DraftServiceStub, group_id: str, incarnation: int,
             watermark: int = 1) -> draft_pb2.GroupDelta:
    """The server's answer to one group's watermark in a Sync."""
    req = draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id=group_id, watermark=watermark,
                                                                 incarnation=incarnation)])
    return stub.Sync(req).groups[0]


def history_bytes_recounted(h: HistoryStore) -> int:
    """The history's memory recomputed from what it holds (its running total must equal it)."""
    keys = list(h)
    return (sum(len(r) * HISTORY_TOKEN_BYTES + HISTORY_RESPONSE_BYTES for k in keys for r in h.responses(k))
            + len(keys) * HISTORY_KEY_BYTES + sum(len(h._keys[k]) for k in keys) * HISTORY_ITERATION_BYTES)


def complete_group(s: DraftStore, gid: str, responses: Sequence[Sequence[int]], version: int | None,
                   key: str = "k") -> int:
    """Registers a group of `responses` at `version` (None: an old client) and finishes them all;
    returns the history responses it loaded."""
    _created, loaded = s.register_group(gid, key, [1, 2, 3], 60, len(responses), policy_version=version)
    for i, r in enumerate(responses):
        s.append(gid, f"r{i}", 0, r, finished=True)
    return loaded
