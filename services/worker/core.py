"""The worker core: one Engine, its step loop, and the chunk jobs it serves (pure: no grpc).

A chunk job is one dispatch of divided rollout (DESIGN.md section 3, step 3): the request's prompt
plus the tokens earlier chunks generated, and a new-token limit. Many chunk jobs run concurrently in
one engine (continuous batching); a dedicated thread runs `engine.step` and fans the step outputs
out to per-chunk event queues that the RPC handler threads drain.

Around each step the worker
  - asks the speculation planner (Seer Algorithm 1) for per-request draft lengths and the draft
    client (a local mirror of the group's suffix index, Seer section 4) for the drafts,
  - appends every accepted token to the draft client so siblings can draft from it,
and around each chunk it
  - fetches the request's missing prefix pages from the KV pool before the engine prefills it,
  - exports and offloads the request's new KV pages when the chunk ends with the request
    unfinished (so the next chunk can run on any worker without re-prefill; pages an earlier chunk
    offloaded or fetched are not sent again), and releases them when the request ends.

The draft client, planner and KV client are injected (Protocols in services.worker.ports) so this module never
imports grpc and tests can drive it with the real engine alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from services.common.log import get_logger, kv, log_context
from services.worker import metrics
from services.worker.chunks import ChunkEvent, ChunkFinish, ChunkJob, ChunkStats, DoneEvent, ErrorEvent, TokensEvent
from services.worker.engine import (
    Draft,
    Engine,
    EngineStats,
    FinishReason,
    GenerateRequest,
    KVPages,
    SamplingParams,
    StepOutput,
)
from services.worker.ports import DraftSource, KVPool, PutResult, SpecPlanner

log = get_logger(__name__)

__all__ = [
    "ChunkEvent", "ChunkFinish", "ChunkHandle", "ChunkJob", "ChunkStats", "DoneEvent", "DraftSource",
    "ErrorEvent", "KVPool", "SpecPlanner", "TokensEvent", "Worker", "WorkerStats", "version_name",
]

_MAX_GROUPS = 1024  # draft mirrors kept per worker; the least recently used are released
_MAX_OFFLOAD_MARKS = 65536  # requests whose offload watermark is remembered (LRU)
# Releases queued on the kv-release thread. Against a hung store each waits its full timeout, so
# an unbounded queue grows with every finished response and close() waited for all of them.
# Beyond this many, a release is dropped (counted): the store's LRU evicts the pages anyway. Far
# above a batch: a whole batch reaching max_tokens in one step queues one release per request at
# once against a healthy store (32 dropped a burst's releases there; review, session 27).
_MAX_PENDING_RELEASES = 1024
_RELEASE_CLOSE_WAIT_S = 2.0  # close() waits this long at most for queued releases, then drops them
_MAX_STEP_FAILURES = 2  # engine step failures in a row that start isolating the failing chunks
_MAX_IDLE_PROBE_STEPS = 4  # isolation: steps a group may wait for the engine to admit it
# The request that checks whether the engine itself works (_canary_locked): token ids every
# vocabulary has, and an id no chunk can have (request ids come from the buffer, "<batch>/<g>/<i>").
_CANARY_ID = "seer-canary"
_CANARY_PROMPT = (1, 2, 3, 4)
_CANARY_TIMEOUT_S = 30.0
_ENGINE_ABORT_GROUPS = 3  # groups given up on by the engine, no token in between, before the canary


def version_name(policy_version: int, family: str = "", weights: str = "") -> str:
    """The engine's model version string, also the KV store namespace and part of every page hash:
    "<family>@v<N>", or "<family>@<weights>@v<N>" once weights were loaded from a named source
    (`weights` = weights_id(source)). Every worker of a deployment must agree on it; within one
    family (everything before the last "@") the store drops older versions when a newer one
    appears, so pages of old weights are never served. Each checkpoint is its own family, so a
    new checkpoint does not drop the previous one's pages: they are never read again and leave by
    Release and LRU eviction (services/kvstore/README.md).

    The weights id is there because the policy version alone does not name the weights: a new
    training run on the same kvstore volume restarts at v0, and a LoadWeights may reload one version
    from another source. Without it such weights would share a namespace (and page hashes) with
    others and be served their KV. It sits before the last "@", so it is part of the store's family
    (versions of other weights neither supersede nor block each other) and the "v<N>" tail stays
    what engines parse."""
    base = f"{family}@{weights}" if family and weights else family or weights
    return f"{base}@v{policy_version}" if base else f"v{policy_version}"


_ID_SAMPLES = 64


def weights_id(source: str) -> str:
    """A short digest naming the weights at `source` (a file, or a directory of weight files) by
    content, not by place: per file its name, size, its first 64 KiB (a safetensors header) and
    _ID_SAMPLES samples of 4 KiB spread evenly over it. Trained weights differ wherever training
    reached; samples all over the file (not one from its middle) keep a checkpoint whose middle
    lies in frozen tensors (a frozen vision tower, frozen embeddings) from taking another's id.
    The same checkpoint copied to another node or path gets the same id, so workers loading their
    own copies still share KV. A few dozen reads per LoadWeights. A source that is not a readable
    file or directory (a name the engine resolves itself) is named by the string."""
    h = hashlib.blake2b(digest_size=6)
    path = Path(source)
    try:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        for f in files:
            size = f.stat().st_size
            h.update(f"\0{f.name}\0{size}\0".encode())
            with f.open("rb") as fh:
                h.update(fh.read(65536))
                for i in range(_ID_SAMPLES):
                    fh.seek(size * i // _ID_SAMPLES)
                    h.update(fh.read(4096))
    except OSError:
        files = []  # unreadable: the engine's load reports it
    if not files:
        h.update(source.encode("utf-8"))
    return h.hexdigest()


@dataclass
class _Active:
    job: ChunkJob
    events: queue.SimpleQueue[ChunkEvent]
    started: float
    stats: ChunkStats = field(default_factory=ChunkStats)
    tokens: list[int] = field(default_factory=list)  # produced by this chunk so far
    done: bool = False
    bad_draft_logged: bool = False  # an invalid draft of this chunk was logged (once per chunk)

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def offset(self) -> int:
        """Position (in the response) of the next token this chunk produces."""
        return len(self.job.output_token_ids) + self.generated


# eq=False: records compare by identity. Two admissions of one request with the same epoch (a
# re-sent chunk racing the first) are equal field-wise, so value equality made submit's
# list.remove drop the other chunk's record: an Abort then missed that chunk, and its own remove
# raised ValueError after it was already in _active and the engine.
@dataclass(eq=False)
class _Admission:
    request_id: str
    dispatch_epoch: int
    aborted: bool = False
    # Whether its caller is gone (the RunChunk stream cancelled or past its deadline): read by the
    # KV fetch, which stops its Gets then (submit's `cancelled`).
    caller_gone: Callable[[], bool] | None = None

    def gone(self) -> bool:
        """Aborted (Abort RPC) or its caller gone: nothing will read the chunk."""
        return self.aborted or (self.caller_gone is not None and self.caller_gone())


class ChunkHandle:
    """The consumer side of one running chunk: iterate its events; cancel to abort it."""

    def __init__(self, worker: Worker, active: _Active) -> None:
        self._worker = worker
        self._active = active
        self.request_id = active.job.request_id

    def next_event(self, timeout: float | None = None) -> ChunkEvent | None:
        try:
            return self._active.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def events(self, poll_seconds: float = 0.5) -> Iterator[ChunkEvent]:
        """Yields events until (and including) the DoneEvent or ErrorEvent."""
        while True:
            ev = self.next_event(poll_seconds)
            if ev is None:
                continue
            yield ev
            if not isinstance(ev, TokensEvent):
                return

    def cancel(self) -> bool:
        """Aborts the chunk if it is still running (a cancelled stream); True if it was."""
        return self._worker.abort_active(self._active)

    @property
    def finished(self) -> bool:
        """The chunk ended (read without the engine lock: a stale False only means release()
        takes the lock to find out)."""
        return self._active.done

    def release(self) -> None:
        """Aborts the chunk unless it already finished (the RPC ended). Takes the engine lock
        when it still runs: up to one engine step."""
        if not self.finished:
            self.cancel()


# ---------------------------------------------------------------------------------------------
# Worker statistics
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerStats:
    worker_id: str
    engine: EngineStats
    policy_version: int
    in_flight: int
    tokens_per_second: float
    accepted_per_position: list[int]
    proposed_per_position: list[int]
    kv_loaded_tokens: int
    kv_recomputed_pages: int
    prefill_tokens: int
    cached_tokens: int
    kv_refetches: int = 0  # continuations fetched again: the engine evicted what they attach to
    invalid_drafts: int = 0  # drafts dropped before the engine saw them (the drafter's bug)
    kv_releases_dropped: int = 0  # releases not sent: too many queued (a slow or hung store)


@dataclass(frozen=True)
class EngineHealth:
    """What the heartbeat tells the scheduler of the engine (HeartbeatRequest.engine_broken and
    engine_failing): "" = fine, else the reason."""

    broken: str = ""  # for good, until the worker restarts (Engine.broken)
    failing: str = ""  # now: the chunks failed and a canary too (a chunk that gets a token mends it)


class _Throughput:
    """Tokens/s over a sliding window (the engine's own figure covers its lifetime)."""

    def __init__(self, window: float = 10.0) -> None:
        self._window = window
        self._events: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 1.0)
            return sum(n for _, n in self._events) / span

    def _trim(self, now: float) -> None:
        cut = now - self._window
        i = 0
        while i < len(self._events) and self._events[i][0] < cut:
            i += 1
        if i:
            del self._events[:i]


