"""Anti-starvation clocks: how long a waiting request has been postponed by NEWER work.

Submissions are RequestInfo.incarnation (the buffer's submit_seq). A waiting request's starvation
clock starts at max(its current wait's start, the first dispatch of a later submission while its
own is tracked) and runs as long as a later submission that has dispatched is tracked without a
break. Within one submission nothing is newer (the policy's order decides), so one synchronous RL
iteration never starves anyone; see services/scheduler/README.md for why (counted from the wait
alone, longest-first became FIFO at paper scale).

`Starvation` keeps the per-submission records and two lazy heaps so that a decision reads only
the top of a heap, not every tracked submission. The SchedulerCore tells it when requests of a
submission are tracked / untracked, start waiting, and dispatch; it asks which waiting request is
starved longest and whether one request is starved. Pure: no grpc, no core state besides the
`alive` predicate the core gives (whether an age-queue entry is still that request's live wait).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from .queues import AgeQueue

# (enqueued_at, request_id, enqueue count): an entry of a submission's age queue.
WaitEntry = tuple[float, str, int]


@dataclass
class Submission:
    """One submission while requests of it are tracked: what anti-starvation needs."""

    # Tells this record from an earlier one of the same number (untracked, then delivered
    # again) in the lazy heaps (Starvation._starved_heap, Starvation._unpostponed).
    token: int
    requests: int = 0  # its requests that are tracked
    dispatched: bool = False  # a chunk of it was dispatched
    # Since when newer work has postponed it without a break: the clock time a chunk of a LATER
    # submission was first dispatched while this one had requests (or when they came, if such a
    # submission was running then); from then on its waiting requests' starvation clocks run.
    # Back to None when no later submission that ran is tracked any more (it finished or was
    # cancelled: it no longer postpones anyone). None: nothing newer runs, so its order is the
    # policy's alone.
    newer_since: float | None = None
    # Its requests' waits in enqueue order (stale entries dropped lazily from the head, and by
    # compaction when they dominate: AgeQueue.compact).
    waiting: AgeQueue = field(default_factory=AgeQueue)
    in_heap: bool = False  # it has its (one) entry in Starvation._starved_heap

    def clock_start(self, enqueued_at: float) -> float:
        """When the starvation clock of a request of it waiting since `enqueued_at` started: once
        it waits AND newer work has postponed it (newer_since, which must be set)."""
        assert self.newer_since is not None
        return max(enqueued_at, self.newer_since)


class Starvation:
    """Per-submission starvation clocks (see the module docstring).

    Cost: track / untrack / wait / dispatch are O(log submissions) amortised, each submission's
    clock starting or stopping counted once (nothing scans every tracked submission: the newest
    one that ran ending scanned them all, 0.4 ms with 10,000 tracked)."""

    def __init__(
        self,
        limit_s: float,
        clock: Callable[[], float],
        alive: Callable[[WaitEntry], bool],
    ) -> None:
        self.limit_s = limit_s  # starvation_seconds
        self._clock = clock
        self._alive = alive
        # Tracked submissions by their number: each holds its requests' waits in enqueue order.
        self._subs: dict[int, Submission] = {}
        self._tokens = itertools.count()
        # The highest tracked submission that has dispatched. Exactly the tracked submissions
        # below it are postponed (newer_since set), so whether a new one is (track) and whom a
        # first dispatch postpones (_first_dispatch_of) need no scan of them all.
        self._top_dispatched: int | None = None
        # (submission, token) of the tracked submissions not postponed (newer_since None): a
        # min-heap, so a first dispatch above _top_dispatched postpones those below it from the
        # top. Lazy: entries of records untracked or postponed since are skipped.
        self._unpostponed: list[tuple[int, int]] = []
        # -submission of the tracked submissions that have dispatched: a max-heap, so the newest
        # that ran ending finds the next one from the top. Lazy: an entry whose number is not
        # tracked, or not dispatched, any more is skipped. No token: an entry left by an earlier
        # record of the number names the right number whenever the current record dispatched.
        self._dispatched_heap: list[int] = []
        # -submission of the postponed submissions (newer_since set): a max-heap, so when the
        # newest that ran ends the clocks that stop (those from the new top up) are popped from
        # the top instead of looked for among all tracked submissions. Lazy like the one above
        # (every postponed record's number is in it: _postponed pushes it). Plain ints, not
        # (number, token) pairs: a pop is ~3x cheaper, which is the whole cost when many stop.
        self._postponed: list[int] = []
        # (lower bound on the start of its oldest wait's starvation clock, submission, token) for
        # the submissions whose newer_since is set: starved_entry looks at the head only, so a
        # decision does not grow with the tracked submissions. Lazy: an entry's key may be stale
        # but never above the true start (both the head's enqueue time and newer_since only
        # grow while it is set); re-keyed when it reaches the head.
        self._starved_heap: list[tuple[float, int, int]] = []

    # ---- what the core tells ---------------------------------------------------------------

    def track(self, sid: int) -> None:
        """A request of submission `sid` is tracked now."""
        sub = self._subs.get(sid)
        if sub is None:
            sub = self._subs[sid] = Submission(token=next(self._tokens))
            if self._top_dispatched is not None and self._top_dispatched > sid:
                # A later submission already running when this one's first request comes (a
                # scheduler restart resumes them in any order) postpones it from now on.
                self._postpone(sid, sub, self._clock())
            else:
                heapq.heappush(self._unpostponed, (sid, sub.token))
        sub.requests += 1

    def untrack(self, sid: int) -> bool:
        """A request of submission `sid` is no longer tracked. Returns whether clocks stopped (the
        newest submission that ran is gone): the core re-checks a hold it took for a starved
        request then."""
        sub = self._subs[sid]
        sub.requests -= 1
        if sub.requests:
            return False
        del self._subs[sid]  # with its waits: nothing of it is left to starve
        self._compact()
        if sid != self._top_dispatched:
            return False  # a later one that ran is still tracked: every clock it ran goes on
        # The newest submission that ran is gone: an earlier one with no later one that ran left
        # is back to the policy's order (its clock stops; a hold taken for one of its requests is
        # released by the core's hold check). Below the new top the clocks go on: the
        # postponement by newer work has had no break. Both heaps are read from their tops: a
        # pop per clock that stops (each started by a _postpone) and per entry gone stale.
        subs = self._subs
        dispatched = self._dispatched_heap
        while dispatched and not ((o := subs.get(-dispatched[0])) is not None and o.dispatched):
            heapq.heappop(dispatched)
        top = -dispatched[0] if dispatched else None
        self._top_dispatched = top
        postponed = self._postponed
        # Every tracked submission from the new top up stops (s >= top; all when none ran).
        while postponed and (top is None or postponed[0] <= -top):
            s = -heapq.heappop(postponed)
            o = subs.get(s)
            if o is not None and o.newer_since is not None:
                o.newer_since = None  # its _starved_heap entry is dropped when read
                heapq.heappush(self._unpostponed, (s, o.token))
        return True

    def wait(self, sid: int, now: float, request_id: str, enq: int) -> None:
        """A request of submission `sid` starts a wait at `now` (`enq`: its enqueue count, which
        `alive` checks to tell its live wait from stale ones)."""
        sub = self._subs[sid]
        sub.waiting.push(now, request_id, enq)
        # At most one live entry per request: a head the policy keeps deferring must not let
        # every other re-enqueue pile up behind it (one entry per chunk).
        sub.waiting.compact(self._alive, sub.requests)
        if sub.newer_since is not None and not sub.in_heap:
            # Its entry was dropped while it had nothing waiting: newer_since is a lower bound.
            heapq.heappush(self._starved_heap, (sub.newer_since, sid, sub.token))
            sub.in_heap = True

    def dispatched(self, sid: int, now: float) -> None:
        """A chunk of submission `sid` was dispatched at `now`."""
        sub = self._subs[sid]
        if not sub.dispatched:
            self._first_dispatch_of(sid, sub, now)

    # ---- what the core asks ----------------------------------------------------------------

    def starved_entry(self, now: float) -> WaitEntry | None:
        """The waiting request postponed by newer work for longest, if past limit_s (ties: the
        earlier submission). Within a submission its oldest wait is the most postponed (one
        newer_since for all), so only each submission's head counts, and the heap of those is
        read from its top: O(log submissions) amortised per decision, not one look per tracked
        submission (5,000 of them cost 1.6 ms a decision)."""
        heap = self._starved_heap
        while heap:
            start, sid, token = heap[0]
            if now - start <= self.limit_s:
                return None  # a lower bound: no submission's clock is past the limit
            sub = self._subs.get(sid)
            if sub is None or sub.token != token:
                heapq.heappop(heap)  # of a record no longer tracked
                continue
            oldest = sub.waiting.oldest(self._alive)
            if oldest is None or sub.newer_since is None:
                heapq.heappop(heap)  # pushed again when both hold again (_postpone, wait)
                sub.in_heap = False
                continue
            actual = sub.clock_start(oldest[0])
            if actual != start:
                heapq.heapreplace(heap, (actual, sid, token))
                continue
            return oldest
        return None

    def is_starved(self, sid: int, enqueued_at: float, now: float) -> bool:
        """Whether a request of submission `sid` waiting since `enqueued_at` is past limit_s on its
        clock at `now`."""
        sub = self._subs.get(sid)
        if sub is None or sub.newer_since is None:
            return False
        return now - sub.clock_start(enqueued_at) > self.limit_s

    # ---- internals -------------------------------------------------------------------------

    def _postpone(self, sid: int, sub: Submission, now: float) -> None:
        """Newer work runs from `now` on: the submission's waiting requests' clocks start."""
        sub.newer_since = now
        heapq.heappush(self._postponed, -sid)
        if not sub.in_heap:
            # newer_since is a lower bound on every start in it; re-keyed when read.
            heapq.heappush(self._starved_heap, (now, sid, sub.token))
            sub.in_heap = True

    def _compact(self) -> None:
        """Entries of records no longer tracked leave the lazy heaps only from the top: drop them
        all at once when they dominate (amortised O(1) per untracked submission)."""
        bound = max(64, 4 * len(self._subs))
        current = self._current
        if len(self._starved_heap) > bound:
            self._starved_heap = [e for e in self._starved_heap if current(e[1], e[2]) is not None]
            heapq.heapify(self._starved_heap)
        if len(self._unpostponed) > bound:
            self._unpostponed = [e for e in self._unpostponed
                                 if (o := current(*e)) is not None and o.newer_since is None]
            heapq.heapify(self._unpostponed)
        # The two number heaps: one entry per live number (an earlier record's may repeat it); a
        # sorted list is a heap.
        subs = self._subs
        if len(self._dispatched_heap) > bound:
            self._dispatched_heap = sorted({n for n in self._dispatched_heap
                                            if (o := subs.get(-n)) is not None and o.dispatched})
        if len(self._postponed) > bound:
            self._postponed = sorted({n for n in self._postponed
                                      if (o := subs.get(-n)) is not None and o.newer_since is not None})

    def _current(self, sid: int, token: int) -> Submission | None:
        """The tracked record a lazy heap entry (sid, token) names, or None if it is gone."""
        o = self._subs.get(sid)
        return o if o is not None and o.token == token else None

    def _first_dispatch_of(self, sid: int, sub: Submission, now: float) -> None:
        """A submission's first chunk runs: every earlier one's waiting requests are postponed by
        newer work from now on (their starvation clocks start). Below the top one that ran every
        earlier one is postponed already: only a new top postpones those from the old top up."""
        sub.dispatched = True
        heapq.heappush(self._dispatched_heap, -sid)
        if self._top_dispatched is not None and sid <= self._top_dispatched:
            return
        self._top_dispatched = sid
        heap = self._unpostponed
        while heap and heap[0][0] < sid:
            s, token = heapq.heappop(heap)
            o = self._subs.get(s)
            if o is not None and o.token == token and o.newer_since is None:
                self._postpone(s, o, now)
