"""The worker's embedded draft client: a local mirror of the groups it serves (Seer DGDS, section 4).

Drafting is local: `propose` reads the mirror's GroupIndex in-process, never an RPC per step.
`append` updates the mirror at once and queues the tokens for the draft server; a background thread
streams the queued appends (Append, batched, coalesced per request) and pulls the siblings' tokens
from other workers (Sync with per-group watermarks, only deltas). Appends are idempotent by offset,
so a resent batch, or our own tokens echoed back by Sync, never corrupt the mirror.

Requests running on this worker are authoritative locally: `resume` makes the mirror's copy of a
request exactly its committed output when a chunk starts (dropping what a failed attempt streamed;
those tokens were sampled with the randomness the new attempt verifies with, so drafting from them
would bias the output) and sends the same truncate to the server in order with the appends; until
`end`, Sync deltas for that request are not applied (they can only be echoes of ours or a stale
attempt's tokens), so a request never drafts from its own tokens at or beyond its current length.

Attempts are ordered by the scheduler's dispatch epoch (`resume(..., epoch)`): every append of the
request carries it, and the server refuses an append older than the newest epoch it has seen for
the request, so a late or retried message of an abandoned attempt (this worker's or another's)
never overwrites a newer attempt's tokens. Epoch 0 (a caller without one) is unordered.

The draft server is an optimisation: when it is down the client keeps drafting from what it has
(own tokens, earlier deltas), retries in the background, and re-registers groups the server lost.
Every group on the server has an incarnation; a mirror whose incarnation is not the server's (the
server restarted, or the group was created again) is rebuilt from the server's whole group, and
this worker's own responses are sent again, unless the mirror's incarnation completed (as far as
the mirror knows, or the reset says reused: the server saw that incarnation complete before another
run registered the id again); then only the new run's requests go to the new one: those whose
attempt here came with the new incarnation's submission (GroupDelta.submit_seq; with only the
reused one's known, reused_submit_seq, any other), whatever the epochs; else those whose attempt
here has a dispatch epoch above the reset's reused_epoch (the largest epoch the old incarnation
took), running or ended already on the stale mirror, or, without epochs, those running here now. Every append
carries the incarnation its tokens were generated under (for a mirror not synced yet, or started
over to re-create a lost group, the one its registration was judged against:
RegisterGroupResponse.incarnation; 0 only until that answer), so a late append of an old incarnation never
lands in a group id registered again (a resubmitted batch id brings the same group and request
ids); the server refuses it, the message is dropped, and the next Sync (forced even for a group
whose every response runs here) answers the mirror with a reset. A group the server dropped while
nothing of it runs here (expired or evicted after completion) is released, never re-created:
re-creating it would promote its responses to history a second time (a stale mirror holding a
response of ours the server may lack registers again with the newest epoch it ran first: the
server refuses the old run's epochs, and a newer one is another run's, whose response then goes to
its incarnation). What is resent follows the server: a response is resent as finished only while
the server's state agrees (a newer attempt elsewhere that cut it back or re-opened it clears our
flag), and a group is known to have completed when the server had
every response finished (our acknowledged finishing appends and the siblings' through Sync), not
when this worker finished them all: a finish still queued when the server restarted never got
there, and the group is re-created so that it completes once.

Background cost (measured through the suite, bench.spec --suite: +11% worker CPU and a draft-server
process at ~4% of a core with the planner drafting nothing): two RPCs every 50 ms, each Sync carrying
back the worker's own tokens. So the client does only the work someone uses:
- a group whose every response is generating here (`len(active) >= group_size`, the usual case for
  a group on one worker) is not synced: every delta would be an echo of our own tokens, which are
  skipped anyway (see above); syncing resumes when one of them ends here;
- while nothing is proposed (the planner has turned speculation off: large batches) the tick
  interval backs off from `sync_interval_s` to `idle_sync_interval_s` (appends are batched bigger,
  syncs are rarer); the first proposal brings the short interval back at once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import grpc
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.errors import InvalidArgument
from services.common.grpcutil import channel
from services.common.log import get_logger, kv
from services.draft.index import DEFAULT_LEVELS, GroupIndex
from services.worker.engine import Draft

log = get_logger(__name__)

_SYNC_GROUPS_PER_RPC = 64  # a Sync of every group at watermark 0 at once could exceed the message limit
# Tick interval while nothing is proposed: appends reach other workers at most this late then, which
# costs them little (they draft from everything else meanwhile) and saves ~8 RPCs a second here.
_IDLE_SYNC_INTERVAL_S = 0.4
_MAX_PENDING = 200_000  # queued append messages; beyond that the oldest are dropped (drafts degrade)
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.CANCELLED}


class _Registration(NamedTuple):
    """What a RegisterGroup of a mirror sends (besides the epoch). A NamedTuple so that comparing
    a queued registration with the one sent (`m.reregister in (None, registration)`) stays a plain
    value comparison."""

    prompt_key: str
    prompt: tuple[int, ...]
    group_size: int
    ttl_seconds: int
    submit_seq: int
    # RegisterGroupRequest.policy_version: the history iteration the server promotes the group's
    # responses as (None = unknown: left unset; the server merges the group into the key's newest
    # version, or without one gives it a fallback number below every version).
    policy_version: int | None = None


@dataclass(slots=True)
class _Running:
    """One attempt of a request started here (resume) and not ended yet, as its caller names it."""

    epoch: int  # its dispatch epoch (0: not given)
    submit_seq: int  # its batch submission (0: not given)
    # Its resume made the request active (an older submission's or a superseded attempt's left the
    # mirror alone). It keeps the request active while it runs, until a newer attempt of the
    # request resumes here (superseded): then the newer one's end is the one that ends the mark.
    made_active: bool
    # A newer attempt of the request (_newer) ran here at the same time as this one: resumed while
    # this one ran (resume flags it), or already running when this one resumed. Its appends are
    # dropped from then on. Only an attempt running alongside supersedes: one that ended before
    # this one resumed does not (after a scheduler restart without its epoch_file behind the clock,
    # the same submission's next chunk comes back at a LOWER epoch, and is the request's attempt).
    superseded: bool = False


@dataclass
class _Mirror:
    index: GroupIndex
    prompt_key: str
    prompt: tuple[int, ...]
    group_size: int
    ttl_seconds: int
    watermark: int = 0
    registered: bool = False
    own: set[str] = field(default_factory=set)  # requests this worker appended (re-sent if the server lost them)
    # Responses resent as finished if the server loses the group: our own finishing appends, and
    # the server's finished state (Sync) for responses not running here; a later writer's cut or
    # re-opening clears it (resent finished at a partial length, it completed the group early).
    finished: set[str] = field(default_factory=set)
    # Finished on the server as last known (our acknowledged finishing appends, Sync): all of the
    # group's responses in it means the group completed there and its responses are history.
    done: set[str] = field(default_factory=set)
    history_loaded: bool = False
    # The mirror followed its incarnation through Sync (a reply applied): known stale when the group
    # expires (_lost_locked). Kept across end()'s whole-group restart (like the incarnation, which it
    # keeps): unlike history_loaded, which that restart clears until the next reply.
    synced: bool = False
    active: set[str] = field(default_factory=set)  # requests generating here now: deltas for them are skipped
    # request -> its attempts started here and not ended, in start order (see _Running). Two
    # attempts of one request may run here at once (a chunk re-dispatched here while the abandoned
    # attempt is still finishing: SGLang drops rids from its batch in any order), so an end names
    # its attempt (epoch, submit_seq) and ends that one: by start order (the earliest), only when
    # the caller does not name it. The request stays active while an attempt that made it active
    # and is not superseded (_Running.superseded) still runs.
    attempts: dict[str, list[_Running]] = field(default_factory=dict)
    resync: set[str] = field(default_factory=set)  # active requests another writer changed meanwhile (see end)
    incarnation: int = 0  # the server's group incarnation this mirror follows (0: not synced yet)
    epochs: dict[str, int] = field(default_factory=dict)  # request -> this worker's newest attempt epoch
    # An append was refused as another incarnation's: Sync this mirror next tick even if every
    # response runs here (skipped otherwise, it would never learn of the reset, and every append
    # after would be refused the same way).
    must_sync: bool = False
    releasing: bool = False  # released by the worker; kept until its queued appends are acknowledged
    # GroupDelta.reused_epoch of a reused reset: an attempt running here with an epoch at most this
    # (1..old_run_epoch) is the old run's; its appends stay in the mirror, never sent to the new run.
    # The fallback for requests without a known submission (see old_run_seqs).
    old_run_epoch: int = 0
    # request -> the batch submission (RunChunkRequest.submit_seq) of this worker's newest attempt
    # of it (register_attempt; absent = unknown). An attempt of another submission is another run's
    # request under the same id (a resubmitted batch): its older epochs are dropped (resume keeps
    # the largest, and the old run's would make the new run's attempt look like the old run's).
    seqs: dict[str, int] = field(default_factory=dict)
    # Requests whose attempt starting here last is of an older submission than seqs' (a chunk of a
    # run the request has moved on from, still in flight): resume, append and end leave the mirror
    # alone for it (its copy here is the newer run's; rewritten with the old run's output, a reset
    # or a re-created group resent that as the newer run's response).
    older_attempts: set[str] = field(default_factory=set)
    # Submissions a reused reset showed to be no run of the incarnation followed now (the reused
    # one's GroupDelta.reused_submit_seq, and those of our requests it judged not the new run's,
    # older than both the new run's and the mirror's; the mirror's own is taken out when it moves);
    # seq_judged: a reused reset carried a submission (either side). Then a request of a known
    # submission is the old run's by membership here, whatever its epoch (a new run after the
    # scheduler's clock went back has epochs at most old_run_epoch); without, by old_run_epoch.
    old_run_seqs: set[int] = field(default_factory=set)
    seq_judged: bool = False
    # Requests whose copy here a Sync delta changed (another writer's tokens) since this worker's
    # attempt of them last started: not that attempt's copy, so a reused reset never resends one
    # as the new run's (on a stale mirror, the old run's response came over our ended attempt's).
    synced_over: set[str] = field(default_factory=set)
    # The newest dispatch epoch a registration of this mirror asked for (sent as
    # RegisterGroupRequest.epoch with its next RegisterGroup; 0 = unknown).
    register_epoch: int = 0
    # The batch submission (RunChunkRequest.submit_seq) of the run this mirror registered for, sent
    # as RegisterGroupRequest.submit_seq (0 = unknown: the epoch alone tells runs apart).
    submit_seq: int = 0
    # A RegisterGroup to send again although the mirror is registered: an attempt of another
    # submission, or one newer than any the mirror registered for, writes into a group that may
    # have completed on the server (register_attempt, _on_refused), so it may be another run's (a
    # resubmitted batch id); the server tells by the submission or the epoch. The group's appends
    # and Syncs wait for it (sent first, they would go to, or be refused by, the old run's group).
    reregister: _Registration | None = None
    # The policy version (RunChunkRequest.policy_version) of the run this mirror follows, sent as
    # RegisterGroupRequest.policy_version (None = unknown: unset). The version of the first attempt
    # of that run registered here (one bringing a version): the draft server keeps the version of a
    # group's first registration (later ones of a running group do not change it), so the first
    # attempt's is what the group has there, and a group re-created after the server lost it gets the
    # same iteration back. A later chunk of the run at another version (weights switched while the
    # group ran; the buffer pins a batch to one version, so not in a Seer loop) changes nothing.
    policy_version: int | None = None
    # Batch submission -> the version its first attempt here brought: the version of the run the
    # mirror moves to when it follows a newer submission (a reset of another worker's registration).
    seq_versions: dict[int, int] = field(default_factory=dict)

    def registration(self) -> _Registration:
        """The mirror's own registration (what it registered for, at its submission and version)."""
        return _Registration(self.prompt_key, self.prompt, self.group_size, self.ttl_seconds, self.submit_seq,
                             self.policy_version)

    def note_version(self, submit_seq: int, policy_version: int | None) -> None:
        """An attempt of submission `submit_seq` (0 = unknown) at `policy_version` (None = unknown)
        starts on this mirror: the first version known for its submission, and for the mirror's
        run when the mirror has none yet (created by a caller without one) and the attempt is of
        its run."""
        if policy_version is None:
            return
        if submit_seq:
            self.seq_versions.setdefault(submit_seq, policy_version)
        if self.policy_version is None and (not submit_seq or not self.submit_seq or submit_seq == self.submit_seq):
            self.policy_version = policy_version

    def follow_version(self, submit_seq: int, policy_version: int | None = None) -> None:
        """The mirror moved to the run of submission `submit_seq`: its version is that run's (the
        registration's `policy_version` that moved it, else the one its attempts here brought;
        unknown: None, so its registrations go out without one). Not the old run's: a mirror that
        re-created the group on a restarted server would stamp the new run with it, and the server
        keeps a group's first version (the right worker's later registration could not mend it)."""
        if policy_version is None:
            policy_version = self.seq_versions.get(submit_seq)
        self.policy_version = policy_version

    def newest_seq(self) -> int:
        """The newest submission the mirror registered for or is registering again for (0 = unknown)."""
        return max(self.submit_seq, self.reregister.submit_seq if self.reregister is not None else 0)

    def newest_epoch(self) -> int:
        """The newest dispatch epoch this mirror registered for or ran an attempt at (0: none)."""
        return max(self.register_epoch, max(self.epochs.values(), default=0))

    @property
    def ready(self) -> bool:
        """Registered, with no re-registration waiting: its appends and Syncs may go out."""
        return self.registered and self.reregister is None

    @property
    def completed(self) -> bool:
        """The server had every response finished: the group completed and became history."""
        return 0 < self.group_size <= len(self.done)


