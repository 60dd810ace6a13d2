"""The draft server's state: groups (index + append log + TTL), history, memory budget, watermarks.

Protocol (DESIGN.md section 4, Seer appendix: update_cst / fetch_cst / register_group):

- register_group(group_id, prompt_key, prompt, ttl, group_size, epoch, submit_seq, policy_version)
  creates the group's index with the prompt and the key's history (policy_version: the history
  iteration its responses are promoted as, below). Re-registering with the same prompt refreshes the TTL.
  The id of a completed group (its responses are history) registered again after it was evicted or
  expired, or with another prompt or group_size, or by another run, starts a new incarnation: a
  batch id used again; another group_size while it runs is refused (0 = unknown agrees with any).
  Another run: where the registration and the group both carry the buffer's `submit_seq`
  (strictly increasing per buffer store), a larger one, whatever the epoch, and whether the group
  completed or still runs (a cancelled run's unfinished group is replaced); a smaller one is an
  older run's straggler: refused (FailedPrecondition, field submit_seq), live or remembered.
  Without, an attempt whose dispatch `epoch` is above every epoch a completed group took (dispatch
  epochs increase over all requests). After it expired or was evicted, the same prompt, key and
  size with the same submit_seq (or, without, at an epoch at most the largest it took) is its own
  run's (a retry): refused (FailedPrecondition, field submit_seq or epoch), not a new incarnation.
- append(group_id, request_id, offset, tokens, finished, epoch) is idempotent by offset (see GroupIndex).
  `epoch` orders the attempts of a request (the scheduler's dispatch_epoch): an append older than
  the newest epoch seen for the request is refused (FailedPrecondition, field epoch), so a late or
  retried message of an abandoned attempt never overwrites a newer attempt's tokens; 0 = unordered.
  `incarnation` (the sender mirror's; 0 = unknown) must be the group's: an old incarnation's late
  append never lands in a group id registered again.
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
  reset=True, so the mirror rebuilds instead of applying a foreign log from its middle. When the
  caller's incarnation is one this server saw complete before the id was registered again (a
  resubmitted batch id), or a running one that a newer submission's registration replaced (the old
  run was cancelled or deleted: remembered and tombstoned as if completed, so that its workers stop
  resending into the newer run's group and its late registrations are refused), the reset also
  says reused=True: the caller's old responses are another run's and must not be resent. It carries
  reused_epoch, the largest append epoch the old incarnation took: the caller's requests of a larger
  epoch are the new run's (dispatched after the resubmission), even the ones that ended on its stale
  mirror; and reused_submit_seq (the old
  incarnation's submit_seq) with submit_seq (the new one's), which decide instead where known (a
  new run after the scheduler's clock went back has epochs at most reused_epoch). After a restart
  nothing is known of older incarnations: reused is False and the workers resend their responses
  (the same run's, re-creating the group), except a worker whose incarnation completed (released)
  or whose run is older than the reset's submit_seq (another run's group: resent by submission).
- seed_history(key, iteration, responses) is idempotent per response (HistoryStore.add: a response
  held for the key loads once, in whatever order, iteration or add; a subset or superset of an
  earlier seed loads only what is new).
- A group whose `group_size` responses are all finished has its responses promoted to history for
  its prompt key (the next iteration's drafts, RhymeRL) and becomes evictable under memory pressure.
  They are promoted as the group's policy version (register's policy_version): the groups of a key
  at one version form one history iteration. A group without one (an old client) merges into the
  key's newest iteration when that is a version, else takes the newest fallback number + 1; fallback
  numbers are kept below every version (HistoryStore.next_iteration, history.unversioned).
- Memory is bounded by `memory_budget_bytes`: over budget, the oldest history iteration goes first,
  then completed groups in the order they completed (never the group being written); when nothing
  is left to evict, new groups, history and appends (re-opening a response, or a request's first
  epoch, too; never a finish, whose entry the response's first append reserved) are refused with
  RESOURCE_EXHAUSTED (drafting degrades; generation
  never depends on the draft server). A worker still mirroring a completed group that
  was evicted or expired drops its mirror (Sync: gone + expired); history never holds the same
  responses of a key twice (HistoryStore.add), whichever way a group completes again.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import secrets
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.log import get_logger, kv
from services.draft.history import (
    HISTORY_ITERATION_RESPONSES,
    HISTORY_RESPONSE_BYTES,
    HISTORY_TOKEN_BYTES,
    HistoryStore,
    log_fields,
    source_id,
    unversioned,
)
from services.draft.index import DEFAULT_LEVELS, GroupIndex, common_prefix, new_index_bytes_bound

log = get_logger(__name__)

_MAX_TOKEN_ID = (1 << 31) - 1
_LOG_ENTRY_BYTES = 120  # a SeqDelta object and its tuple, calibrated with tracemalloc
_LOG_TOKEN_BYTES = 36
_TOMBSTONES = 65536  # expired group ids remembered to tell "expired" from "unknown"
# Completed incarnations remembered per group id (DraftStore._reused), and running ones a newer
# submission replaced (remembered as completed): a watermark of one of them is answered reset +
# reused. Ids as many as tombstones; per id the newest few (an id reused over and over: a worker's
# mirror is at most a few incarnations behind), packed in one bytes object as (incarnation, largest
# epoch, registration digest, group_size, submit_seq) records: uint64 x 3 +
# uint32 + uint64 (36 bytes). The submit_seq (the buffer's submission of the run; 0 = unknown), or
# without it the digest (_registration_digest: prompt key and prompt), size and epoch, tell a
# registration of that run from another's once the group expired (DraftStore.register_group).
_REUSED_PER_ID = 4
_REUSED = struct.Struct("<QQQIQ")
# Memory of one remembered id besides its characters (DraftStats.remembered_ids_bytes; tracemalloc,
# tests/draft/test_client_reused_epoch.py): a tombstone's OrderedDict entry and key string; a reused
# record's entry, key string and bytes object besides its records (_REUSED.size bytes each). The key
# string is shared when an id is in both, and counted in both (an upper bound).
_TOMBSTONE_BYTES = 180
_REUSED_ID_BYTES = 220
_EPOCH_BYTES = 100  # a request's entry in _Group.epochs
# A group's fixed structures besides its index (GroupIndex.memory_bytes counts that): the _Group
# object, its empty log, sets and dicts, its group id and prompt key strings, its entries in
# _groups, _by_key (a dict of its own for a key of one group) and _completed, and its expiry heap
# entry. tracemalloc, 5,000 groups registered with 4-token prompts: ~1,400 bytes each besides
# the index (tests/draft/test_index_memory.py). It was not counted: 2,046 groups admitted under a
# 1 MiB budget held 7.3 MB.
_GROUP_BYTES = 1400
_EXPIRY_SLACK = 64  # stale expiry heap entries allowed beyond the live groups' count (DraftStore._expiry)
# Memory budget: everything a write adds to a group (index growth, bounded by GroupIndex; its log
# entry, tokens or not; a request's first epoch entry) is made room for before it is written, as an
# upper bound, and so is new history; history a completing group promotes is evicted first when it
# does not fit (_maybe_complete). So the reported memory never exceeds the budget. A response's finish
# entry is reserved with its first append (_finish_reservation): a finish is never refused for room,
# since completing a group is what makes it evictable (refused, a store full of incomplete groups
# stayed full until their TTLs ran out). It is a running total (DraftStore._charge), not a sum over
# the groups.


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
    # With reset: the caller's incarnation completed here and the id was registered again (another
    # run): its responses must not be resent into this one.
    reused: bool = False
    # With reused: the largest append epoch the caller's incarnation took (0 = unknown): the
    # caller's requests of a larger epoch are the new run's.
    reused_epoch: int = 0
    # With reused: the submit_seq of the caller's incarnation (0 = unknown). With reset: this
    # incarnation's (0 = unknown). Known on both sides, they decide which of the caller's requests
    # are the new run's, whatever the epochs (a clock gone back gives a new run lower ones).
    reused_submit_seq: int = 0
    submit_seq: int = 0
    expired: bool = False  # with gone: expired or evicted here (not lost in a restart)


@dataclass(frozen=True)
class Registration:
    """DraftStore.register's answer (RegisterGroupResponse)."""

    created: bool
    history_responses: int
    # The group's incarnation and submit_seq the registration was judged against (now live): a
    # worker stamps the appends it queued before it had an incarnation with it, so they never land
    # in an incarnation created after this one (another run's, registered meanwhile).
    incarnation: int
    submit_seq: int


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
    # Tombstones and remembered completed incarnations (outside memory_bytes and the budget).
    remembered_ids_bytes: int = 0
    # History adds rejected as older than every kept iteration of their key (HistoryStore.
    # rejected_adds, retries too; their responses are in evicted_history once). /metrics only:
    # GetDraftStatsResponse has no field for it.
    rejected_history_adds: int = 0


