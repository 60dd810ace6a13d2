"""Work-feed fan-out: each WatchWork stream owns a queue; the core publishes under its lock.

Subscribing takes the snapshot and registers the queue under the same lock as publishing, so a
watcher sees every request exactly once: in the snapshot or as a later event.

A stream sends work items in batches (`batches`, `coalesce`): one gRPC stream message per item cost
about 200 us per item, most of a 2,048-request snapshot's time.

Each queue is bounded (`max_events`, the buffer's watch_queue_events): the core publishes without
waiting for anyone, so a watcher that stops reading (a hung scheduler whose TCP window is full)
would otherwise grow the buffer's memory without bound. A publish that would take a queue past the
bound drops that watcher instead: its queue is freed at once, it leaves the hub, and its stream ends
RESOURCE_EXHAUSTED (`Subscription.take` raises WatcherDropped; the server also ends a stream that is
blocked sending, through the drop callback). The core publishes under its lock, so `publish` only
marks and removes the dropped watchers and hands their callbacks back: the core runs them after it
released its lock (`run_drop_callbacks`), as ending a gRPC stream is a call into gRPC that must not
hold up every other call of the buffer (nor deadlock should gRPC call back). Nothing is lost: the
queue only ever holds a copy of the core's state, and a watcher that watches again gets it whole in
the snapshot (the scheduler reconnects on any error of the feed and replaces its state with the
snapshot).

How full the queues are is a gauge read at scrape time (`seer_buffer_watch_queue_events`: the
deepest queue of the open hubs), so a watcher falling behind shows before it is dropped, at no cost
to publishing.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from services.buffer import metrics
from services.common.errors import ResourceExhausted
from services.common.log import get_logger, kv

log = get_logger(__name__)

# Limits of one WatchWork message: items, and token ids (prompt + output: ~1 MiB encoded). A single
# item over the token limit still goes alone (its context is bounded by the model's).
FEED_BATCH_ITEMS = 512
FEED_BATCH_TOKENS = 1 << 18


def default_watch_queue(max_requests_per_batch: int) -> int:
    """Events one watcher may have queued unless BufferConfig.watch_queue_events says otherwise: 4
    of the largest batches. A SubmitBatch publishes all its requests at once, and a watcher must
    never be dropped for one batch (it would be dropped again after every reconnect); 4 such batches
    of backlog is ~10 s at the feed's ~24,000 items/s. A queued event costs ~620 bytes (its
    WorkItem; the prompt array is the group's, shared): ~160 MiB at the default 65,536 requests a
    batch for a watcher that stopped reading, plus the prompts of finished groups it keeps alive."""
    return 4 * max_requests_per_batch


@dataclass(frozen=True)
class Added:
    item: Any  # core.WorkItem


@dataclass(frozen=True)
class Cancelled:
    request_id: str


Event = Added | Cancelled


def batches(items: Iterable[Any], max_items: int = FEED_BATCH_ITEMS, max_tokens: int = FEED_BATCH_TOKENS
            ) -> Iterator[list[Any]]:
    """core.WorkItems in order, cut into messages of at most max_items and max_tokens token ids
    (prompt, output and stop tokens: each item repeats its group's stop tokens)."""
    batch: list[Any] = []
    tokens = 0
    for it in items:
        n = len(it.prompt_token_ids) + len(it.output_token_ids) + len(it.sampling.stop_token_ids)
        if batch and (len(batch) >= max_items or tokens + n > max_tokens):
            yield batch
            batch, tokens = [], 0
        batch.append(it)
        tokens += n
    if batch:
        yield batch


def coalesce(events: Sequence[Event]) -> Iterator[list[Any] | Cancelled]:
    """Queued events as stream messages, order kept: runs of Added become item batches."""
    run: list[Any] = []
    for e in events:
        if isinstance(e, Added):
            run.append(e.item)
            continue
        yield from batches(run)
        run = []
        yield e
    yield from batches(run)


class WatcherDropped(ResourceExhausted):
    """A watcher fell too far behind: its queue was freed and its stream must end."""


class Subscription:
    """One watcher's queue of events, at most `max_events` long.

    Not a queue.Queue: on overflow the whole backlog is dropped at once, and the stream takes what is
    queued in one step (one message carries many events)."""

    def __init__(self, hub: WatchHub, watcher_id: str, max_events: int, peer: str = "") -> None:
        self.watcher_id = watcher_id
        self.peer = peer
        self.max_events = max_events
        self.peak = 0  # the most events ever queued at once (logged on a drop; tests check the bound)
        self._events: deque[Event] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._dropped: str | None = None  # why, once dropped
        self._closed = False  # the stream ended: a publish that raced with it queues nothing
        self._on_drop: Callable[[str], None] | None = None
        self._hub = hub

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)

    @property
    def dropped(self) -> bool:
        with self._cond:
            return self._dropped is not None

    @property
    def closed(self) -> bool:
        """Whether its stream ended (close(): the server does it when the handler returns)."""
        with self._cond:
            return self._closed

    def offer(self, events: Sequence[Event]) -> str | None:
        """Queues events, or, when they do not fit, frees the queue, marks the watcher dropped and
        returns why (the caller removes it from the hub). Never blocks on the reader."""
        with self._cond:
            if self._dropped is not None or self._closed:
                return None  # already dropped (the hub removes it once), or gone
            if len(self._events) + len(events) <= self.max_events:
                self._events.extend(events)
                self.peak = max(self.peak, len(self._events))
                self._cond.notify()
                return None
            queued = len(self._events)
            # Freed now, not when the stream's thread wakes: that thread may be blocked sending to
            # the very client that stopped reading.
            self._events.clear()
            self._dropped = (
                f"WatchWork watcher {self.watcher_id!r} fell behind: {queued} events queued and {len(events)} "
                f"more would pass watch_queue_events {self.max_events}; its stream is dropped and its queue "
                "freed. Nothing is lost: watch again for a fresh snapshot")
            self._cond.notify_all()
            return self._dropped

    def take(self, max_events: int, timeout: float) -> list[Event]:
        """Up to max_events queued events, oldest first, waiting up to timeout for the first (an
        empty list when none came). Raises WatcherDropped once the watcher was dropped."""
        with self._cond:
            if not self._events and self._dropped is None:
                self._cond.wait(timeout)
            if self._dropped is not None:
                raise WatcherDropped(self._dropped, field="watch_queue_events")
            n = min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(n)]

    def on_drop(self, callback: Callable[[str], None]) -> None:
        """Calls callback(reason) when the watcher is dropped (at once if it already was): the
        server ends a stream whose thread may be blocked sending, and so cannot see the drop itself.
        It runs on the publishing thread after the core released its lock (WatchHub.publish hands it
        back), so a slow one delays only the call whose publish dropped the watcher."""
        with self._cond:
            reason = self._dropped
            if reason is None:
                self._on_drop = callback
                return
        callback(reason)

    def _fire_drop(self, reason: str) -> None:
        with self._cond:
            callback, self._on_drop = self._on_drop, None
        if callback is not None:
            callback(reason)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._events.clear()
            self._on_drop = None  # it holds the stream's context
        self._hub.remove(self)