class _Attempt(Enum):
    """What an attempt starting on a group's existing mirror does to it (_judge_attempt)."""

    KEEP = "keep"  # the mirror's run (or no sign of another): runs on it as it is, nothing sent
    OLDER = "older"  # an older submission's chunk: runs on the mirror as it is, its appends kept local
    REREGISTER = "reregister"  # may be another run: RegisterGroup again, the server tells which
    REPLACE = "replace"  # the mirror's group completed and this is another run: a new mirror


def _judge_attempt(m: _Mirror, prompt_key: str, prompt: tuple[int, ...], group_size: int, request_id: str,
                   epoch: int, submit_seq: int) -> _Attempt:
    """How register_attempt takes an attempt (at dispatch `epoch`, of batch submission `submit_seq`;
    0 = unknown) starting on the group's mirror `m`; reads `m` only (its rules: see register_attempt)."""
    mirror_seq = m.newest_seq()
    seqs_known = bool(submit_seq and mirror_seq)
    if seqs_known and submit_seq < mirror_seq:
        return _Attempt.OLDER
    if not m.completed or m.active:
        other_seq = seqs_known and submit_seq != mirror_seq
        if epoch <= m.register_epoch and not other_seq:
            return _Attempt.KEEP
        # Another prompt, key, size or submission is another run for sure (every worker of a run
        # registers the batch's); the first two cases are the ones the same values may be another
        # run in, when the submissions are not both known.
        other = (prompt_key != m.prompt_key or group_size != m.group_size or prompt != m.prompt or other_seq)
        if not other and (seqs_known or not (m.completed or request_id in m.done)):
            return _Attempt.KEEP
        return _Attempt.REREGISTER
    # Completed, and this attempt is of its run (the same submission or, without one, an epoch this
    # mirror already registered or ran: a retried chunk): the same incarnation, kept. Replaced, it
    # would register again, and the server would take it for the id used again (by the epoch rule).
    same_run = submit_seq == mirror_seq if seqs_known else 0 < epoch <= m.newest_epoch()
    return _Attempt.KEEP if same_run else _Attempt.REPLACE


def _older_submission(m: _Mirror, request_id: str, submit_seq: int, older: bool) -> bool:
    """Whether an attempt of `request_id` of batch submission `submit_seq` (0: not given) is of an
    older submission than the request's here (as _note_submission_locked judges; without its
    submission, `older`: the request's last registration said so, older_attempts), so that it
    leaves mirror `m` alone. Reads `m` only."""
    if submit_seq:
        known = m.seqs.get(request_id, 0)
        return known > submit_seq or (not known and submit_seq < m.submit_seq)
    return older


def _newer(epoch: int, submit_seq: int, than_epoch: int, than_submit_seq: int) -> bool:
    """Whether an attempt (`epoch`, `submit_seq`; 0: not given) is newer than another of the same
    request (`than_epoch`, `than_submit_seq`) running here alongside it: of a newer submission where
    both are known and differ (a newer run's, whatever the epochs), else at a newer epoch where both
    are known. Unnamed attempts are ordered by nothing (never superseded by epoch, as before
    attempts were named)."""
    if submit_seq and than_submit_seq and submit_seq != than_submit_seq:
        return submit_seq > than_submit_seq
    return 0 < than_epoch < epoch


def _named(running: list[_Running], epoch: int, submit_seq: int) -> int | None:
    """The index in `running` of the attempt (`epoch`, `submit_seq`; each 0 = not given, at least one
    given) names: the latest started that matches (the same names resumed again are the same attempt
    again); None when none does."""
    for i in range(len(running) - 1, -1, -1):
        r = running[i]
        if (not epoch or r.epoch == epoch) and (not submit_seq or r.submit_seq == submit_seq):
            return i
    return None


def _superseded(m: _Mirror, request_id: str, epoch: int, submit_seq: int) -> bool:
    """Whether the appends of the attempt of `request_id` named (`epoch`, `submit_seq`; 0: not
    given) are dropped on mirror `m`: it is of an older submission than the request's here, or its
    running entry is superseded (_Running.superseded). An attempt without a running entry here
    (unnamed, or never resumed here) is judged by its submission only. Not by the newest epoch that
    ever resumed the request here (m.epochs): that one may have ended before this attempt resumed,
    and a scheduler restarted without its epoch_file dispatches the same submission's next chunk
    below it; taken for superseded, that attempt's resume left a failed attempt's tokens in the
    copy and every one of its appends was dropped (the group never completed). Reads `m` only."""
    if _older_submission(m, request_id, submit_seq, request_id in m.older_attempts):
        return True
    if not (epoch or submit_seq):
        return False
    running = m.attempts.get(request_id, [])
    i = _named(running, epoch, submit_seq)
    return i is not None and running[i].superseded


