"""The draft server's state: groups (index + append log + TTL), history, memory budget, watermarks.

Protocol (DESIGN.md section 4, Seer appendix: update_cst / fetch_cst / register_group):

- register_group(group_id, prompt_key, prompt, ttl, group_size) creates the group's index with the
  prompt and the key's history. Re-registering with the same prompt refreshes the TTL. The id of a
  completed group (its responses are history) registered again after it was evicted or expired,
  or with another prompt, starts a new incarnation: a batch id used again.
- append(group_id, request_id, offset, tokens, finished, epoch) is idempotent by offset (see GroupIndex).
  `epoch` orders the attempts of a request (the scheduler's dispatch_epoch): an append older than
  the newest epoch seen for the request is refused (FailedPrecondition, field epoch), so a late or
  retried message of an abandoned attempt never overwrites a newer attempt's tokens; 0 = unordered.
  Every append that adds tokens is also recorded in the group's log. With truncate=True the
  response becomes exactly its first `offset` tokens + tokens (a request resuming from its committed
  output drops a failed attempt's extra tokens, which were sampled with the randomness the new
  attempt verifies with); the log entry carries the truncate so mirrors replay it. A retried
  truncate+append changes nothing and logs nothing.
- sync([(group_id, watermark)], incarnations) returns per group the log entries after `watermark`.
  A group's watermark is 1 + the length of its log; 0 means "nothing yet", answered with the prompt,
  the history and the whole log. History seeded into a live group later arrives as a log entry with
  an empty request_id. Every group has a random incarnation, new each time it is created: a
  watermark of another incarnation (the server restarted, or the group expired and was registered
  again; its log may be shorter or longer than the watermark) is answered as watermark 0 with
  reset=True, so the mirror rebuilds instead of applying a foreign log from its middle.
- seed_history(key, iteration, responses) is idempotent (the same responses for the same key load
  once, in whatever order and iteration).
- A group whose `group_size` responses are all finished has its responses promoted to history for
  its prompt key (the next iteration's drafts, RhymeRL) and becomes evictable under memory pressure.
- Memory is bounded by `memory_budget_bytes`: over budget, the oldest history iteration goes first,
  then completed groups, oldest first (never the group being written); when nothing is left to
  evict, new groups, history and appends are refused with RESOURCE_EXHAUSTED (drafting degrades;
  generation never depends on the draft server). A worker still mirroring a completed group that
  was evicted or expired drops its mirror (Sync: gone + expired); history never holds the same
  responses of a key twice (HistoryStore.add), whichever way a group completes again.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.log import get_logger, kv
from services.draft.history import HISTORY_RESPONSE_BYTES, HISTORY_TOKEN_BYTES, HistoryStore
from services.draft.index import DEFAULT_LEVELS, GroupIndex, common_prefix

log = get_logger(__name__)

_MAX_TOKEN_ID = (1 << 31) - 1
_LOG_ENTRY_BYTES = 120  # a SeqDelta object and its tuple, calibrated with tracemalloc
_LOG_TOKEN_BYTES = 36
# Reserved per appended token before the append: index entries (GroupIndex.memory_bytes: 45 bytes per
# level) + token slot + log copy + margin (200 with 3 levels).
_ENTRY_BYTES = 45
_APPEND_TOKEN_FIXED_BYTES = 65


def append_token_bytes(levels: tuple[int, ...]) -> int:
    return _APPEND_TOKEN_FIXED_BYTES + _ENTRY_BYTES * len(levels)
_TOMBSTONES = 65536  # expired group ids remembered to tell "expired" from "unknown"
_EPOCH_BYTES = 100  # a request's entry in _Group.epochs


@dataclass(frozen=True)
class SeqDelta:
    request_id: str  # "" = a history response seeded after the group was created
    offset: int
    token_ids: tuple[int, ...]
    finished: bool = False
    truncate: bool = False  # the response was cut to `offset` before token_ids


@dataclass(frozen=True)
class GroupDelta:
    group_id: str
    watermark: int
    appends: tuple[SeqDelta, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()  # only when the caller's watermark was 0
    history: tuple[tuple[int, ...], ...] = ()  # only when the caller's watermark was 0
    gone: bool = False
    incarnation: int = 0
    reset: bool = False  # the caller's watermark was of another incarnation: this is the whole group
    expired: bool = False  # with gone: expired or evicted here (not lost in a restart)


@dataclass(frozen=True)
class DraftStats:
    groups: int
    history_keys: int
    indexed_tokens: int
    memory_bytes: int
    memory_budget_bytes: int
    bytes_per_token: float
    evicted_history: int
    expired_groups: int
    evicted_groups: int = 0


@dataclass
class _Group:
    group_id: str
    prompt_key: str
    group_size: int
    ttl_s: float
    expires_at: float
    created: float
    index: GroupIndex
    history_iteration: int
    incarnation: int
    # History responses the index loaded at creation (the wm=0 reply rebuilds them from the index:
    # holding the history store's tuples here would keep evicted history alive, unaccounted).
    history_count: int = 0
    log: list[SeqDelta] = field(default_factory=list)
    log_bytes: int = 0
    finished: set[str] = field(default_factory=set)
    completed: bool = False
    epochs: dict[str, int] = field(default_factory=dict)  # request -> newest attempt epoch seen

    @property
    def watermark(self) -> int:
        return 1 + len(self.log)

    @property
    def memory_bytes(self) -> int:
        return self.index.memory_bytes() + self.log_bytes + len(self.epochs) * _EPOCH_BYTES


@dataclass(frozen=True)
class StoreLimits:
    memory_budget_bytes: int = 2 << 30
    history_iterations: int = 2
    default_ttl_seconds: int = 3600
    max_ttl_seconds: int = 7 * 86400
    max_append_tokens: int = 65536
    max_response_tokens: int = 1 << 20
    max_prompt_tokens: int = 1 << 20
    levels: tuple[int, ...] = DEFAULT_LEVELS


def _check_tokens(tokens: Sequence[int], name: str) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t <= _MAX_TOKEN_ID:
            raise InvalidArgument(f"token id {t} is negative or too large", field=f"{name}[{i}]")


class DraftStore:
    """Thread-safe: one lock around everything (the gRPC server calls in from a thread pool)."""

    def __init__(self, limits: StoreLimits | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or StoreLimits()
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._history = HistoryStore(self.limits.history_iterations)
        self._expired: OrderedDict[str, bool] = OrderedDict()  # tombstones: group id -> was completed
        self._expired_count = 0
        self._evicted_groups = 0
        self._next_sweep = 0.0

    # ---- groups ---------------------------------------------------------------------------------

    def register_group(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], ttl_seconds: int = 0,
        group_size: int = 0,
    ) -> tuple[bool, int]:
        """Returns (created, history responses loaded)."""
        if not group_id:
            raise InvalidArgument("must not be empty", field="group_id")
        if ttl_seconds < 0 or ttl_seconds > self.limits.max_ttl_seconds:
            raise InvalidArgument(f"must be in [0, {self.limits.max_ttl_seconds}] (0 = default)", field="ttl_seconds")
        if group_size < 0:
            raise InvalidArgument("must be >= 0 (0 = unknown)", field="group_size")
        if len(prompt_token_ids) > self.limits.max_prompt_tokens:
            raise InvalidArgument(f"{len(prompt_token_ids)} tokens > limit {self.limits.max_prompt_tokens}",
                                  field="prompt_token_ids")
        _check_tokens(prompt_token_ids, "prompt_token_ids")
        ttl = float(ttl_seconds or self.limits.default_ttl_seconds)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            g = self._groups.get(group_id)
            if g is not None:
                if g.prompt_key == prompt_key and g.index.prompt == tuple(prompt_token_ids):
                    # The same registration (a retry, another worker of the group): idempotent, also
                    # once it completed (a sibling's late registration must not start it over).
                    g.ttl_s = ttl
                    g.expires_at = now + ttl
                    return False, g.index.num_history
                if not g.completed:
                    raise AlreadyExists(f"group {group_id!r} exists with another prompt or prompt key",
                                        field="group_id")
                # Completed (its responses are history) and registered with another prompt: the id
                # is used again (a batch id resubmitted after the buffer's retention deleted it).
                del self._groups[group_id]
                # Tombstoned as an expired completed group: if this registration is refused below
                # (no room), the old group's workers are told it expired, not that it was lost.
                self._tombstone(group_id, True)
                log.info("completed group's id registered again with another prompt; new incarnation",
                         extra=kv(group_id=group_id))
            elif self._expired.get(group_id):
                # Completed, then evicted or expired: its responses are history, so this is the id
                # used again (see above), a new incarnation. (Refused, those groups drafted nothing;
                # a straggler re-creating the old one cannot double its history: HistoryStore.add
                # holds the same responses once.)
                log.info("completed group's id registered again after it expired; new incarnation",
                         extra=kv(group_id=group_id))
            # Room for the prompt and the key's history as indexed; eviction (oldest history first)
            # may take some of that very history, so the need is taken again after it: the group
            # then registers with what is left rather than being refused for history now gone.
            per_token = append_token_bytes(self.limits.levels)
            self._evict((len(prompt_token_ids) + (self._history.tokens(prompt_key) if prompt_key else 0)) * per_token)
            self._make_room((len(prompt_token_ids) + (self._history.tokens(prompt_key) if prompt_key else 0))
                            * per_token)
            history = self._history.responses(prompt_key) if prompt_key else []
            index = GroupIndex(prompt_token_ids, levels=self.limits.levels)
            for r in history:
                index.add_history(r)
            iteration = self._history.next_iteration(prompt_key) if prompt_key else 0
            self._groups[group_id] = _Group(group_id, prompt_key, group_size, ttl, now + ttl, now, index, iteration,
                                            _incarnation(), len(history))
            self._expired.pop(group_id, None)
            log.info("group registered", extra=kv(group_id=group_id, prompt_key=prompt_key,
                                                  history=len(history), ttl_s=ttl))
            return True, len(history)

    def _get(self, group_id: str, field_name: str) -> _Group:
        if not group_id:
            raise InvalidArgument("must not be empty", field=field_name)
        g = self._groups.get(group_id)
        if g is None:
            if self._expired.get(group_id):
                # Completed, then expired or evicted (the client releases its mirror on this). An
                # unfinished group that expired is reported as not registered: its workers register
                # it again and resend what they hold, as after a restart.
                raise NotFound(f"group {group_id!r} expired or was evicted", field=field_name)
            raise NotFound(f"group {group_id!r} is not registered", field=field_name)
        return g

    # ---- appends --------------------------------------------------------------------------------

    def append(
        self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int], finished: bool = False,
        *, where: str = "", truncate: bool = False, epoch: int = 0,
    ) -> tuple[int, int]:
        """Returns (tokens appended, duplicate tokens skipped). `where` prefixes field names."""
        if not request_id:
            raise InvalidArgument("must not be empty", field=f"{where}request_id")
        if len(token_ids) > self.limits.max_append_tokens:
            raise InvalidArgument(f"{len(token_ids)} tokens > limit {self.limits.max_append_tokens} per append",
                                  field=f"{where}token_ids")
        if offset < 0:
            raise InvalidArgument("must be >= 0", field=f"{where}offset")
        if offset + len(token_ids) > self.limits.max_response_tokens:
            raise InvalidArgument(f"response would exceed {self.limits.max_response_tokens} tokens",
                                  field=f"{where}offset")
        if epoch < 0:
            raise InvalidArgument("must be >= 0", field=f"{where}epoch")
        _check_tokens(token_ids, f"{where}token_ids")
        with self._lock:
            now = self._clock()
            self._sweep(now)
            g = self._get(group_id, f"{where}group_id")
            current = g.epochs.get(request_id, 0)
            if epoch and epoch < current:
                raise FailedPrecondition(f"stale attempt of request {request_id!r}: epoch {epoch} < {current}, the "
                                         "newest attempt's", field=f"{where}epoch")
            if truncate:
                result = self._truncate_append(g, request_id, offset, token_ids, finished, where, now)
            else:
                result = self._plain_append(g, request_id, offset, token_ids, finished, where, now)
            if epoch > current:
                g.epochs[request_id] = epoch
            return result

    def _plain_append(
        self, g: _Group, request_id: str, offset: int, token_ids: Sequence[int], finished: bool, where: str,
        now: float,
    ) -> tuple[int, int]:
        """append(truncate=False) under the lock."""
        have = g.index.length(request_id)
        if request_id in g.finished and offset + len(token_ids) > have:
            raise FailedPrecondition(f"request {request_id!r} already finished at {have} tokens",
                                     field=f"{where}offset")
        if finished and offset + len(token_ids) < have:
            # "Finished here" while the response is longer: a reordered message, not the end.
            raise FailedPrecondition(f"request {request_id!r} has {have} tokens; a final append must end there, "
                                     f"this one ends at {offset + len(token_ids)}", field=f"{where}finished")
        if offset > have:
            raise InvalidArgument(f"gap: request {request_id!r} has {have} tokens, append starts at {offset}",
                                  field=f"{where}offset")
        new_tokens = max(0, offset + len(token_ids) - have)
        overlap = len(token_ids) - new_tokens
        if overlap and g.index.tokens_at(request_id, offset, overlap) != [int(t) for t in token_ids[:overlap]]:
            # Refused before any room is made: a bad append must not evict other groups' data, nor
            # be answered RESOURCE_EXHAUSTED (which the worker retries) when the budget is full.
            raise InvalidArgument(f"overlap with different tokens for request {request_id!r} at offset {offset}",
                                  field=f"{where}token_ids")
        if new_tokens:
            self._make_room(new_tokens * append_token_bytes(self.limits.levels), keep=g)
        try:
            added = g.index.append(request_id, offset, token_ids)
        except InvalidArgument as e:
            raise InvalidArgument(str(e).split(": ", 1)[-1], field=f"{where}{e.field or 'token_ids'}") from None
        newly_finished = finished and request_id not in g.finished
        if added or newly_finished:
            start = offset + len(token_ids) - added
            entry = SeqDelta(request_id, start, tuple(int(t) for t in token_ids[len(token_ids) - added:]),
                             finished)
            g.log.append(entry)
            g.log_bytes += _LOG_ENTRY_BYTES + added * _LOG_TOKEN_BYTES
        if newly_finished:
            g.finished.add(request_id)
            self._maybe_complete(g)
        g.expires_at = now + g.ttl_s
        return added, len(token_ids) - added

    def _truncate_append(
        self, g: _Group, request_id: str, offset: int, token_ids: Sequence[int], finished: bool, where: str,
        now: float,
    ) -> tuple[int, int]:
        """append(truncate=True) under the lock: the response becomes tokens[:offset] + token_ids."""
        index = g.index
        have = index.length(request_id)
        if offset > have:
            raise InvalidArgument(f"gap: request {request_id!r} has {have} tokens, truncate+append starts at "
                                  f"{offset}", field=f"{where}offset")
        toks = [int(t) for t in token_ids]
        same = common_prefix(index.tokens_at(request_id, offset, len(toks)), toks)
        cuts = offset + same < have
        # Cutting a finished response, extending one, or saying it is not finished re-opens it: the
        # attempt that finished was not committed and the new one may end elsewhere. (A cut and a
        # re-append of the same tokens, coalesced into one message, is the last case.)
        reopen = request_id in g.finished and (cuts or offset + len(toks) > have or not finished)
        if reopen and g.completed:
            raise FailedPrecondition(f"group {g.group_id!r} is complete (promoted to history); request "
                                     f"{request_id!r} cannot be truncated", field=f"{where}truncate")
        fresh = len(toks) - same
        if fresh:
            self._make_room(fresh * append_token_bytes(self.limits.levels), keep=g)
        dropped, added = index.replace_from(request_id, offset + same, toks[same:])
        if reopen:
            g.finished.discard(request_id)
        newly_finished = finished and request_id not in g.finished
        # A re-opening is logged even when no token changed (an entry without tokens, not
        # finished): mirrors follow the server's finished state, and a worker that finished the
        # response must not resend it as finished after a restart (review, session 18).
        if dropped or added or newly_finished or reopen:
            g.log.append(SeqDelta(request_id, offset + same, tuple(toks[same:]), finished, truncate=bool(dropped)))
            g.log_bytes += _LOG_ENTRY_BYTES + added * _LOG_TOKEN_BYTES
        if dropped:
            log.info("response truncated", extra=kv(group_id=g.group_id, request_id=request_id,
                                                    offset=offset + same, dropped=dropped))
        if newly_finished:
            g.finished.add(request_id)
            self._maybe_complete(g)
        g.expires_at = now + g.ttl_s
        return added, len(toks) - added

    def _maybe_complete(self, g: _Group) -> None:
        if g.completed or g.group_size <= 0 or len(g.finished) < g.group_size or not g.prompt_key:
            return
        g.completed = True
        responses = [g.index.tokens(r) for r in sorted(g.finished)]
        # History never holds a group's responses twice: a group completed again (re-created by a
        # worker after a restart, or a new incarnation of its id resent the old responses) adds
        # nothing when the same responses are held for the key already (promoted here before, or
        # refilled from the buffer, which keeps them too).
        if self._history.add(g.prompt_key, g.history_iteration, responses):
            log.info("group complete; responses promoted to history",
                     extra=kv(group_id=g.group_id, prompt_key=g.prompt_key, iteration=g.history_iteration))
        else:
            log.info("group complete; its responses are history already",
                     extra=kv(group_id=g.group_id, prompt_key=g.prompt_key))
        self._evict(keep=g)  # the new history counts against the budget at once

    # ---- history --------------------------------------------------------------------------------

    def seed_history(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> int:
        if not prompt_key:
            raise InvalidArgument("must not be empty", field="prompt_key")
        if iteration < 0:
            raise InvalidArgument("must be >= 0", field="iteration")
        total = 0
        for i, r in enumerate(responses):
            if len(r) > self.limits.max_response_tokens:
                raise InvalidArgument(f"{len(r)} tokens > limit {self.limits.max_response_tokens}",
                                      field=f"responses[{i}]")
            _check_tokens(r, f"responses[{i}].token_ids")
            total += len(r)
        with self._lock:
            if self._history.has(prompt_key, responses):
                return 0  # a retry, or held already (e.g. promoted from a group here): loaded already
            # Room for the stored copy and for the copy indexed (and logged) by every live group
            # of the key, before anything is added: nothing is half-seeded when the budget is full.
            live = [g for g in self._groups.values() if g.prompt_key == prompt_key and not g.completed]
            per_copy = total * (append_token_bytes(self.limits.levels) + _LOG_TOKEN_BYTES) + len(responses) * (
                _LOG_ENTRY_BYTES + 120)
            stored = total * HISTORY_TOKEN_BYTES + len(responses) * HISTORY_RESPONSE_BYTES
            self._make_room(stored + len(live) * per_copy)
            added = self._history.add(prompt_key, iteration, responses)
            # Live groups of this key get the new responses too (as history log entries).
            for g in live:
                if g.group_id in self._groups:
                    for r in added:
                        g.index.add_history(r)
                        g.log.append(SeqDelta("", 0, r, True))
                        g.log_bytes += _LOG_ENTRY_BYTES + len(r) * _LOG_TOKEN_BYTES
            self._evict()
            return len(added)

    # ---- sync -----------------------------------------------------------------------------------

    def sync(self, watermarks: Sequence[tuple[str, int]], incarnations: Sequence[int] | None = None
             ) -> list[GroupDelta]:
        """incarnations[i]: the incarnation watermarks[i] belongs to (0 or None = unknown: trusted)."""
        if incarnations is not None and len(incarnations) != len(watermarks):
            raise InvalidArgument("one incarnation per watermark", field="groups")
        seen: set[str] = set()
        for i, (gid, wm) in enumerate(watermarks):
            if not gid:
                raise InvalidArgument("must not be empty", field=f"groups[{i}].group_id")
            if gid in seen:
                raise InvalidArgument(f"group {gid!r} listed twice", field=f"groups[{i}].group_id")
            if wm < 0:
                raise InvalidArgument("must be >= 0", field=f"groups[{i}].watermark")
            seen.add(gid)
        out: list[GroupDelta] = []
        with self._lock:
            self._sweep(self._clock())
            for i, (gid, wm) in enumerate(watermarks):
                g = self._groups.get(gid)
                if g is None:
                    # expired only for a completed group: an unfinished one that expired (a request
                    # paused between chunks past the TTL) is re-created by its workers, with the
                    # finished siblings they hold; dropping their mirrors would lose those for good.
                    out.append(GroupDelta(gid, 0, gone=True, expired=bool(self._expired.get(gid))))
                    continue
                inc = incarnations[i] if incarnations is not None else 0
                reset = bool(inc) and inc != g.incarnation
                if not reset and wm > g.watermark:
                    raise InvalidArgument(f"watermark {wm} is ahead of the group's {g.watermark}",
                                          field=f"groups[{i}].watermark")
                if wm == 0 or reset:
                    out.append(GroupDelta(gid, g.watermark, _coalesce(g.log), g.index.prompt,
                                          tuple(g.index.history_tokens(g.history_count)), incarnation=g.incarnation,
                                          reset=reset))
                else:
                    out.append(GroupDelta(gid, g.watermark, _coalesce(g.log[wm - 1 :]), incarnation=g.incarnation))
        return out

    # ---- memory ---------------------------------------------------------------------------------

    def _memory(self) -> int:
        return self._history.memory_bytes + sum(g.memory_bytes for g in self._groups.values())

    def _make_room(self, extra: int, keep: _Group | None = None) -> None:
        """Evicts (never `keep`) until `extra` more bytes fit; ResourceExhausted when they cannot."""
        budget = self.limits.memory_budget_bytes
        self._evict(extra, keep)
        if self._memory() + extra > budget:
            raise ResourceExhausted(
                f"draft memory budget {budget} bytes is full ({self._memory()} used, no history or completed "
                "group left to evict)", field="memory_budget_bytes")

    def _evict(self, extra: int = 0, keep: _Group | None = None) -> None:
        """Oldest history iteration first, then completed groups, oldest first; never `keep` (the
        group an append is writing: evicting it would index the tokens into an orphan)."""
        budget = self.limits.memory_budget_bytes
        while self._memory() + extra > budget:
            if self._history.evict_oldest():
                continue
            done = [g for g in self._groups.values() if g.completed and g is not keep]
            if not done:
                return
            oldest = min(done, key=lambda g: g.created)
            del self._groups[oldest.group_id]
            self._tombstone(oldest.group_id, completed=True)
            self._evicted_groups += 1
            log.info("completed group evicted", extra=kv(group_id=oldest.group_id, prompt_key=oldest.prompt_key))

    # ---- expiry ---------------------------------------------------------------------------------

    def _tombstone(self, group_id: str, completed: bool) -> None:
        self._expired[group_id] = completed
        while len(self._expired) > _TOMBSTONES:
            self._expired.popitem(last=False)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + 0.5
        dead = [gid for gid, g in self._groups.items() if g.expires_at <= now]
        for gid in dead:
            self._tombstone(gid, self._groups.pop(gid).completed)
            self._expired_count += 1
        if dead:
            log.info("groups expired", extra=kv(count=len(dead)))

    def expire_now(self) -> int:
        """Runs the TTL sweep immediately; returns the number of live groups."""
        with self._lock:
            self._next_sweep = 0.0
            self._sweep(self._clock())
            return len(self._groups)

    # ---- stats ----------------------------------------------------------------------------------

    def stats(self) -> DraftStats:
        with self._lock:
            self._sweep(self._clock())
            tokens = sum(g.index.indexed_tokens for g in self._groups.values())
            mem = self._memory()
            return DraftStats(
                groups=len(self._groups),
                history_keys=self._history.num_keys,
                indexed_tokens=tokens,
                memory_bytes=mem,
                memory_budget_bytes=self.limits.memory_budget_bytes,
                bytes_per_token=mem / tokens if tokens else 0.0,
                evicted_history=self._history.evicted,
                expired_groups=self._expired_count,
                evicted_groups=self._evicted_groups,
            )

    def index_of(self, group_id: str) -> GroupIndex:
        """The live index of a group (tests and the in-process simulator)."""
        with self._lock:
            return self._get(group_id, "group_id").index


def _incarnation() -> int:
    """A random nonzero 63-bit id for a new group (fits proto uint64 and a Python int cheaply)."""
    return secrets.randbits(63) | 1


def _coalesce(entries: Sequence[SeqDelta]) -> tuple[SeqDelta, ...]:
    """Merges consecutive appends of one request (per-step appends are 1-3 tokens each).

    A truncate at an offset inside the previous entry of the request folds into it (cutting its
    tokens): after the previous entry the response has exactly prev.offset + len(prev.token_ids)
    tokens, so "prev, then cut to e.offset and append" equals one truncate at prev.offset."""
    out: list[SeqDelta] = []
    last: dict[str, int] = {}
    for e in entries:
        j = last.get(e.request_id)
        if e.request_id and j is not None:
            prev = out[j]
            end = prev.offset + len(prev.token_ids)
            if not prev.finished and (end == e.offset or (e.truncate and prev.offset <= e.offset <= end)):
                out[j] = SeqDelta(e.request_id, prev.offset, prev.token_ids[: e.offset - prev.offset] + e.token_ids,
                                  e.finished, prev.truncate or e.truncate)
                continue
        last[e.request_id] = len(out)
        out.append(e)
    return tuple(out)

