"""The worker's DraftClient against a real draft server under faults: late messages of abandoned
attempts, server restarts with another worker first, expired groups, transient errors in the
one-by-one resend, oversized Sync replies. Background ticks are stopped; flush() drives them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import services.common.grpcutil as grpcutil
import services.common.server as common_server
from services.common.server import RunningServer
from services.draft.app import start
from services.draft.config import DraftConfig
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient


def manual(address: str) -> DraftClient:
    c = DraftClient(address, sync_interval_s=3600)
    c._stop.set()
    c._wake.set()
    assert c._thread is not None
    c._thread.join()
    return c


def test_late_flush_of_an_abandoned_attempt_does_not_overwrite_the_new_one() -> None:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    a, b = manual(running.address), manual(running.address)
    try:
        for c in (a, b):
            c.register_group("g", "", [1, 2, 3], group_size=4, ttl_seconds=60)
        a.flush()
        b.flush()
        a.resume("g", "r", [], epoch=100)
        a.append("g", "r", 0, [10, 11, 12])
        a.flush()
        a.append("g", "r", 3, [13, 14])  # queued; worker A is slow ...
        a.end("g", "r")  # ... and its attempt was abandoned
        b.resume("g", "r", [10, 11, 12], epoch=200)  # re-dispatched from the committed output
        b.append("g", "r", 3, [23, 24])
        b.append("g", "r", 5, [25])
        b.flush()
        a.flush()  # A's late flush: refused as an older attempt's
        assert a.stats().stale_messages == 1
        b.append("g", "r", 6, [26])
        b.flush()
        assert store.index_of("g").tokens("r") == [10, 11, 12, 23, 24, 25, 26]
        assert b.stats().append_errors == 0
        a.flush()  # A's mirror follows the server again (the request is no longer active there)
        assert a._groups["g"].index.tokens("r") == [10, 11, 12, 23, 24, 25, 26]
    finally:
        a.close()
        b.close()
        running.stop(0.2)


def test_resume_is_atomic_with_respect_to_sync() -> None:
    """A Sync must not land between resume's truncate and the request becoming active: it would put
    a failed attempt's tokens back into the request's own copy, which it would then draft from."""
    running, _store = start(DraftConfig(port=0, grace_seconds=0.2))
    stale = manual(running.address)
    c = manual(running.address)
    try:
        for x in (stale, c):
            x.register_group("g", "", [1, 2, 3], group_size=4, ttl_seconds=60)
        stale.append("g", "r", 0, [4, 5])
        stale.flush()
        c.flush()
        stale.append("g", "r", 2, [40, 41, 42])  # a failed attempt elsewhere streamed more
        stale.flush()
        racer: list[threading.Thread] = []
        original = c._append_locked

        def racing_append(*args: Any) -> None:
            original(*args)
            # The background thread's Sync, started right after the truncate: it must wait.
            t = threading.Thread(target=c._sync)
            t.start()
            t.join(0.3)
            racer.append(t)

        c._append_locked = racing_append  # type: ignore[method-assign,assignment]
        c.resume("g", "r", [4, 5])
        c._append_locked = original  # type: ignore[method-assign]
        racer[0].join(5)
        assert c.own_length("g", "r") == 2
        d = c.propose("g", "r", [1, 2, 3, 4, 5], 4)
        assert d is None or 40 not in d.tokens
    finally:
        stale.close()
        c.close()
        running.stop(0.2)


def test_server_restart_with_another_worker_first_recovers_our_tokens() -> None:
    running, _store = start(DraftConfig(port=0, grace_seconds=0.2))
    port = running.port
    a, b = manual(running.address), manual(running.address)
    try:
        for c in (a, b):
            c.register_group("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60)
        a.resume("g", "ra", [], epoch=1)
        a.append("g", "ra", 0, [10, 11, 12, 13, 14])
        b.resume("g", "rb", [], epoch=1)
        b.append("g", "rb", 0, [20, 21])
        a.flush()
        b.flush()
        a.flush()
        running.stop(0.2)  # the draft server restarts and loses everything
        running, store = start(DraftConfig(port=port, grace_seconds=0.2))
        b.append("g", "rb", 2, [22, 23])
        b.flush()
        b.flush()  # B notices first: re-registers and resends its response
        a.append("g", "ra", 5, [15, 16])
        for _ in range(4):
            a.flush()
        assert store.index_of("g").tokens("ra") == [10, 11, 12, 13, 14, 15, 16]
        assert store.index_of("g").tokens("rb") == [20, 21, 22, 23]
        assert a._groups["g"].index.tokens("rb") == [20, 21, 22, 23]
        assert a._groups["g"].index.num_history == store.index_of("g").num_history
    finally:
        a.close()
        b.close()
        running.stop(0.2)


def test_expired_completed_group_is_released_not_recreated() -> None:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    a = manual(running.address)
    try:
        a.register_group("g", "key", [1, 2, 3], group_size=1, ttl_seconds=1)
        a.append("g", "r0", 0, [10, 11, 12, 13], finished=True)
        a.flush()
        assert store._history.responses("key") == [(10, 11, 12, 13)]
        store._clock = lambda: 1e12  # type: ignore[method-assign]  # far past the TTL
        assert store.expire_now() == 0
        for _ in range(3):
            a.flush()
        assert not a.has_group("g")
        assert store.stats().groups == 0
        assert store._history.responses("key") == [(10, 11, 12, 13)]  # one iteration, not two
    finally:
        a.close()
        running.stop(0.2)


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details or self._code.name


class _FlakyStub:
    """The real stub, with scripted failures of chosen Append calls (glue test of the retry paths)."""

    def __init__(self, real: Any, script: dict[int, Any]) -> None:
        self.real, self.script, self.calls = real, script, 0

    def Append(self, it: Iterator[Any], timeout: float | None = None) -> Any:
        msgs = list(it)
        self.calls += 1
        err = self.script.get(self.calls)
        if err == "batch-invalid":
            raise _Err(grpc.StatusCode.INVALID_ARGUMENT, "messages[0].offset: bad")
        if err is not None:
            raise _Err(err)
        return self.real.Append(iter(msgs), timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_transient_error_while_resending_one_by_one_keeps_the_message() -> None:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    c = manual(running.address)
    try:
        c.register_group("g", "", [1, 2, 3], group_size=2, ttl_seconds=60)
        c.flush()
        # Call 1: the batch is refused (another message in it is bad); call 3 (x alone): UNAVAILABLE.
        c._stub = _FlakyStub(c._stub, {1: "batch-invalid", 3: grpc.StatusCode.UNAVAILABLE})  # type: ignore[assignment]
        c.append("g", "w", 0, [9, 9])
        c.append("g", "x", 0, [10, 11, 12])
        c.flush()
        c.append("g", "x", 3, [13, 14])
        for _ in range(3):
            c.flush()
        assert store.index_of("g").tokens("x") == [10, 11, 12, 13, 14]
    finally:
        c.close()
        running.stop(0.2)


def test_gap_on_the_server_is_healed_by_resending_the_whole_response() -> None:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    c = manual(running.address)
    try:
        c.register_group("g", "", [1, 2, 3], group_size=2, ttl_seconds=60)
        c.flush()
        c.append("g", "x", 0, [10, 11, 12])
        with c._lock:
            c._pending.clear()  # lost (e.g. dropped past the queue limit)
        c.append("g", "x", 3, [13])
        c.flush()  # a gap on the server ...
        c.flush()  # ... answered by sending the whole response
        assert store.index_of("g").tokens("x") == [10, 11, 12, 13]
    finally:
        c.close()
        running.stop(0.2)


@pytest.fixture
def small_messages(monkeypatch: pytest.MonkeyPatch) -> int:
    """gRPC message limit scaled down (64 MiB -> 1 MiB) so an oversized reply is cheap to build."""
    limit = 1 << 20
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", limit)
    opts = list(grpcutil.CHANNEL_OPTIONS)
    opts[:2] = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    monkeypatch.setattr(grpcutil, "CHANNEL_OPTIONS", opts)
    return limit


def test_oversized_sync_reply_is_split(small_messages: int) -> None:
    running, _store = start(DraftConfig(port=0, grace_seconds=0.2))
    a, b = manual(running.address), manual(running.address)
    try:
        for i in range(8):  # 8 groups x 50K tokens: ~1.2 MB of deltas from watermark 0
            b.register_group(f"g{i}", "", [1, 2, 3], group_size=2, ttl_seconds=60)
            b.append(f"g{i}", "rb", 0, list(range(100_000, 150_000)))
            a.register_group(f"g{i}", "", [1, 2, 3], group_size=2, ttl_seconds=60)
        b.register_group("small", "", [1, 2, 3], group_size=2, ttl_seconds=60)
        b.append("small", "rb", 0, [7, 8, 9])
        b.flush()
        a.register_group("small", "", [1, 2, 3], group_size=2, ttl_seconds=60)
        a.flush()
        assert a.own_length("small", "rb") == 3
        assert a.own_length("g0", "rb") == 50_000
    finally:
        a.close()
        b.close()
        running.stop(0.2)


def test_sync_reply_for_a_released_and_reregistered_group_is_not_applied() -> None:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    store.seed_history("key", 0, [[50, 51, 52]])
    c = manual(running.address)
    try:
        c.register_group("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60)
        c.flush()
        real: Any = c._stub

        class Racing:
            def Sync(self, req: Any, timeout: float | None = None) -> Any:
                out = real.Sync(req, timeout=timeout)
                c.release_group("g")  # meanwhile the worker released the group and started it again
                c.register_group("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60)
                return out

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        c._stub = Racing()  # type: ignore[assignment]
        with c._lock:
            c._groups["g"].registered = True  # skip RegisterGroup: only the Sync races
        c._sync()
        c._stub = real
        fresh = c._groups["g"]
        assert fresh.watermark == 0 and not fresh.history_loaded  # the old mirror's reply was dropped
        c.flush()
        assert c._groups["g"].index.num_history == 1  # the fresh mirror loads the history itself
    finally:
        c.close()
        running.stop(0.2)


def test_mirrors_stay_within_their_memory_budget() -> None:
    """Idle mirrors (nothing running here, nothing unsent) are released least recently used first;
    a group with a chunk running is never released."""
    c = DraftClient(None, memory_budget_bytes=200_000)
    try:
        c.register_group("busy", "", [1, 2, 3], group_size=2)
        c.resume("busy", "r", [], epoch=1)
        c.append("busy", "r", 0, list(range(100, 600)))
        for i in range(10):
            c.register_group(f"idle{i}", "", [1, 2, 3], group_size=2)
            c.append(f"idle{i}", "x", 0, list(range(1000 + i, 1500 + i)))
        c.register_group("last", "", [1, 2, 3], group_size=2)
        st = c.stats()
        assert st.memory_bytes <= 200_000 and st.evicted_mirrors > 0
        assert c.has_group("busy") and c.has_group("last") and not c.has_group("idle0")
    finally:
        c.close()


def test_a_released_group_still_sends_its_queued_appends(draft_server: tuple[RunningServer, DraftStore]) -> None:
    """The worker releases idle mirrors (its LRU of groups); the last queued append of a response
    may be its finish, without which the group never completes on the server nor becomes history
    (review, session 17: release_group dropped them)."""
    running, store = draft_server
    a = manual(running.address)
    try:
        a.register_group("g", "key", [1, 2, 3], group_size=1, ttl_seconds=60)
        a.flush()
        a.resume("g", "r", [], epoch=1)
        a.append("g", "r", 0, [10, 11, 12])
        a.flush()
        a.append("g", "r", 3, [13, 14], finished=True)  # the response's last step
        a.end("g", "r")
        a.release_group("g")  # before the next tick
        a.flush()
        assert store.index_of("g").tokens("r") == [10, 11, 12, 13, 14]
        assert store.stats().history_keys == 1  # completed: its response is history for "key"
    finally:
        a.close()


def test_a_group_completed_here_is_not_re_created_on_a_restarted_server() -> None:
    """A restarted server has no tombstones: a worker that still mirrors a group whose every
    response finished here re-created it, resent them, and the group completed again, promoting
    the same responses to history a second time (review, session 17). It releases the mirror."""
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    port = running.port
    a = manual(running.address)
    try:
        a.register_group("g", "key", [1, 2, 3], group_size=2, ttl_seconds=60)
        a.flush()
        for rid, toks in (("r1", [10, 11]), ("r2", [20, 21, 22])):
            a.resume("g", rid, [], epoch=1)
            a.append("g", rid, 0, toks, finished=True)
            a.end("g", rid)
        a.flush()
        assert store.stats().history_keys == 1
        running.stop(0.2)
        running, store = start(DraftConfig(port=port, grace_seconds=0.2))
        for _ in range(3):
            a.flush()
        assert store.stats().groups == 0 and store.stats().history_keys == 0
        assert not a.has_group("g")
    finally:
        a.close()
        running.stop(0.2)
