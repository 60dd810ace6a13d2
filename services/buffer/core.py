"""The buffer's pure core: batches -> groups -> requests -> chunks, results logs, history.

No gRPC here: the server converts messages and calls these methods; the simulator and the tests use
the core directly. All state changes happen under one lock and are written to RocksDB as one
WriteBatch before anything is acknowledged or published, so a crash at any point loses nothing that
a caller saw acknowledged (DESIGN.md section 3, invariants).

Divided rollout (Seer section 4.1): each group of G samples becomes G requests; the scheduler runs a
request as a sequence of chunks and commits each one here, idempotently by (request_id, seq).
History (RhymeRL section 4): when a batch completes, its responses become the most recent iteration
of their prompt keys (lengths for the scheduler's priors, tokens for history drafts).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import secrets
import threading
import time
from array import array
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.buffer import codec, metrics
from services.buffer import store as keys
from services.buffer.config import DEFAULT_RESULTS_PAGE_BYTES
from services.buffer.events import (
    Added,
    Cancelled,
    DropCallback,
    Event,
    Subscription,
    WatchHub,
    default_watch_queue,
    run_drop_callbacks,
)
from services.buffer.model import ModelInfo
from services.buffer.records import (
    HISTORY_ITERATION_RESPONSES,
    BatchRecord,
    BatchState,
    ChunkRecord,
    ChunkStats,
    FinishReason,
    GroupRecord,
    GroupSpec,
    HistoryIteration,
    RecordError,
    RequestRecord,
    RequestState,
    RolloutResult,
    Sampling,
    add_iteration,
    by_version,
    decode_history,
    encode_history,
)
from services.buffer.store import Store
from services.buffer.validation import (
    content_hash,
    legacy_content_hash,
    typed_groups,
    validate_batch,
    validate_batch_id,
    validate_seed_scope,
    validate_submission_token,
)
from services.common.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SeerError,
    Unavailable,
)
from services.common.log import get_logger, kv, log_context
from services.common.sampling_limits import MAX_LOGPROB

log = get_logger(__name__)

MAX_HISTORY_KEYS = 100_000
MAX_HISTORY_TOKEN_KEYS = 64  # GetHistory with tokens: bounds the work of one call
# GetHistory's reply is cut (whole keys) at this many encoded bytes, half the 64 MiB gRPC message
# limit: 64 keys of 32 responses x 12K tokens made ~75 MB, which gRPC refused as an opaque
# RESOURCE_EXHAUSTED. Read at call time (tests lower it).
HISTORY_REPLY_BYTES = 32 * 1024 * 1024
# The keys of one GetHistory call, in bytes: each comes back (with its history or as omitted), so
# the budget above cannot hold them when they are this many (100,000 keys of up to 512 characters).
MAX_HISTORY_KEY_BYTES = 8 * 1024 * 1024
# Batches deleted by retention that are remembered (id -> results), so a reader coming back to one
# is told what it lost instead of "unknown batch". Stored (keys.deleted_key), so a restart between
# the deletion and the reader's return does not turn it into "unknown batch".
MAX_REMEMBERED_DELETIONS = 10_000
# Submission tokens a CancelBatch found no batch of (the submission refused from then on), newest
# kept: a submission still in flight that long after its cancel is not a case to plan for. Stored
# (keys.cancelled_token_key), as the deletions are.
MAX_CANCELLED_TOKENS = 10_000
RESULTS_PAGE_LIMIT = 256  # results a page holds at most, whatever their size


class OutOfRange(SeerError):
    code_name = "OUT_OF_RANGE"


class SubmitCancelled(SeerError):
    """The submitter cancelled its SubmitBatch before the batch was stored (a Ctrl-C, a closed
    channel): it is not stored. The submitter does not know the outcome of a call it abandoned, and
    its CancelBatch may have arrived first (NOT_FOUND); a batch stored after that would run with
    nobody reading it and nobody left to cancel it."""

    code_name = "CANCELLED"


def _decoded_result(value: bytes, key: bytes) -> RolloutResult | RecordError:
    """A stored result, or the RecordError naming why it cannot be decoded (returned, not raised:
    the caller decides whether one bad value fails the whole read)."""
    try:
        return RolloutResult.decode(value, key=key)
    except RecordError as e:
        return e


def derive_seed(base_seed: int, scope: str, sample_index: int) -> int:
    """A request's seed: a hash of the group's base seed, the batch's seed scope (its id unless the
    submitter named another) and the sample index (uint64).

    The batch id is mixed in because the engine keys its randomness by (seed, position): with a
    fixed trainer seed, this iteration's request i would sample exactly last iteration's response i
    to the same prompt (RL wants fresh samples each iteration). (Speculation no longer depends on
    it: the verifier draws each position as plain sampling does, so no draft can bias the output;
    services/worker/engines/reference/verifier.py.) A seed scope shared by two batches opts out on
    purpose: reruns and A/B runs of one batch, which then sample the same responses (token for token
    where the logits are bit-identical: float32 on the CPU; see the reference engine's sampler.py)."""
    h = hashlib.blake2b(f"{base_seed}:{scope}:{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    batch_id: str
    group_id: str
    group_index: int
    sample_index: int
    group_size: int
    prompt_key: str
    prompt_token_ids: array[int]
    output_token_ids: array[int]
    max_tokens: int
    sampling: Sampling  # seed = this request's own (already derived) seed
    policy_version: int
    next_seq: int
    trace_context: Mapping[str, str] = field(default_factory=dict)  # the batch's (BatchRecord)
    submit_seq: int = 0  # the batch's (BatchRecord): tells a batch id used again from the old batch


@dataclass(frozen=True)
class Commit:
    request_id: str
    seq: int
    token_ids: list[int] | array[int]
    logprobs: list[float] | array[float]
    finish_reason: FinishReason
    policy_version: int
    worker_id: str = ""
    stats: ChunkStats = field(default_factory=ChunkStats)
    submit_seq: int = 0  # the submission of the batch it was generated for (0: not checked)


@dataclass(frozen=True)
class UnreadableResult:
    """A stored result this buffer cannot decode (RecordError: its key and field), left out of a
    results page that was asked to skip such results (read_results' `unreadable`)."""

    batch_id: str
    cursor: int
    error: RecordError


@dataclass(frozen=True)
class UnreadableRequest:
    """A stored request record this buffer cannot decode (RecordError: its key and field), shown in
    a GetBatch's request list as unknown (get_batch's `unreadable`). request_id: from its key."""

    batch_id: str
    request_id: str
    error: RecordError


@dataclass(frozen=True)
class CommitOutcome:
    duplicate: bool
    next_seq: int
    generated_tokens: int
    request_finished: bool
    accepted: bool


@dataclass(frozen=True)
class SubmitOutcome:
    batch_id: str
    num_requests: int
    already_submitted: bool
    policy_version: int
    submission_id: int  # the batch's submit_seq: unique per submission (0: stored before it existed)


@dataclass(frozen=True)
class RequestStatus:
    request_id: str
    state: RequestState
    generated_tokens: int
    num_chunks: int
    finish_reason: FinishReason


@dataclass(frozen=True)
class BatchStatus:
    batch_id: str
    state: BatchState
    num_requests: int
    num_finished: int
    num_cancelled: int
    generated_tokens: int
    policy_version: int
    requests: list[RequestStatus]
    submission_id: int = 0


@dataclass(frozen=True)
class WeightsOutcome:
    version: int
    num_workers: int
    seconds: float


@dataclass(frozen=True)
class HistoryReply:
    histories: list[tuple[str, HistoryIteration]]  # the newest iteration of each returned key
    # Keys left out so the reply stays under HISTORY_REPLY_BYTES (the first that did not fit and every
    # key after it, in request order): ask again for these, fewer at a time.
    omitted: list[str]


class SwitchInProgress(Unavailable):
    """A submission during a weight switch: it must run at the version the switch ends with. The
    switch may take as long as the buffer's switch_timeout_seconds, so the reason is sent with the
    status and the client waits the switch out (seer_client submit_batch) instead of giving up."""

    retry_reason = "weight-switch"


class SwitchNotStarted(Unavailable):
    """The scheduler did not start the switch (it was not reached, or another switch was running):
    nothing was loaded, the old version stays in force; the caller may retry."""


# (version, source) -> number of workers that loaded it; raises a SeerError on failure.
# InvalidArgument, FailedPrecondition and SwitchNotStarted mean the scheduler switched nothing (the
# old version stays in force); any other error leaves the outcome unknown (see update_weights).
SwitchFn = Callable[[int, str], int]
# () -> the policy version the scheduler's workers serve, None when it knows none; raises a
# SeerError when the scheduler cannot be asked.
VersionProbe = Callable[[], int | None]


@dataclass
class _Live:
    """An unfinished request with the output committed so far."""

    rec: RequestRecord
    tokens: array[int] = field(default_factory=codec.i32)
    logprobs: array[float] = field(default_factory=codec.f32)
    chunk_ends: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Response:
    """One response of a completing batch, as its history takes it."""

    group_index: int
    sample_index: int
    prompt_key: str
    token_ids: array[int]
    finish_reason: FinishReason


class _CompletesBatch(Exception):
    """Raised under the lock, before anything is written, by a commit that would complete its batch
    while no history was built for that state of the batch: commit_chunk builds it outside the lock
    and commits again. `last`: the completing response (a copy; the live one may change)."""

    def __init__(self, batch: BatchRecord, last: _Response) -> None:
        super().__init__(batch.batch_id)
        self.batch, self.last = batch, last


@dataclass(frozen=True)
class _BuiltHistory:
    """A store WriteBatch holding the history writes of the commit that completes `batch`, built
    from that record's state; the commit adds its own writes to it. Valid only while the record is
    current: every change of a batch replaces its record (copy, then assignment), so identity says
    nothing happened to the batch since."""

    batch: BatchRecord
    wb: Any


def _varint_bytes(value: int) -> int:
    """Bytes of a non-negative protobuf varint."""
    return max(1, (value.bit_length() + 6) // 7)


def _key_bytes(key: str) -> int:
    """An upper bound on a prompt key's bytes in a GetHistoryResponse (11: a field's tag and length
    prefix, a varint of <= 10 bytes)."""
    return 11 + len(key.encode())


def _history_bytes(it: HistoryIteration, with_tokens: bool) -> int:
    """An upper bound on the encoded size of a PromptHistory beyond its key (_key_bytes): each packed
    array's values at the varint size of its largest (lengths and token ids are >= 0; max() is C
    speed, an exact size would visit every token in Python), 11 bytes for each tag and length."""
    n = 11 + 11 + len(it.lengths) * _varint_bytes(max(it.lengths, default=0)) + 11
    if with_tokens:
        for t in it.token_ids:
            n += 22 + len(t) * _varint_bytes(max(t, default=0))
    return n


def parse_request_id(request_id: str) -> tuple[str, int, int]:
    parts = request_id.split("/")
    try:
        if len(parts) != 3:
            raise ValueError
        validate_batch_id(parts[0])
        gi, si = int(parts[1]), int(parts[2])
        # Canonical decimal only: int() also takes "00", "+0", " 0" and non-ASCII digits, which
        # would name the stored request but miss the live one (a running request then answered
        # "already finished").
        if gi < 0 or si < 0 or parts[1] != str(gi) or parts[2] != str(si):
            raise ValueError
    except (ValueError, InvalidArgument):
        raise InvalidArgument(f"not a request id <batch_id>/<group>/<sample>: {request_id[:200]!r}",
                              field="request_id") from None
    return parts[0], gi, si


class BufferCore:
    def __init__(self, store: Store, model: ModelInfo, *, max_requests_per_batch: int = 65536,
                 history_iterations: int = 2, retain_batches: int = 0,
                 watch_queue_events: int = 0, results_page_bytes: int = DEFAULT_RESULTS_PAGE_BYTES,
                 history_iteration_responses: int = HISTORY_ITERATION_RESPONSES,
                 clock: Callable[[], float] = time.time) -> None:
        if results_page_bytes < 1:
            raise ValueError(f"results_page_bytes: must be > 0, got {results_page_bytes}")
        if history_iteration_responses < 1:
            raise ValueError(f"history_iteration_responses: must be >= 1, got {history_iteration_responses}")
        self._store = store
        self._model = model
        self._max_requests = max_requests_per_batch
        self._history_n = history_iterations  # policy versions kept per prompt key
        self._iteration_responses = history_iteration_responses  # responses one version keeps (oldest go)
        self._retain = retain_batches
        self._page_bytes = results_page_bytes
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Held while a completing commit builds its history outside _lock and until it is written
        # (commit_chunk): history keys change only under it, so the older iterations it read stay
        # current. Taken before _lock, never while holding it.
        self._history_lock = threading.Lock()
        # Bounded per watcher: one that stops reading is dropped, never waited for (events.py).
        self._hub = WatchHub(watch_queue_events or default_watch_queue(max_requests_per_batch))
        self._switching = False
        self._switch_target = 0  # the version being switched to while _switching
        self._switch_workers = 0  # workers that loaded the current version (0 after a restart)
        self._closed = False
        self._batches: dict[str, BatchRecord] = {}
        self._groups: dict[tuple[str, int], GroupRecord] = {}  # groups of running batches
        self._live: dict[str, _Live] = {}
        self._live_by_batch: dict[str, set[str]] = {}
        self._policy_version = 0
        self._policy_source = ""
        # (version, source) of an UpdateWeights whose outcome is unknown (stored: POLICY_INTENT_KEY).
        self._intent: tuple[int, str] | None = None
        # batch id -> open result readers (iter_results): retention keeps these batches until the
        # last reader is gone, so a slow reader is never cut off in the middle of its batch.
        self._readers: dict[str, int] = {}
        # Reads of the store in progress outside _lock (_reading, or _start_read_locked);
        # close() waits for them.
        self._store_reads = 0
        # batch id -> (results it had, its submit_seq), of batches retention deleted; oldest
        # deletion first.
        self._deleted: dict[str, tuple[int, int]] = {}
        self._next_deletion_seq = 1
        self._next_submit_seq = 1
        # Submission tokens CancelBatch found no batch of, oldest first, with the seq their record
        # is stored under: a SubmitBatch carrying one is refused, so that cancel's answer ("not
        # stored") stays true for a submission still in flight. Stored, not in memory only: a
        # restart ends the calls in flight, but a client retries its SubmitBatch (UNAVAILABLE)
        # across it, and that retry was stored after the answer.
        self._cancelled_tokens: dict[str, int] = {}
        self._next_token_seq = 1
        try:
            self._recover()
        except BaseException:
            # The core owns the store (close() closes it): a recovery that failed (a RecordError
            # naming a stored record) closes it too, so the DB's LOCK does not outlive the error.
            self._store.close()
            raise

    # ---- startup -------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuilds the in-memory index from RocksDB (after a restart or a kill -9)."""
        raw = self._store.get(keys.POLICY_VERSION_KEY)
        self._policy_version = int(raw) if raw else 0
        src = self._store.get(keys.POLICY_SOURCE_KEY)
        self._policy_source = src.decode() if src else ""
        if src is None and self._policy_version > 0:
            # Recorded by a buffer that did not keep sources: a scheduler catching a worker up can
            # only reload the worker's own weights under this version (the behaviour before).
            log.warning("policy weights source unknown (recorded before sources were kept)",
                        extra=kv(policy_version=self._policy_version))
        raw_intent = self._store.get(keys.POLICY_INTENT_KEY)
        if raw_intent is not None:
            d = json.loads(raw_intent)
            self._intent = int(d["version"]), str(d["source"])
            log.warning("a weight update did not complete before the restart; submissions wait for its retry",
                        extra=kv(policy_version=self._policy_version, pending_version=self._intent[0]))
        for k, v in self._store.scan(b"b/"):
            b = BatchRecord.decode(v, key=k)
            self._batches[b.batch_id] = b
        raw_seq = self._store.get(keys.NEXT_SUBMIT_SEQ_KEY)
        # max(): a store written before the counter was kept has only its batches to go by.
        self._next_submit_seq = max(int(raw_seq) if raw_seq else 1,
                                    1 + max((b.submit_seq for b in self._batches.values()), default=0))
        deletions: list[tuple[int, str, int, int]] = []  # (deletion seq, batch id, results, submit_seq)
        for k, v in self._store.scan(b"d/"):
            # "<seq> <results>" before the submission was kept: 0 (unknown).
            seq, results, *sub = v.split()
            deletions.append((int(seq), k[2:].decode(), int(results), int(sub[0]) if sub else 0))
        for _seq, bid, n, sub_seq in sorted(deletions):
            self._deleted[bid] = (n, sub_seq)
        self._next_deletion_seq = 1 + max((d[0] for d in deletions), default=0)
        tokens = sorted((int(v), k[2:].decode()) for k, v in self._store.scan(b"t/"))
        for token_seq, token in tokens[-MAX_CANCELLED_TOKENS:]:
            self._cancelled_tokens[token] = token_seq
        self._next_token_seq = 1 + max((t[0] for t in tokens), default=0)
        # Pending work in submission order (the snapshot's, so the scheduler's FIFO), not key order.
        for b in sorted(self._batches.values(), key=lambda b: (b.submit_seq, b.created_at, b.batch_id)):
            if b.terminal:
                continue
            for gk, gv in self._store.scan(f"g/{b.batch_id}/".encode()):
                g = GroupRecord.decode(gv, key=gk)
                self._groups[(b.batch_id, g.group_index)] = g
            for rk, rv in self._store.scan(keys.requests_prefix(b.batch_id)):
                r = RequestRecord.decode(rv, key=rk)
                if not r.active:
                    continue
                live = _Live(r)
                prefix = keys.chunks_prefix(r.batch_id, r.group_index, r.sample_index)
                for ck, cv in self._store.scan(prefix):
                    c = ChunkRecord.decode(cv, key=ck)
                    live.tokens.extend(c.token_ids)
                    live.logprobs.extend(c.logprobs)
                    live.chunk_ends.append(len(live.tokens))
                self._add_live(live)
        metrics.PENDING.set(len(self._live))
        log.info("recovered", extra=kv(batches=len(self._batches), live_requests=len(self._live),
                                       policy_version=self._policy_version))

    def _add_live(self, live: _Live) -> None:
        rid = live.rec.request_id
        self._live[rid] = live
        self._live_by_batch.setdefault(live.rec.batch_id, set()).add(rid)

    def _drop_live(self, rid: str, batch_id: str) -> None:
        self._live.pop(rid, None)
        ids = self._live_by_batch.get(batch_id)
        if ids is not None:
            ids.discard(rid)
            if not ids:
                del self._live_by_batch[batch_id]

    def close(self) -> None:
        """Closes the store; calls still running in handler threads then get UNAVAILABLE."""
        # After a history build in progress (it reads the store outside _lock; commit_chunk).
        with self._history_lock, self._cond:
            if self._closed:
                return
            self._closed = True  # no new read starts (_start_read_locked checks it)
            while self._store_reads:
                self._cond.wait()
            self._store.close()
            self._hub.close()
            self._cond.notify_all()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A read of the store outside _lock (a long scan that would stall every commit under it):
        the store stays open until it ends (close() waits). For callers not holding _lock; one that
        holds it (to take its view under it) uses _start_read_locked instead."""
        with contextlib.ExitStack() as reading:
            with self._lock:
                self._start_read_locked(reading)
            yield

    def _start_read_locked(self, reading: contextlib.ExitStack) -> None:
        """Starts a read of the store outside _lock; the caller holds _lock. The read's end is
        registered on `reading` here, in the same call as its start, so no caller can forget it:
        it ends when that ExitStack closes, however it closes. Callbacks the caller registers
        after this one (releasing a view, closing a scan) run before it, so before close().
        Unavailable once close() began: no read starts then."""
        self._check_open()
        self._store_reads += 1
        reading.callback(self._end_read)

    def _end_read(self) -> None:
        with self._cond:
            self._store_reads -= 1
            if not self._store_reads and self._closed:
                self._cond.notify_all()  # close() waits (StreamResults readers need no wake-up)

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the buffer is shutting down; retry against the restarted service")

    # ---- submission ----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        with self._lock:
            return self._policy_version

    def policy(self) -> tuple[int, str]:
        """(version, source): the policy batches run at and the directory its weights come from
        (the last non-empty UpdateWeights source; "" = the workers' initial weights)."""
        with self._lock:
            return self._policy_version, self._policy_source

    def submit_batch(
        self, batch_id: str, groups: list[GroupSpec], trace_context: Mapping[str, str] | None = None,
        seed_scope: str = "", is_active: Callable[[], bool] = lambda: True, submission_token: str = "",
    ) -> SubmitOutcome:
        """Stores a batch and feeds its requests to the watchers. trace_context: the submitter's
        trace context (W3C keys), handed on with every work item of the batch; a resubmission keeps
        the first one. seed_scope: what request seeds are derived from instead of the batch id
        (batches with one scope and the same base seeds sample alike; "" = the batch id).
        is_active: whether the submitter still wants the batch (the server's _still_wanted: its call
        active, or ended only by its deadline); checked under the lock right before the write, and
        a cancelled call is SubmitCancelled, nothing stored. submission_token: the submitter's name
        for this submission, stored with the batch it creates (cancel_batch); one a cancel_batch
        already answered "not stored" is SubmitCancelled too."""
        validate_batch_id(batch_id)  # format checks only: they do not depend on the buffer's limits
        validate_seed_scope(seed_scope)
        validate_submission_token(submission_token)
        if seed_scope == batch_id:
            seed_scope = ""  # the default, spelled out: the same seeds, so the same submission
        sent = groups

        def legacy() -> str | None:  # what an older buffer stored for odd spellings (see _existing)
            return legacy_content_hash(batch_id, sent, seed_scope)

        # Typed before hashing: hashed as sent, a numpy integer failed json (INTERNAL) and `seed=3.0`
        # was other content than `seed=3`, so a retry spelling it the other way was ALREADY_EXISTS.
        # Typing depends on no limit of this buffer (see below); it leaves well-typed groups as they
        # are, so their hash is the one stored before.
        try:
            groups = typed_groups(groups)
        except InvalidArgument:
            # A spelling typing refuses (top_k=True, group_size=True) was accepted by a buffer
            # before typing and stored, hashed as sent: its caller's retry, spelled the same way,
            # is that batch (already_submitted), not an error about a batch that is running.
            stored = self._existing(batch_id, None, legacy)
            if stored is not None:
                return stored
            raise
        digest = content_hash(batch_id, groups, seed_scope)
        # A stored batch is looked up before the content is validated: it was valid when accepted,
        # and a retry after a restart with other limits (max_context, max_requests_per_batch, model)
        # must still get already_submitted, not an error about a batch that is running.
        existing = self._existing(batch_id, digest, legacy, groups, seed_scope,
                                  lambda: content_hash(batch_id, groups, ""))
        if existing is not None:
            return existing
        valid = validate_batch(batch_id, groups, self._model, self._max_requests, seed_scope)
        scope = seed_scope or batch_id
        # Everything that does not depend on the core's state is built before the lock is taken:
        # the group and request records, their encodings and the work items. For 65,536 requests
        # that is ~0.5 s of Python, and under the lock it stalled every CommitChunk (and so every
        # worker) for as long. The work items need the batch's policy version and submission
        # number: they are built with the current ones and rebuilt under the lock only if an
        # UpdateWeights or another submission changed them meanwhile.
        with self._lock:
            self._check_open()
            guess = self._policy_version, self._next_submit_seq
            watched = len(self._hub) > 0  # no watcher, no work items (one may join meanwhile: below)
        trace = dict(trace_context or {})
        wb = self._store.new_batch()
        new_groups, new_live = [], []
        for gi, vg in enumerate(valid):
            base_seed = vg.sampling.seed if vg.sampling.seed is not None else secrets.randbits(64)
            s = vg.sampling
            g = GroupRecord(batch_id, gi, vg.prompt_key, codec.i32(vg.prompt_token_ids), vg.group_size,
                            vg.max_tokens, Sampling(s.temperature, s.top_p, s.top_k, base_seed,
                                                    s.stop_token_ids, s.ignore_eos), vg.labels)
            wb.put(keys.group_key(batch_id, gi), g.encode())
            new_groups.append(g)
            for si in range(vg.group_size):
                r = RequestRecord(batch_id, gi, si, derive_seed(base_seed, scope, si))
                wb.put(keys.request_key(batch_id, gi, si), r.encode())
                new_live.append(_Live(r))
        items = self._new_work_items(new_groups, new_live, *guess, trace) if watched else None
        events: list[Event] = [Added(it) for it in items] if items is not None else []
        drops: list[DropCallback] = []
        with self._lock:
            self._check_open()
            # Again under the lock: the same batch may have been stored by a concurrent call. No
            # second hash to explain a difference here (`unscoped`): a large batch's would stall
            # every commit behind the lock.
            existing = self._existing(batch_id, digest, legacy, groups, seed_scope)
            if existing is not None:
                return existing
            if self._switching:
                raise SwitchInProgress(f"a weight update to version {self._switch_target} is in progress; "
                                       "retry when it ends")
            if self._intent is not None:
                # A batch must run at the version the workers serve, and that is unknown: labelled
                # with the old one, its chunks would be refused by workers that loaded the new one.
                v, src = self._intent
                raise FailedPrecondition(
                    f"the weight update to version {v} (source {src!r}) did not complete and its outcome is "
                    f"unknown: the workers may serve version {v} or {self._policy_version}; call "
                    f"UpdateWeights(version={v}) again (or move to a newer version) before submitting")
            if not is_active():
                # Checked here, under the lock with the write, not before: validation and record
                # building above take ~0.5 s for a big batch, and a submitter interrupted meanwhile
                # (`seer rollout`'s Ctrl-C) cancels its call and then the batch; that CancelBatch
                # finds nothing (NOT_FOUND), and a batch stored after it ran with nobody reading it.
                # After this check a cancel waits for the lock and finds the batch stored.
                raise SubmitCancelled(f"batch {batch_id!r}: the submission was cancelled by its caller before "
                                      "it was stored; nothing was stored", field="batch_id")
            if submission_token and submission_token in self._cancelled_tokens:
                # Under the lock with the write, as cancel_batch's check: either the cancel found
                # this batch stored and cancelled it, or it told its caller "not stored" and this
                # is refused; never stored after that answer.
                raise SubmitCancelled(f"batch {batch_id!r}: CancelBatch cancelled this submission before it "
                                      "was stored; nothing was stored", field="submission_token")
            version = self._policy_version
            batch = BatchRecord(batch_id=batch_id, content_hash=digest, policy_version=version,
                                created_at=self._clock(), num_groups=len(valid),
                                num_requests=sum(g.group_size for g in valid),
                                trace_context=trace, submit_seq=self._next_submit_seq,
                                submission_token=submission_token)
            wb.put(keys.batch_key(batch_id), batch.encode())
            wb.put(keys.NEXT_SUBMIT_SEQ_KEY, str(self._next_submit_seq + 1).encode())
            if batch_id in self._deleted:
                wb.delete(keys.deleted_key(batch_id))  # the id used again: a new batch
            if len(self._hub) and (items is None or (version, batch.submit_seq) != guess):
                # A watcher joined, or the version or the submission number changed, since the
                # items were built (rare).
                items = self._new_work_items(new_groups, new_live, version, batch.submit_seq, trace)
                events = [Added(it) for it in items]
            self._store.write(wb)
            self._next_submit_seq += 1
            self._batches[batch_id] = batch
            self._deleted.pop(batch_id, None)  # a deleted batch's id used again: a new batch
            for g in new_groups:
                self._groups[(batch_id, g.group_index)] = g
            for live in new_live:
                self._add_live(live)
            if len(self._hub) and events:
                drops = self._hub.publish(events)
            metrics.BATCHES.inc()
            metrics.REQUESTS.inc(len(new_live))
            metrics.PENDING.set(len(self._live))
        # Outside the lock: a drop ends a gRPC stream, which must not stall every other call.
        run_drop_callbacks(drops)
        log.info("batch submitted", extra=kv(batch_id=batch_id, groups=len(valid),
                                             requests=batch.num_requests, policy_version=version))
        return SubmitOutcome(batch_id, batch.num_requests, False, version, batch.submit_seq)

    @staticmethod
    def _new_work_items(groups: list[GroupRecord], lives: list[_Live], version: int, submit_seq: int,
                        trace_context: Mapping[str, str]) -> list[WorkItem]:
        """The work items of a new batch's requests, from its records (no core state: built before
        submit_batch takes the lock)."""
        # groups[i].group_index == i: built in order by submit_batch
        return [_build_work_item(live, groups[live.rec.group_index], version, submit_seq, trace_context)
                for live in lives]

    def _existing(self, batch_id: str, digest: str | None, legacy: Callable[[], str | None],
                  groups: Sequence[GroupSpec] = (), seed_scope: str = "",
                  unscoped: Callable[[], str] | None = None) -> SubmitOutcome | None:
        """The outcome of resubmitting a stored batch (same content), or None when it is new.
        digest: the hash of the submission's typed groups (validation.content_hash). legacy: its hash
        as sent (validation.legacy_content_hash), computed only when `digest` does not match: a batch
        an older buffer stored with an odd spelling (`seed=3.0`) holds that hash, and its caller's
        retry is still the same content. Another stored content is AlreadyExists.
        digest None: typing refused the submission (top_k=True), which an older buffer accepted and
        stored hashed as sent; only a stored batch holding `legacy` is it, and anything else is None
        (the caller raises its typing error: an invalid submission, stored or not).
        groups, seed_scope, unscoped: the submission's typed groups, its seed scope and a hash of it
        without the scope, only to say what differs in the AlreadyExists (_different_content)."""
        with self._lock:
            self._check_open()
            existing = self._batches.get(batch_id)
        if existing is None:
            return None
        if existing.content_hash != digest and existing.content_hash != legacy():
            if digest is None:
                return None
            raise AlreadyExists(_different_content(existing, groups, seed_scope, unscoped), field="batch_id")
        if digest is None:
            log.info("retry of a batch stored from a spelling this buffer refuses: already submitted",
                     extra=kv(batch_id=batch_id))
        return SubmitOutcome(batch_id, existing.num_requests, True, existing.policy_version, existing.submit_seq)

    # ---- work feed -----------------------------------------------------------------------------

    def _work_item(self, live: _Live) -> WorkItem:
        r = live.rec
        b = self._batches[r.batch_id]
        return _build_work_item(live, self._groups[(r.batch_id, r.group_index)], b.policy_version, b.submit_seq,
                                b.trace_context)

    def watch(self, watcher_id: str, peer: str = "") -> tuple[list[WorkItem], Subscription]:
        """The snapshot of runnable requests and a subscription to later events (atomically).

        The subscription holds at most the hub's watch_queue_events; a watcher that falls further
        behind is dropped (Subscription.take raises WatcherDropped) and must watch again. peer: the
        watcher's address, logged with its id (an id may be empty)."""
        with self._lock:
            self._check_open()
            sub = self._hub.add(watcher_id, peer)
            snapshot = [self._work_item(live) for live in self._live.values()]
        metrics.WATCHERS.set(len(self._hub))
        log.info("watcher joined", extra=kv(watcher_id=watcher_id, peer=peer, snapshot=len(snapshot)))
        return snapshot, sub

    def unwatch(self, sub: Subscription) -> None:
        sub.close()
        metrics.WATCHERS.set(len(self._hub))

    # ---- commits -------------------------------------------------------------------------------

    def commit_chunk(self, c: Commit) -> CommitOutcome:
        batch_id, gi, si = parse_request_id(c.request_id)
        with log_context(request_id=c.request_id, group_id=f"{batch_id}/{gi}"):
            try:
                with self._lock:
                    return self._commit_locked(c, batch_id, gi, si)
            except _CompletesBatch as e:
                completing = e
            # This commit completes its batch, whose responses become history in the same write.
            # The history is built here, outside the lock: it copies every token of the batch (0.8 s
            # for 4,096 responses x 4,096 tokens), which stalled every other batch's commits.
            with self._history_lock:
                while True:
                    with self._lock:
                        self._check_open()  # close() waits for _history_lock: the store stays open
                    built = self._build_history(completing)
                    try:
                        with self._lock:
                            return self._commit_locked(c, batch_id, gi, si, built)
                    except _CompletesBatch as e:
                        # The batch changed meanwhile and this commit still completes it (its id
                        # was reused after retention deleted it): build again. Other changes (a
                        # retry of this commit that came first, a cancel) end above.
                        completing = e

    def _stored_request(self, batch_id: str, gi: int, si: int, request_id: str) -> RequestRecord:
        key = keys.request_key(batch_id, gi, si)
        raw = self._store.get(key)
        if raw is None:
            raise NotFound(f"unknown request {request_id!r}", field="request_id")
        return RequestRecord.decode(raw, key=key)

    def _stored_chunk(self, rec: RequestRecord, seq: int) -> ChunkRecord:
        if rec.state == RequestState.FINISHED:  # chunk records were folded into the result
            key = keys.result_key(rec.batch_id, rec.result_index)
            raw = self._store.get(key)
            if raw is None:
                raise Aborted(f"chunk {seq}: the request's result is no longer stored", field="seq")
            return RolloutResult.decode(raw, key=key).chunk(seq)
        key = keys.chunk_key(rec.batch_id, rec.group_index, rec.sample_index, seq)
        raw = self._store.get(key)
        if raw is None:  # pragma: no cover - chunk records are written with the request record
            raise Aborted(f"chunk {seq} is missing", field="seq")
        return ChunkRecord.decode(raw, key=key)

    def _check_duplicate(self, c: Commit, rec: RequestRecord) -> CommitOutcome:
        stored = self._stored_chunk(rec, c.seq)
        incoming = ChunkRecord(codec.i32(c.token_ids), codec.f32(c.logprobs), c.finish_reason)
        if not stored.same_content(incoming):
            metrics.REJECTED.labels("conflict").inc()
            raise Aborted(f"chunk {c.seq} was already committed with different content "
                          f"(by worker {stored.worker_id!r})", field="seq")
        metrics.DUPLICATES.inc()
        return CommitOutcome(True, rec.next_seq, rec.generated, rec.state == RequestState.FINISHED,
                             rec.state != RequestState.CANCELLED)

    def _commit_locked(self, c: Commit, batch_id: str, gi: int, si: int,
                       history: _BuiltHistory | None = None) -> CommitOutcome:
        self._check_open()
        batch = self._batches.get(batch_id)
        if batch is None:
            raise NotFound(f"unknown request {c.request_id!r} (no batch {batch_id!r})", field="request_id")
        if c.submit_seq and batch.submit_seq and c.submit_seq != batch.submit_seq:
            metrics.REJECTED.labels("submission").inc()
            raise NotFound(f"request {c.request_id!r} of submission {c.submit_seq} is gone: batch {batch_id!r} "
                           f"now names submission {batch.submit_seq}", field="submit_seq")
        live = self._live.get(c.request_id)
        rec = live.rec if live is not None else self._stored_request(batch_id, gi, si, c.request_id)
        if rec.state == RequestState.CANCELLED:
            metrics.REJECTED.labels("cancelled").inc()
            return CommitOutcome(c.seq < rec.next_seq, rec.next_seq, rec.generated, False, False)
        if c.policy_version != batch.policy_version:
            metrics.REJECTED.labels("version").inc()
            raise FailedPrecondition(f"batch {batch_id!r} runs policy version {batch.policy_version}, "
                                     f"the chunk was generated with {c.policy_version}", field="policy_version")
        if c.seq < rec.next_seq:
            return self._check_duplicate(c, rec)
        if rec.state == RequestState.FINISHED or live is None:
            raise FailedPrecondition(f"request already finished after {rec.next_seq} chunks", field="seq")
        if c.seq > rec.next_seq:
            metrics.REJECTED.labels("gap").inc()
            raise FailedPrecondition(f"gap: expected chunk {rec.next_seq}, got {c.seq}", field="seq")
        return self._append(c, batch, live, history)

    def _validate_chunk(self, c: Commit, live: _Live, max_tokens: int) -> FinishReason:
        n = len(c.token_ids)
        bad = c.stats.bad_field()
        if bad is not None:
            raise InvalidArgument(f"must be finite and >= 0, got {getattr(c.stats, bad)}", field=f"stats.{bad}")
        if len(c.logprobs) != n:
            raise InvalidArgument(f"{len(c.logprobs)} logprobs for {n} tokens", field="logprobs")
        # C-speed checks (a NaN makes the sum NaN, and max() unreliable); the loop, only on a
        # failure, names the index. -inf (probability 0) is a log-probability, if an odd one: it passes.
        if n and (math.isnan(sum(c.logprobs)) or max(c.logprobs) > MAX_LOGPROB):
            for j, lp in enumerate(c.logprobs):
                if not lp <= MAX_LOGPROB:
                    raise InvalidArgument(f"a log-probability is <= 0, got {lp}", field=f"logprobs[{j}]")
        if c.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CHUNK, FinishReason.ABORTED):
            raise InvalidArgument(f"must be STOP, LENGTH, CHUNK or ABORTED, got {c.finish_reason.name}",
                                  field="finish_reason")
        if c.finish_reason == FinishReason.ABORTED:
            # The scheduler gave up on the request: it ends with what was committed before.
            if n:
                raise InvalidArgument(f"an ABORTED chunk ends the request and carries no tokens, got {n}",
                                      field="token_ids")
            return FinishReason.ABORTED
        vocab = self._model.vocab_size
        if n and (min(c.token_ids) < 0 or max(c.token_ids) >= vocab):  # C-speed check; the loop names the index
            for j, t in enumerate(c.token_ids):
                if not 0 <= t < vocab:
                    raise InvalidArgument(f"token id {t} outside the vocabulary [0, {vocab})",
                                          field=f"token_ids[{j}]")
        total = live.rec.generated + n
        if total > max_tokens:
            raise InvalidArgument(f"{live.rec.generated} tokens committed + {n} exceeds max_tokens {max_tokens}",
                                  field="token_ids")
        if c.finish_reason == FinishReason.LENGTH and total != max_tokens:
            # LENGTH says the response reached max_tokens: a worker turns the engine's LENGTH at a
            # chunk's own limit into CHUNK, and never starts a chunk its context cannot hold (the
            # engine refuses it), so an early LENGTH would silently truncate the response.
            raise InvalidArgument(f"LENGTH after {total} tokens, short of max_tokens {max_tokens}",
                                  field="finish_reason")
        if c.finish_reason == FinishReason.CHUNK:
            if n == 0:
                raise InvalidArgument("an unfinished chunk must carry at least one token", field="token_ids")
            if total == max_tokens:  # the chunk limit and max_tokens coincided: the request is done
                return FinishReason.LENGTH
        return c.finish_reason

    def _append(self, c: Commit, batch: BatchRecord, live: _Live, history: _BuiltHistory | None) -> CommitOutcome:
        rec = live.rec
        group = self._groups[(rec.batch_id, rec.group_index)]
        reason = self._validate_chunk(c, live, group.max_tokens)
        chunk = ChunkRecord(codec.i32(c.token_ids), codec.f32(c.logprobs), c.finish_reason, c.worker_id)
        finished = reason != FinishReason.CHUNK
        new_rec = RequestRecord(
            rec.batch_id, rec.group_index, rec.sample_index, rec.seed,
            state=RequestState.FINISHED if finished else RequestState.RUNNING,
            next_seq=rec.next_seq + 1, generated=rec.generated + len(chunk.token_ids),
            finish_reason=reason if finished else FinishReason.UNSPECIFIED,
            stats=rec.stats.copy(),
        )
        new_rec.stats.add(c.stats)
        new_batch = batch.copy()
        new_batch.generated_tokens += len(chunk.token_ids)
        wb = self._store.new_batch()
        result: RolloutResult | None = None
        if not finished:
            wb.put(keys.chunk_key(rec.batch_id, rec.group_index, rec.sample_index, c.seq), chunk.encode())
        else:
            if batch.num_results + 1 == batch.num_requests:  # this commit completes the batch
                if history is None or history.batch is not batch:
                    last = codec.i32(live.tokens)
                    last.extend(chunk.token_ids)
                    raise _CompletesBatch(batch, _Response(rec.group_index, rec.sample_index, group.prompt_key,
                                                           last, reason))
                wb = history.wb  # holds the history writes (they are most of the bytes)
            # The result holds every token and the chunk boundaries: drop the chunk records (half the bytes).
            wb.delete_range(*keys.chunks_range(rec.batch_id, rec.group_index, rec.sample_index))
            new_rec.result_index = batch.num_results
            tokens = codec.i32(live.tokens)
            tokens.extend(chunk.token_ids)
            logprobs = codec.f32(live.logprobs)
            logprobs.extend(chunk.logprobs)
            result = RolloutResult(
                request_id=rec.request_id, batch_id=rec.batch_id, group_index=rec.group_index,
                sample_index=rec.sample_index, prompt_key=group.prompt_key, token_ids=tokens,
                logprobs=logprobs, finish_reason=reason, policy_version=batch.policy_version,
                stats=new_rec.stats, num_chunks=new_rec.next_seq,
                latency_seconds=max(0.0, self._clock() - batch.created_at), labels=group.labels,
                text=self._model.tokenizer.decode(list(tokens)) if self._model.tokenizer else "",
                chunk_ends=[*live.chunk_ends, len(tokens)], last_chunk_reason=c.finish_reason,
            )
            value = result.encode()
            wb.put(keys.result_key(rec.batch_id, batch.num_results), value)
            # Its size, read by read_results to end a page before reading a value that does not fit.
            wb.put(keys.result_size_key(rec.batch_id, batch.num_results), str(len(value)).encode())
            new_batch.num_results += 1
            if new_batch.num_results == new_batch.num_requests:
                new_batch.state = BatchState.COMPLETED
                new_batch.finished_at = self._clock()
        if reason == FinishReason.ABORTED:
            # The batch still completes; the trainer sees this response as failed (ABORTED).
            log.error("request failed: the scheduler aborted it", extra=kv(
                request_id=rec.request_id, seq=c.seq, generated=rec.generated, worker_id=c.worker_id))
        wb.put(keys.request_key(rec.batch_id, rec.group_index, rec.sample_index), new_rec.encode())
        wb.put(keys.batch_key(rec.batch_id), new_batch.encode())
        purged = self._purge_old(wb, new_batch) if new_batch.terminal else []
        self._store.write(wb)
        self._forget_batches(purged)
        # Durable: now update memory, wake streams.
        self._batches[rec.batch_id] = new_batch
        live.rec = new_rec
        if finished:
            self._drop_live(rec.request_id, rec.batch_id)
            metrics.RESULTS.inc()
            metrics.PENDING.set(len(self._live))
            if new_batch.state == BatchState.COMPLETED:
                self._forget_groups(new_batch.batch_id, new_batch.num_groups)
                log.info("batch completed", extra=kv(batch_id=new_batch.batch_id,
                                                     generated_tokens=new_batch.generated_tokens))
            self._cond.notify_all()
        else:
            live.tokens.extend(chunk.token_ids)
            live.logprobs.extend(chunk.logprobs)
            live.chunk_ends.append(len(live.tokens))
        metrics.COMMITS.inc()
        metrics.COMMITTED_TOKENS.inc(len(chunk.token_ids))
        return CommitOutcome(False, new_rec.next_seq, new_rec.generated, finished, True)

    def _forget_groups(self, batch_id: str, num_groups: int) -> None:
        for gi in range(num_groups):
            self._groups.pop((batch_id, gi), None)

    # ---- retention -----------------------------------------------------------------------------

    def _purge_old(self, wb: Any, just_finished: BatchRecord) -> list[str]:
        """Adds deletions of the oldest finished batches beyond `retain_batches` to wb.

        A batch with a connected result reader is skipped (the limit is exceeded meanwhile): its
        reader gets every result, and the batch goes at the first finished batch after it left."""
        if self._retain <= 0:
            return []
        finished = [b for b in self._batches.values() if b.terminal and b.batch_id != just_finished.batch_id]
        excess = len(finished) + 1 - self._retain
        if excess <= 0:
            return []
        finished = [b for b in finished if b.batch_id not in self._readers]
        finished.sort(key=lambda b: (b.finished_at, b.created_at))
        purged = [b.batch_id for b in finished[:excess]]
        for bid in purged:
            for begin, end in keys.batch_ranges(bid):
                wb.delete_range(begin, end)
            wb.delete(keys.batch_key(bid))
            gone_batch = self._batches[bid]
            wb.put(keys.deleted_key(bid),
                   f"{self._next_deletion_seq} {gone_batch.num_results} {gone_batch.submit_seq}".encode())
            self._next_deletion_seq += 1
        # The remembered deletions _forget_batches will evict (the oldest beyond the limit), in
        # the same write, so the store remembers exactly what memory does.
        gone = set(purged)
        remembered = [bid for bid in self._deleted if bid not in gone] + purged
        for bid in remembered[:max(0, len(remembered) - MAX_REMEMBERED_DELETIONS)]:
            wb.delete(keys.deleted_key(bid))
        return purged

    def _forget_batches(self, batch_ids: list[str]) -> None:
        for bid in batch_ids:
            b = self._batches.pop(bid, None)
            if b is not None:
                self._deleted.pop(bid, None)  # re-inserted: the newest deletion is evicted last
                self._deleted[bid] = (b.num_results, b.submit_seq)
        while len(self._deleted) > MAX_REMEMBERED_DELETIONS:
            del self._deleted[next(iter(self._deleted))]
        if batch_ids:
            log.info("old batches deleted", extra=kv(batches=batch_ids[:10], count=len(batch_ids)))

    # ---- history (RhymeRL) ---------------------------------------------------------------------

    def _build_history(self, completing: _CompletesBatch) -> _BuiltHistory:
        """The completing batch's responses added to the iteration of its policy version of each of
        its prompt keys (records.add_iteration: merged into it when the key has one, else a new
        iteration; the newest `history_iterations` versions kept): the history values its
        completing commit writes. Runs outside _lock, holding _history_lock: the batch's
        results log holds every response but `last` and does not change until that commit (nothing
        else appends, and retention deletes finished batches only; a reused id fails _BuiltHistory's
        check), and history keys are written only under _history_lock."""
        batch = completing.batch
        responses = [completing.last]
        for k, v in self._store.scan(f"l/{batch.batch_id}/".encode()):
            res = _decoded_result(v, k)
            if isinstance(res, RecordError):
                # Left out of the history (a length prior and drafts: one response fewer is
                # harmless), logged and counted: raised, it failed the completing commit, and every
                # retry of it, so the batch could never complete.
                metrics.UNREADABLE_RESULTS.labels("history").inc()
                log.error("stored result cannot be decoded; left out of the prompt history", extra=kv(
                    batch_id=batch.batch_id, key=k.decode(errors="backslashreplace"), field=res.record_field,
                    error=str(res)))
                continue
            responses.append(_Response(res.group_index, res.sample_index, res.prompt_key, res.token_ids,
                                       res.finish_reason))
        # An aborted response is cut short: its length would bias the next iteration's prior low.
        responses = [r for r in responses if r.finish_reason != FinishReason.ABORTED]
        responses.sort(key=lambda r: (r.group_index, r.sample_index))
        per_key: dict[str, HistoryIteration] = {}
        for r in responses:
            it = per_key.setdefault(r.prompt_key, HistoryIteration(batch.batch_id, batch.policy_version, [], []))
            it.lengths.append(len(r.token_ids))
            it.token_ids.append(r.token_ids)
        wb = self._store.new_batch()
        for key, it in per_key.items():
            # An iteration is a policy version, not a batch: a batch split into two submissions, or
            # a prompt in two batches of one version, was two iterations, and the second pushed a
            # genuinely earlier version's responses out of the `history_iterations` kept (the draft
            # service counts versions too: services/draft/README.md "History iterations").
            stored = self._read_history(key)
            kept = add_iteration(stored, it, self._history_n, self._iteration_responses)
            if kept is not None:
                wb.put(keys.history_key(key), encode_history(kept))
            else:
                # Older than every kept version: UpdateWeights waits for the batches of the version
                # it replaces, so this takes a store written otherwise; not silent.
                metrics.HISTORY_DROPPED.inc()
                log.warning("completed batch's responses older than every kept history version; not recorded",
                            extra=kv(batch_id=batch.batch_id, prompt_key=key, policy_version=batch.policy_version,
                                     kept_versions=[s.policy_version for s in stored]))
        return _BuiltHistory(batch, wb)

    def history(self, prompt_key: str) -> list[HistoryIteration]:
        """All kept iterations (policy versions) of a prompt key, newest first (tokens for history
        drafts)."""
        with self._reading():
            return self._read_history(prompt_key)

    def _read_history(self, prompt_key: str) -> list[HistoryIteration]:
        """Read and decoded outside the lock, in _reading (a key's iterations with tokens are MBs:
        GetHistory's 64 of them under it stalled every commit). A key's value is written whole, so
        a commit rewriting it meanwhile is seen entirely or not at all. By version (records.by_version):
        a record an older buffer wrote holds one iteration per batch."""
        key = keys.history_key(prompt_key)
        raw = self._store.get(key)
        return by_version(decode_history(raw, key=key), self._iteration_responses) if raw else []

    def newest_history(self, prompt_keys: list[str], *, with_tokens: bool = False) -> HistoryReply:
        """GetHistory: the newest kept iteration of each known key (keys without history are left
        out), whole keys in request order while the reply fits HISTORY_REPLY_BYTES; the rest are
        `omitted`. A key whose iteration alone is over the budget is RESOURCE_EXHAUSTED naming it
        when it would come first (no reply can carry it, and truncating it would hand the draft
        service shortened responses as if complete); after keys that fit it is omitted like the
        others, so asking again for the omitted keys names it. With tokens (the draft service's
        refill after its restart) a call takes fewer keys: each iteration carries every response of
        the prompt's group."""
        return self._newest_history(prompt_keys, with_tokens=with_tokens, budget=HISTORY_REPLY_BYTES)

    def _newest_history(self, prompt_keys: list[str], *, with_tokens: bool, budget: int | None) -> HistoryReply:
        limit = MAX_HISTORY_TOKEN_KEYS if with_tokens else MAX_HISTORY_KEYS
        if len(prompt_keys) > limit:
            raise InvalidArgument(f"at most {limit} keys per call{' with tokens' if with_tokens else ''}",
                                  field="prompt_keys")
        unique = list(dict.fromkeys(prompt_keys))
        # Every key is in the reply once (in its history or among the omitted ones): counted first.
        used = sum(_key_bytes(k) for k in unique)
        if budget is not None and used > MAX_HISTORY_KEY_BYTES:
            raise InvalidArgument(f"{used} bytes of keys; at most {MAX_HISTORY_KEY_BYTES} per call",
                                  field="prompt_keys")
        out: list[tuple[str, HistoryIteration]] = []
        with self._reading():  # one for all the keys (up to 100,000), not one each
            for n, key in enumerate(unique):
                its = self._read_history(key)
                if not its:
                    continue
                size = _history_bytes(its[0], with_tokens)
                if budget is not None and not out and _key_bytes(key) + size > budget:
                    raise ResourceExhausted(
                        f"the newest history of prompt key {key[:200]!r} takes up to {_key_bytes(key) + size} bytes, "
                        f"over the {budget}-byte reply limit{' (ask without include_tokens)' if with_tokens else ''}",
                        field=f"prompt_keys[{prompt_keys.index(key)}]")
                # The first key goes in whenever it fits alone (the other keys' names, bounded above,
                # may then take the reply past the budget, still far below the message limit): a reply
                # must make progress, or a caller asking again for the omitted keys would loop.
                if budget is not None and out and used + size > budget:
                    return HistoryReply(out, unique[n:])
                used += size
                out.append((key, its[0]))
            return HistoryReply(out, [])

    # ---- results -------------------------------------------------------------------------------

    def _batch(self, batch_id: str, cursor: int | None = None) -> BatchRecord:
        b = self._batches.get(batch_id)
        if b is None:
            gone = self._deleted.get(batch_id)
            if gone is None:
                # Checked only for unknown ids: one stored before the format was enforced as now (a
                # trailing newline passed "$") stays readable.
                validate_batch_id(batch_id)
                raise NotFound(f"unknown batch {batch_id!r}", field="batch_id")
            n = gone[0]
            lost = f"; results [{cursor}, {n}) were not read and are lost" if cursor is not None and cursor < n else ""
            raise NotFound(f"batch {batch_id!r} was deleted by retention with its {n} results (finished "
                           f"batches beyond retain_batches {self._retain} are deleted, oldest first){lost}",
                           field="batch_id")
        return b

    @staticmethod
    def _check_submission(batch_id: str, current: int, wanted: int, deleted: bool = False) -> None:
        """A reader's submission (0 = any) against the one the batch id names now (0 = unknown: a
        record stored before submissions were numbered, which no numbered submission can be)."""
        if wanted and wanted != current:
            now = (f"was deleted by retention with submission {current}" if deleted
                   else f"now names submission {current}")
            raise FailedPrecondition(
                f"batch {batch_id!r} {now}, not {wanted}: the batch id was deleted and submitted again, "
                "and results of the two submissions must not mix (the earlier submission's results are "
                "gone; stream the new one from cursor 0)", field="submission_id")

    def _plan_page(self, batch_id: str, cursor: int, end_index: int, limit: int, budget: int
                   ) -> tuple[int, int, bool]:
        """(n, bytes, sized): how many results from cursor the page takes and their stored bytes,
        from their stored sizes (small values, many to a block), so the value of the first result
        that does not fit is never read: it can be as large as a gRPC message. sized is False when
        a result in range was stored before sizes were kept: n and bytes then cover the results
        before it, and from it on each value is read, then sized. Caller holds the lock."""
        n, used = 0, 0
        sizes = self._store.scan(f"z/{batch_id}/".encode(), keys.result_size_key(batch_id, cursor))
        try:
            while cursor + n < end_index and n < limit:
                item = next(sizes, None)
                if item is None or int(item[0].rsplit(b"/", 1)[1]) != cursor + n:
                    return n, used, False
                size = int(item[1])
                if n and used + size > budget:
                    break
                used += size
                n += 1
        finally:
            sizes.close()
        return n, used, True

    def read_results(self, batch_id: str, cursor: int, limit: int = RESULTS_PAGE_LIMIT,
                     max_bytes: int | None = None, submission_id: int = 0,
                     unreadable: list[UnreadableResult] | None = None
                     ) -> tuple[list[tuple[int, RolloutResult]], bool]:
        """Results from cursor on, in order, and whether the stream is over after them.

        A page holds at most `limit` results and at most `max_bytes` (default: the core's
        results_page_bytes) of their stored values, except that its first result always goes in: a
        single result over the bound comes alone, so every result can be read. submission_id: the
        submission the cursor belongs to (0 = the current one); another is FailedPrecondition.

        unreadable: None (strict) = a stored result that cannot be decoded fails the page
        (RecordError, DATA_LOSS naming its key and field). A list = such a result is left out of
        the page and appended to it (logged and counted in seer_buffer_unreadable_results_total);
        the page's other results are returned, and the caller names what was left out (StreamResults
        ends DATA_LOSS naming each one). Its slot still counts for the page: the caller's next
        cursor is past the last result or unreadable one of the page."""
        entries, done = self._read_page(batch_id, cursor, limit, max_bytes, submission_id)
        page: list[tuple[int, RolloutResult]] = []
        for idx, r in entries:
            if isinstance(r, RecordError):
                if unreadable is None:
                    raise r
                unreadable.append(self._left_out(batch_id, idx, r))
            else:
                page.append((idx, r))
        return page, done

    @staticmethod
    def _left_out(batch_id: str, cursor: int, e: RecordError) -> UnreadableResult:
        # Logged at every read that meets it, not once: each reader is told (its stream's status),
        # and the log says which readers were. Never silent: a result that cannot be delivered.
        metrics.UNREADABLE_RESULTS.labels("results").inc()
        log.error("stored result cannot be decoded; left out of the results page", extra=kv(
            batch_id=batch_id, cursor=cursor, key=e.key.decode(errors="backslashreplace"),
            field=e.record_field, error=str(e)))
        return UnreadableResult(batch_id, cursor, e)

    def _read_page(self, batch_id: str, cursor: int, limit: int, max_bytes: int | None, submission_id: int
                   ) -> tuple[list[tuple[int, RolloutResult | RecordError]], bool]:
        """read_results' page: every result in it, decoded, or the RecordError its value raised
        (one bad value costs its own slot, not the page: the others are decoded still)."""
        budget = self._page_bytes if max_bytes is None else max_bytes
        page: list[tuple[int, RolloutResult | RecordError]] = []
        with contextlib.ExitStack() as reading:
            with self._lock:
                self._check_open()
                gone = self._deleted.get(batch_id) if batch_id not in self._batches else None
                if gone is not None:
                    self._check_submission(batch_id, gone[1], submission_id, deleted=True)
                    if gone[0] == cursor:
                        return [], True  # deleted after its reader had every result: nothing is lost
                b = self._batch(batch_id, cursor)
                self._check_submission(batch_id, b.submit_seq, submission_id)
                if cursor > b.num_results:
                    raise OutOfRange(f"{cursor} is beyond the {b.num_results} results available", field="cursor")
                end_index, terminal = b.num_results, b.terminal
                n, used, sized = self._plan_page(batch_id, cursor, end_index, limit, budget)
                # The values are read and decoded after the lock is released (a page is up to 4 MiB
                # of results, a single result up to a gRPC message, and decoding it under the lock
                # stalled every commit and submission as long), from a view of the store taken
                # here: consistent with the batch record just read whatever a retention delete or
                # a resubmission of the id does meanwhile. The store stays open until the read ends
                # (close() waits for _end_read).
                self._start_read_locked(reading)
                if sized:
                    view = self._store.view()
                    reading.callback(view.release)  # before _end_read, so before close()
                else:
                    scan = self._store.scan(f"l/{batch_id}/".encode(), keys.result_key(batch_id, cursor))
                    reading.callback(scan.close)  # its iterator, too, goes before close()
            if sized:
                # Point reads of exactly the planned values, from the view taken under the lock
                # (a multi-get: the planned keys are known, nothing past them is read).
                planned = [keys.result_key(batch_id, cursor + i) for i in range(n)]
                values = view.get_many(planned)
                for i, v in enumerate(values):
                    if v is None:  # not written with its size (cannot happen: one WriteBatch)
                        raise DataLoss(f"result {cursor + i} of batch {batch_id!r} is missing from the store",
                                       field="cursor")
                    page.append((cursor + i, _decoded_result(v, planned[i])))
            else:
                for k, v in scan:
                    idx = int(k.rsplit(b"/", 1)[1])
                    if idx >= end_index or len(page) >= limit:
                        break
                    if idx >= cursor + n:  # unsized: sized before decoding, as the page is bounded
                        if page and used + len(v) > budget:
                            break
                        used += len(v)
                    page.append((idx, _decoded_result(v, k)))
        done = terminal and cursor + len(page) >= end_index
        return page, done

    def submission_of(self, batch_id: str) -> int:
        """The submission a batch id names now (its submit_seq; 0 when unknown or unnumbered)."""
        with self._lock:
            b = self._batches.get(batch_id)
            return b.submit_seq if b is not None else 0

    def wait_results(self, batch_id: str, cursor: int, timeout: float) -> None:
        """Blocks until results beyond cursor exist, the batch ends, or timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._batch(batch_id).num_results > cursor
                                or self._batch(batch_id).terminal, timeout)

    def iter_results(self, batch_id: str, cursor: int = 0, is_active: Callable[[], bool] = lambda: True,
                     poll_seconds: float = 0.5, submission_id: int = 0,
                     unreadable: list[UnreadableResult] | None = None
                     ) -> Generator[tuple[int, RolloutResult], None, None]:
        """Results from cursor on, waiting for new ones, until the batch is complete or cancelled.

        submission_id: the submission the cursor belongs to (0 = the current one, see
        submission_of). Either way the stream is pinned to one submission: should the batch id come
        to name another one under it, the next page is FailedPrecondition naming submission_id,
        never that submission's results. While the generator is open the batch is exempt from
        retention (see _purge_old). unreadable: as read_results' (None: an undecodable stored
        result ends the iteration with its RecordError; a list: it is left out and appended)."""
        with self._lock:
            self._readers[batch_id] = self._readers.get(batch_id, 0) + 1
            current = self._batches.get(batch_id)
            if not submission_id and current is not None:
                submission_id = current.submit_seq  # pinned (0, unnumbered: nothing to pin to)
        try:
            while True:
                skipped: list[UnreadableResult] = []
                page, done = self.read_results(batch_id, cursor, submission_id=submission_id,
                                               unreadable=None if unreadable is None else skipped)
                if unreadable is not None:
                    unreadable.extend(skipped)
                # Past the page's unreadable results too: each is named once, not read again.
                ends = [idx + 1 for idx, _r in page] + [u.cursor + 1 for u in skipped]
                yield from page
                if ends:
                    cursor = max(ends)
                if done:
                    return
                if not ends:
                    if not is_active():
                        return
                    self.wait_results(batch_id, cursor, poll_seconds)
        finally:
            with self._lock:
                left = self._readers.pop(batch_id, 1) - 1
                if left > 0:
                    self._readers[batch_id] = left

    # ---- batch status and cancellation ---------------------------------------------------------

    def get_batch(self, batch_id: str, include_requests: bool = False,
                  unreadable: list[UnreadableRequest] | None = None) -> BatchStatus:
        """The batch's state and counts; with include_requests, every request's status in order.

        unreadable: None (strict) = a stored request record that cannot be decoded fails the call
        (RecordError, DATA_LOSS naming its key and field). A list = as read_results' for results:
        the other requests are returned, and the undecodable one keeps its place in the list as
        unknown (its request id, from its key, with state and finish reason UNSPECIFIED and no
        counts); it is appended to the list (logged and counted in
        seer_buffer_unreadable_requests_total), for the caller to name (GetBatchResponse.
        unreadable_requests). Before, one such record cost the caller every other request's status."""
        requests = []
        with contextlib.ExitStack() as reading:
            with self._lock:
                self._check_open()
                b = self._batch(batch_id).copy()
                records: Iterator[tuple[bytes, bytes]] = iter(())
                if include_requests:
                    self._start_read_locked(reading)  # close() waits for _end_read: the store stays open
                    # The scan is created here, under the lock: Store.scan creates its RocksDB
                    # iterator, and with it the view it reads, at the call; nothing is read yet.
                    # So every record it yields, the first included, is the store as of now,
                    # consistent with the batch record just copied (one write stores both). Every
                    # step, the seek to the first record included (41-88 ms for a 64 MiB value
                    # when it was taken here), is taken after the lock is released (all of a
                    # 65,536-request batch took 0.2-0.26 s under it, a stall of every commit); a
                    # commit, a retention delete, a cancel or the id submitted again meanwhile
                    # does not show.
                    scan = self._store.scan(keys.requests_prefix(batch_id))
                    # Closed before _end_read, however the decoding ends: a scan kept alive by an
                    # exception's traceback would hold its iterator (and the DB's LOCK) past close().
                    reading.callback(scan.close)
                    records = scan
            try:
                for k, v in records:
                    try:
                        r = RequestRecord.decode(v, key=k)
                    except RecordError as e:
                        if unreadable is None:
                            raise
                        bad = self._unreadable_request(batch_id, k, e)
                        unreadable.append(bad)
                        requests.append(RequestStatus(bad.request_id, RequestState.UNSPECIFIED, 0, 0,
                                                      FinishReason.UNSPECIFIED))
                        continue
                    requests.append(RequestStatus(r.request_id, r.state, r.generated, r.next_seq, r.finish_reason))
            except keys.ScanError as e:
                # A read error is the call's error: the records before it are not a whole answer.
                raise keys.ScanError(f"batch {batch_id!r}: its request records could not be read: {e}",
                                     field="batch_id") from e
        return BatchStatus(b.batch_id, b.state, b.num_requests, b.num_results, b.num_cancelled,
                           b.generated_tokens, b.policy_version, requests, b.submit_seq)

    @staticmethod
    def _unreadable_request(batch_id: str, key: bytes, e: RecordError) -> UnreadableRequest:
        # The request id is in the key (r/<batch>/<group:06>/<sample:04>), which is always readable.
        text = key.decode(errors="backslashreplace")
        parts = text.split("/")
        request_id = (f"{parts[1]}/{int(parts[2])}/{int(parts[3])}"
                      if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit() else text)
        # Logged at every read that meets it, as an unreadable result is (_left_out).
        metrics.UNREADABLE_REQUESTS.inc()
        log.error("stored request record cannot be decoded; shown as unknown in the batch's request list", extra=kv(
            batch_id=batch_id, request_id=request_id, key=text, field=e.record_field, error=str(e)))
        return UnreadableRequest(batch_id, request_id, e)

    def cancel_batch(self, batch_id: str, submission_token: str = "") -> tuple[BatchState, int]:
        """(state, requests the batch's cancellation cancelled). Idempotent: a repeat answers as the
        first call did, so a caller whose reply was lost and who retries learns the same count (not
        0). A completed batch is not cancelled: (COMPLETED, 0).

        submission_token: cancel only the batch stored by the submission that carried it ("" = the
        batch the id names). None stored is NotFound, the id naming another submission is
        FailedPrecondition (that batch untouched), both naming submission_token; either way the
        token is refused by submit_batch from then on, so "not stored" stays true."""
        validate_submission_token(submission_token)
        with self._lock:
            self._check_open()
            if submission_token:
                self._check_token(batch_id, submission_token)
            b = self._batch(batch_id)
            if b.terminal:
                return b.state, b.num_cancelled if b.state == BatchState.CANCELLED else 0
            rids = sorted(self._live_by_batch.get(batch_id, set()))
            wb = self._store.new_batch()
            new_batch = b.copy()
            new_batch.state = BatchState.CANCELLED
            new_batch.finished_at = self._clock()
            new_batch.num_cancelled = len(rids)
            cancelled = []
            for rid in rids:
                r = self._live[rid].rec
                nr = r.copy()
                nr.state, nr.finish_reason = RequestState.CANCELLED, FinishReason.ABORTED
                wb.put(keys.request_key(r.batch_id, r.group_index, r.sample_index), nr.encode())
                # Chunk records live only while a request is unfinished (nothing reads a cancelled
                # request's again): kept, they stayed until retention deleted the batch, or forever
                # with retain_batches 0.
                wb.delete_range(*keys.chunks_range(r.batch_id, r.group_index, r.sample_index))
                cancelled.append(rid)
            wb.put(keys.batch_key(batch_id), new_batch.encode())
            purged = self._purge_old(wb, new_batch)
            self._store.write(wb)
            self._batches[batch_id] = new_batch
            self._forget_batches(purged)
            for rid in cancelled:
                self._drop_live(rid, batch_id)
            self._forget_groups(batch_id, b.num_groups)
            events: list[Event] = [Cancelled(rid) for rid in cancelled]
            drops = self._hub.publish(events)
            metrics.CANCELLED.inc(len(cancelled))
            metrics.PENDING.set(len(self._live))
            self._cond.notify_all()
        run_drop_callbacks(drops)  # outside the lock, as in submit_batch
        log.info("batch cancelled", extra=kv(batch_id=batch_id, cancelled=len(cancelled)))
        return BatchState.CANCELLED, len(cancelled)

    def _check_token(self, batch_id: str, token: str) -> None:
        """Raises unless the batch id names the batch the submission with `token` stored; then
        remembers the token as cancelled (submit_batch refuses it), stored before the answer. Under
        _lock.

        A malformed batch id is refused first, the token not remembered: the caller was told
        INVALID_ARGUMENT, not that the submission was cancelled. An id retention deleted is answered
        as every other call is (_batch: deleted by retention, with its results), not as "no
        submission with the token": that batch may have been the caller's own, stored and run, and
        the deletion record does not keep its token; the token is refused from then on all the
        same (a retry of that submission under the freed id would store a new batch)."""
        b = self._batches.get(batch_id)
        if b is not None and b.submission_token == token:
            return
        deleted = b is None and batch_id in self._deleted
        if b is None and not deleted:
            validate_batch_id(batch_id)  # only unknown ids, as _batch (a legacy stored id stays usable)
        self._remember_cancelled_token(token)
        if deleted:
            self._batch(batch_id)  # raises NotFound: deleted by retention
        if b is None:
            raise NotFound(f"batch {batch_id!r} has no submission with token {token!r}: nothing was cancelled, "
                           "and a submission carrying the token is refused from now on", field="submission_token")
        raise FailedPrecondition(
            f"batch {batch_id!r} names another submission (submission {b.submit_seq}, not the one with token "
            f"{token!r}): it was not cancelled, and a submission carrying the token is refused from now on",
            field="submission_token")

    def _remember_cancelled_token(self, token: str) -> None:
        """Stores `token` as cancelled (newest), evicting the oldest beyond MAX_CANCELLED_TOKENS in
        the same write, so the store remembers exactly what memory does. Under _lock."""
        wb = self._store.new_batch()
        seq = self._next_token_seq
        wb.put(keys.cancelled_token_key(token), str(seq).encode())
        excess = len(self._cancelled_tokens) + (token not in self._cancelled_tokens) - MAX_CANCELLED_TOKENS
        evicted = list(itertools.islice((t for t in self._cancelled_tokens if t != token), max(0, excess)))
        for t in evicted:
            wb.delete(keys.cancelled_token_key(t))
        self._store.write(wb)
        self._next_token_seq += 1
        self._cancelled_tokens.pop(token, None)  # re-inserted: the newest is evicted last
        self._cancelled_tokens[token] = seq
        for t in evicted:
            del self._cancelled_tokens[t]

    # ---- weights -------------------------------------------------------------------------------

    def update_weights(self, version: int, source: str, switch: SwitchFn | None) -> WeightsOutcome:
        """Moves to a new policy version once no batch of the current one runs (batches never mix).

        The scheduler switches the workers before the buffer records the version, so the two can
        disagree when the call fails in between (the scheduler's reply lost to the deadline, the
        buffer's own write failing, a crash). The update's intent is therefore stored before the
        scheduler is called: while it is unresolved (also after a restart) submissions are refused,
        and a retry of the update (or a newer one) calls the scheduler again and resolves it."""
        with self._lock:
            self._check_open()
            if self._switching:
                raise FailedPrecondition(f"a weight update to version {self._switch_target} is in progress; "
                                         "retry when it ends", field="version")
            previous_intent = self._intent
            if previous_intent is not None:
                pv, psrc = previous_intent
                if version < pv:
                    raise FailedPrecondition(
                        f"the weight update to version {pv} did not complete (the workers may serve it): "
                        f"retry it or move to a newer version, got {version}", field="version")
                if version == pv and not source:
                    source = psrc  # the caller's retry of the pending update: its weights
            elif version == self._policy_version and version > 0 and source in ("", self._policy_source):
                # A repeat of the update that made this version current: its caller may have timed
                # out while the switch went on, and the retry must not be refused as "not newer".
                log.info("policy version already current", extra=kv(version=version, source=source))
                return WeightsOutcome(version, self._switch_workers, 0.0)
            if version == self._policy_version and version > 0 and previous_intent is None:
                raise InvalidArgument(f"version {version} is current with source {self._policy_source!r}; "
                                      f"a new source needs a new version", field="source")
            if version <= self._policy_version:
                raise InvalidArgument(f"must be greater than the current version {self._policy_version}, "
                                      f"got {version}", field="version")
            running = sorted(b.batch_id for b in self._batches.values()
                             if b.state == BatchState.RUNNING and b.policy_version == self._policy_version)
            if running:
                raise FailedPrecondition(
                    f"{len(running)} batch(es) of version {self._policy_version} still running "
                    f"(e.g. {running[0]!r}); wait for them or cancel them", field="version")
            if switch is not None:
                self._write_intent((version, source))
            self._switching, self._switch_target = True, version
        t0 = time.monotonic()
        try:
            workers = self._switch(version, source, switch, previous_intent)
            with self._lock:
                self._check_open()
                self._commit_version_locked(version, source)
                self._switch_workers = workers
        finally:
            with self._lock:
                self._switching = False
        seconds = time.monotonic() - t0
        log.info("policy version updated", extra=kv(version=version, workers=workers, seconds=seconds))
        return WeightsOutcome(version, workers, seconds)

    def _switch(self, version: int, source: str, switch: SwitchFn | None,
                previous_intent: tuple[int, str] | None) -> int:
        """Calls the scheduler; on a failure, settles what is pending (see SwitchFn)."""
        if switch is None:
            return 0
        try:
            return switch(version, source)
        except (InvalidArgument, FailedPrecondition, SwitchNotStarted):
            # Refused before any worker loaded anything: this update did not happen. An older
            # unresolved one still may have.
            with self._lock:
                if not self._closed:
                    self._write_intent(previous_intent)
            raise
        except SeerError as e:
            log.error("weight switch outcome unknown; submissions wait for a retry of the update",
                      extra=kv(version=version, source=source, error=str(e)))
            raise Unavailable(f"{e}; the outcome is unknown (the workers may already serve version {version}): "
                              f"batches are refused until UpdateWeights(version={version}) is retried and "
                              "succeeds") from e

    def _commit_version_locked(self, version: int, source: str) -> None:
        """Records `version` as the one in force and clears the intent, in one write."""
        wb = self._store.new_batch()
        wb.put(keys.POLICY_VERSION_KEY, str(version).encode())
        # Always written (a missing key means "unknown"); an empty source relabels the current
        # weights, so the source stays.
        wb.put(keys.POLICY_SOURCE_KEY, (source or self._policy_source).encode())
        wb.delete(keys.POLICY_INTENT_KEY)
        self._store.write(wb)
        self._policy_version = version
        self._policy_source = source or self._policy_source
        self._intent = None

    def reconcile_intent(self, scheduler_version: VersionProbe) -> bool:
        """Settles an update whose outcome is unknown from the version the scheduler reports, so
        submissions need not wait for the trainer's retry (after a lost reply, or a restart between
        the scheduler's switch and the buffer's write). Only a scheduler at the intended version
        settles it: its workers serve that version. Any other answer, or none, leaves the intent (a
        restarted scheduler adopts the buffer's old version, while workers may have loaded the new
        one; only a retry of the update settles that). Returns True when no intent is left."""
        with self._lock:
            intent = self._intent
            if intent is None or self._switching:
                return intent is None
        try:
            version = scheduler_version()
        except SeerError as e:
            log.info("cannot ask the scheduler for its policy version", extra=kv(error=str(e)))
            return False
        with self._lock:
            self._check_open()
            if self._intent != intent or self._switching or version != intent[0]:
                return self._intent is None
            self._commit_version_locked(*intent)
        log.warning("weight update of unknown outcome settled: the scheduler serves its version",
                    extra=kv(policy_version=intent[0]))
        return True

    def pending_intent(self) -> tuple[int, str] | None:
        with self._lock:
            return self._intent

    def _write_intent(self, intent: tuple[int, str] | None) -> None:
        """Stores (or deletes) the unresolved update; the caller holds the lock."""
        wb = self._store.new_batch()
        if intent is None:
            wb.delete(keys.POLICY_INTENT_KEY)
        else:
            wb.put(keys.POLICY_INTENT_KEY, json.dumps({"version": intent[0], "source": intent[1]}).encode())
        self._store.write(wb)
        self._intent = intent


def _different_content(existing: BatchRecord, groups: Sequence[GroupSpec], seed_scope: str,
                       unscoped: Callable[[], str] | None) -> str:
    """The AlreadyExists of a batch id resubmitted with other content: what content is, what to do,
    and what differs where the stored record tells it cheaply. Only the content's hash is stored
    (validation.content_hash), so a differing prompt or sampling field cannot be named; the group
    and request counts are in the record, and a submission that is the stored one but for its
    seed_scope hashes as the stored one without it (one more hash, on this error path only)."""
    requests = sum(g.group_size for g in groups)
    what = ""
    if (existing.num_groups, existing.num_requests) != (len(groups), requests):
        what = (f": the stored batch has {existing.num_groups} group(s) and {existing.num_requests} request(s), "
                f"this submission {len(groups)} and {requests}")
    elif seed_scope and unscoped is not None and unscoped() == existing.content_hash:
        what = (f": only seed_scope differs (the stored batch has none, which means its batch id; this one "
                f"{seed_scope!r})")
    return (f"batch {existing.batch_id!r} was submitted before with different content{what} (content: every "
            "group's prompt, prompt_key, group_size, max_tokens, sampling and labels, and the seed_scope; not the "
            "submission_token); submit this one under a new batch_id, or resubmit exactly the stored content to "
            "collect that batch")


def _build_work_item(live: _Live, g: GroupRecord, version: int, submit_seq: int,
                     trace_context: Mapping[str, str]) -> WorkItem:
    """One request's work item (its output so far included): the one builder of both the feed's
    snapshot / events and a new batch's items."""
    r = live.rec
    s = g.sampling
    return WorkItem(
        request_id=r.request_id, batch_id=r.batch_id, group_id=r.group_id, group_index=r.group_index,
        sample_index=r.sample_index, group_size=g.group_size, prompt_key=g.prompt_key,
        prompt_token_ids=g.prompt_token_ids, output_token_ids=codec.i32(live.tokens), max_tokens=g.max_tokens,
        sampling=Sampling(s.temperature, s.top_p, s.top_k, r.seed, s.stop_token_ids, s.ignore_eos),
        policy_version=version, next_seq=r.next_seq, trace_context=trace_context, submit_seq=submit_seq,
    )