@dataclass
class _Group:
    group_id: str
    prompt_key: str
    group_size: int
    ttl_s: float
    _expires_at: float  # the expires_at property: its setter keeps DraftStore's expiry heap right
    index: GroupIndex
    # The history iteration its responses are promoted as: its policy version (RegisterGroupRequest.
    # policy_version), or without one HistoryStore.next_iteration when it was created (the key's
    # newest version, or a fallback number below every version).
    history_iteration: int
    incarnation: int
    # History responses the index loaded at creation (the wm=0 reply rebuilds them from the index:
    # holding the history store's tuples here would keep evicted history alive, unaccounted).
    history_count: int = 0
    # _registration_digest of its prompt key and prompt, kept with the incarnation once it completed
    # and is removed, or a newer submission replaced it running (DraftStore._remember_reused).
    digest: int = 0
    # The buffer's submission of the run that created it (RegisterGroupRequest.submit_seq; 0 =
    # unknown: an old client), or of the first registration that brought one; kept likewise.
    submit_seq: int = 0
    # history_iteration is a policy version (a registration brought one); False: the fallback
    # number, which the first registration with a version replaces while the group runs.
    versioned: bool = False
    log: list[SeqDelta] = field(default_factory=list)
    log_bytes: int = 0
    finished: set[str] = field(default_factory=set)
    completed: bool = False
    epochs: dict[str, int] = field(default_factory=dict)  # request -> newest attempt epoch seen
    # Responses not finished whose finish entry (a log entry) is reserved in memory_bytes: taken by
    # the first append of a response, used by its finish (DraftStore._finish_reservation).
    finish_reserved: set[str] = field(default_factory=set)
    # What DraftStore's running totals hold for this group (memory_bytes, indexed tokens) as of
    # its last _charge.
    charged_bytes: int = 0
    charged_tokens: int = 0
    # Expiry (DraftStore._expiry): the sequence number and deadline of the group's current heap
    # entry (-1: none, the group is not live; a new incarnation gets a new number, so an old
    # incarnation's entry is never current), when it was added (_groups' order, the order a sweep
    # expires groups in), and what to call when its deadline moves before its entry's (set while
    # it is live: DraftStore._requeue_expiry).
    expiry_seq: int = -1
    queued_at: float = 0.0
    # The current entry itself, (queued_at, expiry_seq, group_id), the tuple in the heap: a rebuild
    # (DraftStore._compact_expiry) collects these, and writes nothing.
    expiry_entry: tuple[float, int, str] = (0.0, -1, "")
    added_seq: int = 0
    requeue: Callable[[_Group], None] | None = field(default=None, repr=False, compare=False)

    @property
    def expires_at(self) -> float:
        return self._expires_at

    @expires_at.setter
    def expires_at(self, at: float) -> None:
        # Later than the heap entry (an append, a re-registration): nothing to do, O(1) (the entry
        # is pushed again when it comes up, DraftStore._sweep). Earlier (a re-registration with a
        # shorter TTL, or a test making a group due): the entry would expire the group late, so a
        # new one is pushed. A property, not a store method each writer must remember to call: no
        # write of a live group's deadline can leave the heap behind.
        self._expires_at = at
        if at < self.queued_at and self.requeue is not None:
            self.requeue(self)

    @property
    def watermark(self) -> int:
        return 1 + len(self.log)

    @property
    def memory_bytes(self) -> int:
        return (_GROUP_BYTES + self.index.memory_bytes() + self.log_bytes + len(self.epochs) * _EPOCH_BYTES
                + len(self.finish_reserved) * _LOG_ENTRY_BYTES)


@dataclass(frozen=True)
class StoreLimits:
    memory_budget_bytes: int = 2 << 30
    history_iterations: int = 2
    history_iteration_responses: int = HISTORY_ITERATION_RESPONSES
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


def _sizes_agree(a: int, b: int) -> bool:
    """Two group sizes of one group agree: equal, or either is 0 ("unknown" agrees with any)."""
    return not a or not b or a == b