def _take_attempt(running: list[_Running], epoch: int, submit_seq: int) -> _Running | None:
    """Removes and returns the attempt an end names (its epoch and submission, each 0 = not
    given) from `running`: the earliest when it names none; when it names one none of them
    matches, the earliest unnamed one (a caller that started it without naming it), else None and
    `running` unchanged (an attempt of another mirror of the group: an aborted attempt ending
    after a new run's attempt of the request replaced the mirror must not end that one). None
    when nothing runs."""
    if epoch or submit_seq:
        i = _named(running, epoch, submit_seq)
        if i is None:
            i = next((j for j, r in enumerate(running) if not r.epoch and not r.submit_seq), None)
        return None if i is None else running.pop(i)
    return running.pop(0) if running else None


@dataclass
class DraftClientStats:
    groups: int = 0
    syncs: int = 0
    sync_errors: int = 0
    append_rpcs: int = 0
    append_errors: int = 0
    sent_tokens: int = 0
    received_tokens: int = 0
    dropped_messages: int = 0
    stale_messages: int = 0  # appends the server refused as an older attempt's
    stale_incarnation_messages: int = 0  # appends the server refused as another group incarnation's
    resets: int = 0  # mirrors rebuilt (server restart, group re-created)
    evicted_mirrors: int = 0  # idle mirrors released to stay within memory_budget_bytes
    memory_bytes: int = 0  # the mirrors' indexes (GroupIndex.memory_bytes)
    proposals: int = 0
    proposed_tokens: int = 0
    skipped_group_syncs: int = 0  # groups left out of a Sync: all their responses generate here
    register_rpcs: int = 0  # RegisterGroup calls answered (first registrations and re-registrations)


