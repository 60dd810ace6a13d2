"""The worker's DraftClient against a real draft server under faults: late messages of abandoned
attempts, server restarts with another worker first, expired groups, transient errors in the
one-by-one resend, oversized Sync replies. Background ticks are stopped; flush() drives them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
from tests.draft.draft_helpers import DraftServer, finish, manual, register, restart


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
        running, store = restart(running)  # the draft server restarts and loses everything
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
        register((c,), group_size=2)
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
    # ~210 KB a mirror of 500 tokens (GroupIndex.memory_bytes): the busy one and one idle one fit.
    c = DraftClient(None, memory_budget_bytes=500_000)
    try:
        c.register_group("busy", "", [1, 2, 3], group_size=2)
        c.resume("busy", "r", [], epoch=1)
        c.append("busy", "r", 0, list(range(100, 600)))
        for i in range(10):
            c.register_group(f"idle{i}", "", [1, 2, 3], group_size=2)
            c.append(f"idle{i}", "x", 0, list(range(1000 + i, 1500 + i)))
        c.register_group("last", "", [1, 2, 3], group_size=2)
        st = c.stats()
        assert st.memory_bytes <= 500_000 and st.evicted_mirrors > 0
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
        register((a,), group_size=1)
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
    a = manual(running.address)
    try:
        register((a,), group_size=2)
        for rid, toks in (("r1", [10, 11]), ("r2", [20, 21, 22])):
            finish(a, rid, toks, epoch=1)
        a.flush()
        assert store.stats().history_keys == 1
        running, store = restart(running)
        for _ in range(3):
            a.flush()
        assert store.stats().groups == 0 and store.stats().history_keys == 0
        assert not a.has_group("g")
    finally:
        a.close()
        running.stop(0.2)


@contextmanager
def two_workers(group_size: int) -> Iterator[tuple[DraftServer, DraftClient, DraftClient]]:
    """Workers A and B (manual clients) with group "g" (prompt key "key") registered on both."""
    srv = DraftServer()
    a, b = manual(srv.address), manual(srv.address)
    try:
        register((a, b), group_size=group_size)
        yield srv, a, b
    finally:
        a.close()
        b.close()
        srv.stop()


def test_a_finish_cut_back_elsewhere_is_not_resent_as_finished_after_a_restart() -> None:
    """Worker A finished r1, but its last chunk was not committed: worker B resumed r1 from the
    committed output and cut it back. A's mirror kept its own "finished" flag; after a restart A
    re-created the group and resent r1 as finished at B's partial length, completing the group
    early with a partial response promoted to history (review, session 18)."""
    with two_workers(group_size=3) as (srv, a, b):
        for rid, toks in (("r0", [10, 11, 12]), ("r1", [20, 21, 22, 23, 24])):
            finish(a, rid, toks, epoch=1)
        a.flush()
        b.resume("g", "r1", [20, 21, 22], epoch=2)  # re-dispatched from the committed output
        b.append("g", "r1", 3, [30])
        b.flush()
        a.flush()  # A's mirror follows B's copy of r1 (unfinished)
        assert a._groups["g"].index.tokens("r1") == [20, 21, 22, 30]
        a.resume("g", "r2", [], epoch=1)
        a.append("g", "r2", 0, [40, 41])
        a.flush()
        srv.restart()
        for _ in range(2):
            a.flush()  # A notices first (r2 runs here): re-creates the group and resends what it holds
        a.append("g", "r2", 2, [42], finished=True)
        a.end("g", "r2")
        a.flush()
        assert srv.store.index_of("g").tokens("r1") == [20, 21, 22, 30]
        assert srv.store.stats().history_keys == 0  # r1 is not finished: B still runs it
        b.append("g", "r1", 4, [31, 32], finished=True)
        for _ in range(3):
            b.flush()
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12), (20, 21, 22, 30, 31, 32), (40, 41, 42)]


def test_a_finish_re_opened_elsewhere_without_a_cut_is_not_resent_as_finished() -> None:
    """The same when the newer attempt resumes from all of the finished response (its truncate
    cuts nothing, only re-opens it): the server logged nothing then, so the mirrors never learnt."""
    with two_workers(group_size=2) as (srv, a, b):
        finish(a, "r0", [10, 11, 12], epoch=1)
        a.flush()
        b.resume("g", "r0", [10, 11, 12], epoch=2)  # re-opened, not a token changed
        b.flush()
        a.resume("g", "r1", [], epoch=1)
        a.append("g", "r1", 0, [20])
        a.flush()
        srv.restart()
        for _ in range(2):
            a.flush()
        a.append("g", "r1", 1, [21], finished=True)
        a.end("g", "r1")
        a.flush()
        assert srv.store.stats().history_keys == 0  # r0 is B's now, and unfinished
        b.append("g", "r0", 3, [13], finished=True)
        for _ in range(3):
            b.flush()
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12, 13), (20, 21)]


def test_a_split_group_that_completed_is_not_completed_again_after_a_restart() -> None:
    """A group split over two workers completed; after a restart each worker re-created it with
    its own finished response and it completed a second time (review, session 18). Each worker
    saw the group complete (its own acknowledged finish, the other's through Sync): released."""
    with two_workers(group_size=2) as (srv, a, b):
        finish(a, "r0", [10, 11, 12], epoch=1)
        a.flush()
        finish(b, "r1", [20, 21], epoch=1)
        b.flush()
        a.flush()
        assert srv.store.stats().history_keys == 1
        srv.restart()
        for _ in range(3):
            a.flush()
            b.flush()
        assert srv.store.stats().groups == 0 and srv.store.stats().history_keys == 0
        assert not a.has_group("g") and not b.has_group("g")


def test_responses_refilled_from_the_buffer_are_not_promoted_again() -> None:
    """The server-side guard of the same: both workers' finishes were acknowledged but neither saw
    the other's before the restart, so both re-create the group; the restarted server refilled the
    key's history from the buffer with these very responses. History holds them once."""
    with two_workers(group_size=2) as (srv, a, b):
        a.append("g", "r0", 0, [10, 11, 12], finished=True)
        b.append("g", "r1", 0, [20, 21], finished=True)
        a._tick_appends_only()
        b._tick_appends_only()  # the group completes; no Sync tells either worker so
        assert srv.store._history.responses("key") == [(10, 11, 12), (20, 21)]
        srv.restart()
        srv.store.seed_history("key", 0, [[20, 21], [10, 11, 12]])  # the buffer's copy, in its order
        for _ in range(3):
            a.flush()
            b.flush()
        assert srv.store.index_of("g").tokens("r1") == [20, 21]  # re-created and completed ...
        assert sorted(srv.store._history.responses("key")) == [(10, 11, 12), (20, 21)]  # ... promoted once


@pytest.mark.parametrize("released", [False, True])
def test_a_restart_before_the_last_finishing_append_is_sent_still_completes_the_group(released: bool) -> None:
    """The worker ran the whole group; the server restarted while its last finishing append was
    still queued. The client released the mirror (every response finished here) and the append
    was never resent: the group never reached history (review, session 18). Also when the worker
    had released the group itself before the tick (its queued appends are still owed)."""
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    a = manual(running.address)
    try:
        register((a,), group_size=2)
        finish(a, "r0", [10, 11, 12], epoch=1)
        a.flush()
        a.resume("g", "r1", [], epoch=1)
        a.append("g", "r1", 0, [20, 21])
        a.flush()
        a.append("g", "r1", 2, [22], finished=True)  # queued ...
        a.end("g", "r1")
        if released:
            a.release_group("g")
        running, store = restart(running)  # ... when the server restarts
        for _ in range(4):
            a.flush()
        assert sorted(store._history.responses("key")) == [(10, 11, 12), (20, 21, 22)]
        if released:
            assert not a.has_group("g") and a.stats().groups == 0
    finally:
        a.close()
        running.stop(0.2)


def test_a_request_that_ends_here_follows_what_another_worker_wrote_while_it_ran() -> None:
    """Sync deltas for a request running here are skipped (our copy is the truth while it runs);
    when its chunk here ends after another worker took it over, the skipped ones were never
    replayed and the mirror kept the abandoned attempt's copy (review, session 18)."""
    with two_workers(group_size=2) as (srv, a, b):
        a.resume("g", "r", [], epoch=1)
        a.append("g", "r", 0, [10, 11, 12, 13])
        a.flush()
        b.resume("g", "r", [10, 11], epoch=2)  # A's attempt was given up on; B runs the request now
        b.append("g", "r", 2, [20, 21, 22])
        b.flush()
        a.flush()
        assert a.own_length("g", "r") == 4  # still running on A: its own copy
        a.end("g", "r")
        a.flush()
        assert a._groups["g"].index.tokens("r") == [10, 11, 20, 21, 22]
        b.append("g", "r", 5, [23], finished=True)
        b.flush()
        a.flush()
        assert a._groups["g"].index.tokens("r") == srv.store.index_of("g").tokens("r") == [10, 11, 20, 21, 22, 23]


def test_a_group_id_used_again_after_its_group_completed_starts_a_new_incarnation() -> None:
    """A batch id resubmitted after the buffer's retention deleted it brings the same group ids. The
    server refused to register a completed group's id again (evicted or expired: FAILED_PRECONDITION;
    still here with another prompt: ALREADY_EXISTS), so those groups drafted nothing (review,
    session 18). The old incarnation's responses are history already: a fresh one starts."""
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    a, b = manual(running.address), manual(running.address)
    try:
        a.register_group("g", "key", [1, 2, 3], group_size=1, ttl_seconds=60)
        a.register_group("h", "kh", [4, 5, 6], group_size=1, ttl_seconds=60)
        a.flush()
        for gid in ("g", "h"):
            a.resume(gid, "r0", [], epoch=1)
            a.append(gid, "r0", 0, [10, 11, 12], finished=True)
            a.end(gid, "r0")
        a.flush()
        assert store.stats().history_keys == 2
        assert not a.has_group("g")  # completed: no mirror for new work (the worker registers it again)
        g_incarnation = a._groups["g"].incarnation
        # g expires; h (still here) comes back with another prompt on worker B.
        store._groups["g"].expires_at = 0.0
        store.expire_now()
        b.register_group("h", "kh", [7, 8, 9], group_size=1, ttl_seconds=60)
        b.flush()
        assert store.index_of("h").prompt == (7, 8, 9)
        b.resume("h", "r0", [], epoch=1)
        b.append("h", "r0", 0, [60, 61], finished=True)
        b.end("h", "r0")
        b.flush()
        assert store._history.responses("kh") == [(60, 61), (10, 11, 12)]  # the new iteration first
        # g, with the same prompt, on worker A, which still mirrors the completed old incarnation.
        register((a,), group_size=1)
        assert a.has_group("g") and a._groups["g"].incarnation not in (0, g_incarnation)
        finish(a, "r0", [50, 51], epoch=1)
        a.flush()
        assert store._history.responses("key") == [(50, 51), (10, 11, 12)]
        a.flush()
        assert "h" not in a._groups  # A's mirror of the old h (completed) gave way, nothing resent
        assert store.index_of("h").tokens("r0") == [60, 61]
    finally:
        a.close()
        b.close()
        running.stop(0.2)


def test_a_retried_registration_of_a_live_group_is_idempotent(
        draft_server: tuple[RunningServer, DraftStore], draft_stub: Any) -> None:
    """Only a completed group's id starts over; the same registration again (a retry, a second
    worker) keeps the live group, completed or not, and another prompt for a group still running
    is ALREADY_EXISTS."""
    from seer.v1 import draft_pb2

    _running, store = draft_server
    req = draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="key", prompt_token_ids=[1, 2, 3],
                                         ttl_seconds=60, group_size=1)
    assert draft_stub.RegisterGroup(req).created
    incarnation = store._groups["g"].incarnation
    assert not draft_stub.RegisterGroup(req).created
    other = draft_pb2.RegisterGroupRequest(group_id="g", prompt_key="key", prompt_token_ids=[9], group_size=1)
    with pytest.raises(grpc.RpcError) as e:
        draft_stub.RegisterGroup(other)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    store.append("g", "r0", 0, [10, 11], finished=True)  # completed
    assert not draft_stub.RegisterGroup(req).created
    assert store._groups["g"].incarnation == incarnation
    assert store._history.responses("key") == [(10, 11)]