class DraftStore:
    """Thread-safe: one lock around everything (the gRPC server calls in from a thread pool)."""

    def __init__(self, limits: StoreLimits | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or StoreLimits()
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        # Completed groups (the evictable ones), in the order they completed: eviction takes the
        # first in O(1). (It took the oldest created with a min() over every group per eviction.)
        # Completion order, not creation: the groups of a batch register within moments and complete
        # over minutes (the long tail), so creation order would evict a group that completed a moment
        # ago, whose workers are still mirroring it and may still send a straggler's appends, before
        # one whose workers finished with it long ago. A group completes at most once.
        self._completed: OrderedDict[str, _Group] = OrderedDict()
        # Running totals over the live groups, kept exactly by _charge / _add_group / _remove_group:
        # the budget check runs on every append, and summing over the groups took 9 ms with 5,000
        # live groups, under the lock.
        self._group_bytes = 0
        self._indexed_tokens = 0
        self._history = HistoryStore(self.limits.history_iterations, self.limits.history_iteration_responses)
        self._expired: OrderedDict[str, bool] = OrderedDict()  # tombstones: group id -> was completed
        # Group id -> its incarnations that completed and were then removed (replaced by a new
        # incarnation, expired or evicted), newest last. A reset of one of them is the id used
        # again by another run, not a restart: its workers must not resend the old responses (they
        # are history, and would become the new run's). Bounded like the tombstones: an id dropped
        # from here is answered as unknown (resend), as before GroupDelta.reused. Each incarnation
        # with the largest epoch it took (GroupDelta.reused_epoch), _REUSED-packed.
        self._reused: OrderedDict[str, bytes] = OrderedDict()
        # Estimated memory of _expired and _reused (DraftStats.remembered_ids_bytes), kept by
        # _tombstone and _remember_reused.
        self._remembered_bytes = 0
        self._expired_count = 0
        self._evicted_groups = 0
        self._next_sweep = 0.0
        # TTL expiry as a min-heap of (deadline, seq, group id) with lazy deletion: a sweep looks at
        # the entries due only (it scanned every live group under the lock, every 0.5 s: 0.25 ms at
        # 5,000 groups, 9 ms at 50,000; bench.store_scaling). An entry is current when its group
        # is live and holds its seq (expiry_seq); the others (a group removed, or replaced by a new
        # incarnation of its id, or an entry superseded by an earlier deadline) are dropped when
        # they come up. A refresh that moves a deadline later (every append: one per decode step)
        # pushes nothing (_Group.expires_at): the current entry, now early, is pushed again at the
        # group's deadline when it comes up, so a busy group costs one push per TTL, not one per
        # append, and the heap does not grow with appends. Ids, not groups: a stale entry must not
        # keep an evicted group's memory alive. The heap is rebuilt when stale entries outnumber
        # the live groups (_compact_expiry): it holds at most 2 x live groups + _EXPIRY_SLACK.
        self._expiry: list[tuple[float, int, str]] = []
        self._expiry_seq = itertools.count()
        # Live groups by prompt key, in _groups' order (seed_history loads a key's history into its
        # live groups: it looked through every group). Kept by _add_group / _remove_group.
        self._by_key: dict[str, dict[str, _Group]] = {}

    # ---- groups ---------------------------------------------------------------------------------

    def register_group(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], ttl_seconds: int = 0,
        group_size: int = 0, epoch: int = 0, submit_seq: int = 0, policy_version: int | None = None,
    ) -> tuple[bool, int]:
        """Returns (created, history responses loaded); see register. The tests' and benchmarks'
        shorthand: the service calls register (it answers the incarnation and submission too)."""
        r = self.register(group_id, prompt_key, prompt_token_ids, ttl_seconds, group_size, epoch, submit_seq,
                          policy_version)
        return r.created, r.history_responses

    def register(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], ttl_seconds: int = 0,
        group_size: int = 0, epoch: int = 0, submit_seq: int = 0, policy_version: int | None = None,
    ) -> Registration:
        """Registers the group; returns what the registration was judged against (the group's
        incarnation and submission as of this call: RegisterGroupResponse). epoch: the registering
        attempt's dispatch epoch (0 = unknown). submit_seq: the buffer's submission of its batch (0
        = unknown); where both it and the group's are known, it alone tells the same run from
        another. policy_version: the version the group generates with, its history iteration (None
        = unknown: the key's newest version, or without one a fallback number below every version,
        HistoryStore.next_iteration; the first registration that brings a version while the group
        runs replaces it; any registration with a version renumbers a refill of the key seeded under
        the fallback, _renumber_refill)."""
        if not group_id:
            raise InvalidArgument("must not be empty", field="group_id")
        if ttl_seconds < 0 or ttl_seconds > self.limits.max_ttl_seconds:
            raise InvalidArgument(f"must be in [0, {self.limits.max_ttl_seconds}] (0 = default)", field="ttl_seconds")
        if group_size < 0:
            raise InvalidArgument("must be >= 0 (0 = unknown)", field="group_size")
        if epoch < 0:
            raise InvalidArgument("must be >= 0 (0 = unknown)", field="epoch")
        if submit_seq < 0:
            raise InvalidArgument("must be >= 0 (0 = unknown)", field="submit_seq")
        if policy_version is not None and policy_version < 0:
            raise InvalidArgument("must be >= 0 (unset = unknown)", field="policy_version")
        if len(prompt_token_ids) > self.limits.max_prompt_tokens:
            raise InvalidArgument(f"{len(prompt_token_ids)} tokens > limit {self.limits.max_prompt_tokens}",
                                  field="prompt_token_ids")
        _check_tokens(prompt_token_ids, "prompt_token_ids")
        ttl = float(ttl_seconds or self.limits.default_ttl_seconds)
        digest = _registration_digest(prompt_key, prompt_token_ids)  # outside the lock: O(prompt)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            g = self._groups.get(group_id)
            if g is not None:
                same_prompt = g.prompt_key == prompt_key and g.index.prompt == tuple(prompt_token_ids)
                # group_size 0 is "unknown" on either side: it agrees with any size.
                same_size = _sizes_agree(group_size, g.group_size)
                # Another run: both submissions known, they alone decide, whatever the epochs and
                # whether the group completed (a scheduler restarted without its epoch_file behind a
                # clock gone back dispatches a new run below the old run's epochs; a lost commit's
                # retry of the old run is dispatched above them). submit_seq is strictly
                # increasing per buffer store, so a newer one is a resubmission of the batch id
                # (its old run completed, or was cancelled or deleted and left this group
                # unfinished: kept, the new run's appends were refused as stale attempts of it
                # until the TTL ran out), and an older one a straggler of a run the id has moved
                # on from (a retried RegisterGroup, a worker re-creating what it lost): refused,
                # as the remembered path below refuses it once this group expired (taken as
                # another run, it reset this run's workers as if their own run were another's).
                # Without both: a completed group registered by an attempt dispatched after every
                # attempt it took is another run (a resubmitted batch id brings the same prompt,
                # key and size too); a group that took no epoch cannot be ordered against.
                largest = max(g.epochs.values(), default=0)
                if submit_seq and g.submit_seq:
                    if submit_seq < g.submit_seq:
                        raise FailedPrecondition(
                            f"group {group_id!r} is of submit_seq {g.submit_seq}; submit_seq {submit_seq} is an "
                            "older run's registration: nothing to draft for", field="submit_seq")
                    new_run = submit_seq > g.submit_seq
                else:
                    new_run = g.completed and epoch > largest > 0
                if same_prompt and same_size and not new_run:
                    # The same registration (a retry, another worker of the group): idempotent, also
                    # once it completed (a sibling's late registration must not start it over).
                    if group_size and not g.group_size:
                        # The first registration did not know the size: it is known now, and the
                        # group completes (promotes its responses) on it from now on.
                        if len(g.finished) > group_size:
                            raise AlreadyExists(f"group {group_id!r} has {len(g.finished)} finished responses, "
                                                f"more than group_size {group_size}", field="group_size")
                        g.group_size = group_size
                        self._maybe_complete(g)
                    if submit_seq and not g.submit_seq and not g.completed:
                        # Created by an old client: the running group takes its run's submission
                        # from this registration (another worker of the same run), so that its
                        # completion is judged by it later. Not a completed one: that it is the
                        # same run was judged by epochs only.
                        g.submit_seq = submit_seq
                    if policy_version is not None and not g.versioned and not g.completed:
                        # Likewise its iteration: the run's version, not the number it was given.
                        g.history_iteration, g.versioned = policy_version, True
                    if policy_version is not None:
                        # A version is known for the key now: a refill seeded under fallback 0
                        # becomes the buffer's version it was (whichever group of the key brings it).
                        self._renumber_refill(g)
                    g.ttl_s = ttl
                    g.expires_at = now + ttl
                    return Registration(False, g.index.num_history, g.incarnation, g.submit_seq)
                if not g.completed and not new_run:
                    # Another run under the same id while this one is running. Another group_size
                    # alone is one too (not a retry: every worker of a run sends the batch's size):
                    # taken as the same group, it would complete, and promote, at the first size.
                    if same_prompt:
                        raise AlreadyExists(f"group {group_id!r} exists with group_size {g.group_size}, not "
                                            f"{group_size}", field="group_size")
                    raise AlreadyExists(f"group {group_id!r} exists with another prompt or prompt key",
                                        field="group_id")
                # Completed (its responses are history) and registered with another prompt, key or
                # group size, or by a newer run: the id is used again (a batch id resubmitted after
                # the buffer's retention deleted it). Or running, and registered by a newer
                # submission (the old run was cancelled or deleted).
                # Remembered even while running (as a completed one always is): its workers' next
                # Sync is a reused reset (their responses are the old run's, not to be resent into
                # this one), and a late registration of it is refused by its submit_seq.
                self._remove_group(g, remember=True)
                # Tombstoned as an expired completed group: if this registration is refused below
                # (no room), the old group's workers are told it expired, not that it was lost.
                self._tombstone(group_id, True)
                log.info("group's id registered again by another run; new incarnation",
                         extra=kv(group_id=group_id, epoch=epoch, largest_epoch=largest, same_prompt=same_prompt,
                                  same_size=same_size, submit_seq=submit_seq, old_submit_seq=g.submit_seq,
                                  old_completed=g.completed))
            else:
                # Not live. Both cases are judged against the id's remembered incarnations by one
                # _same_run_reused call; only a tombstoned completed group also goes by epoch.
                # Without a completed tombstone:
                # Never registered, lost in a restart, or an unfinished group that expired (its
                # workers re-create it). By submission still, whatever the tombstone: an incarnation
                # remembered of a newer run (or of this run, with this prompt: replaced by a newer
                # one, or completed) means this is a straggler of a run the id moved on from. After
                # a newer run replaced this run's running group and then expired unfinished
                # (tombstone False), the straggler was accepted and created a group of the old run
                # (review). The epoch rule stays with the tombstone (submit_seq 0: as before).
                # With one (completed, then evicted or expired): its responses are history, so this
                # is the id used again (see above), a new incarnation, unless the registration says it is the
                # same run: the same prompt, key and size (0 agrees with any), as the live path
                # above tells the same registration, and an epoch at most the largest that
                # completed incarnation took (a retried RegisterGroup, a straggler of the run
                # re-creating the group it lost). Taken as new, that run's workers still following
                # the old incarnation would get reset + reused and take their own run for another;
                # refused as the existing-group path above would answer it (idempotent: nothing of
                # that run is created again). Another prompt, key or size is another run whatever
                # its epoch (a scheduler restarted without its epoch_file behind a clock that went
                # back dispatches low epochs); the same ones at such a low epoch cannot be told from
                # the old run and are refused (services/draft/README.md).
                # Every remembered incarnation, not only the newest: after a run with another prompt
                # reused the id in between, a straggler of the older run matched nothing newer and
                # got a lone incarnation of the old prompt (review, session 27).
                # With the submission known on both sides it decides instead of the epoch: the same
                # submit_seq is that run (a lost commit's retry dispatched above its epochs too),
                # another is another run (a new run dispatched below them: the clock went back).
                # An older submit_seq than a remembered incarnation's is an older run's, whatever
                # its prompt: refused as in the live path.
                expired = bool(self._expired.get(group_id))
                same = self._same_run_reused(group_id, digest, group_size, epoch, submit_seq, by_epoch=expired)
                if same is not None:
                    largest, by_seq = same
                    if not by_seq:  # only with by_epoch, so only for an expired completed group
                        raise FailedPrecondition(
                            f"group {group_id!r} completed (its responses are history) and expired; epoch {epoch} "
                            f"is of that run (its largest epoch is {largest}): nothing to draft for", field="epoch")
                    if expired:
                        raise FailedPrecondition(
                            f"group {group_id!r} completed (its responses are history) and expired; submit_seq "
                            f"{submit_seq} is of that run or an older one: nothing to draft for", field="submit_seq")
                    raise FailedPrecondition(
                        f"group {group_id!r}: submit_seq {submit_seq} is of a run the id moved on from (a "
                        "newer run registered it): nothing to draft for", field="submit_seq")
                if expired:
                    log.info("completed group's id registered again after it expired; new incarnation",
                             extra=kv(group_id=group_id))
            # Room for the prompt and the key's history as indexed; eviction (oldest history first)
            # may take some of that very history, so the need is taken again after it: the group
            # then registers with what is left rather than being refused for history now gone.
            self._evict(self._new_group_bytes(len(prompt_token_ids), prompt_key))
            self._make_room(self._new_group_bytes(len(prompt_token_ids), prompt_key))
            history = self._history.responses(prompt_key) if prompt_key else []
            index = GroupIndex(prompt_token_ids, levels=self.limits.levels)
            for r in history:
                index.add_history(r)
            # One RL iteration is one policy version: every group of the key at that version is
            # promoted into one history iteration. The key's next number (newest kept + 1), the
            # only rule before the version was sent and still the one without it, made a group
            # registered after another of its key and version completed (a prompt sampled twice
            # in a batch, a batch split into two submissions) a newer iteration of its own, which
            # pushed a genuinely earlier one out of the `history_iterations` kept.
            if policy_version is not None:
                iteration = policy_version
            else:
                iteration = self._history.next_iteration(prompt_key) if prompt_key else unversioned(0)
            g = _Group(group_id, prompt_key, group_size, ttl, now + ttl, index, iteration,
                       _incarnation(), len(history), digest, submit_seq, policy_version is not None)
            self._add_group(g)
            if self._expired.pop(group_id, None) is not None:
                self._remembered_bytes -= _TOMBSTONE_BYTES + len(group_id)
            if policy_version is not None and prompt_key:
                # Another group of the key may hold a refill seeded under fallback 0 before any
                # version was known: renumbered only when that group itself took a version, it was
                # dropped one version early when this group's version completed (review 4417).
                self._renumber_refill(g)
            log.info("group registered", extra=kv(group_id=group_id, prompt_key=prompt_key,
                                                  history=len(history), ttl_s=ttl))
            return Registration(True, len(history), g.incarnation, g.submit_seq)

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
        *, where: str = "", truncate: bool = False, epoch: int = 0, incarnation: int = 0,
    ) -> tuple[int, int]:
        """Returns (tokens appended, duplicate tokens skipped). `where` prefixes field names.
        `incarnation`: the group incarnation the sender's mirror follows (0 = unknown: trusted)."""
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
        if incarnation < 0:
            raise InvalidArgument("must be >= 0", field=f"{where}incarnation")
        _check_tokens(token_ids, f"{where}token_ids")
        with self._lock:
            now = self._clock()
            self._sweep(now)
            g = self._get(group_id, f"{where}group_id")
            if incarnation and incarnation != g.incarnation:
                # A late append of an earlier incarnation of this id (a resubmitted batch id brings
                # the same group and request ids): in the new one it would land as the start of a
                # response not started yet, or extend a shorter one, with tokens of another run,
                # and the new run's own appends there are then refused (an overlap with different
                # tokens), so its response never reaches the index. The sender's next Sync is
                # answered with reset; if the tokens are of the same run (a group re-created after
                # a restart or an unfinished group's expiry) it resends them then.
                raise FailedPrecondition(
                    f"group {group_id!r} is incarnation {g.incarnation}, this append is of incarnation "
                    f"{incarnation} (the group was registered again): sync, and resend under the new one",
                    field=f"{where}incarnation")
            current = g.epochs.get(request_id, 0)
            if epoch and epoch < current:
                raise FailedPrecondition(f"stale attempt of request {request_id!r}: epoch {epoch} < {current}, the "
                                         "newest attempt's", field=f"{where}epoch")
            # The newest epoch is recorded with the append's writes (not if it is refused); a new
            # request's first epoch is an entry the budget must hold.
            new_epoch = epoch if epoch > current else 0
            if truncate:
                return self._truncate_append(g, request_id, offset, token_ids, finished, where, now, new_epoch)
            return self._plain_append(g, request_id, offset, token_ids, finished, where, now, new_epoch)

    def _plain_append(
        self, g: _Group, request_id: str, offset: int, token_ids: Sequence[int], finished: bool, where: str,
        now: float, new_epoch: int,
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
        newly_finished = finished and request_id not in g.finished
        need = self._write_bytes(g, request_id, have, new_tokens, new_tokens > 0 or newly_finished, new_epoch)
        need += self._finish_reservation(g, request_id, newly_finished, reopen=False)
        if need > 0:
            self._make_room(need, keep=g)
        try:
            added = g.index.append(request_id, offset, token_ids)
        except InvalidArgument as e:
            raise InvalidArgument(str(e).split(": ", 1)[-1], field=f"{where}{e.field or 'token_ids'}") from None
        if new_epoch and (added or newly_finished or not g.completed):
            # A completed group does not take the epoch of an append that changes nothing: a new
            # run's attempt whose response equals the old run's (the same seeds) would otherwise
            # raise the group's largest epoch over the new run's, and its registration (and
            # GroupDelta.reused_epoch) would take that run for this one.
            g.epochs[request_id] = new_epoch
        if added or newly_finished:
            start = offset + len(token_ids) - added
            entry = SeqDelta(request_id, start, tuple(int(t) for t in token_ids[len(token_ids) - added:]),
                             finished)
            g.log.append(entry)
            g.log_bytes += _LOG_ENTRY_BYTES + added * _LOG_TOKEN_BYTES
        if newly_finished:
            g.finished.add(request_id)
        self._settle_reservation(g, request_id)
        self._charge(g)
        if newly_finished:
            self._maybe_complete(g)
        g.expires_at = now + g.ttl_s
        return added, len(token_ids) - added

    def _truncate_append(
        self, g: _Group, request_id: str, offset: int, token_ids: Sequence[int], finished: bool, where: str,
        now: float, new_epoch: int,
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
        newly_finished = finished and (reopen or request_id not in g.finished)
        # A re-opening is logged even when no token changed (an entry without tokens, not
        # finished): mirrors follow the server's finished state, and a worker that finished the
        # response must not resend it as finished after a restart (review, session 18).
        logged = cuts or fresh > 0 or newly_finished or reopen
        # A retry that changes nothing needs no room (it is never refused for it), and a cut counts
        # what it surely frees: a cut alone (a resumed attempt with nothing new yet) is refused only
        # when it grows the memory (a 1-2 token cut and its log entry).
        need = self._write_bytes(g, request_id, offset + same, fresh, logged, new_epoch)
        need += self._finish_reservation(g, request_id, newly_finished, reopen)
        if cuts:
            need -= index.truncate_bytes_floor(have - offset - same)
        if need > 0:
            self._make_room(need, keep=g)
        dropped, added = index.replace_from(request_id, offset + same, toks[same:])
        if new_epoch and (logged or not g.completed):  # see _plain_append
            g.epochs[request_id] = new_epoch
        if reopen:
            g.finished.discard(request_id)
        if logged:
            g.log.append(SeqDelta(request_id, offset + same, tuple(toks[same:]), finished, truncate=bool(dropped)))
            g.log_bytes += _LOG_ENTRY_BYTES + added * _LOG_TOKEN_BYTES
        if newly_finished:
            g.finished.add(request_id)
        self._settle_reservation(g, request_id)
        self._charge(g)
        if dropped:
            log.info("response truncated", extra=kv(group_id=g.group_id, request_id=request_id,
                                                    offset=offset + same, dropped=dropped))
        if newly_finished:
            self._maybe_complete(g)
        g.expires_at = now + g.ttl_s
        return added, len(toks) - added

    @staticmethod
    def _finish_reservation(g: _Group, request_id: str, newly_finished: bool, reopen: bool) -> int:
        """The change in reserved bytes an append makes (room is made for it with the rest; the
        append records it, _settle_reservation). A response that is not finished holds one log
        entry for its finish: its first append takes it, its finish uses it (so a finish never
        needs room: completing a group is what makes it evictable), a re-opening takes it again."""
        held = request_id in g.finish_reserved
        if newly_finished:
            return -_LOG_ENTRY_BYTES if held else 0
        if held or (request_id in g.finished and not reopen):
            return 0
        return _LOG_ENTRY_BYTES

    @staticmethod
    def _settle_reservation(g: _Group, request_id: str) -> None:
        """After an append: a response not finished holds its finish's reservation, a finished one none."""
        if request_id in g.finished:
            g.finish_reserved.discard(request_id)
        else:
            g.finish_reserved.add(request_id)

    @staticmethod
    def _write_bytes(g: _Group, request_id: str, start: int, tokens: int, logged: bool, new_epoch: int) -> int:
        """An upper bound of the memory an append adds to g: `tokens` new tokens at `start`, a log
        entry when `logged` (a finish or a re-opening without tokens too), and the request's first
        epoch entry."""
        need = g.index.append_bytes_bound(start, tokens)
        if logged:
            need += _LOG_ENTRY_BYTES + tokens * _LOG_TOKEN_BYTES
        if new_epoch and request_id not in g.epochs:
            need += _EPOCH_BYTES
        return need

    def _maybe_complete(self, g: _Group) -> None:
        if g.completed or g.group_size <= 0 or len(g.finished) < g.group_size or not g.prompt_key:
            return
        g.completed = True
        self._completed[g.group_id] = g  # evictable from now on
        rids = sorted(g.finished)
        responses = [g.index.tokens(r) for r in rids]
        # History never holds a group's responses twice: a group completed again (re-created by a
        # worker after a restart, or a new incarnation of its id resent the old responses) adds
        # nothing when the same responses are held for the key already (promoted here before, or
        # refilled from the buffer, which keeps them too). By source (group id, request id): an
        # equal response of another group of the key is another sample, held once more.
        sources = [source_id(g.group_id, r) for r in rids]
        if self._history.add(g.prompt_key, g.history_iteration, responses, sources):
            log.info("group complete; responses promoted to history",
                     extra=kv(group_id=g.group_id, prompt_key=g.prompt_key, **log_fields(g.history_iteration)))
        else:
            log.info("group complete; its responses are history already",
                     extra=kv(group_id=g.group_id, prompt_key=g.prompt_key))
        # The new history counts against the budget at once. It was not made room for before the
        # append: with the budget full, that would refuse the very append that makes memory
        # evictable. Eviction takes history first, and with all of it gone (this promotion too) the
        # memory is back within the budget the append's own writes were made room for: g is
        # never needed.
        self._evict(keep=g)

    def _renumber_refill(self, g: _Group) -> None:
        """A registration of g brought a version: a buffer refill seeded for its key under fallback
        number 0 meanwhile (refill_history: no group of the key had a version; the buffer's version
        is kept on that fallback iteration, HistoryStore.note_refill) becomes the buffer's version
        it was, as if seeded once the version was known. Whichever group of the key brings the
        version (a new group, a running unversioned one, a completed one's late registration), and
        whether or not the groups running when the refill was seeded still run: the version was
        kept on those groups, and once they had all completed a later version left the refill at
        fallback 0, dropped one version early (tests/draft/test_refill_renumber.py). Only the
        seeded responses move: an unversioned group's promotion stays at its fallback number, as
        it does when the group completes after a version came. Caller holds the lock."""
        renumbered = self._history.renumber_refill(g.prompt_key)
        if renumbered is None:
            return
        moved, version = renumbered
        if moved:
            log.info("history refill renumbered as the buffer's version (a group of its key took a version)",
                     extra=kv(prompt_key=g.prompt_key, responses=moved, iteration=version, versioned=True))
            # At most a new iteration's fixed structures more: history goes first, as a promotion.
            self._evict(keep=g)

    # ---- history --------------------------------------------------------------------------------

    def refill_history(self, prompt_key: str, buffer_version: int, responses: Sequence[Sequence[int]], *,
                       versioned: bool = False) -> tuple[int, int]:
        """Seeds the buffer's newest iteration of a key (HistoryBackfill); returns (responses added,
        the stored iteration). Numbered here, under the lock, not when the key was queued: as the
        buffer's version (`buffer_version`, at least 0) when `versioned` (a registration that
        queued it brought a version) or any group of the key has one now; else as fallback number
        0 (history.unversioned: the number an unversioned group on an empty key is given, so the
        refill and that group's responses form one iteration), with the buffer's version kept on
        that iteration (HistoryStore.note_refill), so that the first registration of the key with
        a version renumbers the refill (_renumber_refill). Decided at queueing time, a refill
        queued by a registration without a version stayed fallback 0 after a later registration
        gave the group its version."""
        self._check_seed(prompt_key, responses)
        version = max(0, buffer_version)
        with self._lock:
            groups = list(self._by_key.get(prompt_key, {}).values())
            versioned = versioned or any(g.versioned for g in groups)
            iteration = version if versioned else unversioned(0)
            added = self._seed_locked(prompt_key, iteration, responses)
            if not versioned:
                self._history.note_refill(prompt_key, iteration, version)
            return added, iteration

    def seed_history(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]], *,
                     versioned: bool = True) -> int:
        """Loads responses of (key, iteration); returns how many were new. iteration: a policy
        version (SeedHistory), or with versioned=False a fallback number (history.unversioned; the
        backfill numbers its seeds with refill_history)."""
        self._check_seed(prompt_key, responses)
        if iteration < 0:
            raise InvalidArgument("must be >= 0", field="iteration")
        if not versioned:
            iteration = unversioned(iteration)
        with self._lock:
            return self._seed_locked(prompt_key, iteration, responses)

    def _check_seed(self, prompt_key: str, responses: Sequence[Sequence[int]]) -> None:
        if not prompt_key:
            raise InvalidArgument("must not be empty", field="prompt_key")
        for i, r in enumerate(responses):
            if len(r) > self.limits.max_response_tokens:
                raise InvalidArgument(f"{len(r)} tokens > limit {self.limits.max_response_tokens}",
                                      field=f"responses[{i}]")
            _check_tokens(r, f"responses[{i}].token_ids")

    def _seed_locked(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> int:
        """seed_history's add of (key, stored iteration), under the lock."""
        # Only the responses not held for the key already load (HistoryStore.add: a retry, a
        # subset or superset of an earlier seed, responses promoted from a group here): room is
        # made for those, for the stored copy and the copy indexed (and logged) by every live
        # group of the key, before anything is added, so nothing is half-seeded when the budget
        # is full. Making room may evict the iteration that held some of them: they are new
        # again then, so the need is taken again until eviction leaves it as it was.
        live = [g for g in self._by_key.get(prompt_key, {}).values() if not g.completed]
        reserved = -1
        while True:
            # One plan a pass gives the whole cost and is the add applied below (each part planned
            # the add on its own, and add() once more: the seed's responses matched against every
            # held response of the key three or four times, under the lock). A pass again only
            # when making room evicted history, which may make held responses new.
            planned = self._history.plan_add(prompt_key, iteration, responses)
            new = planned.new
            count, total = len(new), sum(len(r) for r in new)
            log_copy = total * _LOG_TOKEN_BYTES + count * _LOG_ENTRY_BYTES
            copies = sum(g.index.history_bytes_bound(count, total) + log_copy for g in live) if count else 0
            # The iteration's (and the key's) fixed structures when the add creates them, also
            # for held responses that only move to a new iteration; net of what the iteration's
            # response cap drops of earlier adds at once (the live groups' indexes keep their
            # copies: `copies` stays whole).
            trimmed = planned.trimmed_bytes if count else 0
            stored = total * HISTORY_TOKEN_BYTES + count * HISTORY_RESPONSE_BYTES + planned.structure_bytes
            need = max(0, stored - trimmed) + copies
            if need <= reserved:
                break  # what eviction made new again is covered
            evicted = self._history.evicted
            self._make_room(need)
            reserved = need
            if self._history.evicted == evicted:
                break  # no history evicted: what is held is as it was
        # Held responses brought by a newer iteration move to it (their bytes move with them). The
        # last pass's plan, unless eviction changed the history after it (add() plans again then).
        added = self._history.add(prompt_key, iteration, responses, planned=planned)
        # Live groups of this key get the new responses too (as history log entries). (None was
        # evicted making room: only completed groups are.)
        for g in live:
            for r in added:
                g.index.add_history(r)
                g.log.append(SeqDelta("", 0, r, True))
                g.log_bytes += _LOG_ENTRY_BYTES + len(r) * _LOG_TOKEN_BYTES
            self._charge(g)
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
                    old = self._reused_record(gid, inc) if reset else None
                    out.append(GroupDelta(gid, g.watermark, _coalesce(g.log), g.index.prompt,
                                          tuple(g.index.history_tokens(g.history_count)), incarnation=g.incarnation,
                                          reset=reset, reused=old is not None,
                                          reused_epoch=old[0] if old else 0,
                                          reused_submit_seq=old[1] if old else 0,
                                          submit_seq=g.submit_seq if reset else 0))
                else:
                    out.append(GroupDelta(gid, g.watermark, _coalesce(g.log[wm - 1 :]), incarnation=g.incarnation))
        return out

    # ---- memory ---------------------------------------------------------------------------------

    def _memory(self) -> int:
        """The reported memory: running totals, O(1) (it is checked on every write)."""
        return self._history.memory_bytes + self._group_bytes

    def _charge(self, g: _Group) -> None:
        """Brings the running totals up to date with g after a change to g (its index, log or
        epochs): g's memory is recomputed (O(1): GroupIndex keeps its counts) and the totals move by
        the difference from what was charged for g, so they cannot drift from the sum over the
        groups, however g changed. Every change to a live group is followed by this, before the
        totals are read again."""
        mem = g.memory_bytes
        tokens = g.index.indexed_tokens
        self._group_bytes += mem - g.charged_bytes
        self._indexed_tokens += tokens - g.charged_tokens
        g.charged_bytes = mem
        g.charged_tokens = tokens

    def _add_group(self, g: _Group) -> None:
        """Every group is created through here (and removed through _remove_group): the totals, the
        key index and the expiry heap rely on it."""
        self._groups[g.group_id] = g
        self._charge(g)
        g.added_seq = next(self._expiry_seq)
        self._by_key.setdefault(g.prompt_key, {})[g.group_id] = g
        self._push_expiry(g)
        g.requeue = self._requeue_expiry

    def _remove_group(self, g: _Group, *, remember: bool = False) -> None:
        """Drops a live group (evicted, expired, or replaced by a new incarnation) and its share of
        the totals. A completed group's incarnation is remembered (_remember_reused), and so is a
        running one's with `remember` (replaced by a newer submission's registration)."""
        del self._groups[g.group_id]
        self._completed.pop(g.group_id, None)
        self._group_bytes -= g.charged_bytes
        self._indexed_tokens -= g.charged_tokens
        g.charged_bytes = g.charged_tokens = 0
        same_key = self._by_key[g.prompt_key]
        del same_key[g.group_id]
        if not same_key:
            del self._by_key[g.prompt_key]
        # Its heap entry is stale from now on (the group is not in _groups); dropped when it comes
        # up, or by a rebuild.
        g.expiry_seq = -1
        g.expiry_entry = (0.0, -1, "")
        g.requeue = None
        self._compact_expiry()
        if g.completed or remember:
            self._remember_reused(g)

    def _remember_reused(self, g: _Group) -> None:
        """Whatever comes under a completed group's id next is another run (its responses are
        history): a worker still following this incarnation is told so (sync: reused), with the
        largest epoch it took. Also called for a running group a newer submission's registration
        replaced (register): its run was cancelled or deleted, so its workers must not resend its
        responses into the newer run's group (reused tells them), and a late registration of it is
        refused by its submit_seq (_same_run_reused) instead of starting a group of the old run.
        Every attempt of this run that wrote here had an epoch at most that (the newest per request
        is kept, and older ones are refused below it), and the new run's attempts are dispatched
        after it was submitted, so with larger epochs (the scheduler's
        clock increases over all requests)."""
        known = self._reused.pop(g.group_id, b"")
        if known:
            self._remembered_bytes -= _REUSED_ID_BYTES + len(g.group_id) + len(known)
        newest = _REUSED.pack(g.incarnation, max(g.epochs.values(), default=0), g.digest, g.group_size, g.submit_seq)
        entry = (known + newest)[-_REUSED_PER_ID * _REUSED.size :]
        self._reused[g.group_id] = entry
        self._remembered_bytes += _REUSED_ID_BYTES + len(g.group_id) + len(entry)
        while len(self._reused) > _TOMBSTONES:
            gid, dropped = self._reused.popitem(last=False)
            self._remembered_bytes -= _REUSED_ID_BYTES + len(gid) + len(dropped)

    def _reused_record(self, group_id: str, incarnation: int) -> tuple[int, int] | None:
        """(largest epoch, submit_seq) of the id's completed incarnation `incarnation`, None when
        it is not remembered as one (caller holds the lock)."""
        for inc, epoch, _digest, _size, seq in _REUSED.iter_unpack(self._reused.get(group_id, b"")):
            if inc == incarnation:
                return int(epoch), int(seq)
        return None

    def _same_run_reused(self, group_id: str, digest: int, group_size: int, epoch: int,
                         submit_seq: int, *, by_epoch: bool = True) -> tuple[int, bool] | None:
        """(largest epoch, judged by submit_seq) of a remembered incarnation of the id that this
        registration belongs to, or that is of a newer run than it; None when none. Where the
        registration and the incarnation both carry a submit_seq, it decides alone: an older one is
        an older run's (refused whatever the prompt: the id moved on), the same one with the same
        prompt and key by digest and an agreeing size (0 agrees with any) is that run. Else the
        same prompt, key and size at an epoch from 1 to that incarnation's largest (only with
        by_epoch). Caller holds the lock."""
        for _inc, largest, old_digest, old_size, old_seq in _REUSED.iter_unpack(self._reused.get(group_id, b"")):
            same_registration = digest == old_digest and _sizes_agree(group_size, old_size)
            if submit_seq and old_seq:
                if submit_seq < old_seq or (submit_seq == old_seq and same_registration):
                    return int(largest), True
            elif by_epoch and same_registration and 0 < epoch <= largest:
                return int(largest), False
        return None

    def _new_group_bytes(self, prompt_len: int, prompt_key: str) -> int:
        """An upper bound of a new group's memory: its fixed structures, its index of the prompt and
        the key's history."""
        count, tokens = (self._history.count(prompt_key), self._history.tokens(prompt_key)) if prompt_key else (0, 0)
        return _GROUP_BYTES + new_index_bytes_bound(self.limits.levels, prompt_len, count, tokens)

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
            # The first completed group that is not `keep`: at most two looked at.
            oldest = next((g for g in self._completed.values() if g is not keep), None)
            if oldest is None:
                return
            self._remove_group(oldest)
            self._tombstone(oldest.group_id, completed=True)
            self._evicted_groups += 1
            log.info("completed group evicted", extra=kv(group_id=oldest.group_id, prompt_key=oldest.prompt_key))

    # ---- expiry ---------------------------------------------------------------------------------

    def _tombstone(self, group_id: str, completed: bool) -> None:
        if group_id not in self._expired:
            self._remembered_bytes += _TOMBSTONE_BYTES + len(group_id)
        self._expired[group_id] = completed
        while len(self._expired) > _TOMBSTONES:
            gid, _ = self._expired.popitem(last=False)
            self._remembered_bytes -= _TOMBSTONE_BYTES + len(gid)

    def _requeue_expiry(self, g: _Group) -> None:
        """A live group's deadline moved before its heap entry's (_Group.expires_at): a new entry
        becomes current and the old one goes stale."""
        self._push_expiry(g)
        self._compact_expiry()

    def _push_expiry(self, g: _Group) -> None:
        """Makes an entry at g.expires_at g's current one. Invariant for a live group:
        g.queued_at <= g.expires_at, so every group due is reached by popping the entries due."""
        seq = next(self._expiry_seq)
        g.expiry_seq = seq
        g.queued_at = at = g.expires_at
        g.expiry_entry = entry = (at, seq, g.group_id)
        heapq.heappush(self._expiry, entry)

    def _compact_expiry(self) -> None:
        """Rebuilds the heap from the live groups' current entries when stale entries outnumber
        them (+ slack, so a small store does not rebuild on every removal): O(live groups), after at
        least as many removals or superseded entries as live groups, so O(1) amortised per removal.

        The rebuild is one pause under the lock, so it only collects each group's current entry
        (the very tuple in the heap) and heapifies (in C). It renumbered every group and moved its
        entry to its deadline (a new tuple, three attribute writes and two property reads a group):
        at 50,000 live groups the slowest operation took 46-59 ms, now 20-24 ms (session 25,
        alternating runs; 88-101 ms before on a busy machine). Entries left early by refreshes stay
        early: the sweep pushes them again when they come up, as it does anyway. (Draining the old
        heap a few entries per operation instead would remove the pause, at the price of a second
        heap that the sweep and every invariant must consider: not worth it for ~20 ms at most once
        per 50,000 removals or superseded entries.)"""
        if len(self._expiry) <= 2 * len(self._groups) + _EXPIRY_SLACK:
            return
        self._expiry = [g.expiry_entry for g in self._groups.values()]
        heapq.heapify(self._expiry)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + 0.5
        heap = self._expiry
        dead: list[_Group] = []
        while heap and heap[0][0] <= now:
            _, seq, gid = heapq.heappop(heap)
            g = self._groups.get(gid)
            if g is None or g.expiry_seq != seq:
                continue  # stale: the group was removed, is a new incarnation, or has a newer entry
            if g.expires_at <= now:
                dead.append(g)
            else:
                # Refreshed since it was pushed: pushed again at its deadline (> now: this loop
                # does not see it again). One pop, one push: the heap does not grow.
                self._push_expiry(g)
        # In _groups' order, as the sweep that scanned every group expired them (the tombstones'
        # order: which ones the cap drops first).
        dead.sort(key=lambda g: g.added_seq)
        for g in dead:
            self._remove_group(g)
            self._tombstone(g.group_id, g.completed)
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
            tokens = self._indexed_tokens
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
                remembered_ids_bytes=self._remembered_bytes,
                rejected_history_adds=self._history.rejected_adds,
            )

    def index_of(self, group_id: str) -> GroupIndex:
        """The live index of a group (tests and the in-process simulator)."""
        with self._lock:
            return self._get(group_id, "group_id").index


def _registration_digest(prompt_key: str, prompt_token_ids: Sequence[int]) -> int:
    """A 64-bit digest of a registration's prompt key and prompt (nonzero; 0 = none). Kept with a
    completed incarnation (_REUSED) in place of the prompt itself: a prompt is up to
    max_prompt_tokens, and 65,536 ids are remembered. A collision (2^-64) only takes another run's
    low-epoch registration for the old run's (refused: it drafts from nothing)."""
    key = prompt_key.encode()
    h = hashlib.blake2b(len(key).to_bytes(4, "little") + key, digest_size=8)
    h.update(array("I", prompt_token_ids).tobytes())  # token ids are checked to fit 31 bits
    return int.from_bytes(h.digest(), "little") | 1


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

