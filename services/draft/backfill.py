"""History refill from the buffer: a restarted draft server gets its history drafts back.

The draft server keeps history (RhymeRL: the previous iteration's responses to the same prompt) in
memory only, and builds it from the groups it saw complete. The buffer keeps the same responses
durably (RocksDB). Without a refill, a draft server that restarts (a crash, a rolling update, a
rescheduled pod) drafts from siblings alone for a whole iteration: at temperature 0.7 that is
1.4-1.5 accepted tokens per step instead of 1.8-1.9 (docs/benchmarks.md, bench.spec).

So when a group registers and its prompt key has no history here, the key goes on a queue; a
background thread asks the buffer for the newest iteration's responses to that key
(BufferInternalService.GetHistory with include_tokens) and seeds them (DraftStore.seed_history),
which also hands them to the live groups of the key (they reach the workers' mirrors through Sync
as history entries). Registration never waits for the buffer.

The refill's history iteration is decided when it is seeded (DraftStore.refill_history, under the
store's lock), not when the key was queued: when a registration that queued it brought its policy
version (RegisterGroupRequest.policy_version: history iterations are versions), or any group of the
key has one by then, the version the buffer's iteration was generated with, so it is the older
iteration it is, or the same one as the group's (a batch of that version split into two
submissions whose first completed before this server restarted). Without any version, fallback
iteration number 0 (kept below every version: history.unversioned), the number a group registered
without a version on an empty key is given: the refilled responses and that group's own responses,
once it completes, form one iteration, so a refill never counts as a newer iteration than the one
it stood in for, and it leaves with it. If a registration of the key then brings a version (a
group takes its version: a worker of the run that has an attempt of it, after one whose mirror had
none registered it first; another group of the key registers with one; also after the groups
running at the refill completed), the refill is renumbered as the buffer's version
(DraftStore._renumber_refill, HistoryStore.note_refill): numbered as fallback 0 for good, it was
dropped one version early.

A key is asked for at most once per `retry_after_s` (a key on its first iteration has no history
anywhere; every one of its groups would otherwise cost a buffer call). Errors are logged and the
key is asked for again after that delay: the refill is an optimisation, never a failure of the
rollout.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from services.common.log import get_logger, kv
from services.draft.history import log_fields
from services.draft.store import DraftStore

log = get_logger(__name__)



class BufferIteration(NamedTuple):
    """The buffer's newest iteration of a prompt key: the policy version its batch was generated
    with and its responses (none when the buffer has no history for the key)."""

    policy_version: int
    responses: Sequence[Sequence[int]]


# prompt_key -> its newest iteration in the buffer (BufferHistoryLink.fetch_iteration).
FetchFn = Callable[[str], BufferIteration]


class HistoryBackfill:
    def __init__(self, store: DraftStore, fetch: FetchFn, *, retry_after_s: float = 60.0,
                 max_queued: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if retry_after_s < 0:
            raise ValueError("retry_after_s: must be >= 0")
        if max_queued < 1:
            raise ValueError("max_queued: must be >= 1")
        self._store = store
        self._fetch = fetch
        self._retry_after_s = retry_after_s
        self._max_queued = max_queued
        self._clock = clock
        self._cv = threading.Condition()
        self._queue: collections.deque[str] = collections.deque()
        # Queued keys -> whether a registration that queued it brought a policy version (the
        # refill is then seeded as the buffer's version; else the store decides: refill_history).
        self._queued: dict[str, bool] = {}
        self._asked_at: dict[str, float] = {}  # key -> when it was last asked for (bounded below)
        self._busy = False
        self._closed = False
        self.refilled_keys = 0
        self.refilled_responses = 0
        self.errors = 0
        self.dropped = 0
        self._thread: threading.Thread | None = None

    def start(self) -> HistoryBackfill:
        self._thread = threading.Thread(target=self._run, name="draft-history-backfill", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def on_register(self, prompt_key: str, history_loaded: int, policy_version: int | None = None) -> None:
        """Called after a group registered: queue its key when it came without history.
        policy_version: the registration's (None = unknown), which numbers the refill (above)."""
        if not prompt_key or history_loaded > 0:
            return
        now = self._clock()
        with self._cv:
            if self._closed:
                return
            if prompt_key in self._queued:
                self._queued[prompt_key] |= policy_version is not None
                return
            asked = self._asked_at.get(prompt_key)
            if asked is not None and now - asked < self._retry_after_s:
                return
            if len(self._queue) >= self._max_queued:
                self.dropped += 1  # asked again by a later group of the key
                return
            self._queue.append(prompt_key)
            self._queued[prompt_key] = policy_version is not None
            self._cv.notify()

    def idle(self) -> bool:
        """Nothing queued or in flight (tests wait for this)."""
        with self._cv:
            return not self._queue and not self._busy

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key = self._queue.popleft()
                versioned = self._queued.pop(key)
                self._asked_at[key] = self._clock()
                self._forget_old_locked()
                self._busy = True
            try:
                self._refill(key, versioned)
            finally:
                with self._cv:
                    self._busy = False

    def _refill(self, key: str, versioned: bool) -> None:
        try:
            fetched = self._fetch(key)
            responses = [r for r in fetched.responses if len(r)]
        except Exception as e:  # the buffer is down or slow: drafts from siblings only meanwhile
            self.errors += 1
            log.warning("history refill from the buffer failed", extra=kv(prompt_key=key, error=str(e)))
            return
        if not responses:
            return
        try:
            # Numbered by the store under its lock (refill_history): `versioned` only says a
            # registration that queued the key brought a version; one may have come since.
            added, iteration = self._store.refill_history(key, fetched.policy_version, responses,
                                                          versioned=versioned)
        except Exception as e:  # e.g. a response over the store's limits: skip the key, keep serving
            self.errors += 1
            log.warning("history refill rejected", extra=kv(prompt_key=key, error=str(e)))
            return
        self.refilled_keys += 1
        self.refilled_responses += added
        log.info("history refilled from the buffer", extra=kv(prompt_key=key, responses=added, **log_fields(iteration)))

    def _forget_old_locked(self) -> None:
        # Bounded memory: entries past the retry delay carry no information any more.
        if len(self._asked_at) < 4 * self._max_queued:
            return
        now = self._clock()
        for k in [k for k, t in self._asked_at.items() if now - t >= self._retry_after_s]:
            del self._asked_at[k]
