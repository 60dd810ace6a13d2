"""The worker's embedded DraftClient against a real draft server: mirrors, deltas, restarts."""

from __future__ import annotations

import time

from services.common.server import RunningServer
from services.draft.app import start
from services.draft.config import DraftConfig
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import wait_until


def test_two_workers_share_a_group(draft_server: tuple[RunningServer, DraftStore]) -> None:
    running, store = draft_server
    store.seed_history("key", 0, [[50, 51, 52, 53, 54, 55]])
    a = DraftClient(running.address, sync_interval_s=0.02)
    b = DraftClient(running.address, sync_interval_s=0.02)
    try:
        prompt = [1, 2, 3, 4]
        for c in (a, b):
            c.register_group("g", "key", prompt, group_size=2, ttl_seconds=60)
        # History reaches the mirrors with the first sync.
        wait_until(lambda: a.propose("g", "r0", [*prompt, 50, 51], 4) is not None)
        # Worker A streams r0 in per-step pieces; worker B drafts r1 from them without any RPC per step.
        r0 = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
        for off in range(0, len(r0), 2):
            a.append("g", "r0", off, r0[off : off + 2], finished=off + 2 >= len(r0))
        wait_until(lambda: store.index_of("g").length("r0") == len(r0))
        wait_until(lambda: (d := b.propose("g", "r1", [*prompt, 10, 11, 12], 4)) is not None and d.tokens[0] == 13)
        d = b.propose("g", "r1", [*prompt, 10, 11, 12], 4)
        assert d is not None and d.tokens == (13, 14, 15, 16) and d.parents == (-1, 0, 1, 2)
        tree = b.propose("g", "r1", [*prompt, 10, 11, 12], 4, width=2)
        assert tree is not None
        # Own tokens echoed back by Sync are deduplicated by offset.
        b.append("g", "r1", 0, [10, 11, 12, 99])
        wait_until(lambda: a.propose("g", "r0", [12, 99], 2) is None or store.index_of("g").length("r1") == 4)
        wait_until(lambda: store.index_of("g").length("r1") == 4)
        assert store.index_of("g").tokens("r0") == r0
        assert a.stats().append_errors == 0 and b.stats().sync_errors == 0
    finally:
        a.close()
        b.close()


def test_local_only_client() -> None:
    c = DraftClient(None)
    c.register_group("g", "", [1, 2, 3], group_size=2)
    c.append("g", "r0", 0, [4, 5, 6, 7])
    d = c.propose("g", "r1", [1, 2, 3, 4], 3)
    assert d is not None and d.tokens == (5, 6, 7)
    assert c.propose("unknown", "r1", [1, 2, 3], 3) is None
    c.append("g", "r0", 9, [1])  # a gap is dropped, not raised, on the decode path
    assert c.propose("g", "r1", [1, 2, 3, 4], 3) == d
    c.close()


def test_client_survives_server_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    running, _store = start(DraftConfig(port=0, grace_seconds=0.2))
    port = running.port
    c = DraftClient(f"127.0.0.1:{port}", sync_interval_s=0.02, rpc_timeout_s=1.0)
    try:
        c.register_group("g", "k", [1, 2], group_size=2)
        c.append("g", "r0", 0, [3, 4, 5])
        wait_until(lambda: _store.stats().indexed_tokens >= 3)
        running.stop(0)
        c.append("g", "r0", 3, [6, 7])  # server down: still drafts locally
        d = c.propose("g", "r1", [1, 2, 3], 2)
        assert d is not None and d.tokens == (4, 5)
        running2, store2 = start(DraftConfig(port=port, grace_seconds=0.2))
        try:
            # The new server lost the group: the client re-registers it and resends its own tokens.
            wait_until(lambda: "g" in {*store2._groups} and store2.index_of("g").tokens("r0") == [3, 4, 5, 6, 7],
                  timeout=10)
        finally:
            running2.stop(0)
    finally:
        c.close()


def test_a_follower_client_keeps_its_appends_local(draft_server: tuple[RunningServer, DraftStore]) -> None:
    """The worker's client is the one writer of its requests on the server: the plugin's (a
    follower) resumes and appends locally only, so its truncates never cut the worker's appends."""
    running, store = draft_server
    worker = DraftClient(running.address, sync_interval_s=0.02)
    plugin = DraftClient(running.address, sync_interval_s=0.02, follower=True)
    try:
        for c in (worker, plugin):
            c.register_group("g", "key", (1, 2, 3), group_size=2, ttl_seconds=60)
        wait_until(lambda: store.stats().groups == 1)
        worker.resume("g", "r", [], epoch=5)
        worker.append("g", "r", 0, [10, 11, 12])
        wait_until(lambda: store.index_of("g").length("r") == 3)
        plugin.resume("g", "r", [])  # what the plugin does when it first sees the attempt
        plugin.append("g", "r", 0, [10])
        plugin.append("g", "s", 0, [30, 31])  # even a response the worker never sent
        worker.append("g", "r", 3, [13])
        wait_until(lambda: store.index_of("g").length("r") == 4)
        time.sleep(0.2)  # several of the follower's ticks
        assert store.index_of("g").tokens("r") == [10, 11, 12, 13]
        assert store.index_of("g").length("s") == 0
        # It still syncs: the sibling's tokens reach its mirror.
        worker.append("g", "t", 0, [40, 41, 42])
        wait_until(lambda: (d := plugin.propose("g", "x", [40, 41], 2)) is not None and d.tokens[0] == 42)
    finally:
        worker.close()
        plugin.close()
