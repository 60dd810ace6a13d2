"""Priority queue of pending chunks with lazy invalidation (O(log n) per operation), plus the
FIFOs that drive anti-starvation: one AgeQueue per submission and one for paused requests (O(1)
amortised per operation). One decision stays well under 1 ms with 10,000 pending requests
(bench/sched_overhead.py)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Key = tuple[float, ...]

# One sequence over all queues: entries of different queues with equal keys compare in enqueue
# order, so merging two queues by their heads keeps the FIFO tie-break of a single queue.
_SEQ = itertools.count()


@dataclass
class PendingQueue:
    """Min-heap of (key, seq, request_id, version); an entry is live when its version matches the
    request's current version (re-keying pushes a new entry and bumps the version)."""

    heap: list[tuple[Key, int, str, int]] = field(default_factory=list)

    def push(self, key: Key, request_id: str, version: int) -> None:
        heapq.heappush(self.heap, (key, next(_SEQ), request_id, version))

    def pop(self) -> tuple[Key, int, str, int] | None:
        return heapq.heappop(self.heap) if self.heap else None

    def peek_live(self, live: dict[str, int]) -> tuple[Key, int, str, int] | None:
        """The best live entry (stale entries at the head are dropped), without removing it."""
        heap = self.heap
        while heap and live.get(heap[0][2]) != heap[0][3]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def restore(self, entry: tuple[Key, int, str, int]) -> None:
        heapq.heappush(self.heap, entry)

    def compact(self, live: dict[str, int]) -> None:
        """Drop stale entries when they dominate the heap (keeps memory bounded)."""
        if len(self.heap) > 64 and len(self.heap) > 4 * max(1, len(live)):
            self.heap = [e for e in self.heap if live.get(e[2]) == e[3]]
            heapq.heapify(self.heap)


@dataclass
class AgeQueue:
    """Pending chunks in enqueue order: (enqueued_at, request_id, enqueue count); stale entries
    (dispatched, re-enqueued, cancelled) are dropped lazily from the head."""

    items: deque[tuple[float, str, int]] = field(default_factory=deque)

    def push(self, at: float, request_id: str, version: int) -> None:
        self.items.append((at, request_id, version))

    def oldest(self, alive: Callable[[tuple[float, str, int]], bool]) -> tuple[float, str, int] | None:
        while self.items and not alive(self.items[0]):
            self.items.popleft()
        return self.items[0] if self.items else None

    def compact(self, alive: Callable[[tuple[float, str, int]], bool], live: int) -> None:
        """Drop stale entries when they dominate the queue (`live`: an upper bound on the live
        entries, e.g. the requests that can wait in it). Only the head is pruned otherwise, and a
        head that stays alive (a request the policy keeps deferring) let every later re-enqueue
        pile up behind it: one entry per chunk, not per request. Past 4x it is one O(n) pass that
        leaves at most `live`: amortised O(1) per push."""
        if len(self.items) > 64 and len(self.items) > 4 * max(1, live):
            self.items = deque(e for e in self.items if alive(e))
