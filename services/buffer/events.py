"""Work-feed fan-out: each WatchWork stream owns a queue; the core publishes under its lock.

Subscribing takes the snapshot and registers the queue under the same lock as publishing, so a
watcher sees every request exactly once: in the snapshot or as a later event.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Added:
    item: Any  # core.WorkItem


@dataclass(frozen=True)
class Cancelled:
    request_id: str


Event = Added | Cancelled


class Subscription:
    def __init__(self, hub: WatchHub, watcher_id: str) -> None:
        self.watcher_id = watcher_id
        self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._hub = hub

    def put(self, event: Event) -> None:
        self._q.put(event)

    def get(self, timeout: float) -> Event | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._hub.remove(self)


class WatchHub:
    def __init__(self) -> None:
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()

    def add(self, watcher_id: str) -> Subscription:
        sub = Subscription(self, watcher_id)
        with self._lock:
            self._subs.add(sub)
        return sub

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, events: list[Event]) -> None:
        with self._lock:
            subs = list(self._subs)
        for s in subs:
            for e in events:
                s.put(e)

    def __len__(self) -> int:
        with self._lock:
            return len(self._subs)
