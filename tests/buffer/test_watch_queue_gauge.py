"""seer_buffer_watch_queue_events: the deepest WatchWork queue, read at scrape time, so an operator
sees a scheduler falling behind before it is dropped at watch_queue_events
(seer_buffer_watch_queue_limit). It rises as events are published to a watcher that does not read,
falls as the watcher drains, and a dropped or closed watcher no longer counts."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.buffer import events
from services.buffer.core import BufferCore
from services.buffer.events import WatchHub
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store

LIMIT = 8


def _gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


def _depth() -> float | None:
    return _gauge("seer_buffer_watch_queue_events")


def _groups(n: int) -> list[GroupSpec]:
    return [GroupSpec(prompt_key=f"p{g}", prompt_token_ids=(1, 2, 3), group_size=1, max_tokens=4,
                      sampling=Sampling(temperature=1.0, seed=g)) for g in range(n)]


@pytest.fixture
def own_hubs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gauges report every open core of the process: these tests see only their own."""
    hubs: weakref.WeakSet[WatchHub] = weakref.WeakSet()
    monkeypatch.setattr(events, "_HUBS", hubs)


@pytest.mark.usefixtures("own_hubs")
def test_gauge_follows_the_deepest_watcher_queue(tmp_path: Path) -> None:
    assert _depth() == 0 and _gauge("seer_buffer_watch_queue_limit") == 0  # no core open
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None),
                      watch_queue_events=LIMIT)
    try:
        assert _depth() == 0 and _gauge("seer_buffer_watch_queue_limit") == LIMIT
        _snap, slow = core.watch("slow")  # never reads until told to
        _snap, fast = core.watch("fast")  # drains after every publish
        assert _depth() == 0
        core.submit_batch("a", _groups(3))
        assert _depth() == 3
        fast.take(100, 0)
        assert _depth() == 3  # the slow one's queue is still full
        core.submit_batch("b", _groups(2))
        fast.take(100, 0)
        assert _depth() == 5  # rises with each publish the slow one does not read
        slow.take(2, 0)
        assert _depth() == 3  # falls as it drains
        slow.take(100, 0)
        assert _depth() == 0

        core.submit_batch("c", _groups(LIMIT))
        fast.take(100, 0)
        assert _depth() == LIMIT  # at the bound: the next publish drops it
        core.submit_batch("d", _groups(3))
        assert slow.dropped and len(core._hub) == 1
        assert _depth() == 3  # the fast one's: the dropped queue is freed and no longer counts
        fast.take(100, 0)
        assert _depth() == 0

        core.submit_batch("e", _groups(4))
        assert _depth() == 4
        core.unwatch(fast)  # a stream that ended: its queue no longer counts
        assert _depth() == 0
        core.unwatch(slow)
    finally:
        core.close()
    # A closed core is no longer reported.
    assert _depth() == 0 and _gauge("seer_buffer_watch_queue_limit") == 0


@pytest.mark.usefixtures("own_hubs")
def test_gauge_takes_the_deepest_of_every_open_core(tmp_path: Path) -> None:
    model = ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None)
    one = BufferCore(Store(tmp_path / "one"), model, watch_queue_events=LIMIT)
    two = BufferCore(Store(tmp_path / "two"), model, watch_queue_events=2 * LIMIT)
    try:
        _snap, w1 = one.watch("w")
        _snap, w2 = two.watch("w")
        one.submit_batch("a", _groups(2))
        two.submit_batch("a", _groups(5))
        assert _depth() == 5 and _gauge("seer_buffer_watch_queue_limit") == 2 * LIMIT
        two.close()
        assert _depth() == 2 and _gauge("seer_buffer_watch_queue_limit") == LIMIT
        one.unwatch(w1)
        two.unwatch(w2)
    finally:
        one.close()
        two.close()