class WatchHub:
    """The watchers of the work feed. Publishing never waits for one: each has its own bounded
    queue, and one a publish does not fit is dropped (removed, counted, logged, its stream ended)."""

    def __init__(self, max_queued_events: int) -> None:
        if max_queued_events < 1:
            raise ValueError(f"max_queued_events: must be >= 1, got {max_queued_events}")
        self.max_queued_events = max_queued_events
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        with _HUBS_LOCK:
            _HUBS.add(self)  # reported by the queue gauges until close()

    def close(self) -> None:
        """Stops reporting this hub's queues (its core closed; its watchers' streams end)."""
        with _HUBS_LOCK:
            _HUBS.discard(self)

    def deepest(self) -> int:
        """Events queued for the watcher furthest behind (0 without watchers). O(watchers): for a
        scrape, not for every publish."""
        with self._lock:
            subs = list(self._subs)
        return max((len(s) for s in subs), default=0)

    def add(self, watcher_id: str, peer: str = "") -> Subscription:
        sub = Subscription(self, watcher_id, self.max_queued_events, peer)
        with self._lock:
            self._subs.add(sub)
        return sub

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, events: list[Event]) -> list[DropCallback]:
        """Queues events for every watcher; drops the watchers they do not fit (never waits).

        Returns the drop callbacks still to run (one per watcher dropped): the caller runs them with
        run_drop_callbacks once it no longer holds its lock. A dropped watcher is already out of the
        hub and its queue freed; only the news of it (ending its stream) is deferred."""
        with self._lock:
            subs = list(self._subs)
        pending: list[DropCallback] = []
        for s in subs:
            reason = s.offer(events)
            if reason is not None:
                self._drop(s, reason)
                pending.append(functools.partial(s._fire_drop, reason))
        return pending

    def _drop(self, sub: Subscription, reason: str) -> None:
        self.remove(sub)
        metrics.WATCHERS_DROPPED.inc()
        metrics.WATCHERS.set(len(self))
        log.warning("watcher dropped: its work-feed queue is full", extra=kv(
            watcher_id=sub.watcher_id, peer=sub.peer, watch_queue_events=sub.max_events, peak=sub.peak,
            error=reason))

    def __len__(self) -> int:
        with self._lock:
            return len(self._subs)


# A dropped watcher's drop callback, bound to its reason (WatchHub.publish returns them).
DropCallback = Callable[[], None]


def run_drop_callbacks(pending: Sequence[DropCallback]) -> None:
    """Runs what WatchHub.publish returned; the caller must not hold the core's lock. One that fails
    is logged and the others still run: the publish they came from (a submission, a cancel) is
    already stored and must not be reported failed for it."""
    for fire in pending:
        try:
            fire()
        except Exception as e:
            log.error("a dropped watcher's callback failed", extra=kv(error=f"{type(e).__name__}: {e}"))


# The open hubs (one per BufferCore; more only in tests), for the gauges below. Weak, so a core
# dropped without close() is not kept alive by its metrics.
_HUBS: weakref.WeakSet[WatchHub] = weakref.WeakSet()
_HUBS_LOCK = threading.Lock()


def _open_hubs() -> list[WatchHub]:
    with _HUBS_LOCK:
        return list(_HUBS)


def _deepest_queue() -> float:
    # Reads the module global at each call: tests may swap in their own set of hubs.
    return float(max((h.deepest() for h in _open_hubs()), default=0))


def _queue_limit() -> float:
    return float(max((h.max_queued_events for h in _open_hubs()), default=0))


# Computed at scrape time: a scrape (every few seconds) visits every watcher once, while a gauge set
# on the publishing path would need every queue's depth at each publish (the deepest may be another
# watcher's) and again at each drain, on the stream threads.
metrics.WATCH_QUEUE_EVENTS.set_function(_deepest_queue)
metrics.WATCH_QUEUE_LIMIT.set_function(_queue_limit)
