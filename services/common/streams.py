"""Admission of long-lived gRPC streams below a sync server's handler threads.

A sync gRPC server runs each call on a thread of its pool, and a stream keeps that thread for as
long as it lasts. Unbounded, enough open streams take every thread, and the unary calls queue behind
them: the buffer's CommitChunk that would wake its waiting result streams (a deadlock), a worker's
Abort, heartbeat and LoadWeights, the kvstore's Exists and Release. So each service admits at most
`limit` streams at once and refuses the next at once with RESOURCE_EXHAUSTED naming its option
(clients retry with backoff, or elsewhere), and the unary calls always find a thread.

Used by the buffer (StreamResults, WatchWork; the last slots kept for WatchWork), the worker
(RunChunk) and the kvstore (Put, Get).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.common.errors import ResourceExhausted


def default_stream_limit(max_workers: int) -> int:
    """Streams a server with `max_workers` handler threads admits when not configured: 8 threads
    kept for unary calls on a large pool (56 of the default 64), half of a small one."""
    if max_workers > 16:
        return max_workers - 8
    return max(1, max_workers // 2)


def check_stream_limit(option: str, configured: int, max_workers: int, unary: str) -> None:
    """Validates a configured stream limit (0 = derived) against the server's handler threads;
    `unary` names the calls that need threads of their own (for the message)."""
    if max_workers < 2:
        raise ValueError(f"max_workers: must be >= 2 (a stream holds one handler thread), got {max_workers}")
    if configured < 0:
        raise ValueError(f"{option}: must be >= 0 (0 = derived from max_workers), got {configured}")
    if configured and configured >= max_workers:
        raise ValueError(f"{option}: must be below max_workers ({max_workers}): a stream holds a handler thread, "
                         f"and {unary} need threads of their own, got {configured}")


class StreamSlots:
    """A counter of open streams with a cap; `hold(method)` is the admission of one stream.

    `reserve` slots at the top are kept for the methods in `reserved_for`: every other method is
    admitted only while fewer than limit - reserve streams are open. on_open(+1 / -1) and
    on_refused(method) feed the service's own metrics."""

    def __init__(
        self,
        limit: int,
        option: str,
        *,
        reserve: int = 0,
        reserved_for: frozenset[str] = frozenset(),
        on_open: Callable[[int], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"{option}: must be >= 1, got {limit}")
        if reserve < 0 or (reserve and reserve >= limit):
            raise ValueError(f"{option}: a reserve of {reserve} leaves no slot of {limit} for other streams")
        self.limit = limit
        self.option = option
        self.reserve = reserve
        self.reserved_for = reserved_for
        self._on_open = on_open
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._open = 0
        self.refused = 0

    @contextmanager
    def hold(self, method: str) -> Iterator[None]:
        cap = self.limit if method in self.reserved_for else self.limit - self.reserve
        with self._lock:
            admitted = self._open < cap
            if admitted:
                self._open += 1
            else:
                self.refused += 1
        if not admitted:
            if self._on_refused is not None:
                self._on_refused(method)
            kept = f", the last {self.reserve} kept for {', '.join(sorted(self.reserved_for))}" if self.reserve else ""
            raise ResourceExhausted(
                f"{method} refused: {cap} streams are open ({self.option} {self.limit}{kept}); retry with backoff "
                "or elsewhere",
                field=self.option,
            )
        if self._on_open is not None:
            self._on_open(1)
        try:
            yield
        finally:
            if self._on_open is not None:
                self._on_open(-1)
            with self._lock:
                self._open -= 1