class DraftClient:
    def __init__(
        self,
        address: str | None,
        *,
        sync_interval_s: float = 0.05,
        idle_sync_interval_s: float | None = None,
        rpc_timeout_s: float = 5.0,
        levels: Sequence[int] = DEFAULT_LEVELS,
        min_token_prob: float = 0.1,
        memory_budget_bytes: int = 1 << 30,
        follower: bool = False,
    ) -> None:
        """follower: a second client of the same worker's requests (SGLang's SEER plugin, beside the
        worker's own client) keeps its appends local: one writer per response on the server, since
        both would send the same tokens and their truncates (resume) could cut each other's appends.
        It still registers groups (with the same values) and syncs.

        idle_sync_interval_s: the tick interval while nothing is proposed (None: the larger of
        sync_interval_s and 0.4 s). memory_budget_bytes: the mirrors' indexes are kept under it by
        releasing the least recently used groups with nothing running here (checked every tick
        and at registration; a group with a chunk running is never released)."""
        if memory_budget_bytes < 1:
            raise ValueError("memory_budget_bytes: must be >= 1")
        self.memory_budget_bytes = memory_budget_bytes
        if idle_sync_interval_s is None:
            idle_sync_interval_s = max(sync_interval_s, _IDLE_SYNC_INTERVAL_S)
        if sync_interval_s <= 0 or idle_sync_interval_s < sync_interval_s:
            raise ValueError("sync_interval_s, idle_sync_interval_s: need 0 < sync_interval_s <= idle_sync_interval_s")
        self.address = address or None
        self.follower = follower
        self.sync_interval_s = sync_interval_s
        self.idle_sync_interval_s = idle_sync_interval_s
        self._interval = sync_interval_s  # current tick interval (backs off while nothing is proposed)
        self._proposed_since_tick = False
        self.rpc_timeout_s = rpc_timeout_s
        self.levels = tuple(levels)
        self.min_token_prob = min_token_prob
        self._lock = threading.Lock()
        self._groups: OrderedDict[str, _Mirror] = OrderedDict()  # least recently used first
        self._pending: list[draft_pb2.AppendRequest] = []
        self._stats = DraftClientStats()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stub: draft_pb2_grpc.DraftServiceStub | None = None
        self._channel: grpc.Channel | None = None
        self._thread: threading.Thread | None = None
        if self.address:
            self._channel = channel(self.address)
            self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)
            self._thread = threading.Thread(target=self._run, name="draft-sync", daemon=True)
            self._thread.start()

    # ---- decode-path API (all local) ------------------------------------------------------------

    def register_group(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
        ttl_seconds: int = 3600, *, policy_version: int | None = None,
    ) -> None:
        """Creates the local mirror (idempotent) and registers the group on the server in the
        background (the first Sync brings the siblings' tokens and the history). A mirror whose
        group completed (nothing of it runs here) is replaced: the id is used again (a batch id
        resubmitted after the buffer's retention), the server starts a new incarnation for it.
        Without a dispatch epoch: see register_attempt."""
        self.register_attempt(group_id, prompt_key, prompt_token_ids, group_size, ttl_seconds,
                              policy_version=policy_version)

    def register_attempt(
        self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
        ttl_seconds: int = 3600, *, request_id: str = "", epoch: int = 0, submit_seq: int = 0,
        policy_version: int | None = None,
    ) -> None:
        """register_group for a chunk of `request_id` at dispatch `epoch` (RunChunkRequest.dispatch_epoch;
        0 = unknown) starting here; the worker core calls it for every chunk (local, no RPC unless
        said below). The registration carries the epoch (RegisterGroupRequest.epoch): a completed
        group that took no attempt as new starts a new incarnation for it, whatever the prompt (a
        resubmitted batch id brings the same one). A mirror already registered sends RegisterGroup
        again only when the group may have completed on the server and the attempt is newer than
        any this mirror registered for: every response is finished there as last known (a chunk
        running here keeps the mirror, so it is not replaced), or this very request is (dispatched
        again after it finished: another run, or a lost commit), or the registration is another
        prompt, key or group size than the mirror's. A later chunk of a group this
        worker registered for the same run costs nothing. A stale mirror that knows neither (a
        sibling's finish not synced yet) learns it from the refusal of the new attempt's first
        append (_on_refused), and registers then.

        submit_seq (RunChunkRequest.submit_seq; 0 = unknown): with the mirror's known too, it
        decides as the server does (RegisterGroupRequest.submit_seq), whatever the epochs: another
        submission is another run (registered again at once, whatever the epoch: a new run after
        the scheduler's clock went back has lower ones), the same one is the mirror's run (a retry
        at a newer epoch, a lost commit's: nothing sent, the server would answer idempotent). An
        older one than the mirror's (or than the one it is registering again for) is a chunk of a
        run the id has moved on from, still in flight: it runs on the mirror as it is, its appends
        kept local (_old_run_locked); the mirror never moves to an older submission (registered
        for it, the server refuses it, and the next chunk of the newer run moved it back, each
        move holding the group's appends until answered).

        policy_version (RunChunkRequest.policy_version; None = unknown: left unset, the server then
        merges the group into the key's newest version, or without one gives it a fallback number
        below every version, until a registration brings the version): the group's history
        iteration on the server (RegisterGroupRequest.policy_version), so that groups of one prompt
        key at one version form one iteration. Every RegisterGroup of the mirror carries the version
        of the first attempt of its run registered here (_Mirror.policy_version: the server keeps a
        group's first version too); a registration for another run (registering again, a new
        mirror) carries that run's attempt's when this worker has one, and none when it has no
        attempt of that run (a mirror moved by a Sync reset: the old run's version is not the new
        run's)."""
        prompt = tuple(int(t) for t in prompt_token_ids)
        version = None if policy_version is None else int(policy_version)
        if version is not None and version < 0:
            raise InvalidArgument("must be >= 0 (None = unknown)", field="policy_version")
        with self._lock:
            m = self._groups.get(group_id)
            if m is not None:
                if request_id and submit_seq:
                    self._note_submission_locked(m, request_id, submit_seq)
                m.note_version(submit_seq, version)
                verdict = _judge_attempt(m, prompt_key, prompt, group_size, request_id, epoch, submit_seq)
                if verdict is not _Attempt.REPLACE:
                    # Wanted again (also before its queued appends went out): left marked for
                    # release, it would be dropped at the next tick while the chunk runs on it.
                    m.releasing = False
                if verdict is _Attempt.OLDER:
                    log.info("draft chunk of an older submission than its group's mirror; its appends stay local",
                             extra=kv(group_id=group_id, request_id=request_id, submit_seq=submit_seq,
                                      mirror_submit_seq=m.newest_seq()))
                    return
                if verdict is _Attempt.REREGISTER:
                    self._reregister_locked(group_id, m, request_id, epoch, _Registration(
                        prompt_key, prompt, group_size, int(ttl_seconds), submit_seq,
                        version if version is not None else m.policy_version))
                    return
                if verdict is _Attempt.KEEP:
                    return
                del self._groups[group_id]
                self._pending = [a for a in self._pending if a.group_id != group_id]
                log.info("draft group completed; mirror replaced for its id used again", extra=kv(group_id=group_id))
            self._groups[group_id] = _Mirror(GroupIndex(prompt, levels=self.levels), prompt_key, prompt,
                                             group_size, int(ttl_seconds), register_epoch=epoch,
                                             submit_seq=submit_seq,
                                             seqs={request_id: submit_seq} if request_id and submit_seq else {},
                                             policy_version=version,
                                             seq_versions={submit_seq: version}
                                             if submit_seq and version is not None else {})
            self._enforce_budget_locked()
        self._wake.set()

    @staticmethod
    def _note_submission_locked(m: _Mirror, request_id: str, submit_seq: int) -> None:
        """An attempt of `request_id` from batch submission `submit_seq` (nonzero) starts here
        (caller holds the lock). A newer submission than its last attempt's here is another run's
        request under the same id: the old attempt's epoch goes (resume keeps the largest, and the
        new run's may be lower, after the scheduler's clock went back). An older one never lowers
        the recorded submission (it set it back, and dropped the newer attempt's epoch: the old
        chunk's resume then overwrote the newer run's copy, which a re-created group took as the
        newer run's response); the attempt is marked older (older_attempts) instead. So is one
        older than the mirror's submission when none is recorded for the request yet: the copy
        here is the mirror's run's (a sibling's, through Sync), which the old chunk's resume
        overwrote as well. (The mirror's submission as registered: while a newer one's registration
        is queued, the copies here are still the mirror's run's.)"""
        known = m.seqs.get(request_id, 0)
        # Against the submission the mirror follows, not one it is registering again for: nothing of
        # that run reached the copies here yet (its own attempts record their submission), so a
        # chunk of the mirror's run resumes its copy and indexes its tokens (marked older, it only
        # drafted, from a copy that may hold a failed attempt's tokens); its appends stay local.
        if known > submit_seq or (not known and submit_seq < m.submit_seq):
            m.older_attempts.add(request_id)
            return
        m.older_attempts.discard(request_id)
        if known and known != submit_seq:
            m.epochs.pop(request_id, None)
        m.seqs[request_id] = submit_seq

    def _drop_older_runs_locked(self, gid: str, m: _Mirror) -> None:
        """The mirror moved to a newer submission (m.submit_seq): its requests of older ones are
        an older run's, not its own any more: not resent, and their queued appends (which would
        be stamped with, or land in, the newer run's incarnation) dropped. Its own submission is
        no old run (a reset may have marked it one while the mirror followed an older run's
        incarnation): the requests of the run it follows now are sent. Caller holds the lock."""
        m.old_run_seqs.discard(m.submit_seq)
        older = {rid for rid, q in m.seqs.items() if 0 < q < m.submit_seq}
        if not older:
            return
        m.own -= older
        m.finished -= older
        self._pending = [a for a in self._pending if a.group_id != gid or a.request_id not in older]

    @staticmethod
    def _old_run_locked(m: _Mirror, request_id: str) -> bool:
        """The request's attempt here is of a run whose incarnation completed (a reused reset), or
        of an older submission than the mirror's (register_attempt): its appends stay local. By its
        submission where both it and a reset's or the mirror's are known, else by epoch
        (old_run_epoch). Caller holds the lock."""
        seq = m.seqs.get(request_id, 0)
        if seq and seq < m.newest_seq():
            return True
        if seq and m.seq_judged:
            return seq in m.old_run_seqs
        return 0 < m.epochs.get(request_id, 0) <= m.old_run_epoch

    def release_group(self, group_id: str) -> None:
        """Drops the mirror (the worker serves no request of the group any more). With appends still
        queued it is kept until they are acknowledged: the last one may be what finishes a response,
        without which the group never completes on the server (nor becomes history), and if the
        server lost the group meanwhile the mirror is what re-creates it."""
        with self._lock:
            m = self._groups.get(group_id)
            if m is None:
                return
            if m.registered and any(a.group_id == group_id for a in self._pending):
                m.releasing = True
            else:
                del self._groups[group_id]

    def has_group(self, group_id: str) -> bool:
        """A mirror the worker may use for new work: not released, and its group not completed (a
        chunk starting in a completed group is its id used again: register_group starts over)."""
        with self._lock:
            m = self._groups.get(group_id)
            return m is not None and not m.releasing and not (m.completed and not m.active)

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None:
        """Adds a request's new tokens to the mirror and queues them for the server. Never blocks
        on the network; bad appends are logged and dropped (drafting is best effort).

        truncate=True first drops the request's tokens at or after `offset` (draft.proto
        AppendRequest.truncate), locally at once and on the server in order with the appends.

        epoch, submit_seq: the appending attempt's, as given to its resume (0: not given). An
        attempt of an older submission, or one a newer attempt of the request superseded while it
        ran here (_superseded), appends nothing; without them only the request's registration
        tells (older_attempts)."""
        with self._lock:
            self._append_locked(group_id, request_id, offset, [int(t) for t in token_ids], finished, truncate,
                                epoch, submit_seq)

    def _append_locked(self, group_id: str, request_id: str, offset: int, toks: list[int], finished: bool,
                       truncate: bool, epoch: int = 0, submit_seq: int = 0) -> None:
        m = self._groups.get(group_id)
        if m is None or _superseded(m, request_id, epoch, submit_seq):
            # (An attempt of an older submission than the request's here, see _Mirror.older_attempts,
            # or one a newer attempt of it superseded while it ran here: _Running.superseded.)
            return
        try:
            if truncate:
                m.index.replace_from(request_id, offset, toks)
                m.finished.discard(request_id)
            else:
                m.index.append(request_id, offset, toks)
        except InvalidArgument as e:
            log.warning("draft append dropped: %s", e, extra=kv(group_id=group_id, request_id=request_id))
            return
        if self._old_run_locked(m, request_id):
            # An attempt of the run whose incarnation completed (GroupDelta.reused_*) still
            # running here: its tokens are no response of the new incarnation (stamped with the
            # mirror's, they would land there); they stay local, for its own drafts.
            return
        m.own.add(request_id)
        if finished:
            m.finished.add(request_id)
        if self._stub is not None and not self.follower:
            # While the request runs here our stream is the truth on the server too: sending it
            # as truncate+append overwrites tokens a cancelled attempt elsewhere flushed late
            # (that worker's plain appends never overwrite ours). A no-op when nothing differs.
            wire_truncate = truncate or request_id in m.active
            self._pending.append(draft_pb2.AppendRequest(group_id=group_id, request_id=request_id, offset=offset,
                                                         token_ids=toks, finished=finished,
                                                         truncate=wire_truncate,
                                                         # The newest epoch that resumed the request
                                                         # here, not this attempt's: an attempt below
                                                         # an ended one (a scheduler restarted behind
                                                         # the clock) is refused by the server under
                                                         # its own, which took the ended one's.
                                                         epoch=m.epochs.get(request_id, 0),
                                                         incarnation=m.incarnation))
            if len(self._pending) > _MAX_PENDING:
                drop = len(self._pending) - _MAX_PENDING
                del self._pending[:drop]
                self._stats.dropped_messages += drop

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None:
        """A chunk of the request starts here from its committed output: the mirror's copy becomes
        exactly output_token_ids (what an earlier chunk elsewhere added is filled in, what a failed
        attempt streamed beyond it is dropped), the server gets the same as one truncate+append
        (a no-op there when it already agrees), and Sync deltas for the request are ignored until
        `end`. Only the differing tail is re-indexed. epoch: this attempt's dispatch epoch (stamped
        on every append of the request from here on; 0 = unordered). submit_seq: its batch
        submission (0: not given; the request's registration then tells an older one's).

        An attempt of an older submission than the request's here, or at an older epoch than an
        attempt of it still running here (_newer), is superseded: it leaves the mirror alone (the
        copy, its epoch and its Sync deltas stay the newer attempt's; it drafts from them as they
        are). A newer attempt resuming supersedes those of the request still running here: their
        appends are dropped from then on. An attempt that already ended supersedes nothing: one of
        the same submission at a lower epoch resumes as the request's attempt (a scheduler
        restarted without its epoch_file behind the clock); its appends carry the request's newest
        epoch here, which the server took.

        One critical section: a Sync applied between the truncate and marking the request active
        could put a stale attempt's tokens back into its own copy (it would then draft from them)."""
        with self._lock:
            m = self._groups.get(group_id)
            if m is None:
                return
            self._groups.move_to_end(group_id)  # recently used: released last
            running = m.attempts.setdefault(request_id, [])
            if (_older_submission(m, request_id, submit_seq, request_id in m.older_attempts)
                    or any(not r.superseded and _newer(r.epoch, r.submit_seq, epoch, submit_seq) for r in running)):
                running.append(_Running(epoch, submit_seq, False, superseded=True))
                return
            for r in running:
                if _newer(epoch, submit_seq, r.epoch, r.submit_seq):
                    r.superseded = True  # its late appends would go out under this one's epoch
            if epoch:
                m.epochs[request_id] = max(epoch, m.epochs.get(request_id, 0))
            m.synced_over.discard(request_id)  # our attempt's copy from here on
            # Its entry first: the truncate+append below finds it (the latest of its names), not an
            # earlier attempt of the same names still running here and superseded since.
            running.append(_Running(epoch, submit_seq, True))
            self._append_locked(group_id, request_id, 0, [int(t) for t in output_token_ids], False, True,
                                epoch, submit_seq)
            m.active.add(request_id)

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        """The request's chunk here is over: Sync deltas for it apply to the mirror again. If
        another worker wrote to it meanwhile (its attempt here was given up on), the deltas skipped
        while it ran are not replayable one by one: the mirror syncs the whole group again, and
        keeps its copies until the reply replaces them.

        Ends one attempt of the request, the one `epoch` and `submit_seq` name (as given to its
        resume; without them, the earliest still running here, see _Mirror.attempts). Attempts end
        in any order (SGLang drops rids from its batch as they finish or abort): an abandoned
        attempt ending after its re-dispatched successor started here leaves the newer one active
        (cleared, Sync deltas would overwrite its copy: an echo of its own tokens, or the abandoned
        attempt's, to draft from); the newer one ending first ends the mark although the
        abandoned one still runs (its appends are dropped, _Running.superseded), so the server's
        state (that response finished) comes in by Sync again. An end that names an attempt not
        running here changes nothing (see _take_attempt)."""
        with self._lock:
            m = self._groups.get(group_id)
            if m is None:
                return
            running = m.attempts.get(request_id, [])
            ended = _take_attempt(running, epoch, submit_seq)
            if ended is None and (epoch or submit_seq):
                return  # not an attempt of this mirror's (or already ended): nothing of it to end
            made_active = ended.made_active if ended is not None else request_id not in m.older_attempts
            if not running:
                m.attempts.pop(request_id, None)
            if not made_active:
                if all(r.made_active for r in running):
                    m.older_attempts.discard(request_id)  # no older submission's attempt runs here now
                return
            if any(r.made_active and not r.superseded and not _older_submission(m, request_id, r.submit_seq, False)
                   for r in running):
                return  # another attempt that made it active, and is not superseded, still runs here
            m.active.discard(request_id)
            if request_id in m.resync:
                m.resync.discard(request_id)
                incarnation, synced = m.incarnation, m.synced
                self._restart_mirror_locked(m, m.index.request_ids())
                # The same incarnation: a whole-group reply, not a reset; still the one it synced.
                m.incarnation, m.synced = incarnation, synced

    def own_length(self, group_id: str, request_id: str) -> int:
        """Tokens of the request in the mirror (tests: never beyond its current length)."""
        with self._lock:
            m = self._groups.get(group_id)
            return 0 if m is None else m.index.length(request_id)

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        """A draft for the request's next tokens from the local mirror, or None."""
        if max_len <= 0:
            return None
        with self._lock:
            self._proposed_since_tick = True
            if self._interval > self.sync_interval_s:
                # Speculation resumed after an idle stretch: the short interval again, from now.
                self._interval = self.sync_interval_s
                self._wake.set()
            m = self._groups.get(group_id)
            if m is None:
                return None
            p = m.index.propose(context, max_len, width=width, min_token_prob=self.min_token_prob,
                                request_id=request_id)
            self._stats.proposals += 1
            self._stats.proposed_tokens += len(p.tokens)
        if not p.tokens:
            return None
        return Draft(p.tokens, p.parents)

    def stats(self) -> DraftClientStats:
        with self._lock:
            s = DraftClientStats(**vars(self._stats))
            s.groups = len(self._groups)
            s.memory_bytes = sum(m.index.memory_bytes() for m in self._groups.values())
            return s

    def _enforce_budget_locked(self) -> None:
        """Releases least recently used mirrors with nothing running here until the mirrors fit
        memory_budget_bytes (a mirror holds its group's responses and history: unbounded, 1,024
        groups of 16 x 4K tokens with history would take several GB). Caller holds the lock."""
        total = sum(m.index.memory_bytes() for m in self._groups.values())
        if total <= self.memory_budget_bytes:
            return
        unsent = {a.group_id for a in self._pending}  # released, their queued tokens would be lost
        for gid in list(self._groups):
            m = self._groups[gid]
            # `active`, not `attempts`: a mirror whose only attempts running here are of an older
            # submission, or superseded (they left the request inactive, _Running.made_active), is
            # released like an idle one, here and on the server's expiry or a reset (_lost_locked,
            # _judge_reset). Harmless (tests/worker/test_draft_client_older_attempt_release.py):
            # their appends are dropped whether the mirror is kept or not (_superseded), their
            # output never lands in the newer run (the buffer refuses an older submission's
            # commit), so released they only draft nothing (propose None; append and end no-ops);
            # and a newer run's chunk re-creating the mirror registers at its own submission,
            # against which their late appends are still older (_older_submission). Kept for them,
            # memory would be held, and an expired group re-registered, for a discarded chunk.
            if m.active or gid in unsent:
                continue
            total -= m.index.memory_bytes()
            del self._groups[gid]
            self._stats.evicted_mirrors += 1
            log.info("draft mirror released for memory", extra=kv(group_id=gid, budget=self.memory_budget_bytes))
            if total <= self.memory_budget_bytes:
                return

    def flush(self, timeout: float = 5.0) -> None:
        """Sends queued appends and syncs once now (tests, and before a worker stops)."""
        if self._stub is None:
            return
        self._tick()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                log.warning("draft sync thread did not stop in time")
        try:
            self._tick_appends_only()
        except Exception:  # best effort on the way out
            log.debug("final draft flush failed", exc_info=True)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # ---- background sync ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:
                log.exception("draft sync tick failed")
            self._wake.wait(self._next_interval())
            self._wake.clear()

    def _next_interval(self) -> float:
        """sync_interval_s while drafts are proposed; doubling up to idle_sync_interval_s while not."""
        with self._lock:
            if self._proposed_since_tick:
                self._interval = self.sync_interval_s
            else:
                self._interval = min(self.idle_sync_interval_s, self._interval * 2)
            self._proposed_since_tick = False
            return self._interval

    @property
    def tick_interval_s(self) -> float:
        """The current background tick interval (tests, stats)."""
        with self._lock:
            return self._interval

    def _tick(self) -> None:
        self._register_pending()
        self._tick_appends_only()
        self._sync()
        with self._lock:
            self._finish_releases_locked()
            self._enforce_budget_locked()

    def _finish_releases_locked(self) -> None:
        """Drops released mirrors whose queued appends were all acknowledged (caller holds the lock)."""
        unsent = {a.group_id for a in self._pending}
        for gid in [g for g, m in self._groups.items() if m.releasing and g not in unsent]:
            del self._groups[gid]

    def _register_pending(self) -> None:
        assert self._stub is not None
        with self._lock:
            todo = [(gid, m, m.reregister or m.registration(),
                     m.register_epoch) for gid, m in self._groups.items() if not m.ready]
        for gid, m, registration, epoch in todo:
            key, prompt, size, ttl, seq, version = registration
            with self._lock:
                # Sent with the newest attempt this mirror ran too (register_epoch is only the
                # registrations'): re-creating a group the server lost, a completed one that expired
                # must be told this run's epoch, or it takes the run for the id used again.
                sent = max(epoch, max(m.epochs.values(), default=0))
            req = draft_pb2.RegisterGroupRequest(group_id=gid, prompt_key=key, prompt_token_ids=prompt,
                                                 ttl_seconds=ttl, group_size=size, epoch=sent, submit_seq=seq)
            if version is not None:
                # Optional on the wire: unset is unknown (the server merges the group into the
                # key's newest version, or gives it a fallback number below every version), 0 is
                # the first policy version.
                req.policy_version = version
            try:
                resp = self._stub.RegisterGroup(req, timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Completed on the server earlier, then evicted or expired, or an older run's
                    # registration: nothing to draft for. Unless a newer registration was queued
                    # while this one was out (a newer submission's chunk started here): the mirror
                    # is that run's now, and released, the newer run's appends were lost.
                    with self._lock:
                        if self._groups.get(gid) is m and m.reregister in (None, registration):
                            del self._groups[gid]
                            log.info("draft group completed earlier, or moved on to a newer run; mirror released",
                                     extra=kv(group_id=gid, submit_seq=seq))
                        else:
                            log.info("draft registration refused; a newer one is queued", extra=kv(group_id=gid))
                    continue
                if m.registered and e.code() not in _RETRY_CODES:
                    # A re-registration refused for good (ALREADY_EXISTS: another run's group of
                    # another size runs under the id): the mirror goes on as registered; its next
                    # Sync tells it what the server holds (reset). Retried, its appends and Syncs
                    # would wait forever.
                    with self._lock:
                        if self._groups.get(gid) is m and m.register_epoch == epoch \
                                and m.reregister in (None, registration):
                            m.reregister = None
                log.warning("draft RegisterGroup failed: %s", e.code().name, extra=kv(group_id=gid))
                continue
            with self._lock:
                self._stats.register_rpcs += 1
                if self._groups.get(gid) is not m:
                    continue
                m.registered = True
                if m.register_epoch == epoch and m.reregister in (None, registration):
                    # (A newer attempt's or submission's asked meanwhile: sent next tick. By the
                    # registration too: a newer submission may come at a lower epoch.)
                    m.reregister = None
                if seq > m.submit_seq:
                    # The run the server judged this registration by: later chunks of it are the
                    # mirror's run (register_attempt). Never an older one (it is never sent).
                    m.submit_seq = seq
                    m.follow_version(seq, version)
                    self._drop_older_runs_locked(gid, m)
                elif resp.created and version is not None and version != m.policy_version:
                    # A new incarnation of this registration (another run under the id, told by
                    # the epoch): the mirror's group is at its version from now on.
                    m.policy_version = version
                if not m.incarnation and resp.incarnation and m.ready:
                    # Not synced yet (a new mirror, or one re-creating a group the server lost): it
                    # follows the incarnation this registration was judged against, and so do the
                    # appends it queued meanwhile (incarnation 0 would land in whichever incarnation
                    # the group has when they arrive: another run's, registered in between, where
                    # an old run's epochs lock the new run's attempts out). Not while a newer
                    # registration is queued: its answer says which incarnation they are for.
                    m.incarnation = resp.incarnation
                    for a in self._pending:
                        if a.group_id == gid and not a.incarnation:
                            a.incarnation = resp.incarnation
                if resp.created and (key, prompt, size) != (m.prompt_key, m.prompt, m.group_size):
                    # A new incarnation of another registration (the id used again with another
                    # prompt or size): the mirror follows it from its next Sync (reset), rebuilt
                    # from this prompt.
                    m.prompt_key, m.prompt, m.group_size, m.ttl_seconds = key, prompt, size, ttl

    def _tick_appends_only(self) -> None:
        if self._stub is None:
            return
        with self._lock:
            registered = {gid for gid, m in self._groups.items() if m.ready}
            batch = [a for a in self._pending if a.group_id in registered]
            self._pending = [a for a in self._pending if a.group_id not in registered and a.group_id in self._groups]
        if not batch:
            return
        batch = _coalesce(batch)
        try:
            self._stub.Append(iter(batch), timeout=self.rpc_timeout_s)
            self._stats.append_rpcs += 1
            self._stats.sent_tokens += sum(len(a.token_ids) for a in batch)
            self._acknowledged(batch)
            return
        except grpc.RpcError as e:
            code = e.code()
            self._stats.append_errors += 1
            if code in _RETRY_CODES:
                with self._lock:
                    self._pending[:0] = batch  # resend later; appends are idempotent
                return
            log.warning("draft Append refused (%s: %s); resending one by one", code.name, e.details())
        # A refused message stops the stream; the ones before it were applied. Resend each alone.
        retry: list[draft_pb2.AppendRequest] = []
        for k, a in enumerate(batch):
            try:
                self._stub.Append(iter([a]), timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                if code in _RETRY_CODES:
                    retry.extend(batch[k:])  # the server is going away: keep this and the rest, in order
                    break
                self._on_refused(a, code, e.details() or "")
                continue
            self._acknowledged([a])
        if retry:
            with self._lock:
                self._pending[:0] = retry

    def _acknowledged(self, msgs: Sequence[draft_pb2.AppendRequest]) -> None:
        """Appends the server applied: a response's last one says its finished state there now."""
        last = {(a.group_id, a.request_id): a for a in msgs}
        with self._lock:
            for (gid, rid), a in last.items():
                m = self._groups.get(gid)
                if m is None or not m.registered:
                    continue  # released, or lost and to be re-created: the old server's state is moot
                if a.finished:
                    m.done.add(rid)
                elif a.truncate:
                    m.done.discard(rid)  # re-opened there (a plain append leaves the state as it was)

    def _on_refused(self, a: draft_pb2.AppendRequest, code: grpc.StatusCode, details: str) -> None:
        """One append the server refused for good (not a transient error)."""
        with self._lock:
            m = self._groups.get(a.group_id)
            if m is None:
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION and _names_incarnation(details):
                # Sent under another incarnation than the group's (the id was registered again, or
                # the group was re-created after a restart): first, since it says nothing about the
                # response in the group as it is now (its finished state stays). Dropped; the next
                # Sync answers our watermark with reset, which releases a completed mirror or
                # rebuilds it and resends our own responses under the new incarnation.
                self._stats.stale_incarnation_messages += 1
                if a.incarnation == m.incarnation:
                    m.must_sync = True
                log.info("draft append of another group incarnation refused",
                         extra=kv(group_id=a.group_id, request_id=a.request_id, incarnation=a.incarnation))
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION and a.epoch and _names_complete(details):
                # An attempt newer than any this mirror registered for re-opens a response of a
                # group that completed on the server (its responses are history): another run's
                # attempt on a stale mirror (a resubmitted batch id), or a lost commit's retry.
                # Registered again with its epoch, the server tells which: a new incarnation when
                # the completed group took no attempt as new, and this mirror's next Sync (held
                # until then: it would bring the old run's response over this attempt's copy) is
                # a reused reset, which resends this attempt's response, finished state kept, into
                # the new one. Otherwise idempotent: the refusal stands. Every such refusal returns
                # here, whatever its epoch: the response is finished on the server (the group is
                # complete), so our finished state stays (a second new-run request ending in the
                # same batch with a lower epoch, dispatched earlier, lost its finish in the resend
                # and the new incarnation never completed); only a newer epoch registers again.
                if a.epoch > m.register_epoch:
                    # A registration queued meanwhile (a newer submission's) stays the one sent:
                    # replaced by the mirror's, an older run's, the newer run never registered.
                    self._reregister_locked(a.group_id, m, a.request_id, a.epoch, m.reregister or m.registration())
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION and a.finished and a.request_id not in m.done:
                # Our finish did not apply (a newer attempt elsewhere owns the response, or it ends
                # elsewhere): not ours to resend as finished; Sync brings the server's state.
                m.finished.discard(a.request_id)
            if code == grpc.StatusCode.NOT_FOUND:
                # The server lost the group (restart) or expired it: see _lost_locked.
                self._lost_locked(a.group_id, m, expired="expired" in details)
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION and "stale attempt" in details:
                self._stats.stale_messages += 1  # a newer attempt elsewhere owns the request now
                log.info("draft append of an older attempt refused", extra=kv(group_id=a.group_id,
                                                                              request_id=a.request_id))
                return
            if code == grpc.StatusCode.INVALID_ARGUMENT and "gap" in details and a.offset > 0 \
                    and a.request_id in m.own and m.index.length(a.request_id):
                # The server is missing the start of our response (an earlier message was dropped, or
                # the group was re-created with another worker's copy first): send all of it.
                self._pending.append(self._whole_locked(a.group_id, m, a.request_id))
                return
        log.warning("draft append dropped (%s: %s)", code.name, details,
                    extra=kv(group_id=a.group_id, request_id=a.request_id))

    def _reregister_locked(self, gid: str, m: _Mirror, request_id: str, epoch: int,
                           registration: _Registration) -> None:
        """Queues RegisterGroup again (`registration`, with `epoch`): for a newer attempt of a group
        that may have completed on the server, or an attempt of a newer submission than the
        mirror's (register_attempt, _on_refused), or to move the group off an older run's
        incarnation (a plain reset to one: its straggler re-created the id after a restart), or
        for a stale mirror's expired group holding a response of ours (_lost_locked). The server
        tells by the submission, else the epoch, whether it is another run (a new incarnation; a
        running older run's group is replaced) or this one (idempotent). The group's appends and
        Syncs wait for it (_Mirror.reregister). Caller holds the lock.
        register_epoch only grows: a newer submission's attempt may come at a lower epoch (the
        scheduler's clock went back), and lowered, it made every later attempt above it look newer
        and register again (the submission decides then, not the epoch)."""
        m.register_epoch = max(m.register_epoch, epoch)
        m.reregister = registration
        log.info("draft group registering again (may have completed, a newer submission, or an older run's "
                 "incarnation)", extra=kv(group_id=gid, request_id=request_id, epoch=epoch,
                                          submit_seq=registration.submit_seq))
        self._wake.set()

    def _whole_locked(self, gid: str, m: _Mirror, rid: str) -> draft_pb2.AppendRequest:
        """This worker's whole copy of a response as one message (caller holds the lock). A truncate
        while the request runs here (our copy is the truth); a plain append otherwise (it must not
        overwrite what a newer attempt elsewhere sent). Under the mirror's current incarnation (0
        when it has none yet: accepted by whichever the group has)."""
        return draft_pb2.AppendRequest(group_id=gid, request_id=rid, offset=0, token_ids=m.index.tokens(rid),
                                       finished=rid in m.finished, truncate=rid in m.active,
                                       epoch=m.epochs.get(rid, 0), incarnation=m.incarnation)

    def _requeue_own(self, gid: str, m: _Mirror, rids: Sequence[str] | None = None) -> None:
        """Queues this worker's whole sequences of a group again (caller holds the lock)."""
        if self.follower:
            return
        for rid in sorted(m.own if rids is None else rids):
            if m.index.length(rid) or rid in m.finished:
                self._pending.append(self._whole_locked(gid, m, rid))

    def _fresh_index_locked(self, m: _Mirror, keep: Sequence[str]) -> GroupIndex:
        """A new index with the prompt and this worker's copies of `keep` (caller holds the lock)."""
        index = GroupIndex(m.prompt, levels=self.levels)
        for rid in keep:
            toks = m.index.tokens(rid)
            if toks:
                index.append(rid, 0, toks)
        return index

    def _lost_locked(self, gid: str, m: _Mirror, expired: bool) -> None:
        """The server has no such group (gone, NOT_FOUND). Lost in a server restart, or needed by a
        request running here: re-registered and our responses resent. Expired or evicted (after
        completing) with nothing of it running here: the mirror is released; re-creating it would
        promote the same responses to history again. Unless this stale mirror (it did not know the
        group completed) holds a response of ours the server may lack: then it registers again
        with the newest epoch it ran, and the server tells which run that is (see below)."""
        # The group completed on the server as far as we know (every response finished there: our
        # acknowledged finishes and the siblings' through Sync, whichever workers ran them): a
        # restarted server (no tombstones) would let us re-create it and it would complete a second
        # time. Released likewise. Not so when a finish of ours was never acknowledged (the server
        # restarted while it was queued): then the group never completed, and resending is the
        # only way its responses reach history.
        if (expired or m.completed) and not m.active:
            newest = m.newest_epoch()
            # A stale mirror only: one that followed the incarnation through Sync (synced; not
            # history_loaded, which end()'s whole-group restart clears until the next reply). One
            # that registered and never synced took its incarnation from its registration's
            # answer, which judged its run to be that incarnation's: that one completed (its
            # responses are history), and registered again with an epoch above the ones it took
            # (ours never reached it), with submit_seq 0 the server re-created it as a new run.
            if expired and not m.completed and m.synced and newest and any(r not in m.done for r in m.own):
                # A new run's chunk that ended on this stale mirror before any tick (a chunk ending
                # at once): its appends met the old run's expired group, and released, its response
                # never reached the new run's incarnation (nothing else here re-creates it). Registered
                # again with the newest epoch run here: an epoch of the old run is refused (then
                # released: FAILED_PRECONDITION in _register_pending); a newer one starts, or finds,
                # the new run's incarnation, and the next Sync of our old incarnation is a reused
                # reset, which resends only the new run's responses (by epoch, _new_run).
                # The mirror keeps its incarnation for that reset: restarted (below), it would
                # resend the old run's responses too.
                if m.reregister is None:
                    self._reregister_locked(gid, m, "", newest, m.registration())
                return
            del self._groups[gid]
            log.info("draft group gone on the server; mirror released", extra=kv(group_id=gid))
            return
        # Start over: the new registration's first Sync brings the history and the siblings again
        # (kept, they would be loaded twice); our own copies stay and are resent whole, which
        # covers the appends still queued for the group (resent after them, they hit a gap); the
        # copies of requests running here that are not ours (an older run's late chunk) stay local.
        self._restart_mirror_locked(m, sorted(m.own | m.active))
        m.registered = False
        if not self.follower:
            self._pending = [a for a in self._pending if a.group_id != gid]
        self._requeue_own(gid, m)

    def _sync(self) -> None:
        assert self._stub is not None
        with self._lock:
            # A group whose every response generates here has nothing to sync but echoes of our
            # own tokens, which are skipped anyway; its first sync (history, prompt) still runs.
            marks = []
            for gid, mirror in self._groups.items():
                if not mirror.ready:
                    # Not registered, or registering again: a Sync of the old run's group now would
                    # bring its responses over this worker's newer attempt's copies.
                    continue
                if mirror.history_loaded and mirror.watermark > 0 and not mirror.must_sync \
                        and 0 < mirror.group_size <= len(mirror.active):
                    self._stats.skipped_group_syncs += 1
                    continue
                marks.append((gid, mirror.watermark, mirror.incarnation, mirror))
        # In slices: one reply carrying every group from watermark 0 (after a server restart) could
        # exceed the message size limit, and then no group would ever sync again. A slice whose
        # reply is still too large is halved (down to one group).
        todo = [marks[k : k + _SYNC_GROUPS_PER_RPC] for k in range(0, len(marks), _SYNC_GROUPS_PER_RPC)]
        while todo:
            part = todo.pop()
            if not self._sync_some(part) and len(part) > 1:
                todo += [part[: len(part) // 2], part[len(part) // 2 :]]

    def _sync_some(self, marks: Sequence[tuple[str, int, int, _Mirror]]) -> bool:
        """One Sync RPC; False when its reply was too large (RESOURCE_EXHAUSTED)."""
        assert self._stub is not None
        req = draft_pb2.SyncRequest(groups=[draft_pb2.GroupWatermark(group_id=g, watermark=w, incarnation=i)
                                            for g, w, i, _m in marks])
        try:
            resp = self._stub.Sync(req, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            self._stats.sync_errors += 1
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # A watermark ahead of a server that does not know incarnations: start over the
                # group the error names (all of this slice when it names none).
                bad = _named_group(e.details() or "", len(marks))
                with self._lock:
                    for j, (gid, _w, _i, sent) in enumerate(marks):
                        m = self._groups.get(gid)
                        if m is sent and (bad is None or bad == j):
                            self._restart_mirror_locked(m, sorted(m.own | m.active))
            log.warning("draft Sync failed: %s", e.code().name, extra=kv(groups=len(marks)))
            return e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
        self._stats.syncs += 1
        # One group at a time under the lock: propose() (the decode path) takes the same lock, and
        # a reply of many groups from watermark 0 would otherwise stall a decode step for all of it.
        asked = {gid: m for gid, _w, _i, m in marks}
        for d in resp.groups:
            with self._lock:
                m = self._groups.get(d.group_id)
                if m is None or m is not asked.get(d.group_id):
                    continue  # released (or released and registered again) while the Sync was out
                self._stats.received_tokens += self._apply_locked(d, m)
        return True

    def _apply_locked(self, d: draft_pb2.GroupDelta, m: _Mirror) -> int:
        """Applies one group's Sync reply to its mirror; returns the tokens added. Caller holds the lock."""
        if d.gone:
            self._lost_locked(d.group_id, m, d.expired)
            return 0
        received = 0
        old: GroupIndex | None = None
        if d.reset:
            reset = _judge_reset(m, d)
            if reset.release:
                del self._groups[d.group_id]
                log.info("draft group completed; mirror released for its new incarnation",
                         extra=kv(group_id=d.group_id))
                return 0
            # The copies kept: every request running here (the truth, also an old run's attempt or
            # one of a newer submission the mirror is registering again for, whose appends stay
            # local meanwhile: it drafts from it, and a later reset may resend it) and, for a
            # completed incarnation, the new run's that ended here already.
            old = self._restart_mirror_locked(m, sorted(m.active | reset.new_run))
            # Our queued appends of the old incarnation would be refused (one by one, after their
            # batch): what of them is still ours is resent whole below, under the new one.
            self._pending = [a for a in self._pending
                             if a.group_id != d.group_id or a.incarnation in (0, d.incarnation)]
            if reset.completed:
                old = None  # only the new run's requests are ours in the new incarnation (resent below)
                m.own = set(reset.new_run)  # (with a request running here the reset took out of ours)
                m.finished &= reset.new_run
                m.old_run_epoch = max(m.old_run_epoch, reset.reused_epoch)
                if reset.seq_judged:
                    m.seq_judged = True
                    m.old_run_seqs |= reset.old_run_seqs
            m.synced_over.clear()  # the copies kept are ours; the reply's deltas below mark again
            if reset.follow_seq:
                # Follows the new incarnation's run from here on (register_attempt compares with
                # it: kept at the old run's, that run's late chunks looked like the mirror's run).
                m.submit_seq = d.submit_seq
                m.follow_version(d.submit_seq)
                self._drop_older_runs_locked(d.group_id, m)
            elif reset.reregister:
                # An older run's incarnation (its straggler re-created the id after a restart):
                # registered again by our newer submission, the server replaces it, and the next
                # Sync is a reused reset that resends our run's responses into the new one.
                self._reregister_locked(d.group_id, m, "", m.newest_epoch(), m.registration())
        if m.watermark == 0 and not m.history_loaded:
            for h in d.history:
                m.index.add_history(h.token_ids)
            m.history_loaded = True
        finished: dict[str, bool] = {}  # the server's finished state of each response the reply touches
        for a in d.appends:
            rid = a.request_id
            if not rid:
                m.index.add_history(a.token_ids)
                continue
            if rid in m.active:
                # Generating here: the local copy is the truth (see the module doc). Another
                # writer's tokens (an attempt elsewhere took the request over) are made up at end().
                if a.truncate or m.index.tokens_at(rid, a.offset, len(a.token_ids)) != list(a.token_ids):
                    m.resync.add(rid)
                continue
            finished[rid] = a.finished
            if not a.truncate and m.index.tokens_at(rid, a.offset, len(a.token_ids)) == list(a.token_ids) and not (
                    a.finished and m.index.length(rid) > a.offset + len(a.token_ids)):
                continue  # an echo: our copy may be ahead (appends not sent yet), never cut it
            try:
                # The server's log is the truth for a response not running here, so a delta that
                # differs replaces from its offset: a copy of ours from an abandoned attempt
                # (tokens beyond what the newer attempt sent) gives way instead of refusing the
                # newer tokens as an overlap.
                dropped, added = m.index.replace_from(rid, a.offset, a.token_ids)
                received += added
                if dropped or added:
                    m.synced_over.add(rid)
            except InvalidArgument as e:
                log.warning("draft delta skipped: %s", e, extra=kv(group_id=d.group_id))
        for rid, fin in finished.items():
            if fin:
                m.done.add(rid)
                m.finished.add(rid)
                continue
            if rid in m.done:
                # Re-opened or cut back by another writer after it finished: ours is no longer
                # the response's end. (A finish of ours not acknowledged yet stays: this may be an
                # echo of our earlier appends; its acknowledgement or refusal settles it.)
                m.finished.discard(rid)
                m.done.discard(rid)
        m.watermark = d.watermark
        m.incarnation = d.incarnation
        m.synced = True
        m.must_sync = False
        # Resent only now, stamped with the new incarnation (the mirror's).
        if d.reset and old is None:
            self._requeue_own(d.group_id, m, sorted(m.own))
        if old is not None:
            # Our responses the new incarnation lacks come back from our old copy; they and those
            # running here (our copy is the truth) go to the server again.
            lacking = [r for r in sorted(m.own) if r not in m.active and not m.index.length(r)]
            for r in lacking:
                toks = old.tokens(r)
                if toks:
                    m.index.append(r, 0, toks)
            self._requeue_own(d.group_id, m, sorted(m.active & m.own) + lacking)
        return received

    def _restart_mirror_locked(self, m: _Mirror, keep: Sequence[str]) -> GroupIndex:
        """The mirror starts over from watermark 0 with the prompt and our copies of `keep`; returns
        the old index. Caller holds the lock."""
        old = m.index
        m.index = self._fresh_index_locked(m, keep)
        m.watermark = 0
        m.incarnation = 0
        m.synced = False
        m.history_loaded = False
        m.done.clear()  # the server's state as known so far: the whole-group reply brings it again
        self._stats.resets += 1
        return old


def _new_run(m: _Mirror, reused_epoch: int, reused_seq: int = 0, new_seq: int = 0) -> set[str]:
    """Our requests of the run that registered the group id again, after our incarnation
    completed (reads `m` only). By submission first, where the request's attempt here came with
    one (RunChunkRequest.submit_seq): the new incarnation's (GroupDelta.submit_seq) is the new
    run's, or, with only the reused one's known (reused_submit_seq), any other one; whatever the
    epochs (a new run after the scheduler's clock went back has epochs at most reused_epoch). Else
    by dispatch epoch when both are known: the old run's attempts all had epochs at most
    reused_epoch, the new run's were dispatched later, so with larger ones, whether they run here
    now or already ended on this stale mirror (a chunk ending at once on a complete output, a short
    chunk between two ticks: their appends of the old incarnation were refused, and this resend is
    their only way into the new one). Without (an old server, appends without epochs): the
    requests running here now, as before.
    By submission or epoch, the request's copy here must still be that attempt's: running here, or
    no Sync delta changed it since the attempt started (synced_over: the old incarnation's Sync may
    have brought the old run's finished response over it after the attempt ended here). A new
    run's attempt whose copy was overwritten so is lost to the new incarnation (as before epochs);
    resending the old run's tokens as its would be worse."""
    keep: set[str] = set()
    # Also a request running here of the new incarnation's submission that is not among our
    # responses: a reset to an older incarnation took it out (a chunk of a newer submission
    # started while the Sync was out); its copy here is that attempt's, the new run's.
    keep.update(r for r in m.active - m.own if new_seq and m.seqs.get(r, 0) == new_seq)
    for rid in m.own:
        seq = m.seqs.get(rid, 0)
        epoch = m.epochs.get(rid, 0)
        if seq and (new_seq or reused_seq):
            new = seq == new_seq if new_seq else seq != reused_seq
        elif reused_epoch and epoch:
            new = epoch > reused_epoch
        else:
            new = rid in m.active  # neither known: the requests running here now
        if new and (rid in m.active or rid not in m.synced_over):
            keep.add(rid)
    return keep


class _Reset(NamedTuple):
    """How a Sync reset (another incarnation of the mirror's group) is taken (_judge_reset)."""

    completed: bool  # the mirror's incarnation completed: only the new run's requests go to the new one
    new_run: frozenset[str]  # (completed) our requests of the new run (_new_run)
    release: bool  # (completed) nothing of ours is the new run's and nothing runs here: released
    reused_epoch: int  # (completed) GroupDelta.reused_epoch of a reused reset, else 0
    seq_judged: bool  # (completed) a submission was carried: the old run is judged by submission
    old_run_seqs: frozenset[int]  # (seq_judged) submissions found to be the old run's
    follow_seq: bool  # the new incarnation is of a newer submission: the mirror follows it
    reregister: bool  # an older run's incarnation: register our newer submission again


def _judge_reset(m: _Mirror, d: draft_pb2.GroupDelta) -> _Reset:
    """How _apply_locked takes the reset `d` of mirror `m`; reads `m` only.

    Another incarnation of the group: the mirror is rebuilt from its whole state (as for watermark
    0); the responses running here keep our copy (the truth). Ours completed (its responses are
    history): nothing of it goes to the new one, which is the group re-created after a restart or
    its id used again; with nothing running here, released. The server says so too (reused) when
    it saw our incarnation complete before the id was registered again, which this mirror may not
    know (a sibling's finish not synced yet): the new incarnation is another run (a resubmitted
    batch id), and our old responses must not go into it. Without reused (a restarted server knows
    nothing of older incarnations) an incomplete mirror's responses are the same run's: resent.
    A plain reset to an incarnation of a newer submission than the mirror's (the server restarted,
    or the group expired unfinished, and a newer run registered the id): our responses are an
    older run's too, resent only as reused decides (by submission)."""
    newer_run = bool(d.submit_seq and 0 < m.submit_seq < d.submit_seq)
    completed = m.completed or d.reused or newer_run
    reused_epoch = d.reused_epoch if d.reused else 0
    reused_seq = d.reused_submit_seq if d.reused else 0
    # The new incarnation's submission names the new run only when it is one: reused, or a newer
    # submission than the mirror's. A plain reset of the mirror's own (or an older) submission is
    # its group re-created after a restart (a stale sibling's mirror, an older run's straggler):
    # taken as the new run, every response of our completed run was resent and the group
    # completed, and became history, a second time.
    new_seq = d.submit_seq if d.reused or newer_run else 0
    new_run = frozenset(_new_run(m, reused_epoch, reused_seq, new_seq)) if completed \
        else frozenset()
    # Judged by submission from here on (_old_run_locked): the reused run's, and every submission
    # of ours the reset found not the new run's, if older than both the new run's and the mirror's:
    # the mirror's own run (a plain reset to an older run's incarnation) or a newer one queued
    # (register_attempt while the Sync was out) is no old run; marked, their requests' appends
    # stayed local for good, and they never reached the incarnation they register for.
    seq_judged = completed and bool(reused_seq or d.submit_seq)
    old_run_seqs: set[int] = set()
    if seq_judged:
        if reused_seq:
            old_run_seqs.add(reused_seq)
        if d.submit_seq:
            newest = max(d.submit_seq, m.newest_seq())
            old_run_seqs.update(q for q in m.seqs.values() if q != d.submit_seq and q < newest)
    return _Reset(
        completed=completed, new_run=new_run, release=completed and not new_run and not m.active,
        reused_epoch=reused_epoch, seq_judged=seq_judged, old_run_seqs=frozenset(old_run_seqs),
        follow_seq=d.submit_seq > m.submit_seq,
        reregister=bool(d.submit_seq and m.submit_seq > d.submit_seq and m.reregister is None))


def _coalesce(batch: list[draft_pb2.AppendRequest]) -> list[draft_pb2.AppendRequest]:
    """Merges contiguous appends of one request (one message per request per flush). A truncate
    inside the previous message of the request folds into it (cutting its tokens): applying the
    previous message leaves exactly prev.offset + len(prev.token_ids) tokens, so "prev, then cut
    and append" is one truncate+append at prev.offset."""
    out: list[draft_pb2.AppendRequest] = []
    last: dict[tuple[str, str], int] = {}
    for a in batch:
        key = (a.group_id, a.request_id)
        j = last.get(key)
        if j is not None:
            prev = out[j]
            end = prev.offset + len(prev.token_ids)
            if not prev.finished and prev.epoch == a.epoch and prev.incarnation == a.incarnation and (
                    end == a.offset or (a.truncate and prev.offset <= a.offset <= end)):
                del prev.token_ids[a.offset - prev.offset :]
                prev.token_ids.extend(a.token_ids)
                prev.finished = a.finished
                prev.truncate = prev.truncate or a.truncate
                continue
        last[key] = len(out)
        out.append(draft_pb2.AppendRequest(group_id=a.group_id, request_id=a.request_id, offset=a.offset,
                                           token_ids=a.token_ids, finished=a.finished, truncate=a.truncate,
                                           epoch=a.epoch, incarnation=a.incarnation))
    return out


def _names_incarnation(details: str) -> bool:
    """The refusal names the append's incarnation field (the draft server: "messages[i].incarnation:
    ..."). Matched on the field name, not the word anywhere: a group or request id may contain it."""
    return re.match(r"(messages\[\d+\]\.)?incarnation:", details) is not None


def _names_complete(details: str) -> bool:
    """The refusal says the response cannot be re-opened because its group completed (the draft
    server: "messages[i].truncate: group ... is complete ..."); matched on the field name first."""
    return re.match(r"(messages\[\d+\]\.)?truncate: group .* is complete", details, re.DOTALL) is not None


def _named_group(details: str, n: int) -> int | None:
    """The index i of "groups[i]" in an error's details (the server names the bad watermark), if any."""
    hit = re.search(r"groups\[(\d+)\]", details)
    if hit is None:
        return None
    i = int(hit.group(1))
    return i if i < n else None
