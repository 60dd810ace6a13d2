"""The draft client does only the background work someone uses: no Sync for a group whose every
response generates on this worker, and a longer tick while nothing is proposed."""

from __future__ import annotations

from collections.abc import Callable

from services.common.server import RunningServer
from services.draft.store import DraftStore
from services.worker.draft_client import DraftClient
from tests.draft.draft_helpers import wait_until


def wait(cond: Callable[[], bool]) -> None:
    """The idle tests wait across slowed-down ticks: a longer timeout."""
    wait_until(cond, timeout=10.0)


def test_all_active_group_is_not_synced_until_one_ends(draft_server: tuple[RunningServer, DraftStore]) -> None:
    running, store = draft_server
    a = DraftClient(running.address, sync_interval_s=0.02)
    b = DraftClient(running.address, sync_interval_s=0.02)
    try:
        prompt = [1, 2, 3]
        a.register_group("g", "k", prompt, group_size=2)
        b.register_group("g", "k", prompt, group_size=2)
        a.flush()  # registered, first sync done (history and prompt)
        a.resume("g", "r0", [])
        a.resume("g", "r1", [])
        a.append("g", "r0", 0, [4, 5])
        # A background tick that left the group out started after the resumes, so no tick that
        # still included it is in flight (the background ticks are sequential).
        wait(lambda: a.stats().skipped_group_syncs > 0)
        # Tokens from another worker (say, a late attempt of a third response).
        b.append("g", "rx", 0, [7, 8, 9, 10, 11])
        b.flush()
        assert store.index_of("g").tokens("rx") == [7, 8, 9, 10, 11]
        syncs = a.stats().syncs
        a.flush()
        # Both of the group's responses generate on A: A makes no Sync for it, so rx is not in A's mirror.
        assert a.stats().syncs == syncs
        assert a.propose("g", "r0", [*prompt, 7, 8], 3) is None
        # Our own appends still reach the server.
        wait(lambda: store.index_of("g").tokens("r0") == [4, 5])
        a.end("g", "r1")  # r1's chunk is over here: the group is synced again
        a.flush()
        d = a.propose("g", "r0", [*prompt, 7, 8], 3)
        assert d is not None and d.tokens == (9, 10, 11)
        assert a.stats().syncs > syncs
    finally:
        a.close()
        b.close()


def test_tick_backs_off_while_nothing_is_proposed(draft_server: tuple[RunningServer, DraftStore]) -> None:
    running, store = draft_server
    c = DraftClient(running.address, sync_interval_s=0.02, idle_sync_interval_s=0.16)
    try:
        c.register_group("g", "k", [1, 2], group_size=4)
        c.append("g", "r0", 0, [3, 4, 5])
        wait(lambda: c.tick_interval_s == 0.16)
        # Appends still go out at the idle interval.
        c.append("g", "r0", 3, [6])
        wait(lambda: store.index_of("g").tokens("r0") == [3, 4, 5, 6])
    finally:
        c.close()


def test_interval_doubles_while_idle_and_resets_on_a_proposal() -> None:
    c = DraftClient(None, sync_interval_s=0.05, idle_sync_interval_s=0.3)  # no thread: ticks by hand
    c.register_group("g", "k", [1, 2], group_size=2)
    c.append("g", "r0", 0, [3, 4, 5])
    assert [c._next_interval() for _ in range(4)] == [0.1, 0.2, 0.3, 0.3]
    assert c.propose("g", "r1", [1, 2, 3], 2) is not None
    assert c.tick_interval_s == 0.05  # at once, not only after the next tick
    assert c._next_interval() == 0.05  # a tick with proposals keeps the short interval
    assert c._next_interval() == 0.1
    c.close()


def test_interval_arguments_are_checked() -> None:
    for kw in ({"sync_interval_s": 0.0}, {"sync_interval_s": 0.5, "idle_sync_interval_s": 0.1}):
        try:
            DraftClient(None, **kw)  # type: ignore[arg-type]
        except ValueError as e:
            assert "sync_interval_s" in str(e)
        else:
            raise AssertionError(f"{kw} accepted")