def draft_depths(draft: Draft) -> list[int]:
    """Depth (0 = first draft position) of every node of a draft tree."""
    depths: list[int] = []
    for p in draft.parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class Worker:
    """Owns one Engine; every engine call happens under `_lock` (the engine is not thread-safe)."""

    def __init__(
        self,
        engine: Engine,
        *,
        worker_id: str = "worker",
        policy_version: int = 0,
        draft: DraftSource | None = None,
        planner: SpecPlanner | None = None,
        kv_pool: KVPool | None = None,
        speculation: bool = True,
        gamma_max: int = 8,
        draft_width: int = 1,
        multipath_max_batch: int = 4,
        group_ttl_seconds: float = 3600.0,
        kv_offload: bool = True,
        engine_name: str = "reference",
        model_family: str = "",
        weights_source: str = "",
        step_clock: str = "wall",
    ) -> None:
        self.engine = engine
        self.engine_name = engine_name
        self.model_family = model_family
        # Where the loaded weights came from: the engine's model directory at start (the factory
        # names the engine's version with its weights_id too), then the last LoadWeights source.
        # A reload without a source reloads those, so it keeps naming them (see version_name).
        self._weights_source = weights_source
        self.worker_id = worker_id
        self._policy_version = policy_version
        self._draft = draft
        self._planner = planner
        # The planner closes its cost loop with the time of every decode step, when it can take it.
        # Wall time by default: it is what throughput is, on any engine (a GPU, a multi-threaded
        # CPU engine); the planner's estimates are robust to a descheduled step. "thread" (the loop
        # thread's CPU time) suits a single-threaded CPU engine on a shared machine.
        if step_clock not in ("wall", "thread"):
            raise ValueError(f"step_clock: {step_clock!r} is not wall or thread")
        self._step_observer = getattr(planner, "observe_step", None)
        # Per-request acceptance (optional for a SpecPlanner): each verified draft's outcome, and
        # the end of each chunk so the planner forgets the request.
        self._request_observer: Callable[[str, int, int], None] | None = getattr(planner, "observe_request", None)
        self._request_forget: Callable[[str], None] | None = getattr(planner, "forget_request", None)
        self._clock = time.perf_counter if step_clock == "wall" else time.thread_time
        self._kv = kv_pool
        self._speculation = speculation and gamma_max > 0
        self._gamma_max = gamma_max
        self._draft_width = draft_width
        self._multipath_max_batch = multipath_max_batch
        self._group_ttl = group_ttl_seconds
        self._kv_offload = kv_offload

        self._lock = threading.RLock()  # guards the engine and _active
        self._waiting = 0  # handler threads waiting for _lock (the loop yields to them)
        self._engine_stats: EngineStats | None = None  # snapshot for lock-free stats()
        self._snapshot_at = 0.0
        self._waiting_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._active: dict[str, _Active] = {}
        # Chunks between RunChunk and admission (the KV fetch, waiting for the engine lock behind a
        # step), so that an Abort in that window is not lost: _start ends them ABORTED. The list
        # under its own lock (submit must not wait for a step to add itself); `aborted` is set and
        # read under the engine lock.
        self._admitting: list[_Admission] = []
        self._admitting_lock = threading.Lock()
        self._loading = False  # LoadWeights in progress: refuse new chunks
        self._step_failures = 0  # engine step failures in a row
        # False once the chunks failed and a canary request too (_fail_culprits_locked,
        # _on_engine_abort_locked), until a chunk gets a token: the engine, not a request, is
        # broken. False for good once the engine says it is broken (Engine.broken: a failed weight
        # load left its weights unknown; _note_engine_broken_locked). Listeners (the gRPC health
        # status, so Kubernetes' liveness probe restarts the process) hear every change.
        self.engine_healthy = True
        # Why it is False (engine_health(), for the scheduler): the canary's failure, or the
        # engine's Engine.broken. Plain str attributes: read without the lock.
        self._failing_reason = ""
        self._broken_reason = ""
        # Replaced, never changed in place (under _listeners_lock), so a removal needs no engine
        # lock (Registrar.stop must not wait for a hung step) and a notification iterating the old
        # list is not disturbed.
        self._health_listeners: list[Callable[[bool], None]] = []
        self._listeners_lock = threading.Lock()
        # Groups whose chunks the engine gave up on (an engine-side ABORTED: SGLang's failed
        # generate) since a chunk last got a token: at _ENGINE_ABORT_GROUPS of them, the canary.
        self._engine_abort_groups: set[str] = set()
        self._canary_running = False  # outputs delivered during a canary start no second one
        self._canary_due = False  # run the canary after the current step's outputs are delivered
        # Engine requests whose abort raised: still in the engine, generating for a chunk that has
        # ended, and holding the request id (a retry of the request on this worker would be refused
        # "already live", an INVALID_ARGUMENT that costs the request an attempt). The abort is tried
        # again before every step and before the id is added again (_engine_abort_locked).
        self._orphans: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered_groups: OrderedDict[str, None] = OrderedDict()
        self._throughput = _Throughput()
        self._offloads: set[Future[Any]] = set()
        # Per request: (model version, N) = the request's prefix pages [0, N) are in the KV pool,
        # owned by it (this worker offloaded them, or an earlier chunk's worker did and this one
        # fetched them). The next offload exports from page N on, so a request run in many chunks
        # sends each page once instead of its whole prefix after every chunk (issue 6).
        self._offloaded: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._offloaded_lock = threading.Lock()  # offload callbacks run on the KV client's thread
        # Releases are RPCs: they run here, never under the engine lock.
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="kv-release") if kv_pool is not None else None
        self._releases = threading.Condition()  # guards the two counters below
        self._releases_pending = 0  # queued or running on _bg
        self._releases_dropped = 0
        # Worker-level counters the engine does not keep (per-position counts: the engine's).
        self._kv_loaded_tokens = 0
        self._kv_recomputed_pages = 0
        self._kv_refetches = 0
        self._invalid_drafts = 0
        # (proposed, accepted) per draft position, replaced whole after each step's update (never
        # changed in place): stats() reads it without the engine lock, and two lists copied one
        # after the other there could straddle an update (accepted above proposed at a position,
        # or lengths differing), which the scheduler takes for a broken worker and quarantines.
        self._pos_counts: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    # -- lifecycle ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """_lock for handler threads: counted, so the step loop lets them in between steps."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def start(self) -> Worker:
        with self._locked():
            self._snapshot_locked()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop; chunks still running end ABORTED."""
        with self._locked():
            for act in list(self._active.values()):
                self._abort_locked(act)
            self._stop.set()
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.wait_offloads(timeout)
        if self._bg is not None:
            # Bounded: against a hung store each queued release would wait its whole RPC timeout.
            # What is still queued is cancelled; a running one ends when the KV client closes its
            # channels below. Unreleased pages are evicted by the store's LRU.
            with self._releases:
                self._releases.wait_for(lambda: self._releases_pending == 0, min(timeout, _RELEASE_CLOSE_WAIT_S))
                if self._releases_pending:
                    log.warning("kv releases still queued at close; dropped",
                                extra=kv(pending=self._releases_pending))
            self._bg.shutdown(wait=False, cancel_futures=True)
        if self._draft is not None:
            self._draft.close()
        if self._kv is not None:
            self._kv.close()

    def wait_offloads(self, timeout: float = 30.0) -> None:
        """Waits for the KV offloads started so far (tests; shutdown)."""
        for fut in list(self._offloads):
            try:
                fut.result(timeout=timeout)
            except Exception:
                log.warning("kv offload failed", exc_info=True)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def in_flight(self) -> int:
        with self._locked():
            return len(self._active)

    # -- chunk submission --------------------------------------------------------------------

    def submit(self, job: ChunkJob, cancelled: Callable[[], bool] | None = None) -> ChunkHandle:
        """Starts a chunk; raises InvalidArgument / FailedPrecondition / AlreadyExists / Unavailable.
        cancelled: whether the caller is gone (the RunChunk stream's context no longer active); a KV
        fetch for the chunk stops its Gets then, like after an Abort."""
        job = self._validate(job)
        complete = self._complete_finish(job)
        if complete is not None:
            return self._end_at_once(job, complete)
        admission = _Admission(job.request_id, job.dispatch_epoch, caller_gone=cancelled)
        with self._admitting_lock:
            self._admitting.append(admission)
        try:
            return self._submit(job, admission)
        finally:
            # After _start put the chunk in _active (or it failed): an Abort finds it there now.
            with self._admitting_lock:
                self._admitting.remove(admission)

    def _submit(self, job: ChunkJob, admission: _Admission) -> ChunkHandle:
        with log_context(request_id=job.request_id, group_id=job.group_id):
            self._register_group(job)
            prefix = job.prompt_token_ids + job.output_token_ids
            fetched = self._fetch_kv(prefix, admission) if job.fetch_kv and self._kv is not None else None
            req = GenerateRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_token_ids,
                max_new_tokens=job.max_new_tokens,
                sampling=job.sampling,
                output_token_ids=job.output_token_ids,
                group_id=job.group_id,
                prompt_key=job.prompt_key,
                # As sent: 0 = unknown (see _register_group); an engine registering 1 had the draft
                # server complete the group at its first finished response.
                group_size=job.group_size,
                is_probe=job.is_probe,
                dispatch_epoch=job.dispatch_epoch,
                submit_seq=job.submit_seq,
                policy_version=job.policy_version,
            )
            act = _Active(job=job, events=queue.SimpleQueue(), started=time.monotonic())
            # A continuation (pages from first_page on) attaches to the prefix pages cached here when
            # it was fetched; if the engine evicted them meanwhile, import would reject it and the
            # whole prefix would be recomputed. Fetch once more, from what is cached now.
            if not self._start(job, req, act, prefix, fetched, check_attach=True, admission=admission):
                log.info("kv prefix pages evicted between fetch and import; fetching again",
                         extra=kv(first_page=fetched.first_page if fetched else 0))
                self._start(job, req, act, prefix, self._fetch_kv(prefix, admission), check_attach=False,
                            admission=admission)
            stats = act.stats
            log.debug("chunk started", extra=kv(seq=job.seq, prefix=len(prefix), cached=stats.cached_tokens,
                                                kv_loaded=stats.kv_loaded_tokens, max_new=job.max_new_tokens))
            return ChunkHandle(self, act)

    def run(self, job: ChunkJob) -> tuple[list[int], list[float], DoneEvent]:
        """Submits a chunk and waits for it (tests, the simulator, the bench)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        for ev in self.submit(job).events():
            if isinstance(ev, TokensEvent):
                tokens += ev.token_ids
                logprobs += ev.logprobs
            elif isinstance(ev, ErrorEvent):
                raise ev.error
            else:
                return tokens, logprobs, ev
        raise AssertionError("unreachable")

    def _complete_finish(self, job: ChunkJob) -> ChunkFinish | None:
        """How the response ended when the committed output it resumes from is already complete: it
        ends with a stop token (EOS too, without ignore_eos) or fills max_tokens. None otherwise.

        The scheduler dispatches only unfinished requests, so this means its view and the output
        diverged (a worker with other stop ids committed a CHUNK ending in one, say). Generating on
        would append tokens past the response's end; refusing (INVALID_ARGUMENT) would cost the
        request its attempts and end a complete response ABORTED. A chunk with no tokens and this
        finish reason is what the scheduler and the buffer take as the response's end: nothing is
        added, and a buffer that had already finished the request refuses the commit (a resync)."""
        done = len(job.output_token_ids)
        if job.max_tokens and done == job.max_tokens:
            return ChunkFinish.LENGTH
        if done:
            last = job.output_token_ids[-1]
            stop = job.sampling.stop_token_ids
            if last in stop or (not job.sampling.ignore_eos and last in self.engine.eos_token_ids):
                return ChunkFinish.STOP
        return None

    def _end_at_once(self, job: ChunkJob, finish: ChunkFinish) -> ChunkHandle:
        """A chunk whose response is already complete: ends `finish` with no tokens, never reaching
        the engine. Refused like any chunk (shutdown, loading, policy version, a running attempt):
        its DoneEvent carries the policy version the request's other chunks were checked against."""
        act = _Active(job=job, events=queue.SimpleQueue(), started=time.monotonic())
        with log_context(request_id=job.request_id, group_id=job.group_id):
            # The draft group must learn the response is finished, as from any STOP / LENGTH end
            # (below): otherwise it never completes there (no history, no expiry as completed) and
            # siblings keep treating the response as open.
            self._register_group(job)
        with log_context(request_id=job.request_id, group_id=job.group_id), self._locked():
            self._check_admissible_locked(job)
            running = self._active.get(job.request_id)
            if running is not None:  # an abandoned attempt (a newer epoch, see _start) ends here too
                self._abort_locked(running)
            self._finish_locked(act, finish, at_once=True)
        return ChunkHandle(self, act)

    def _check_admissible_locked(self, job: ChunkJob) -> None:
        """Refusals every chunk gets before it runs here (the engine lock held)."""
        if self._stop.is_set():
            raise Unavailable("worker is shutting down")
        if self._loading:
            raise Unavailable("worker is loading weights; retry after the switch")
        if job.policy_version != self._policy_version:
            raise FailedPrecondition(
                f"chunk wants policy version {job.policy_version}, worker serves {self._policy_version}",
                field="policy_version",
            )
        running = self._active.get(job.request_id)
        if running is not None and not _newer(job.dispatch_epoch, running.job.dispatch_epoch):
            raise AlreadyExists(f"{job.request_id!r} is already running here", field="request_id")

    def _start(self, job: ChunkJob, req: GenerateRequest, act: _Active, prefix: tuple[int, ...],
               fetched: KVPages | None, *, check_attach: bool, admission: _Admission) -> bool:
        """Admits the chunk under the engine lock: imports the fetched pages, adds the request.
        Returns False, admitting nothing, when `check_attach` and `fetched` no longer attaches to
        the pages cached here. A chunk aborted while it was being admitted ends ABORTED here
        without running."""
        with self._locked():
            self._check_admissible_locked(job)
            running = self._active.get(job.request_id)
            if running is not None:
                # Newer than the running attempt (else refused above). The scheduler raises a
                # request's epoch only when it has given up on the attempt before (a failed
                # stream, a deadline): that attempt is abandoned, and its cancel
                # may still be on its way here. Refused, the re-dispatch would cost the request an
                # attempt (ALREADY_EXISTS counts) for the abandoned attempt's sake.
                log.info("a newer attempt supersedes the running one", extra=kv(
                    request_id=job.request_id, running_epoch=running.job.dispatch_epoch,
                    epoch=job.dispatch_epoch))
                self._abort_locked(running)
            if admission.aborted:
                act.done = True
                act.stats.wall_seconds = time.monotonic() - act.started
                metrics.CHUNKS.labels(finish=ChunkFinish.ABORTED.value).inc()
                act.events.put(DoneEvent(ChunkFinish.ABORTED, act.stats, self._policy_version))
                log.info("chunk aborted before it was admitted", extra=kv(request_id=job.request_id, seq=job.seq))
                return True
            if fetched is not None and check_attach and not self._attaches(fetched, prefix):
                self._kv_refetches += 1
                return False
            # The watermark may come from an earlier attempt of this chunk that ran past the
            # resumed prefix (its CHUNK was never committed, so the request is re-dispatched from
            # a shorter output and generates a different chain). Only the prefix's whole pages are
            # shared with that chain: lower the mark to them, else the next offload would skip the
            # new chain's pages up to the old mark and the next worker would recompute them.
            self._lower_offloaded(job.request_id, len(prefix) // self.engine.kv_layout.page_size)
            stats = act.stats
            claim = False
            if fetched is not None:
                self._import_kv(fetched, prefix, stats)
                if job.output_token_ids and len(job.output_token_ids) + job.max_new_tokens < job.max_tokens:
                    # A resumed request's stored prefix is normally its own (its earlier chunks
                    # offloaded it), but where one of those offloads was dropped or lost a
                    # replica the fetch found a sibling's pages, which would go with that
                    # sibling's Release. Offloading the fetched pages claims them for this request;
                    # the store has every one, so only claims travel, no page bytes. Not for the
                    # response's last chunk: nothing fetches this prefix after it, and it releases
                    # its pages at the end. (A first chunk's fetch finds its siblings' prompt pages,
                    # which it claims at its first offload: its watermark stays at 0.) Sent once
                    # the request is admitted: a refused chunk must not leave claims behind.
                    claim = True
                elif job.output_token_ids:
                    self._mark_offloaded(job.request_id, fetched.model_version, fetched.end_page)
            # The engine computes at least the last token (its logits start the chunk), so a prefix
            # of whole cached pages reuses one page less: count what it can actually reuse.
            ps = self.engine.kv_layout.page_size
            reusable = (len(prefix) - 1) // ps * ps if prefix else 0
            stats.cached_tokens = min(self.engine.cached_prefix_tokens(prefix), reusable)
            if job.fetch_kv and self._kv is not None:
                page = self.engine.kv_layout.page_size
                missing = len(prefix) // page - stats.cached_tokens // page
                stats.kv_recomputed_pages = max(0, missing)
                self._kv_recomputed_pages += stats.kv_recomputed_pages
            stats.prefill_tokens = len(prefix) - stats.cached_tokens
            if job.request_id in self._orphans:
                self._engine_abort_locked(job.request_id)
            try:
                self.engine.add_request(req)
            except ValueError as e:
                raise InvalidArgument(str(e)) from e
            if claim and fetched is not None:
                self._send_offload_locked(job.request_id, fetched)
            # Under the engine lock, before the request can be drafted for in a step.
            self._draft_resume_locked(job)
            self._active[job.request_id] = act
            metrics.IN_FLIGHT.set(len(self._active))
            self._wake.notify_all()
        return True

    def _validate(self, job: ChunkJob) -> ChunkJob:
        if not job.request_id:
            raise InvalidArgument("must not be empty", field="request_id")
        if job.request_id == _CANARY_ID:
            raise InvalidArgument(f"{_CANARY_ID!r} is reserved for the worker's engine check", field="request_id")
        if not job.prompt_token_ids:
            raise InvalidArgument("must not be empty", field="prompt_token_ids")
        if job.max_new_tokens < 1:
            raise InvalidArgument(f"must be >= 1, got {job.max_new_tokens}", field="max_new_tokens")
        if job.max_tokens < 0:
            raise InvalidArgument(f"must be >= 0, got {job.max_tokens}", field="max_tokens")
        if job.group_size < 0:
            raise InvalidArgument(f"must be >= 0, got {job.group_size}", field="group_size")
        done = len(job.output_token_ids)
        if job.max_tokens:
            if done > job.max_tokens:  # done == max_tokens: complete, ends at once (_complete_finish)
                raise InvalidArgument(
                    f"the request already has {done} output tokens, past max_tokens {job.max_tokens}",
                    field="output_token_ids",
                )
            # A chunk never runs past the request's total limit.
            if done + job.max_new_tokens > job.max_tokens:
                job = _replace(job, max_new_tokens=job.max_tokens - done)
        total = len(job.prompt_token_ids) + done + job.max_new_tokens
        if total > self.engine.max_context:
            raise InvalidArgument(
                f"prompt ({len(job.prompt_token_ids)}) + output ({done}) + max_new_tokens ({job.max_new_tokens})"
                f" = {total} exceeds the context limit {self.engine.max_context}",
                field="max_new_tokens",
            )
        vocab = self.engine.vocab_size
        for name, toks in (("prompt_token_ids", job.prompt_token_ids), ("output_token_ids", job.output_token_ids)):
            for i, t in enumerate(toks):
                if not 0 <= t < vocab:
                    raise InvalidArgument(f"{t} is outside the vocabulary [0, {vocab})", field=f"{name}[{i}]")
        try:
            job.sampling.validate(vocab)
        except ValueError as e:
            raise InvalidArgument(str(e), field="sampling") from e
        return job

    # -- abort -------------------------------------------------------------------------------

    def abort(self, request_id: str, dispatch_epoch: int = 0) -> bool:
        """Aborts a running chunk by request id; False when none runs here. With a dispatch_epoch
        (the RunChunkRequest.dispatch_epoch of the attempt meant; 0 = any attempt), an abort older
        than the running attempt is ignored (False): it was sent for an abandoned attempt (a chunk
        past its deadline, say), and the request has been dispatched here again since."""
        with self._locked():
            # Attempts not admitted yet (fetching their KV, or waiting for this lock behind a
            # step) too, also while an earlier attempt still runs: each would run its whole chunk
            # for a request the scheduler has dropped (a newer one supersedes the running one).
            found = False
            with self._admitting_lock:
                for adm in self._admitting:
                    if adm.request_id == request_id and not _newer(adm.dispatch_epoch, dispatch_epoch):
                        adm.aborted = found = True
            act = self._active.get(request_id)
            if act is None:
                return found
            if _newer(act.job.dispatch_epoch, dispatch_epoch):
                log.info("abort of an earlier attempt ignored", extra=kv(
                    request_id=request_id, abort_epoch=dispatch_epoch, running_epoch=act.job.dispatch_epoch))
                return found
            return self._abort_locked(act) or found

    def abort_active(self, act: _Active) -> bool:
        with self._locked():
            if self._active.get(act.job.request_id) is not act:
                return False
            return self._abort_locked(act)

    def _engine_abort_locked(self, request_id: str) -> None:
        """engine.abort, which must not fail the caller: a request it could not abort is an orphan,
        aborted again before the next step and before its id is added again."""
        try:
            self.engine.abort(request_id)
        except Exception:
            if request_id not in self._orphans:
                log.warning("engine abort failed; retried before the next step", exc_info=True,
                            extra=kv(request_id=request_id))
            self._orphans.add(request_id)
        else:
            self._orphans.discard(request_id)

    def _abort_orphans_locked(self) -> None:
        for rid in list(self._orphans):
            self._engine_abort_locked(rid)

    def _abort_locked(self, act: _Active) -> bool:
        if act.done:
            return False
        self._engine_abort_locked(act.job.request_id)
        self._finish_locked(act, ChunkFinish.ABORTED)
        log.info("chunk aborted", extra=kv(request_id=act.job.request_id, group_id=act.job.group_id))
        return True

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, version: int, source: str | None, drain_timeout: float = 300.0) -> float:
        """Drains in-flight chunks, then loads weights as `version`; returns the seconds it took."""
        if version < 0:
            raise InvalidArgument(f"must be >= 0, got {version}", field="version")
        t0 = time.monotonic()
        with self._locked():
            if self._loading:
                raise FailedPrecondition("another LoadWeights is in progress", field="version")
            if version < self._policy_version:
                raise FailedPrecondition(
                    f"version {version} is older than the served version {self._policy_version}", field="version"
                )
            self._loading = True
        try:
            deadline = t0 + drain_timeout
            with self._locked():
                while self._active:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Unavailable(f"{len(self._active)} chunks still running after {drain_timeout:.0f}s")
                    self._wake.wait(min(left, 0.5))
                src = source or self._weights_source
                try:
                    name = version_name(version, self.model_family, weights_id(src) if src else "")
                    self.engine.load_weights(source or None, name)
                except Exception as e:
                    # A load that left the engine broken (SGLang failing after it wrote weights, or
                    # given up on) is no refusal, and its worker must restart: NOT_SERVING now.
                    # Waiting for failed chunks and a canary would wait for ever once the scheduler
                    # dropped this worker: it then only retries the catch-up load (INTERNAL every
                    # time) and never places a chunk here.
                    if self._note_engine_broken_locked("a weight load failed"):
                        raise
                    if isinstance(e, (OSError, ValueError)):  # missing, unreadable or malformed files
                        raise InvalidArgument(str(e), field="source") from e
                    raise
                self._policy_version = version
                self._weights_source = src
                metrics.POLICY_VERSION.set(version)
                with self._offloaded_lock:
                    self._offloaded.clear()  # pages of the old version are never reused
        finally:
            with self._locked():
                self._loading = False
        seconds = time.monotonic() - t0
        log.info("weights loaded", extra=kv(version=version, source=source or "(reload)", seconds=round(seconds, 3)))
        return seconds

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> WorkerStats:
        """Never waits for the engine: an engine step can take seconds on a CPU, and heartbeats and
        GetWorkerStats must not stall behind it. Engine figures are the snapshot the loop takes after
        every step (and whenever the engine lock is free right now)."""
        if self._lock.acquire(blocking=False):
            try:
                self._snapshot_locked()
            finally:
                self._lock.release()
        es = self._engine_stats
        if es is None:  # not started and the lock was busy: wait once
            with self._locked():
                self._snapshot_locked()
            es = self._engine_stats
            assert es is not None
        proposed, accepted = _position_counts(es, self._pos_counts)
        rate = self._throughput.rate()
        metrics.FREE_PAGES.set(es.free_pages)
        metrics.TOKENS_PER_SECOND.set(rate)
        return WorkerStats(
            worker_id=self.worker_id,
            engine=es,
            policy_version=self._policy_version,
            in_flight=len(self._active),
            tokens_per_second=rate,
            accepted_per_position=accepted,
            proposed_per_position=proposed,
            kv_loaded_tokens=self._kv_loaded_tokens,
            kv_recomputed_pages=self._kv_recomputed_pages,
            kv_refetches=self._kv_refetches,
            invalid_drafts=self._invalid_drafts,
            kv_releases_dropped=self._releases_dropped,
            prefill_tokens=es.prefill_tokens,
            cached_tokens=es.cached_tokens,
        )

    def _snapshot_locked(self) -> None:
        self._engine_stats = self.engine.stats()
        self._snapshot_at = time.monotonic()

    # -- the step loop -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            produced = 0
            with self._lock:  # the loop itself: no priority bookkeeping
                while not self._stop.is_set() and not self._active:
                    if self._orphans:  # an engine in another process runs them without steps
                        self._abort_orphans_locked()
                    # Idle too: the heartbeat reports Engine.broken at once (engine_health), and the
                    # scheduler then places nothing here, so no step would ever see it and health
                    # stayed SERVING for good (no liveness probe or `seer up` restart).
                    if self.engine_healthy:
                        self._note_engine_broken_locked("seen while idle")
                    self._wake.wait(0.5)
                if self._stop.is_set():
                    return
                if self._orphans:
                    self._abort_orphans_locked()
                started = self._clock()
                drafts = self._plan_drafts_locked() if self._speculation else {}
                try:
                    outs, drafts = self._engine_step_locked(drafts)
                except Exception as e:  # an engine failure must not kill the loop
                    self._on_step_failure_locked(e)
                else:
                    # The engine committed the step: from here on nothing is retried, and a fault
                    # of ours fails at most the chunk whose output it was handling.
                    self._step_failures = 0
                    produced = self._after_step_locked(outs, drafts, self._clock() - started)
                    if self._canary_due:
                        self._run_due_canary_locked()
                # An engine may also turn broken outside a load (Engine.broken); one attribute read.
                if self.engine_healthy:
                    self._note_engine_broken_locked("seen after an engine step")
            # Python locks are not fair: step aside while a handler thread (submit, abort, stats)
            # waits for the engine, and do not spin while the engine has nothing runnable.
            if self._waiting:
                time.sleep(0.0005)
            elif not produced:
                time.sleep(0.002)

    def _engine_step_locked(self, drafts: dict[str, Draft]) -> tuple[list[StepOutput], dict[str, Draft]]:
        """engine.step and nothing else: what raises here is an engine step failure (Engine.step is
        exception-safe: nothing advanced). Returns the outputs and the drafts actually used."""
        try:
            return self.engine.step(drafts or None), drafts
        except ValueError:
            if not drafts:
                raise
            # A malformed draft is the drafter's bug; speculation is optional, so step without it.
            log.warning("engine rejected drafts; stepping without them", exc_info=True)
            return self.engine.step(None), {}

    def _after_step_locked(self, outs: Sequence[StepOutput], drafts: Mapping[str, Draft],
                           seconds: float | None) -> int:
        """Everything after a committed step; never raises. The observers and the accounting are
        the worker's business only: a fault there is logged and the chunks go on. seconds: the
        step's time for the planner's cost loop (None: not a representative step, not observed)."""
        try:
            self._observe_acceptance(outs, drafts)
            if self._step_observer is not None and self._speculation and seconds is not None:
                self._observe_step(outs, seconds)
        except Exception:
            log.warning("step observers failed", exc_info=True)
        produced = self._deliver_outs_locked(outs)
        try:
            if produced:
                self._throughput.add(produced)
                metrics.TOKENS.inc(produced)
            if time.monotonic() - self._snapshot_at > 0.1:
                self._snapshot_locked()
        except Exception:
            log.warning("step accounting failed", exc_info=True)
        return produced

    def _deliver_outs_locked(self, outs: Sequence[StepOutput]) -> int:
        """Hands a committed step's outputs to their chunks; returns the tokens delivered. Each output
        is delivered on its own: a fault while handling one fails that chunk (its stream ends in an
        error and the scheduler runs it again from its committed output) and no other."""
        produced = 0
        for out in outs:
            act = self._active.get(out.request_id)
            if act is None or act.done:
                continue  # aborted between the step and now
            try:
                self._deliver_locked(act, out)
            except Exception as e:
                log.error("delivering a step's output failed; failing its chunk", exc_info=True,
                          extra=kv(request_id=out.request_id))
                # The engine has gone on with tokens the chunk's stream may lack: it cannot continue.
                self._engine_abort_locked(out.request_id)
                self._fail_locked(act, e)
                continue
            produced += len(out.token_ids)
        return produced

    def _on_step_failure_locked(self, error: Exception) -> None:
        """A failed step changed nothing in the engine (Engine.step is exception-safe), so one
        failure is retried: a transient error (an allocation failure, say) then costs no chunk its
        progress. A second failure in a row looks for the request(s) whose presence makes the step
        fail (_isolate_locked) and fails only those; the others keep their progress. Chunks whose
        request the engine dropped (a failure while committing aborts the step's requests) fail at
        once."""
        self._step_failures += 1
        self._fail_dropped_locked(error)
        if self._step_failures < _MAX_STEP_FAILURES:
            log.warning("engine step failed; retrying it", exc_info=True, extra=kv(chunks=len(self._active)))
            return
        self._step_failures = 0
        log.error("engine step failed again; looking for the chunks that make it fail", exc_info=True,
                  extra=kv(chunks=len(self._active)))
        self._isolate_locked(error)

    def _fail_dropped_locked(self, error: Exception) -> None:
        """Fails the chunks whose request the engine no longer has (a step that fails while
        committing aborts every request in it, Engine.step): no later step would ever end them. The
        scheduler runs them again from their committed output."""
        for act in [a for a in self._active.values() if not a.done and not self._engine_has(a.job.request_id)]:
            self._fail_locked(act, error)

    def _isolate_locked(self, error: Exception) -> None:
        """Steps the running chunks in smaller and smaller groups until every group either steps
        or is one chunk that fails alone (adaptive group testing: about 2 log2(n) steps for one
        culprit among n, at most 2n - 1 when every step fails). A fault that follows a request
        (input the engine cannot run) then fails that request's chunk only.

        The Engine interface has no pause: a chunk is taken out of the engine by aborting its
        request and put back by adding it again after the tokens it has delivered (a resumed
        request: a re-prefill, mostly from the prefix cache). Sampling at an output position
        depends only on (seed, position), so a seeded chunk produces the same tokens as if it had
        never left. Runs under the engine lock (new chunks wait): a rare path, bounded in steps."""
        suspects = [a for a in self._active.values() if not a.done]
        for act in suspects:
            self._engine_abort_locked(act.job.request_id)
        culprits: list[tuple[_Active, Exception]] = []  # chunks that fail alone, with their failure
        engine_stepped = False  # a step succeeded meanwhile: the engine runs other requests
        if len(suspects) == 1:
            culprits.append((suspects[0], error))
        groups: deque[list[_Active]] = deque([suspects] if len(suspects) > 1 else [])
        while groups:
            group = [a for a in groups.popleft() if not a.done]
            if not group:
                continue
            failed, group_error, stepped = self._try_group_locked(group)
            engine_stepped = engine_stepped or stepped
            if len(failed) == 1:
                culprits.append((failed[0], group_error or error))
            elif failed:
                mid = len(failed) // 2
                groups.appendleft(failed[mid:])
                groups.appendleft(failed[:mid])
        if culprits:
            self._fail_culprits_locked(culprits, engine_stepped)
        # A step that failed while committing aborts every request in it, also chunks of groups
        # that had passed the test.
        self._fail_dropped_locked(error)
        log.info("engine step failure isolated", extra=kv(suspects=len(suspects), failed=len(culprits)))

    def _fail_culprits_locked(self, culprits: list[tuple[_Active, Exception]], engine_stepped: bool) -> None:
        """Fails the chunks that fail alone, saying whose fault it is. The scheduler counts a
        worker's own failures (INTERNAL) towards quarantining it, a request's (INVALID_ARGUMENT)
        only towards that request's attempts. When no step succeeded meanwhile (one chunk ran, or
        every chunk failed alone), the culprits all carry the fault (siblings of one prompt the
        engine cannot run) or the engine is broken (a CUDA fault corrupts the context, a device is
        gone) and every later chunk would fail the same way: a canary request, run alone in the
        now empty engine, tells the two apart."""
        broken: Exception | None = None
        if not engine_stepped:
            broken = self._canary_locked()
            if broken is not None:
                self._set_engine_health_locked(False, broken)
        for act, e in culprits:
            if broken is not None:
                self._fail_locked(act, e)
                continue
            log.error("a chunk makes every engine step fail while the engine runs others; failing it", exc_info=e,
                      extra=kv(request_id=act.job.request_id, group_id=act.job.group_id))
            self._fail_locked(act, InvalidArgument(
                f"the engine cannot run this request: every step it is in fails, alone, while the engine "
                f"runs others ({type(e).__name__}: {e})"))

    def _canary_locked(self) -> Exception | None:
        """Runs a one-token greedy request of a fixed short prompt (alone in the engine after an
        isolation); None when it produced its token, else the failure. Other requests' outputs of
        the same steps (an engine in another process keeps running its requests) are delivered as
        usual: dropped, their chunks would miss tokens."""
        req = GenerateRequest(request_id=_CANARY_ID, prompt_token_ids=_CANARY_PROMPT, max_new_tokens=1,
                              sampling=SamplingParams(temperature=0.0, ignore_eos=True))
        self._canary_running = True
        if _CANARY_ID in self._orphans:
            self._engine_abort_locked(_CANARY_ID)
        try:
            self.engine.add_request(req)
            # By time, not steps: a step of an engine that runs in another process (SGLang) returns
            # nothing while the token is on its way, where the reference engine's produces it.
            deadline = time.monotonic() + _CANARY_TIMEOUT_S
            while time.monotonic() < deadline:
                outs = self.engine.step(None)
                others = [o for o in outs if o.request_id != _CANARY_ID]
                if others:
                    self._after_step_locked(others, {}, None)
                    if any(o.token_ids for o in others):
                        # Another request got tokens: the engine works (with a full batch, the
                        # canary would wait its turn and time out on a working engine).
                        return None
                for out in outs:
                    if out.request_id != _CANARY_ID:
                        continue
                    if out.token_ids:
                        return None
                    if out.finished:  # given up on (SGLang: a failed generate)
                        return RuntimeError("the engine aborted the canary request")
            return RuntimeError(f"the canary request produced no token in {_CANARY_TIMEOUT_S:g} s")
        except Exception as e:
            return e
        finally:
            self._canary_running = False
            self._engine_abort_locked(_CANARY_ID)

    def _on_engine_abort_locked(self, group: str) -> None:
        """An engine whose step never raises (SGLang: a failed generate comes back as an aborted
        request) gives the isolation above nothing to work on. Chunks of _ENGINE_ABORT_GROUPS
        different groups given up on with no token in between (groups: siblings share a prompt
        the engine may refuse) run the canary; if the engine gives up on that too, it is broken
        (NOT_SERVING, as after an isolation)."""
        self._engine_abort_groups.add(group)
        if self._canary_running or not self.engine_healthy or len(self._engine_abort_groups) < _ENGINE_ABORT_GROUPS:
            return
        self._engine_abort_groups.clear()
        # Not here: this runs while a step's outputs are being delivered, and the canary's steps
        # deliver newer tokens of the other requests, which would overtake the rest of this step's.
        self._canary_due = True

    def _run_due_canary_locked(self) -> None:
        """The canary _on_engine_abort_locked asked for, once the step's outputs are delivered."""
        self._canary_due = False
        broken = self._canary_locked()
        if broken is not None:
            self._set_engine_health_locked(False, broken)

    def on_engine_health(self, listener: Callable[[bool], None]) -> None:
        """Calls listener(engine_healthy) now and at every change (under the engine lock: keep it
        short, e.g. setting a gRPC health status)."""
        with self._locked():
            # An engine already broken (before the worker's first step) would otherwise be reported
            # SERVING for good: the scheduler places no chunk on a worker registered broken, so no
            # step ever runs to notice it, and no liveness probe would restart the process.
            self._note_engine_broken_locked("at start")
            with self._listeners_lock:
                self._health_listeners = [*self._health_listeners, listener]
            listener(self.engine_healthy)

    def remove_engine_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Undoes on_engine_health(listener), every time it was added (equal bound methods match).
        Without the engine lock: a step hung in a dead engine must not hold up a stop. A change
        being notified at that moment may still call it once."""
        with self._listeners_lock:
            self._health_listeners = [x for x in self._health_listeners if x != listener]

    def engine_health(self) -> EngineHealth:
        """The engine's state for the scheduler's heartbeat, without the engine lock (the heartbeat
        must not wait for a step). Broken as soon as Engine.broken says so (one attribute read),
        even before the step loop saw it; failing while engine_healthy is False for a reason a
        token mends."""
        broken = self._broken_reason or self.engine.broken or ""
        if broken:
            return EngineHealth(broken=broken)
        return EngineHealth(failing="" if self.engine_healthy else (self._failing_reason or "the engine is failing"))

    def _note_engine_broken_locked(self, when: str) -> bool:
        """Whether the engine says it is broken (Engine.broken); if so, health NOT_SERVING for good
        (nothing but a restart mends it), with a log line naming the reason."""
        reason = self.engine.broken
        if reason is None:
            return False
        self._broken_reason = reason
        if self.engine_healthy:
            log.error("the engine is broken; health NOT_SERVING until the worker restarts",
                      extra=kv(when=when, reason=reason))
            self._set_engine_health_locked(False, logged=True)
        return True

    def _set_engine_health_locked(self, healthy: bool, error: Exception | None = None, logged: bool = False) -> None:
        if healthy == self.engine_healthy:
            return
        if healthy and self.engine.broken is not None:
            return  # a token from a broken engine (Engine.broken) mends nothing: it stays NOT_SERVING
        # The reason before the flag: a heartbeat reading both without the lock never sees the
        # engine failing with no reason.
        self._failing_reason = ("" if healthy else "the engine is broken" if error is None
                                else f"the chunks failed and a canary request too: {error}")
        self.engine_healthy = healthy
        metrics.ENGINE_HEALTHY.set(1 if healthy else 0)
        if healthy:
            log.info("the engine produces tokens again; healthy")
        elif not logged:
            log.error("the engine is broken, not a request (the chunks failed and a canary request too); health "
                      "NOT_SERVING until a chunk gets a token", extra=kv(error=str(error)))
        for listener in self._health_listeners:
            try:
                listener(healthy)
            except Exception:
                log.warning("engine health listener failed", exc_info=True)

    def _try_group_locked(self, group: list[_Active]) -> tuple[list[_Active], Exception | None, bool]:
        """Puts `group` back into the engine and steps until each of its chunks has stepped once
        (the engine may admit them over several steps); the chunks cleared before stay in the
        batch. Returns the chunks of the group that had not stepped when a step failed (taken out
        of the engine again) and that failure, or ([], None) when the group stepped; and whether
        any engine step succeeded."""
        pending: dict[str, _Active] = {}
        for act in group:
            if act.job.request_id in self._orphans:
                self._engine_abort_locked(act.job.request_id)
            try:
                self.engine.add_request(self._resume_request(act))
            except Exception as e:  # cannot even be admitted again: this chunk alone
                self._fail_locked(act, e)
                continue
            pending[act.job.request_id] = act
        idle = 0
        stepped_once = False
        while pending and idle < _MAX_IDLE_PROBE_STEPS:
            try:
                outs = self.engine.step(None)
            except Exception as e:
                for rid in pending:
                    self._engine_abort_locked(rid)
                return list(pending.values()), e, stepped_once
            stepped_once = True
            self._after_step_locked(outs, {}, None)  # re-prefills: no step time for the planner
            stepped = [o.request_id for o in outs if o.request_id in pending]
            for rid in stepped:
                del pending[rid]
            for rid in [rid for rid, a in pending.items() if a.done]:
                del pending[rid]  # aborted meanwhile
            idle = 0 if stepped else idle + 1
        # Left pending: the engine did not schedule them (no free pages, say). They stay in; if
        # they are what fails, the next failures find them.
        return [], None, stepped_once

    @staticmethod
    def _resume_request(act: _Active) -> GenerateRequest:
        """The engine request that continues `act` after the tokens it has delivered."""
        job = act.job
        return GenerateRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            max_new_tokens=job.max_new_tokens - act.generated,
            sampling=job.sampling,
            output_token_ids=job.output_token_ids + tuple(act.tokens),
            group_id=job.group_id,
            prompt_key=job.prompt_key,
            group_size=job.group_size,  # as sent: 0 = unknown
            is_probe=job.is_probe,
            dispatch_epoch=job.dispatch_epoch,
            submit_seq=job.submit_seq,
            policy_version=job.policy_version,  # an engine that registers the group itself sends it
        )

    def _engine_has(self, request_id: str) -> bool:
        try:
            self.engine.request_tokens(request_id)
        except KeyError:
            return False
        return True

    def _plan_drafts_locked(self) -> dict[str, Draft]:
        """Drafts for the next step; {} on any fault (speculation is optional, and a fault of the
        drafter must not count as an engine step failure)."""
        try:
            return self._plan_drafts_inner_locked()
        except Exception:
            log.warning("draft planning failed; stepping without drafts", exc_info=True)
            return {}

    def _plan_drafts_inner_locked(self) -> dict[str, Draft]:
        if self._draft is None:
            return {}
        acts = [a for a in self._active.values() if not a.done]
        if not acts:
            return {}
        if self._planner is not None:
            lengths = dict(self._planner.plan([(a.job.request_id, a.job.is_probe) for a in acts]))
        else:
            lengths = {a.job.request_id: self._gamma_max for a in acts}
        # Multi-path drafts (top-k branches at forks) only pay when the batch is small: in the
        # long tail the step is memory-bound and extra verified nodes are nearly free (Seer 4.3).
        width = self._draft_width if len(acts) <= self._multipath_max_batch else 1
        drafts: dict[str, Draft] = {}
        for a in acts:
            rid = a.job.request_id
            n = min(int(lengths.get(rid, 0)), self._gamma_max)
            # Never draft past the chunk's limit: the bonus token always comes on top.
            n = min(n, a.job.max_new_tokens - a.generated - 1)
            if n <= 0:
                continue
            try:
                context = self.engine.request_tokens(rid)
                d = self._draft.propose(a.job.group_id, rid, context, n, width)
            except Exception:
                log.warning("draft proposal failed", exc_info=True, extra=kv(request_id=rid))
                continue
            if d is not None and d.tokens and self._draft_valid_locked(a, d):
                drafts[rid] = d
        return drafts

    def _draft_valid_locked(self, act: _Active, d: Draft) -> bool:
        """Whether d may go to the engine. The engine refuses a whole step over one bad draft
        (ValueError), which would cost every other request of the batch its draft; a bad one is
        dropped here instead, alone. The drafter keeps proposing it step after step, so it is
        counted every time but logged once per chunk, without a traceback (it is bad data, not a
        fault of ours)."""
        try:
            d.validate(self.engine.vocab_size)
        except ValueError as e:
            self._invalid_drafts += 1
            metrics.INVALID_DRAFTS.inc()
            if not act.bad_draft_logged:
                act.bad_draft_logged = True
                log.warning("invalid draft dropped; the request steps without it (logged once per chunk)",
                            extra=kv(request_id=act.job.request_id, group_id=act.job.group_id, error=str(e)))
            return False
        return True

    def _observe_acceptance(self, outs: Sequence[StepOutput], drafts: Mapping[str, Draft]) -> None:
        if not drafts:
            return
        proposed = [0] * self._gamma_max
        accepted = [0] * self._gamma_max
        per_request: list[tuple[str, int, int]] = []  # (request id, depth verified, accepted)
        for out in outs:
            d = drafts.get(out.request_id)
            if d is None:
                continue
            used = out.num_draft_tokens  # the engine may trim a draft to what the request can emit
            if used <= 0:
                continue
            depth = max(draft_depths(Draft(d.tokens[:used], d.parents[:used]))) + 1
            for i in range(min(depth, len(proposed))):
                proposed[i] += 1
            for i in range(min(out.num_accepted, len(accepted))):
                accepted[i] += 1
            per_request.append((out.request_id, depth, out.num_accepted))
        old_p, old_a = self._pos_counts
        self._pos_counts = (  # one assignment: a reader sees the old pair or the new one
            tuple(x + y for x, y in zip_longest(old_p, proposed, fillvalue=0)),
            tuple(x + y for x, y in zip_longest(old_a, accepted, fillvalue=0)))
        for i, (p, a) in enumerate(zip(proposed, accepted, strict=True)):
            if p:
                metrics.PROPOSED.labels(position=str(i)).inc(p)
            if a:
                metrics.ACCEPTED.labels(position=str(i)).inc(a)
        if self._planner is not None:
            try:
                self._planner.observe(proposed, accepted)
                # Each request's own outcome too, where the planner takes it: acceptance differs
                # strongly per request (RL: a response backed by the previous iteration's history
                # accepts nearly everything, a sibling drafting from weak matches nearly nothing),
                # and one batch-wide alpha kept drafting off for both at B = 4.
                if self._request_observer is not None:
                    for rid, depth, acc in per_request:
                        self._request_observer(rid, depth, acc)
            except Exception:
                log.warning("planner.observe failed", exc_info=True)

    def _planner_forget_locked(self, request_id: str) -> None:
        """The chunk ended here (finished, aborted or failed): the planner drops the request's own
        acceptance (a next chunk may run on another worker; memory stays bounded by the batch)."""
        if self._request_forget is None:
            return
        try:
            self._request_forget(request_id)
        except Exception:
            log.warning("planner.forget_request failed", exc_info=True, extra=kv(request_id=request_id))

    def _observe_step(self, outs: Sequence[StepOutput], seconds: float) -> None:
        """Step time to the planner (plan, drafts and verify), for decode steps only: a step that
        prefilled (a chunk's first step) costs far more and says nothing about drafting."""
        live = [a for a in self._active.values() if not a.done]
        if not outs or len(outs) != len(live):
            return  # a request did not step (prefilling in parts, or waiting for KV)
        for out in outs:
            act = self._active.get(out.request_id)
            if act is None or act.generated == 0 or not out.token_ids:
                return
        assert self._step_observer is not None
        try:
            self._step_observer(len(outs), sum(len(o.token_ids) for o in outs), seconds)
        except Exception:
            log.warning("planner.observe_step failed", exc_info=True)

    def _deliver_locked(self, act: _Active, out: StepOutput) -> None:
        job = act.job
        st = act.stats
        st.steps += 1
        st.draft_tokens += out.num_draft_tokens
        st.accepted_tokens += out.num_accepted
        if out.token_ids:
            offset = act.offset
            act.tokens.extend(out.token_ids)
            act.events.put(TokensEvent(list(out.token_ids), list(out.logprobs)))
            if self._draft is not None:
                complete = out.finished and self._response_complete(act, out)
                try:
                    self._draft_append_locked(job, offset, out.token_ids, complete)
                except Exception:
                    log.warning("draft append failed", exc_info=True, extra=kv(request_id=job.request_id))
        if out.finished:
            finish = self._finish_reason(act, out)
            if finish == ChunkFinish.ABORTED:
                # Not one of ours: those end the chunk in _abort_locked, and the engine forgets the
                # request. The engine gave up on it (SGLang reports a failed generate so), which is a
                # failed attempt: an ABORTED chunk is no failure to the scheduler (it aborts chunks
                # itself), so an engine that gives up on everything would cost nothing and be fed
                # for ever.
                self._fail_locked(act, RuntimeError("the engine aborted the request (a failed generate)"))
                self._on_engine_abort_locked(job.group_id or job.request_id)
                return
            self._finish_locked(act, finish)
        if out.token_ids:
            # A chunk got a token: the engine works (not merely a step that did not raise: an
            # engine in another process, SGLang, never raises).
            self._engine_abort_groups.clear()
            if not self.engine_healthy:
                self._set_engine_health_locked(True)

    def _response_complete(self, act: _Active, out: StepOutput) -> bool:
        return self._finish_reason(act, out) in (ChunkFinish.STOP, ChunkFinish.LENGTH)

    @staticmethod
    def _finish_reason(act: _Active, out: StepOutput) -> ChunkFinish:
        if out.finish_reason == FinishReason.STOP:
            return ChunkFinish.STOP
        if out.finish_reason == FinishReason.ABORTED:
            return ChunkFinish.ABORTED
        # The engine says LENGTH when this call's max_new_tokens is reached: the request is
        # complete only if that was also its total limit.
        job = act.job
        total_limit = job.max_tokens or (len(job.output_token_ids) + job.max_new_tokens)
        return ChunkFinish.LENGTH if act.offset >= total_limit else ChunkFinish.CHUNK

    def _finish_locked(self, act: _Active, finish: ChunkFinish, *, at_once: bool = False) -> None:
        """The one place a chunk ends with a finish. at_once: a chunk that never reached the
        engine (_end_at_once: its response was complete), so it is not in _active, and the draft
        group learns the response finished, as a STOP / LENGTH step's append tells it."""
        if act.done:
            return
        act.done = True
        job = act.job
        act.stats.wall_seconds = time.monotonic() - act.started
        if not at_once:
            self._active.pop(job.request_id, None)
            self._planner_forget_locked(job.request_id)
        try:
            if at_once:
                self._draft_finish_at_once_locked(job)
            else:
                self._draft_end_locked(job)
            metrics.IN_FLIGHT.set(len(self._active))
            metrics.CHUNKS.labels(finish=finish.value).inc()
            if self._kv is not None:
                if finish == ChunkFinish.CHUNK and self._kv_offload:
                    self._offload_locked(act)
                elif finish in (ChunkFinish.STOP, ChunkFinish.LENGTH):
                    # The response is over: its stored pages go.
                    with self._offloaded_lock:
                        self._offloaded.pop(job.request_id, None)
                    self._release(job)
        except Exception:
            # Bookkeeping and optimizations (drafts, metrics, the KV pool): the chunk itself is
            # complete and off the worker, so it must still end, or its stream would wait forever.
            log.warning("chunk end bookkeeping failed", exc_info=True, extra=kv(request_id=job.request_id))
        act.events.put(DoneEvent(finish, act.stats, self._policy_version))
        self._wake.notify_all()  # LoadWeights waits for the drain
        if at_once:
            log.warning("chunk resumes a complete response; ended at once with no tokens", extra=kv(
                request_id=job.request_id, seq=job.seq, finish=finish.value, output=len(job.output_token_ids),
                max_tokens=job.max_tokens))
            return
        log.info("chunk done", extra=kv(request_id=job.request_id, group_id=job.group_id, seq=job.seq,
                                        finish=finish.value, tokens=act.generated, steps=act.stats.steps,
                                        accepted=act.stats.accepted_tokens,
                                        wall=round(act.stats.wall_seconds, 4)))

    def _fail_locked(self, act: _Active, error: Exception) -> None:
        if act.done:
            return
        act.done = True
        self._active.pop(act.job.request_id, None)
        self._planner_forget_locked(act.job.request_id)
        try:
            self._draft_end_locked(act.job)
            metrics.IN_FLIGHT.set(len(self._active))
        except Exception:
            log.warning("chunk end bookkeeping failed", exc_info=True, extra=kv(request_id=act.job.request_id))
        act.events.put(ErrorEvent(error))
        self._wake.notify_all()

    # -- the KV pool -------------------------------------------------------------------------

    def _fetch_kv(self, prefix: tuple[int, ...], admission: _Admission) -> KVPages | None:
        """Pulls the prefix pages this engine lacks from the pool (outside the engine lock). Stops
        when the chunk is aborted or its caller gone meanwhile (its pages would go unused: _start
        ends an aborted chunk, the RunChunk handler releases one whose stream ended)."""
        assert self._kv is not None
        with self._locked():
            have = self.engine.cached_prefix_tokens(prefix)
            layout = self.engine.kv_layout
            version = self.engine.model_version
        if len(prefix) - have < layout.page_size:
            return None  # nothing a full page could add
        try:
            return self._kv.fetch_prefix(prefix, version, layout, min_tokens=have,
                                         cancelled=admission.gone)
        except Exception:
            # The pool is an optimization: recompute rather than fail the chunk.
            log.warning("kv fetch failed; recomputing the prefix", exc_info=True)
            return None

    def _attaches(self, pages: KVPages, prefix: tuple[int, ...]) -> bool:
        """Whether the engine still caches the pages before pages.first_page (engine lock held)."""
        return self.engine.cached_prefix_tokens(prefix) >= pages.first_page * pages.layout.page_size

    def _import_kv(self, pages: KVPages, prefix: tuple[int, ...], stats: ChunkStats) -> None:
        before = self.engine.cached_prefix_tokens(prefix)
        try:
            self.engine.import_kv(pages)
        except ValueError:
            log.warning("kv import rejected; recomputing the prefix", exc_info=True)
            return
        after = self.engine.cached_prefix_tokens(prefix)
        stats.kv_loaded_tokens = max(0, after - before)
        self._kv_loaded_tokens += stats.kv_loaded_tokens

    def offloaded_pages(self, request_id: str) -> int:
        """Prefix pages of request_id known to be in the KV pool (offloaded or fetched here)."""
        with self._offloaded_lock:
            version, n = self._offloaded.get(request_id, ("", 0))
        return n if version == self.engine.model_version else 0

    def _mark_offloaded(self, request_id: str, version: str, end_page: int, start_page: int = 0) -> None:
        """Pages [start_page, end_page) of request_id are (being) stored. If the mark is below
        start_page (an earlier offload failed meanwhile and was unmarked), it stays there: jumping
        to end_page would hide the gap for good."""
        with self._offloaded_lock:
            old_version, old = self._offloaded.pop(request_id, ("", 0))
            old = old if old_version == version else 0
            self._offloaded[request_id] = (version, max(end_page, old) if old >= start_page else old)
            while len(self._offloaded) > _MAX_OFFLOAD_MARKS:
                self._offloaded.popitem(last=False)

    def _lower_offloaded(self, request_id: str, page: int, version: str | None = None) -> None:
        """request_id's stored chain is known only up to `page`: the mark goes down to it (never
        up). With a version, only a mark of that version: an offload of pages from `page` on did
        not land, and the next one starts there again (a mark of another version is another
        chain). Without: the chain is cut there whatever its version."""
        with self._offloaded_lock:
            cur = self._offloaded.get(request_id)
            if cur is not None and (version is None or cur[0] == version) and cur[1] > page:
                self._offloaded[request_id] = (cur[0], page)

    def _offload_locked(self, act: _Active) -> None:
        assert self._kv is not None
        job = act.job
        start = self.offloaded_pages(job.request_id)
        try:
            # Export under the lock (the engine may evict the pages after the next step), and only
            # the pages not in the pool yet; the transfer itself runs in the KV client's threads.
            pages = self.engine.export_kv(job.prompt_token_ids + job.output_token_ids + tuple(act.tokens), start)
        except Exception:
            log.warning("kv export failed", exc_info=True, extra=kv(request_id=job.request_id))
            return
        if not pages.pages:
            return
        self._send_offload_locked(job.request_id, pages)

    def _send_offload_locked(self, request_id: str, pages: KVPages) -> None:
        """Queues pages of request_id for the store and raises its watermark; a failed or partial
        offload lowers it again (_offload_done)."""
        assert self._kv is not None
        try:
            fut = self._kv.offload_async(pages, request_id)
        except Exception:
            log.warning("kv offload failed", exc_info=True, extra=kv(request_id=request_id))
            return
        self._mark_offloaded(request_id, pages.model_version, pages.end_page, pages.first_page)
        self._offloads.add(fut)
        version, first = pages.model_version, pages.first_page
        fut.add_done_callback(lambda f: self._offload_done(f, request_id, version, first))

    def _offload_done(self, fut: Future[Any], request_id: str, version: str, first_page: int) -> None:
        self._offloads.discard(fut)
        exc = fut.exception()
        if exc is not None:
            log.warning("kv offload failed: %s", exc, extra=kv(request_id=request_id))
            self._lower_offloaded(request_id, first_page, version)
            return
        res: PutResult = fut.result()
        missing = res.first_unstored
        if missing is not None:
            # Dropped (queue full), or a replica failed: the next offload of this request exports
            # again from the first page the store lacks (it only takes the missing ones), instead of
            # leaving a gap that would end every later fetch of this prefix there.
            log.info(
                "kv offload incomplete; resending from the first missing page",
                extra=kv(request_id=request_id, page=first_page + missing, dropped=res.dropped),
            )
            self._lower_offloaded(request_id, first_page + missing, version)

    def _release(self, job: ChunkJob) -> None:
        kv_pool, bg = self._kv, self._bg
        assert kv_pool is not None and bg is not None
        version, rid = self.engine.model_version, job.request_id
        with self._releases:
            if self._releases_pending >= _MAX_PENDING_RELEASES:
                self._releases_dropped += 1
                log.warning("kv release dropped: too many queued (store slow or down)",
                            extra=kv(request_id=rid, pending=self._releases_pending,
                                     dropped=self._releases_dropped))
                return
            self._releases_pending += 1

        def settled() -> None:
            with self._releases:
                self._releases_pending -= 1
                self._releases.notify_all()

        def release() -> None:
            try:
                kv_pool.release(version, rid)
            except Exception:
                log.warning("kv release failed", exc_info=True, extra=kv(request_id=rid))
            finally:
                settled()

        try:
            bg.submit(release)
        except RuntimeError:  # closed meanwhile: nothing sends it
            settled()

    # -- the draft server --------------------------------------------------------------------

    def _register_group(self, job: ChunkJob) -> None:
        if self._draft is None or not job.group_id:
            return
        # Every chunk registers its attempt: the registration carries this attempt's dispatch
        # epoch, by which the draft server tells a new run under a reused group id (a resubmitted
        # batch id: the same prompt, group and request ids) from the completed old one. Called for
        # a group known here too (local; the client sends RegisterGroup again only when the group
        # may have completed on the server): a mirror still following the old run's group would
        # take the new run's chunk into it. It carries the chunk's policy version too (the version
        # checked admissible here: the one served), the group's history iteration on the draft
        # server, so groups of one prompt key at one version merge into one iteration; the mirror
        # keeps its run's first one (DraftClient.register_attempt).
        draft = self._draft
        # All under the engine lock (the draft client's calls here are local and short): released
        # after the lock, an evicted group's mirror could be dropped just after another chunk
        # of that group registered it again, leaving that chunk without drafts or appends.
        with self._locked():
            # The draft client may have released the mirror on its own (the server expired the
            # group while nothing of it ran here): then register it again.
            known = job.group_id in self._registered_groups and draft.has_group(job.group_id)
            if known:
                self._registered_groups.move_to_end(job.group_id)
                try:
                    draft.register_attempt(job.group_id, job.prompt_key, job.prompt_token_ids, job.group_size,
                                           int(self._group_ttl), request_id=job.request_id, epoch=job.dispatch_epoch,
                                           submit_seq=job.submit_seq, policy_version=job.policy_version)
                except Exception:
                    log.warning("draft register_attempt failed", exc_info=True)
                return
            self._registered_groups[job.group_id] = None
            try:
                # Least recently started first, but never a group with a chunk running here: its
                # mirror is what the running request drafts from and appends to.
                busy = {a.job.group_id for a in self._active.values()}
                for gid in list(self._registered_groups):
                    if len(self._registered_groups) <= _MAX_GROUPS:
                        break
                    if gid not in busy and gid != job.group_id:
                        del self._registered_groups[gid]
                        draft.release_group(gid)
                # group_size as sent (0 = unknown: the draft server then never completes the group
                # on its own). Registered as 1 before session 27, such a group completed at its first finish, and
                # with dispatch epochs every later request started a new run.
                draft.register_attempt(job.group_id, job.prompt_key, job.prompt_token_ids, job.group_size,
                                       int(self._group_ttl), request_id=job.request_id, epoch=job.dispatch_epoch,
                                       submit_seq=job.submit_seq, policy_version=job.policy_version)
            except Exception:
                # Drafting degrades to nothing for this group; generation itself is unaffected.
                log.warning("draft register_attempt failed", exc_info=True)
                self._registered_groups.pop(job.group_id, None)

    def _draft_resume_locked(self, job: ChunkJob) -> None:
        """The request's response in the draft index becomes exactly its committed output.

        Resuming from the committed output is the truth: a failed or cancelled attempt of this
        chunk may have streamed further tokens into the draft index, and the re-dispatched chunk
        samples and verifies with the same (seed, position) randomness, so a draft made of those
        tokens would bias the output (the engine's verification is lossless only for drafts
        independent of its random numbers). Earlier chunks that ran elsewhere are filled in (a gap
        would make the later appends invalid). Also for an empty output: the failed attempt may
        have been the first chunk.
        """
        if self._draft is None or not job.group_id:
            return
        try:
            # Each call names the chunk's attempt (dispatch epoch, submission): two attempts of a
            # request may overlap in the mirror and end in any order.
            self._draft.resume(job.group_id, job.request_id, job.output_token_ids, epoch=job.dispatch_epoch,
                               submit_seq=job.submit_seq)
        except Exception:
            log.warning("draft resume failed", exc_info=True, extra=kv(request_id=job.request_id))

    def _draft_finish_at_once_locked(self, job: ChunkJob) -> None:
        """A chunk ending at once on a complete output (_end_at_once): the response in the draft
        index becomes its committed output, finished, as a STOP / LENGTH step's append makes it
        (_deliver_locked), under this attempt's epoch; then the chunk is over for the mirror. The
        resume, the finishing append at the output's full length (no tokens) and the end happen in
        one engine-lock section, as for a chunk that ran."""
        if self._draft is None or not job.group_id:
            return
        self._draft_resume_locked(job)
        try:
            self._draft_append_locked(job, len(job.output_token_ids), (), True)
        except Exception:
            log.warning("draft append failed", exc_info=True, extra=kv(request_id=job.request_id))
        self._draft_end_locked(job)

    def _draft_end_locked(self, job: ChunkJob) -> None:
        if self._draft is None or not job.group_id:
            return
        try:
            self._draft.end(job.group_id, job.request_id, epoch=job.dispatch_epoch, submit_seq=job.submit_seq)
        except Exception:
            log.warning("draft end failed", exc_info=True, extra=kv(request_id=job.request_id))

    def _draft_append_locked(self, job: ChunkJob, offset: int, token_ids: Sequence[int], finished: bool) -> None:
        """The chunk's tokens to the draft source, named by its attempt (an abandoned attempt's late
        tokens are dropped there, not sent as a newer one's)."""
        if self._draft is not None:
            self._draft.append(job.group_id, job.request_id, offset, token_ids, finished,
                               epoch=job.dispatch_epoch, submit_seq=job.submit_seq)


def _position_counts(es: EngineStats, own: tuple[Sequence[int], Sequence[int]]) -> tuple[list[int], list[int]]:
    """(proposed, accepted) per draft position for WorkerStats: the engine's pair when it keeps
    both (one snapshot), else the worker's own pair `own` (one consistent read); never one list
    of each, which need not agree (accepted above proposed, or other lengths)."""
    proposed, accepted = list(es.proposed_per_position), list(es.accepted_per_position)
    if proposed and accepted:
        return proposed, accepted
    return list(own[0]), list(own[1])


def _newer(epoch: int, than: int) -> bool:
    """Whether dispatch epoch `epoch` orders after `than` (0 = unordered: never newer, nor older)."""
    return bool(epoch and than and epoch > than)


def _replace(job: ChunkJob, **changes: object) -> ChunkJob:
    import dataclasses

    return dataclasses.replace(job, **changes)  # type: ignore[arg-type]

