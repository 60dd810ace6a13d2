"""The scheduler's dispatch loop: buffer work feed -> SchedulerCore -> worker chunks -> buffer commits.

Threads (DESIGN.md sections 2-3):
- watch: consumes BufferInternalService.WatchWork. A (re)connect delivers a snapshot of every
  unfinished request that replaces our state, except that chunks in flight stay in flight (their
  commits are retried until the buffer is back; CommitChunk is idempotent by (request, seq)).
- dispatch: asks the core for dispatches and runs each chunk on a pool thread: RunChunk on the
  worker, collect the stream, CommitChunk, then core.on_chunk_done. A worker stream error means the
  worker died mid-chunk: nothing of the chunk was committed, so the same seq is dispatched again
  from the last committed prefix (nothing lost, nothing duplicated).
- liveness: a worker silent for 3 heartbeat intervals is removed and its chunks re-queued.

A chunk past chunk_timeout is aborted on its worker and re-dispatched alone (the worker stays). A
request whose chunk fails MAX_CHUNK_ATTEMPTS times for its own reasons is failed in the buffer with
an ABORTED commit, so its batch still completes. Every dispatch has a token: a chunk whose request
moved on (worker removed, request re-queued or cancelled) is never committed and never settles the
request's next dispatch; the in-flight counters (and their gauge) come down exactly once per dispatch.

The policy decisions live in services.scheduler.core (pure); this module only drives it. Every
core call happens under one lock: the core is single-threaded by design.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from seer.v1 import buffer_pb2, common_pb2, scheduler_pb2, worker_pb2

from services.common.chunkstats import ChunkStats
from services.common.errors import (
    Aborted,
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
from services.common.telemetry import Counter, Gauge, context_from, tracer
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore, chunk_stats_problem, telemetry_problem
from services.scheduler.core.types import Dispatch, RequestInfo, WorkerSpec
from services.scheduler.epochs import EpochClock
from services.scheduler.links import BufferLink, Cancelled, DeadlineExceeded, WorkerLink
from services.scheduler.worker_errors import clip, worker_errors_text

log = get_logger(__name__)

PENDING = Gauge("seer_scheduler_pending_requests", "requests waiting for a chunk dispatch")
IN_FLIGHT = Gauge("seer_scheduler_in_flight_chunks", "chunks running on workers")
DISPATCHED = Counter("seer_scheduler_dispatched_chunks", "chunks dispatched to workers")
REDISPATCHED = Counter("seer_scheduler_redispatched_chunks", "chunks that failed and were queued again")
COMMITTED_TOKENS = Counter("seer_scheduler_committed_tokens", "tokens committed to the buffer")
WORKERS = Gauge("seer_scheduler_workers", "registered workers")
# 0 while workers are registered means none serves: each is catching up (or retrying a failed
# catch-up load), ahead of the suite's version, awaiting a weight switch's end, quarantined,
# draining or its engine broken. Read at scrape time (Dispatcher._serving_workers): a quarantine is
# also lifted inside the core (after sane telemetry), where no gauge would be set.
SERVING = Gauge("seer_scheduler_serving_workers",
                "registered workers chunks can be placed on: at the suite's policy version, not quarantined, "
                "not draining, engine not broken")
# Registered workers whose heartbeat says their engine is broken for good (excluded from
# seer_scheduler_serving_workers until they restart), and those whose engine is failing now
# (transient: still placed on, so still counted serving). Read at scrape time, like SERVING.
ENGINE_BROKEN = Gauge("seer_scheduler_engine_broken_workers",
                      "registered workers whose engine is broken until they restart (HeartbeatRequest.engine_broken): "
                      "no chunk is placed there")
ENGINE_FAILING = Gauge("seer_scheduler_engine_failing_workers",
                       "registered workers whose engine is failing now (HeartbeatRequest.engine_failing; transient, "
                       "still placed on)")
WORKER_TPS = Gauge("seer_scheduler_worker_tokens_per_second", "tokens/s reported by a worker", ["worker_id"])
WORKER_ACCEPT = Gauge(
    "seer_scheduler_worker_draft_acceptance", "accepted / proposed draft tokens reported by a worker", ["worker_id"]
)

# A chunk that fails this many times in a row for reasons other than a worker dying is dropped
# (logged as an error) rather than retried forever; the buffer is told with an ABORTED commit so the
# batch still completes.
MAX_CHUNK_ATTEMPTS = 8
# How long a chunk refused for a full worker (RESOURCE_EXHAUSTED: no stream slot) keeps its slot
# reserved before it is placed again.
_BUSY_BACKOFF_S = 0.2
# Threads of the abort-commit pool; the chunk pool without a dispatch_threads cap (a bound only a
# runaway would reach: threads start on demand).
_ABORT_THREADS = 16
_UNCAPPED_THREADS = 1 << 16
# Prompt keys remembered as having no history at the buffer (Dispatcher._history_unknown).
_HISTORY_UNKNOWN_KEYS = 65_536


@dataclass(frozen=True)
class Resync:
    """A committed-but-unconfirmed chunk (the commit was a duplicate or refused) waiting for a fresh
    snapshot. `token` is the dispatch it belongs to: only that dispatch may be resolved by it."""

    token: int
    worker: WorkerState
    old_len: int  # output length before the chunk
    chunk_len: int
    max_new: int
    # The chunk ended the response (its finish reason is not CHUNK): only then does a snapshot that
    # no longer lists the request mean that this chunk finished it.
    final: bool = False


@dataclass
class TrackedRequest:
    """Our copy of a buffer request: its spec and the committed output so far."""

    item: buffer_pb2.WorkItem
    output: list[int]
    next_seq: int
    # The dispatch currently running it (None = queued in the core); a token guards against a
    # stale chunk thread committing after its worker was removed and the request moved on.
    dispatch_token: int | None = None
    worker_id: str = ""
    stream: object | None = None
    attempts: int = 0
    dropped: bool = False
    # Set while a committed-but-unconfirmed chunk waits for a fresh snapshot (no thread owns it).
    resync: Resync | None = None
    # RunChunkRequest.dispatch_epoch of its latest dispatch (_chunk_request).
    last_epoch: int = 0
    # time.monotonic() of the buffer's latest acknowledgement of one of our commits (_apply_snapshot).
    acked_at: float = 0.0
    # Its dispatch's chunk is being committed (_commit, until the dispatch is released): a snapshot
    # that no longer lists the request may have been taken after that commit finished it.
    committing: bool = False


@dataclass
class WorkerState:
    worker_id: str
    address: str
    link: WorkerLink
    capacity: scheduler_pb2.WorkerCapacity
    engine: str
    policy_version: int
    last_seen: float
    telemetry: scheduler_pb2.WorkerTelemetry = field(default_factory=scheduler_pb2.WorkerTelemetry)
    in_flight: int = 0
    active: bool = False  # added to the core (after any catch-up weight load)
    spec: WorkerSpec | None = None
    incarnation: str = ""  # RegisterWorkerRequest.incarnation ("" = unknown)
    # Registered (or caught up) while a weight switch was in progress: it is brought to the
    # switch's outcome when the switch ends, not activated on the version being replaced.
    await_switch: bool = False
    # Its catch-up loop runs (_catch_up, set from its first check to its last). A worker takes one
    # load at a time and refuses a second with FAILED_PRECONDITION, so a weight switch drains these
    # before loading, and no second catch-up of the same registration starts a load.
    catching_up: bool = False
    # Its last heartbeat said it is stopping (HeartbeatRequest.draining).
    draining: bool = False
    # Why its engine is broken until the worker restarts (HeartbeatRequest.engine_broken or
    # RegisterWorkerRequest's; "" = not broken). Sticky for this registration: a broken engine is
    # never mended, and a heartbeat without the field (a draining notice) must not undo it.
    engine_broken: str = ""
    # The last heartbeat's HeartbeatRequest.engine_failing (transient; shown, not acted upon).
    engine_failing: str = ""


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    address: str
    healthy: bool
    quarantined: bool
    in_flight_chunks: int
    telemetry: scheduler_pb2.WorkerTelemetry
    draining: bool = False
    quarantine_reason: str = ""  # why it is quarantined ("" when trusted)
    engine_broken: str = ""  # why its engine is broken for good ("" when it is not): not placed on
    engine_failing: str = ""  # why its engine is failing now (transient: still placed on)


@dataclass(frozen=True)
class SchedulerStats:
    policy: str
    pending_requests: int
    in_flight_chunks: int
    dispatched_chunks: int
    redispatched_chunks: int
    workers: list[WorkerView]
    policy_version: int | None = None


class Dispatcher:
    def __init__(
        self,
        cfg: SchedulerConfig,
        buffer_link: Callable[[str], BufferLink] = BufferLink,
        worker_link: Callable[[str], WorkerLink] = WorkerLink,
    ) -> None:
        self.cfg = cfg
        self.core = SchedulerCore(cfg.policy_config())
        self._buffer_link_factory = buffer_link
        self._worker_link_factory = worker_link
        self._buffer: BufferLink | None = buffer_link(cfg.buffer_address) if cfg.buffer_address else None
        self._cond = threading.Condition(threading.RLock())
        self._requests: dict[str, TrackedRequest] = {}
        self._workers: dict[str, WorkerState] = {}
        # Prompt keys the buffer had no history for when last asked, most recent last (a new
        # prompt's members can arrive in several feed messages: one GetHistory for them, not one per
        # message). Bounded: it held every distinct prompt ever seen. Keys with history are not
        # kept here: the core holds those (and drops the least used beyond history_max_prompts, to
        # be asked for again when the prompt comes back).
        self._history_unknown: OrderedDict[str, None] = OrderedDict()
        self.core.on_history_recorded = self._history_recorded
        # Requests we gave up on (failed in the buffer with an ABORTED commit, or meant to be): a
        # snapshot that still lists one gets the abort again instead of tracking it (the core has
        # settled it and would never run it). Forgotten once the buffer no longer lists it.
        # request_id -> the submit_seq of the request given up on.
        self._abandoned: dict[str, int] = {}
        self._aborting: set[str] = set()  # those whose abort commit is being sent now
        # worker_id -> quarantine reason of a quarantined worker taken out of the core (removed,
        # re-registered, recycled for its version): applied again when it is activated, so that
        # registering again is no way out of quarantine.
        self._quarantine_carry: dict[str, str] = {}
        self._in_flight = 0
        self._dispatched = 0
        self._redispatched = 0
        self._next_token = 0
        self._epochs = EpochClock(cfg.epoch_file)
        self._dirty = True
        self._paused = False
        self._stopping = threading.Event()
        self._resync = threading.Event()
        self._stream: object | None = None
        self._version: int | None = None
        # Highest policy version among work items: the suite's version when this scheduler has not
        # seen a switch itself (it restarted after one); the buffer only admits batches at it.
        self._seen_version: int | None = None
        self._source = ""
        # One thread per running chunk (its RunChunk stream). Threads start on demand, so without a
        # cap the workers' batch slots (the core's admission) bound them. Abort commits (each may
        # retry up to commit_timeout) have their own pool: on a chunk's thread they would keep it
        # busy after its dispatch stopped counting in flight.
        self._pool = ThreadPoolExecutor(max_workers=cfg.dispatch_threads or _UNCAPPED_THREADS,
                                        thread_name_prefix="chunk")
        self._abort_pool = ThreadPoolExecutor(max_workers=_ABORT_THREADS, thread_name_prefix="abort")
        self._threads: list[threading.Thread] = []
        self._tracer = tracer("seer.scheduler")
        self.watcher_id = f"scheduler-{uuid.uuid4().hex[:8]}"
        # One dispatcher per process: the newest one is what the gauge reads (weakly: a test's
        # closed dispatcher is not kept alive by it).
        this = weakref.ref(self)
        SERVING.set_function(lambda: float(d._serving_workers()) if (d := this()) is not None else 0.0)
        ENGINE_BROKEN.set_function(
            lambda: float(d._count_workers(lambda w: bool(w.engine_broken))) if (d := this()) is not None else 0.0)
        ENGINE_FAILING.set_function(
            lambda: float(d._count_workers(lambda w: bool(w.engine_failing and not w.engine_broken)))
            if (d := this()) is not None else 0.0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = [
            ("dispatch", self._dispatch_loop),
            ("liveness", self._liveness_loop),
        ]
        if self._buffer is not None:
            targets.append(("watch", self._watch_loop))
        for name, target in targets:
            t = threading.Thread(target=target, name=f"scheduler-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            streams = [r.stream for r in self._requests.values() if r.stream is not None]
            self._cond.notify_all()
        self._cancel(self._stream)
        for s in streams:
            self._cancel(s)
        for t in self._threads:
            t.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._abort_pool.shutdown(wait=True, cancel_futures=True)  # after the chunks: they may add aborts
        with self._cond:
            for w in self._workers.values():
                w.link.close()
        if self._buffer is not None:
            self._buffer.close()

    @staticmethod
    def _cancel(stream: object | None) -> None:
        cancel = getattr(stream, "cancel", None)
        if callable(cancel):
            with contextlib.suppress(Exception):
                cancel()

    def _wake(self) -> None:
        with self._cond:
            self._wake_locked()

    def _wake_locked(self) -> None:
        """Something the dispatch loop decides on changed (work, workers, in-flight counts): it
        decides again."""
        self._dirty = True
        self._cond.notify_all()

    # ---- workers -----------------------------------------------------------------------------

    def register_worker(
        self,
        worker_id: str,
        address: str,
        capacity: scheduler_pb2.WorkerCapacity,
        engine: str,
        policy_version: int,
        incarnation: str = "",
        engine_broken: str = "",
    ) -> float:
        """engine_broken: RegisterWorkerRequest.engine_broken (see _note_engine_broken_locked)."""
        if not worker_id:
            raise InvalidArgument("must not be empty", field="worker_id")
        _check_address(address)
        if policy_version < 0:
            # Versions are >= 0 (SwitchWeights refuses others): a negative one would read as behind
            # every version and start a catch-up load of the suite's version at once.
            raise InvalidArgument(f"must be >= 0, got {policy_version}", field="policy_version")
        _check_capacity(capacity)
        spec = WorkerSpec(worker_id, capacity.total_kv_pages, capacity.page_size, capacity.max_batch_size,
                          max_context=capacity.max_context)
        spec.validate()
        stale: WorkerState | None = None
        with self._cond:
            old = self._workers.get(worker_id)
            if (
                old is not None
                and incarnation
                and old.incarnation == incarnation
                and old.address == address
                and old.spec == spec
                and old.policy_version == policy_version
            ):
                # The same worker process reconnecting (its Registrar registers again after any
                # failed Heartbeat RPC): its chunks in flight keep running, its quarantine stays.
                old.last_seen = time.monotonic()
                old.engine = engine
                self._note_engine_broken_locked(old, engine_broken)
                reconnected = True
            else:
                reconnected = False
        if reconnected:
            log.info("worker reconnected", extra=kv(worker_id=worker_id, address=address, incarnation=incarnation))
            return self.cfg.heartbeat_interval
        with self._cond:
            if worker_id in self._workers:
                # A restarted worker (or one that cannot say it is the same process) registers
                # again: whatever ran on its old incarnation is gone.
                stale = self._remove_worker_locked(worker_id, reason="re-registered")
            link = self._worker_link_factory(address)
            state = WorkerState(worker_id, address, link, capacity, engine, policy_version, time.monotonic(),
                                spec=spec, incarnation=incarnation)
            self._workers[worker_id] = state
            # Before any activation below: a broken worker must not be placed on in between.
            self._note_engine_broken_locked(state, engine_broken)
            target = self._catch_up_target_locked()
            needs_load = target is not None and policy_version < target[0]
            ahead = target is not None and policy_version > target[0]
            switching = self._paused
            if switching:
                # A weight switch is in progress: the version it replaces is about to be stale and
                # this worker is not among those it loads. Activated now, it would be placed on and
                # refuse (or run at the old version) chunks of the new version, each costing the
                # request an attempt, then be recycled. The switch's end catches it up instead.
                state.await_switch = True
                needs_load = ahead = False
            elif not needs_load and not ahead:
                self._activate_locked(state, spec)
        if stale is not None:
            stale.link.close()
        log.info("worker registered", extra=kv(worker_id=worker_id, address=address, engine=engine,
                                                 policy_version=policy_version, catch_up=needs_load,
                                                 awaits_weight_switch=switching))
        if ahead:
            # Its chunks would be refused (a batch's tokens all come from the batch's version) and
            # weights cannot be loaded backwards: it serves once the suite switches to its version.
            log.error("worker is ahead of the suite's policy version; not placing chunks on it",
                      extra=kv(worker_id=worker_id, policy_version=policy_version,
                               suite_version=target[0] if target else None))
        if needs_load:
            self._start_catch_up(state)
        return self.cfg.heartbeat_interval

    def _catch_up_target_locked(self) -> tuple[int, str] | None:
        """(version, weights source) a worker behind must load; None when the version is unknown."""
        if self._version is not None:
            return self._version, self._source
        if self._seen_version is not None:
            # Only work items told the version (a buffer that sends no policy event): its source is
            # unknown, so the worker reloads its own weights under it, as before policy events.
            return self._seen_version, ""
        return None

    def _activate_locked(self, state: WorkerState, spec: WorkerSpec) -> None:
        state.await_switch = False
        self.core.add_worker(spec)
        reason = self._quarantine_carry.pop(state.worker_id, "")
        if reason:
            log.warning("worker registered again while quarantined; it stays quarantined",
                        extra=kv(worker_id=state.worker_id, reason=reason))
            self.core.quarantine_worker(state.worker_id, reason, offence=False)  # not a new offence
        if state.draining:  # it said so while inactive (catching up on weights): still no placement
            self.core.set_draining(state.worker_id, True)
        if state.engine_broken:  # the same for an engine it said is broken
            self.core.set_engine_broken(state.worker_id, state.engine_broken)
        state.active = True
        WORKERS.set(len(self._workers))
        self._wake_locked()

    def _start_catch_up(self, state: WorkerState) -> None:
        threading.Thread(target=self._catch_up, args=(state,), daemon=True).start()

    def _catch_up(self, state: WorkerState) -> None:
        """An inactive worker behind the suite's policy version loads it, then serves. The target
        (version and weights source, read together under the lock) is re-read after each load: a
        switch or the buffer's policy may have moved it meanwhile.

        `catching_up` is held from the first check to the last, and cleared under the lock in the
        same critical section that decides to stop: a switch ending between two loads must see the
        loop as running (it goes on to the switch's version itself), and one ending after the loop
        parked the worker for it must see it as parked (the switch's end resumes it)."""
        with self._cond:
            if state.catching_up:
                return  # a catch-up of this registration runs: it re-reads the target after its load
            state.catching_up = True
        delay = self.cfg.catch_up_retry_initial
        attempt = 0
        try:
            while True:
                with self._cond:
                    step = self._catch_up_step_locked(state)
                    if step is None:
                        self._end_catch_up_locked(state)
                        return
                    version, source = step
                attempt += 1
                log.info("worker catching up", extra=kv(worker_id=state.worker_id, version=version,
                                                        source=source or "(reload)", attempt=attempt))
                try:
                    state.link.load_weights(version, source, timeout=self.cfg.drain_timeout)
                except (SeerError, ValueError) as e:  # ValueError: its link was closed (worker removed)
                    # Retried in place after a doubling delay; the worker stays registered (listed
                    # unhealthy) and keeps serving nothing until a load succeeds. It used to be
                    # dropped: its next heartbeat was answered "unknown", it registered again at
                    # once and failed again, hundreds of times a minute for as long as the source
                    # was bad. A removal, re-registration or switch ends the wait early.
                    log.warning("catch-up weight load failed; retrying",
                                extra=kv(worker_id=state.worker_id, version=version, source=source or "(reload)",
                                         attempt=attempt, retry_in_s=delay, error=str(e)))
                    target = (version, source)
                    with self._cond:
                        self._cond.wait_for(lambda t=target: self._catch_up_wait_over_locked(state, t),  # type: ignore[misc]
                                            timeout=delay)
                    delay = min(delay * 2, self.cfg.catch_up_retry_max)
                    continue
                delay, attempt = self.cfg.catch_up_retry_initial, 0
                with self._cond:
                    if self._workers.get(state.worker_id) is state and not state.active:
                        state.policy_version = max(state.policy_version, version)
        except BaseException:
            with self._cond:
                self._end_catch_up_locked(state)
            raise

    def _catch_up_wait_over_locked(self, state: WorkerState, target: tuple[int, str]) -> bool:
        """A failed catch-up stops waiting for its retry: stopping, the worker gone or replaced, a
        switch started (it drains catch-ups and would wait for this one's delay), its engine broken
        (the catch-up parks), or the target moved (the buffer's policy, or a switch that ended)."""
        return (
            self._stopping.is_set()
            or self._workers.get(state.worker_id) is not state
            or state.active
            or self._paused
            or bool(state.engine_broken)
            or self._catch_up_target_locked() != target
        )

    def _catch_up_step_locked(self, state: WorkerState) -> tuple[int, str] | None:
        """The (version, source) the catch-up loads next, or None when it stops here."""
        if self._stopping.is_set() or self._workers.get(state.worker_id) is not state or state.active \
                or state.spec is None:
            return None  # stopping, gone, or a weight switch activated it meanwhile
        if self._paused:
            # A switch is in progress: its target is not the version to activate on; the switch's
            # end resumes this catch-up (_take_awaiting_switch_locked).
            state.await_switch = True
            return None
        target = self._catch_up_target_locked()
        if target is None or state.policy_version > target[0]:
            return None  # unknown version, or ahead: a later switch to its version activates it
        if state.policy_version == target[0]:
            self._activate_locked(state, state.spec)
            return None
        if state.engine_broken:
            # Parked: its engine can load nothing until the worker restarts, and each load failed
            # INTERNAL and was retried for good (8 loads in 3 s at short delays). A restart
            # registers a new incarnation (a new WorkerState) that catches up from the start.
            log.warning("worker engine broken; not loading weights to catch it up until it restarts",
                        extra=kv(worker_id=state.worker_id, version=target[0], reason=state.engine_broken))
            return None
        return target

    def _end_catch_up_locked(self, state: WorkerState) -> None:
        state.catching_up = False
        self._cond.notify_all()  # a switch may be waiting for the catch-ups to end

    def _recycle_stale_worker(self, w: WorkerState, version: int) -> None:
        """Take a worker behind the batch's version out of placement until it has caught up."""
        with self._cond:
            if self._workers.get(w.worker_id) is not w or not w.active or w.spec is None:
                return
            w.policy_version = min(w.policy_version, version - 1)  # it said so: behind `version`
            self._remove_worker_locked(w.worker_id, reason=f"policy version behind {version}")
            w.active, w.in_flight = False, 0
            self._workers[w.worker_id] = w
        self._start_catch_up(w)

    def heartbeat(self, worker_id: str, telemetry: scheduler_pb2.WorkerTelemetry | None, draining: bool = False,
                  incarnation: str = "", engine_broken: str = "", engine_failing: str = "") -> bool:
        """draining: the worker is stopping (HeartbeatRequest.draining): no new chunk goes there; its
        chunks in flight run on. Every heartbeat carries it, so a worker activated later (a catch-up)
        has it applied by its next one. telemetry None: no report (a draining notice sent without
        reading the engine); the last one stands. incarnation: the sending process's; one that is
        not the registration's (an old process of the same worker id, still draining beside its
        replacement) is answered unknown and changes nothing, or it would mark the new process
        draining and overwrite its telemetry.

        A report the core finds impossible (workers.telemetry_problem) quarantines the worker and is
        otherwise dropped: the listing (WorkerInfo.telemetry) and the gauges keep the last trusted
        report, and WorkerInfo.quarantine_reason says why the worker is quarantined. Before, the
        rejected figures were shown and exported as the worker's (an acceptance of 7.0 from accepted
        > proposed). A worker not yet in the core (catching up on weights) has its report checked by
        the same rule against its registered capacity, and an impossible one is dropped the same
        way (logged; it cannot be quarantined before the core knows it, and its first report once
        active is checked there).

        engine_broken / engine_failing: HeartbeatRequest's (see _note_engine_broken_locked and
        _note_engine_failing_locked). engine_failing is taken only from a heartbeat with telemetry:
        one without (the draining notice) leaves it as it was."""
        if not worker_id:
            raise InvalidArgument("must not be empty", field="worker_id")
        trusted = False
        with self._cond:
            state = self._workers.get(worker_id)
            if state is None:
                return False
            if incarnation and state.incarnation and incarnation != state.incarnation:
                return False
            state.last_seen = time.monotonic()
            state.draining = draining
            self._note_engine_broken_locked(state, engine_broken)
            if telemetry is not None:
                # A heartbeat without telemetry is the draining notice (or an old worker's): it
                # may not have read the engine, so its empty engine_failing says nothing. Taken
                # as "mended", it logged a false recovery that flapped back at the next heartbeat.
                self._note_engine_failing_locked(state, engine_failing)
            report = _telemetry_report(telemetry) if telemetry is not None else None
            if state.active:
                self.core.set_draining(worker_id, draining)
                if report is not None:
                    trusted = self.core.update_worker(worker_id, **report)
                self._wake_locked()
            elif report is not None and state.spec is not None:
                problem = _report_problem(state.spec, report)
                trusted = not problem
                if problem:
                    log.warning("impossible telemetry from a worker not yet serving; report dropped",
                                extra=kv(worker_id=worker_id, reason=problem))
            if telemetry is not None and trusted:
                state.telemetry.CopyFrom(telemetry)
                # Under the lock: a removal between this report and the gauges (which removes the
                # worker's series) must not leave a series behind for a worker that is gone.
                WORKER_TPS.labels(worker_id).set(telemetry.tokens_per_second)
                proposed = sum(telemetry.proposed_per_position)
                if proposed:
                    WORKER_ACCEPT.labels(worker_id).set(sum(telemetry.accepted_per_position) / proposed)
        return True

    def _note_engine_broken_locked(self, state: WorkerState, reason: str) -> None:
        """The worker says its engine is broken until it restarts: no new chunk goes there from now
        on, as for a draining worker (the chunks in flight end as they end: they fail INTERNAL, or
        finish if the engine still runs them). Before, the scheduler kept placing chunks there
        until the failures quarantined it, each costing a request an attempt, while the worker
        waited out its orchestrator's grace period (60 s) before a restart. Sticky for this
        registration: "" (a worker that predates the field, or a draining notice sent without it)
        clears nothing; a restarted worker registers as a new WorkerState. Logged once."""
        if not reason or state.engine_broken:
            return
        state.engine_broken = reason
        log.error("worker engine broken; placing no new chunk on it until it restarts",
                  extra=kv(worker_id=state.worker_id, reason=reason, in_flight=state.in_flight))
        if state.active:
            self.core.set_engine_broken(state.worker_id, reason)
            self._wake_locked()  # a hold on it moves, and queued chunks go elsewhere now
        else:
            self._cond.notify_all()  # a catch-up waiting to retry a failed load parks now

    def _note_engine_failing_locked(self, state: WorkerState, reason: str) -> None:
        """The worker's engine is failing now (transient: healthy again when a chunk gets a token).
        Shown (WorkerInfo.engine_failing, seer_scheduler_engine_failing_workers) and logged at each
        change, but placement is left alone: excluded, the worker would never get the chunk whose
        token mends it (it would only wait for its restart). Its failed chunks already count
        towards quarantining it (SchedulerCore.on_worker_fault), and the probation after a
        quarantine lets one chunk at a time through: that chunk is the re-probe, and a worker
        still failing costs one attempt, not a batch."""
        if reason == state.engine_failing:
            return
        if reason:
            log.warning("worker engine failing (chunks and a canary request failed); still placing chunks on it: "
                        "one that gets a token mends it", extra=kv(worker_id=state.worker_id, reason=reason))
        else:
            log.info("worker engine no longer failing", extra=kv(worker_id=state.worker_id))
        state.engine_failing = reason

    def _remove_worker_locked(self, worker_id: str, reason: str) -> WorkerState | None:
        state = self._workers.pop(worker_id, None)
        if state is None:
            return None
        # Its per-worker series go with it: worker ids churn (a pod name per restart under
        # Kubernetes), and every id ever seen stayed exported with its last figures.
        for gauge in (WORKER_TPS, WORKER_ACCEPT):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)
        if state.active:
            quarantined = self.core.quarantine_reason(worker_id)
            if quarantined:
                self._quarantine_carry[worker_id] = quarantined
        requeued = self.core.remove_worker(worker_id) if state.active else []
        # Chunks still streaming from it are cut off; their threads see the request moved on. A
        # chunk held for resync is given up too: the core re-queued it, and the snapshot must not
        # resolve the request's next dispatch with this chunk's outcome (the dispatch's token
        # changes, so a late commit or resolution of this one is dropped).
        for r in self._requests.values():
            if r.worker_id == worker_id and r.dispatch_token is not None:
                self._cancel(r.stream)
                self._release_locked(r, None)
                self._redispatched += 1
                REDISPATCHED.inc()
        WORKERS.set(len(self._workers))
        self._wake_locked()
        log.warning("worker removed", extra=kv(worker_id=worker_id, reason=reason, requeued=len(requeued)))
        return state

    def _release_locked(self, r: TrackedRequest, w: WorkerState | None) -> None:
        """The request's dispatch is over (done, failed, moved or parked): it no longer counts in
        flight. `w` is the worker state it ran on (None = the worker was removed)."""
        r.dispatch_token, r.worker_id, r.stream, r.resync = None, "", None, None
        r.committing = False
        if w is not None:
            w.in_flight -= 1
        self._in_flight -= 1
        IN_FLIGHT.set(self._in_flight)
        PENDING.set(self.core.pending_count())

    def _liveness_loop(self) -> None:
        limit = 3 * self.cfg.heartbeat_interval
        while not self._stopping.wait(self.cfg.heartbeat_interval / 2):
            now = time.monotonic()
            gone: list[WorkerState] = []
            with self._cond:
                for wid, w in list(self._workers.items()):
                    if now - w.last_seen > limit:
                        state = self._remove_worker_locked(wid, reason="missed heartbeats")
                        if state is not None:
                            gone.append(state)
            for w in gone:
                w.link.close()

    # ---- weight switch -----------------------------------------------------------------------

    def switch_weights(self, version: int, source: str) -> tuple[int, float]:
        """Pause dispatch, wait for in-flight chunks, load `version` on every worker, resume."""
        if version < 0:
            raise InvalidArgument(f"must be >= 0, got {version}", field="version")
        t0 = time.monotonic()
        with self._cond:
            if self._paused:
                raise Aborted("another weight switch is in progress")
            self._paused = True
            self._cond.notify_all()  # a catch-up waiting to retry a failed load stops for the switch
        try:
            deadline = t0 + self.cfg.drain_timeout
            with self._cond:
                # Running catch-up loads are drained too: a worker takes one load at a time and
                # refuses a second (FAILED_PRECONDITION), so loading it now would drop it. Each
                # catch-up stops after its current load (it sees the pause) and the worker is
                # loaded below with the others.
                while self._in_flight > 0 or any(w.catching_up for w in self._workers.values()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if self._in_flight > 0:
                            raise FailedPrecondition(f"{self._in_flight} chunks still in flight after drain timeout")
                        break  # only catch-ups still loading: they are left to themselves (below)
                    self._cond.wait(min(left, 0.5))
                workers, loading, broken = [], [], []
                for w in self._workers.values():
                    if w.engine_broken:
                        # Its engine can load nothing until the worker restarts: the load would
                        # fail INTERNAL, not as a refusal, so a switch to a bad source that every
                        # healthy worker refused read as "outcome unknown" and dropped them all.
                        # Left as it is (placed on by nothing); its restart registers a new
                        # incarnation, which catches up to whatever version this switch leaves.
                        broken.append(w.worker_id)
                    elif w.catching_up:
                        # Its catch-up load outlasted the drain: the catch-up ends in the paused
                        # check (await_switch) or, if it outlasts the switch, loads the switch's
                        # outcome itself.
                        w.await_switch = True
                        loading.append(w.worker_id)
                    else:
                        workers.append(w)
                if loading and not workers:
                    # Nobody could be asked: nothing switched and the source is unchecked, so
                    # it must not become the suite's version (the catch-ups would then load it).
                    raise FailedPrecondition(f"every worker is still loading weights to catch up ({loading}); "
                                             f"retry the switch to version {version}", field="version")
            errors: dict[str, str] = {}
            refused: set[str] = set()  # workers that refused the load (they loaded nothing)
            bad_source: set[str] = set()  # of those, the ones that refused it as INVALID_ARGUMENT naming source

            def load(w: WorkerState) -> None:
                try:
                    w.link.load_weights(version, source, timeout=self.cfg.drain_timeout)
                except SeerError as e:
                    errors[w.worker_id] = str(e)
                    if isinstance(e, (InvalidArgument, FailedPrecondition, NotFound)):
                        refused.add(w.worker_id)
                    if isinstance(e, InvalidArgument) and e.field == "source":
                        bad_source.add(w.worker_id)
                except ValueError as e:
                    # Its link was closed under the load (the worker was removed meanwhile): it did
                    # not confirm the version, so it must not count as loaded.
                    errors[w.worker_id] = f"link closed: {e}"

            # Each load runs in a copy of this context, so the trace of the caller (trainer ->
            # buffer -> SwitchWeights) continues into every worker's LoadWeights.
            threads = [
                threading.Thread(target=contextvars.copy_context().run, args=(load, w), daemon=True) for w in workers
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # Every worker asked refused the load (a bad source, say): each loaded nothing and still
            # serves the version in force, so nothing switched and nobody is dropped. Dropping them
            # left the suite with no worker, and the next switch was then adopted unchecked.
            all_refused = bool(workers) and refused == set(errors) and len(errors) == len(workers)
            with self._cond:
                if len(errors) < len(workers) or not workers:
                    # An empty source relabels the current weights: a worker catching up later
                    # must still load the directory they came from.
                    self._version, self._source = version, source or self._source
                for w in workers:
                    if w.worker_id not in errors:
                        w.policy_version = version
                        if not w.active and w.spec is not None and self._workers.get(w.worker_id) is w:
                            self._activate_locked(w, w.spec)  # it was waiting to catch up: done
                # A worker that could not load the version while others did (or whose outcome is
                # unknown: a deadline, a lost connection) must not serve it: drop it (it can
                # register again and catch up). Only the registration that was asked to load: one
                # that registered again meanwhile (a new state) awaits the switch's end instead.
                dropped = [] if all_refused else [
                    w for w in workers if w.worker_id in errors and self._workers.get(w.worker_id) is w]
                for w in dropped:
                    self._remove_worker_locked(w.worker_id, reason="weight load failed")
            for w in dropped:
                w.link.close()  # as every removal does: its channel would stay open for good
            if errors and len(errors) == len(workers):
                # none: the weights in force, relabelled; clipped, as each worker's error is (the
                # status's details are bounded by gRPC's metadata limit).
                from_source = f" from {clip(repr(source))}" if source else ""
                if all_refused:
                    # Nothing switched, the version in force is unchanged and every worker serves
                    # it. A refusal, so the buffer keeps the old version in force instead of
                    # holding submissions.
                    log.warning("every worker refused the weight load; the version in force is unchanged",
                                extra=kv(version=version, source=source, version_in_force=self._version,
                                         errors=errors))
                    if bad_source == set(errors):
                        # Every worker found the source itself bad (no such directory, not a
                        # checkpoint): the caller's argument, named as such (the trainer catches
                        # INVALID_ARGUMENT on `source`, not a precondition on `version`).
                        raise InvalidArgument(
                            f"no worker could load version {version}{from_source}: "
                            f"{worker_errors_text(errors, InvalidArgument.code_name, 'source')}", field="source")
                    raise FailedPrecondition(
                        f"no worker loaded version {version}{from_source}: "
                        f"{worker_errors_text(errors, FailedPrecondition.code_name, 'version')}", field="version")
                # A deadline or a lost connection: a worker may still be loading, and may come back
                # on the new version. The outcome is unknown (the buffer holds submissions until
                # the update is retried).
                raise Unavailable(f"no worker confirmed loading version {version}{from_source}: "
                                  f"{worker_errors_text(errors, Unavailable.code_name, None)}")
            loaded = len(workers) - len(errors)
            seconds = time.monotonic() - t0
            if not workers and broken:
                # As with no worker registered (below): the version is in force, unchecked, and
                # nothing serves it until a worker restarts and catches up to it. Refusing it
                # would make the buffer keep the old version in force, which no worker serves
                # either (every one is broken), and the next switch would face the same.
                log.warning("weights switched with every registered worker's engine broken: no worker loaded it; "
                            "each loads it to catch up once it restarts",
                            extra=kv(version=version, source=source, broken=broken))
            elif not workers:
                # Accepted (workers that register later catch up to it), but nothing checked the
                # source and nothing serves it until one does: the listing shows no healthy worker.
                log.warning("weights switched with no worker registered: no worker loaded it; workers that "
                            "register later load it to catch up", extra=kv(version=version, source=source))
            else:
                log.info("weights switched", extra=kv(version=version, workers=loaded, seconds=round(seconds, 3),
                                                      skipped_broken=broken))
            return loaded, seconds
        finally:
            with self._cond:
                self._paused = False
                waiting = self._take_awaiting_switch_locked()
                self._wake_locked()
            for w in waiting:
                self._start_catch_up(w)  # to the version the switch left (its new one, or the old)

    def _take_awaiting_switch_locked(self) -> list[WorkerState]:
        """Workers that registered (or finished a catch-up) during the switch that just ended: each
        is caught up to the version it left, then activated."""
        # One still catching up is left to its running loop, which re-reads the target after its
        # load (another catch-up of it would only return at once).
        waiting = [w for w in self._workers.values() if w.await_switch and not w.active and not w.catching_up]
        for w in waiting:
            w.await_switch = False
        return waiting

    # ---- work feed ---------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        assert self._buffer is not None
        backoff = 0.1
        while not self._stopping.is_set():
            snapshot: list[buffer_pb2.WorkItem] = []
            in_snapshot = True
            try:
                opened_at = time.monotonic()  # the buffer takes the snapshot after this
                stream = self._buffer.watch(self.watcher_id)
                self._stream = stream
                for ev in stream:
                    kind = ev.WhichOneof("event")
                    if kind == "added":
                        if in_snapshot:
                            snapshot.extend(ev.added.items)
                        else:
                            self._add_items(list(ev.added.items))
                    elif kind == "cancelled_request_id":
                        self._cancel_request(ev.cancelled_request_id)
                    elif kind == "policy":
                        self._adopt_policy(ev.policy.version, ev.policy.source)
                    elif kind == "snapshot_done":
                        self._apply_snapshot(snapshot, opened_at)
                        snapshot, in_snapshot, backoff = [], False, 0.1
                        log.info("work feed connected", extra=kv(buffer=self._buffer.address))
            except SeerError as e:
                if not self._stopping.is_set() and not self._resync.is_set():
                    # Log the loss once per outage, not every retry.
                    level = log.info if backoff <= 0.1 else log.debug
                    level("work feed lost; reconnecting", extra=kv(error=str(e)))
            if self._resync.is_set():
                self._resync.clear()
                continue
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)

    def _adopt_policy(self, version: int, source: str) -> None:
        """The buffer's policy (sent first in each snapshot): after a restart this scheduler learns
        the version batches run at and where its weights come from, so a worker that registers
        behind it catches up with the right weights, not its own under a new label."""
        with self._cond:
            if self._version is not None and self._version > version:
                # A switch this scheduler did that the buffer has not recorded yet. Its source is
                # empty only when it relabelled the weights: then they are still the buffer's.
                self._source = self._source or source
                return
            self._version, self._source = version, source or (self._source if self._version == version else "")
            self._cond.notify_all()  # a catch-up waiting to retry a failed load goes for the new target
            behind = [w for w in self._workers.values() if w.active and w.policy_version < version]
        for w in behind:
            self._recycle_stale_worker(w, version)
        if behind:
            log.info("workers behind the buffer's policy; catching them up",
                     extra=kv(version=version, workers=[w.worker_id for w in behind]))

    def _request_resync(self) -> None:
        """Reconnect the work feed: the fresh snapshot corrects any request we lost track of."""
        self._resync.set()
        self._cancel(self._stream)

    def _fetch_history(self, items: list[buffer_pb2.WorkItem]) -> dict[str, list[int]]:
        """History priors (RhymeRL) from the buffer for the items' prompt keys the core holds none
        for: new ones, and ones the core's bound dropped (not those the buffer recently had none for).
        Nothing under a policy that does not use them: the call blocks the watch thread (a whole
        snapshot's keys, up to its timeout while the buffer is slow) for priors no decision reads."""
        if not self.core.cfg.uses_history:
            return {}
        with self._cond:
            keys = sorted({i.prompt_key for i in items if i.prompt_key and i.prompt_key not in self._history_unknown
                           and not self.core.has_history(i.prompt_key)})
        if not keys or self._buffer is None:
            return {}
        try:
            histories = self._buffer.history(keys)
        except SeerError as e:
            log.info("history unavailable", extra=kv(error=str(e)))
            return {}
        found = {h.prompt_key: list(h.lengths) for h in histories if h.lengths}
        with self._cond:
            for key in keys:
                if key not in found:
                    self._history_unknown[key] = None
                    self._history_unknown.move_to_end(key)
            while len(self._history_unknown) > _HISTORY_UNKNOWN_KEYS:
                self._history_unknown.popitem(last=False)
        return found

    def _history_recorded(self, prompt_key: str) -> None:
        """The core holds a history for the key now (its group completed, or the buffer's was set):
        not "unknown" any more, so that once the core's bound drops it, the buffer (which has it by
        then) is asked again. Called by the core, under self._cond."""
        self._history_unknown.pop(prompt_key, None)

    def _info(self, item: buffer_pb2.WorkItem, generated: int) -> RequestInfo:
        return RequestInfo(
            request_id=item.request_id,
            group_id=item.group_id,
            prompt_key=item.prompt_key,
            sample_index=item.sample_index,
            group_size=item.group_size,
            prompt_len=len(item.prompt_token_ids),
            max_tokens=item.max_tokens,
            generated=generated,
            incarnation=item.submit_seq,
        )

    def _add_items(self, items: list[buffer_pb2.WorkItem]) -> None:
        history = self._fetch_history(items)
        aborts: list[buffer_pb2.WorkItem] = []
        with self._cond:
            for item in items:
                if self._still_tracked_locked(item):
                    continue
                abort = self._track_locked(item)
                if abort is not None:
                    aborts.append(abort)
            # After the groups exist (set_history gives a key's live groups their prior): set
            # before, a message with more keys than history_max_prompts dropped its first keys'
            # priors before their groups were added.
            for key, lengths in history.items():
                self.core.set_history(key, lengths)
            self._wake_locked()
        self._send_aborts([(item, item.next_seq) for item in aborts], resync_on_refusal=False)

    def _still_tracked_locked(self, item: buffer_pb2.WorkItem) -> bool:
        """Whether we track this very request. A tracked request of an earlier submission of the
        item's batch id (deleted by retention and submitted again while its cancellation passed us
        by) is dropped here: the item is a new request under the old id."""
        r = self._requests.get(item.request_id)
        if r is None:
            return False
        if r.item.submit_seq == item.submit_seq:
            return True
        log.warning("request id submitted again in a new batch; dropping the old request", extra=kv(
            request_id=item.request_id, old_submit_seq=r.item.submit_seq, submit_seq=item.submit_seq))
        r.dropped = True  # its chunk in flight, if any, is not committed (_commit)
        if r.resync is not None and r.resync.token == r.dispatch_token:
            self._release_locked(r, r.resync.worker)  # a held chunk: no thread settles it now
        else:
            # A chunk still running would hold its batch slot and KV on the worker to the end of
            # the chunk for nothing.
            self._stop_running_chunk_locked(r)
        del self._requests[item.request_id]
        self._forget_in_core_locked(item.request_id)
        return False

    def _stop_running_chunk_locked(self, r: TrackedRequest, *, cancel_stream: bool = True) -> None:
        """Ends the running chunk of a request we no longer want (set `dropped` first: its thread
        then settles the dispatch without committing or counting an attempt). The chunk is aborted
        on the worker by its own dispatch_epoch, not "any attempt" (epoch 0): the id may be
        dispatched again (a new submission of its batch id), and an abort still queued would then
        end that newer attempt on the worker, counted against the request and the worker (review,
        session 25). A dispatch whose thread has not sent the chunk yet has no stream: the thread
        sees `dropped` and sends nothing.

        cancel_stream: also cancel our end of the stream. Without it (a cancel event) the stream
        stays open: the worker ends it ABORTED, or its commit, if it had finished, comes back a
        duplicate."""
        if r.dispatch_token is None or r.stream is None:
            return
        if cancel_stream:
            self._cancel(r.stream)
        worker = self._workers.get(r.worker_id)
        if worker is None:
            return
        # On the abort pool: this runs on the watch thread, and a worker whose server hangs would
        # stall the whole work feed for each stopped request's abort timeout.
        with contextlib.suppress(RuntimeError):  # the pool is shut down: stopping
            self._abort_pool.submit(self._abort_on_worker, worker, r.item.request_id, r.last_epoch)

    def _track_locked(self, item: buffer_pb2.WorkItem) -> buffer_pb2.WorkItem | None:
        """Track a work item. Returns it instead when it must be failed in the buffer (an ABORTED
        commit at its next_seq, sent by the caller outside the lock): a request we gave up on
        that the buffer still lists (the first abort was abandoned or refused), or one the core
        has already settled and would never run (tracked, it would hang its batch)."""
        rid = item.request_id
        if self._abandoned.get(rid, item.submit_seq) != item.submit_seq:
            self._abandoned.pop(rid)  # given up on in an earlier submission of its batch id
        if rid in self._abandoned:
            if rid in self._aborting:
                return None  # its abort is on its way
            self._aborting.add(rid)
            log.warning("a request given up on is still listed; sending its abort again",
                        extra=kv(request_id=rid, seq=item.next_seq))
            return item
        output = list(item.output_token_ids)
        info = self._info(item, min(len(output), item.max_tokens))
        try:
            info.validate()
        except InvalidArgument as e:
            log.error("unschedulable work item", extra=kv(request_id=rid, error=str(e)))
            return None
        try:
            added = self.core.add_request(info)
        except SeerError as e:
            # E.g. a group whose members disagree on group_size: refuse the item, keep the feed.
            log.error("work item refused by the scheduler core", extra=kv(request_id=rid, error=str(e)))
            return None
        if not added:
            log.error("work item already settled by the scheduler core; failing it in the buffer",
                      extra=kv(request_id=rid, seq=item.next_seq, generated=len(output), max_tokens=item.max_tokens))
            self._abandoned[rid] = item.submit_seq
            self._aborting.add(rid)
            return item
        self._requests[rid] = TrackedRequest(item=item, output=output, next_seq=item.next_seq)
        if self._seen_version is None or item.policy_version > self._seen_version:
            self._seen_version = item.policy_version
        return None

    def _apply_snapshot(self, items: list[buffer_pb2.WorkItem], opened_at: float = math.inf) -> None:
        """A fresh snapshot replaces our state; chunks in flight stay in flight.

        opened_at: time.monotonic() when the watch that sent it was opened. The buffer takes the
        snapshot when the watch connects and streams it for as long as that takes (many MB, then
        our history fetch), so a commit it acknowledged after opened_at may be missing from it."""
        history = self._fetch_history(items)
        aborts: list[buffer_pb2.WorkItem] = []
        with self._cond:
            by_id = {i.request_id: i for i in items}
            # A request given up on that the buffer no longer lists is settled there.
            self._abandoned = {rid: seq for rid, seq in self._abandoned.items()
                               if rid in by_id or rid in self._aborting}
            for rid in list(self._requests):
                r = self._requests[rid]
                snap = by_id.get(rid)
                if snap is not None and not self._still_tracked_locked(snap):
                    continue  # an earlier submission's request under a reused batch id: dropped
                if r.resync is not None:
                    if r.resync.token == r.dispatch_token:
                        self._resolve_resync_locked(r, snap)
                        continue
                    r.resync = None  # a stale hold (its dispatch is gone): never resolve another with it
                if r.dispatch_token is not None:
                    if snap is None and not r.committing:
                        # Cancelled while we were away (no cancel event reached us): its chunk
                        # would run to its end for a commit the buffer refuses. Not while its
                        # chunk is being committed: that commit may be what finished it, and the
                        # commit's outcome settles it (a refusal is resolved by a snapshot).
                        log.info("request gone from the buffer while its chunk ran; aborting it",
                                 extra=kv(request_id=rid, worker_id=r.worker_id))
                        r.dropped = True
                        self._stop_running_chunk_locked(r)
                        self._forget_in_core_locked(rid)
                        del self._requests[rid]
                    continue
                if snap is None:
                    # Finished or cancelled while we were away: the buffer is authoritative.
                    self._forget_in_core_locked(rid)
                    del self._requests[rid]
                elif snap.next_seq < r.next_seq and r.acked_at >= opened_at:
                    # Taken before our latest commit was acknowledged: ours is newer. Taken as it
                    # is, it would send the committed chunk again (a conflict, then another resync).
                    continue
                else:
                    if snap.next_seq != r.next_seq or list(snap.output_token_ids) != r.output:
                        r.output, r.next_seq = list(snap.output_token_ids), snap.next_seq
                    # The buffer's count is the truth, up (e.g. a late commit of a chunk the core
                    # re-queued landed) or down (a commit it lost): the core must count what it
                    # holds (KV reservations, estimates, group lengths). Compared with the core's
                    # own count, not with our previous copy: the two could differ, and a core
                    # counting past the response's end finishes a request the buffer still runs.
                    self._resync_core_locked(r)
            for item in items:
                if item.request_id not in self._requests:
                    abort = self._track_locked(item)
                    if abort is not None:
                        aborts.append(abort)
            for key, lengths in history.items():  # after the groups exist (as in _add_items)
                self.core.set_history(key, lengths)
            self._wake_locked()
        # The seq of each abort is the buffer's own next_seq: an abort refused for a stale seq is
        # right this time.
        self._send_aborts([(item, item.next_seq) for item in aborts], resync_on_refusal=False)
        log.info("work snapshot applied", extra=kv(requests=len(items)))

    def _resync_core_locked(self, r: TrackedRequest) -> None:
        rid = r.item.request_id
        try:
            self.core.resync_generated(rid, min(len(r.output), r.item.max_tokens))
        except SeerError as e:
            # Only an inconsistent feed gets here (e.g. an unfinished request at max_tokens): keep
            # applying the rest of the snapshot.
            log.error("could not resync the core's generated count", extra=kv(
                request_id=rid, output=len(r.output), max_tokens=r.item.max_tokens, error=str(e)))

    def _resolve_resync_locked(self, r: TrackedRequest, snap: buffer_pb2.WorkItem | None) -> None:
        """Completes a chunk whose commit outcome we could not trust, from the buffer's own state."""
        assert r.resync is not None
        hold = r.resync
        worker_id, old_len, chunk_len, max_new = hold.worker.worker_id, hold.old_len, hold.chunk_len, hold.max_new
        rid = r.item.request_id
        self._release_locked(r, hold.worker)
        if snap is None:
            del self._requests[rid]
            if hold.final:
                # The buffer no longer lists it and the chunk ended the response: the chunk finished it.
                self.core.on_chunk_done(rid, worker_id, min(chunk_len, max_new), True)
                return
            # A chunk that does not end the response, and the buffer no longer lists the request: it
            # left for another reason (e.g. its batch was cancelled while the feed reconnected, so no
            # cancel event came), with a length we do not know. Recorded as finished at
            # old_len + chunk_len, it would become a made-up length in its group's finished lengths
            # (its siblings' estimate) and in its prompt's history (the next iteration's prior).
            log.info("request gone from the buffer while its chunk waited for resync; forgotten",
                     extra=kv(request_id=rid, worker_id=worker_id, output=old_len, chunk=chunk_len))
            self._forget_in_core_locked(rid)
            return
        r.output, r.next_seq = list(snap.output_token_ids), snap.next_seq
        new_tokens = max(0, min(len(r.output) - old_len, max_new))
        self.core.on_chunk_done(rid, worker_id, new_tokens, False)
        # new_tokens is clamped to the chunk: when the buffer holds fewer tokens than before the
        # chunk (a commit it lost) or more than the chunk added (another dispatch's late commit),
        # the core's count would stay wrong for good (the next snapshot finds our copy equal to the
        # buffer's). Too large, it finished the request in the core while the buffer still listed
        # it: never dispatched again, its batch never completed.
        self._resync_core_locked(r)

    def _forget_in_core_locked(self, request_id: str) -> None:
        """Cancels a request in the core. On the watch thread a NotFound (a request the core already
        forgot, e.g. one re-tracked from a snapshot after it was dropped) must not abort applying
        the rest of the feed, or every reconnect would fail the same way."""
        with contextlib.suppress(NotFound):
            self.core.cancel_request(request_id)

    def _cancel_request(self, request_id: str) -> None:
        with self._cond:
            r = self._requests.pop(request_id, None)
            if r is None:
                return
            r.dropped = True
            self._forget_in_core_locked(request_id)
            if r.resync is not None:
                # Held for resync: no chunk thread owns it any more, and the snapshot walks only
                # tracked requests, so its in-flight count comes down here.
                self._release_locked(r, r.resync.worker)
            else:
                self._stop_running_chunk_locked(r, cancel_stream=False)
            self._wake_locked()

    @staticmethod
    def _abort_on_worker(worker: WorkerState, request_id: str, dispatch_epoch: int = 0) -> None:
        # ValueError: the worker was removed meanwhile and its channel closed.
        with contextlib.suppress(SeerError, ValueError):
            # Epoch 0 = any attempt; our aborts name the attempt (the dispatch's last_epoch, set
            # under the lock together with its stream), so a newer one under the same id lives.
            worker.link.abort(request_id, dispatch_epoch=dispatch_epoch)

    # ---- dispatch ----------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            with self._cond:
                if not self._dirty or self._paused:
                    self._cond.wait(0.2)
                if self._paused or self._stopping.is_set():
                    continue
                self._dirty = False
                started: list[tuple[Dispatch, TrackedRequest, WorkerState, int]] = []
                # With dispatch_threads, never more chunks than threads: one queued behind the pool
                # would count as in flight (a batch slot taken, KV reserved) without running.
                room = self.cfg.dispatch_threads - self._in_flight if self.cfg.dispatch_threads else None
                for d in self.core.next_dispatches(room) if room is None or room > 0 else ():
                    r = self._requests.get(d.request_id)
                    w = self._workers.get(d.worker_id)
                    if r is None or w is None or r.dispatch_token is not None:
                        log.error("core dispatched an unknown or busy request",
                                  extra=kv(request_id=d.request_id, worker_id=d.worker_id))
                        self.core.on_chunk_failed(d.request_id, d.worker_id)
                        continue
                    self._next_token += 1
                    r.dispatch_token, r.worker_id = self._next_token, d.worker_id
                    w.in_flight += 1
                    self._in_flight += 1
                    self._dispatched += 1
                    DISPATCHED.inc()
                    started.append((d, r, w, self._next_token))
                aborts = self._take_unschedulable_locked()
                PENDING.set(self.core.pending_count())
                IN_FLIGHT.set(self._in_flight)
            for d, r, w, token in started:
                self._pool.submit(self._run_chunk, d, r, w, token)
            self._send_aborts(aborts, resync_on_refusal=True)

    def _take_unschedulable_locked(self) -> list[tuple[buffer_pb2.WorkItem, int]]:
        """Requests the core dropped because no trusted worker can hold them: failed in the
        buffer (ABORTED), or their batches would wait for them forever."""
        aborts: list[tuple[buffer_pb2.WorkItem, int]] = []
        for u in self.core.take_unschedulable():
            r = self._requests.pop(u.request_id, None)
            if r is None:
                continue
            r.dropped = True
            log.error("request fits on no worker; failing it", extra=kv(
                request_id=u.request_id, reason=u.reason, need_tokens=u.need_tokens,
                largest_kv_tokens=u.largest_kv_tokens, largest_max_context=u.largest_context_tokens,
                prompt_tokens=len(r.item.prompt_token_ids), generated=len(r.output), max_tokens=r.item.max_tokens,
                chunk_size=self.cfg.chunk_size))
            self._abandoned[u.request_id] = r.item.submit_seq
            self._aborting.add(u.request_id)
            aborts.append((r.item, r.next_seq))
        return aborts

    def _send_aborts(self, aborts: list[tuple[buffer_pb2.WorkItem, int]], *, resync_on_refusal: bool) -> None:
        """Send abort commits on the pool (each may retry up to commit_timeout)."""
        for item, seq in aborts:
            try:
                self._abort_pool.submit(self._commit_abort, item, seq, resync_on_refusal=resync_on_refusal)
            except RuntimeError:  # the pool is shut down: stopping
                return

    def _chunk_request(self, d: Dispatch, r: TrackedRequest) -> worker_pb2.RunChunkRequest:
        item = r.item
        # Strictly increasing over the request's dispatches, and over a scheduler restart (which
        # forgets last_epoch) or a wall clock gone back: epochs.EpochClock.
        r.last_epoch = self._epochs.next(r.last_epoch)
        return worker_pb2.RunChunkRequest(
            request_id=item.request_id,
            batch_id=item.batch_id,
            group_id=item.group_id,
            prompt_key=item.prompt_key,
            seq=r.next_seq,
            prompt_token_ids=item.prompt_token_ids,
            output_token_ids=r.output,
            # The core's generated count can lag the buffer's after a resync; never exceed the rest.
            max_new_tokens=max(1, min(d.max_new_tokens, item.max_tokens - len(r.output))),
            max_tokens=item.max_tokens,
            sampling=item.sampling,
            policy_version=item.policy_version,
            is_probe=d.is_probe,
            group_size=item.group_size,
            fetch_kv=d.fetch_kv,
            dispatch_epoch=r.last_epoch,
            # The batch's submission (unique per submission, durable in the buffer): the worker
            # registers the draft group with it, which tells a resubmitted batch id's new run from
            # a retry of the old one where dispatch epochs cannot (a clock gone back, a lost commit).
            submit_seq=item.submit_seq,
        )

    def _run_chunk(self, d: Dispatch, r: TrackedRequest, w: WorkerState, token: int) -> None:
        with log_context(request_id=d.request_id, group_id=r.item.group_id), \
                self._tracer.start_as_current_span("scheduler.dispatch", context=_trace_parent(r.item)) as span:
            span.set_attribute("seer.request_id", d.request_id)
            span.set_attribute("seer.worker_id", d.worker_id)
            span.set_attribute("seer.seq", r.next_seq)
            try:
                self._run_chunk_inner(d, r, w, token)
            except Exception:
                log.exception("chunk driver failed")
                self._finish_chunk(r, w, token, failed=True)

    def _run_chunk_inner(self, d: Dispatch, r: TrackedRequest, w: WorkerState, token: int) -> None:
        with self._cond:
            # The dispatch may have ended before its thread started (its worker removed and the
            # request moved on, or the request cancelled). Sent anyway, it would run a chunk nobody
            # reserved KV for, raise the request's epoch above the live attempt's and replace that
            # attempt's stream.
            if r.dispatch_token != token:
                return  # already released by whoever moved it on
            if r.dropped:
                self._finish_chunk(r, w, token, failed=False, drop=True)
                return
            req = self._chunk_request(d, r)
            stream = w.link.run_chunk(req, timeout=self.cfg.chunk_timeout)
            r.stream = stream
        tokens: list[int] = []
        logprobs: list[float] = []
        done: worker_pb2.ChunkDone | None = None
        try:
            for ev in _events(stream):
                if ev.WhichOneof("event") == "tokens":
                    tokens.extend(ev.tokens.token_ids)
                    logprobs.extend(ev.tokens.logprobs)
                else:
                    done = ev.done
        except DeadlineExceeded as e:
            # Only this chunk is slow (chunk_timeout): its worker and its other chunks are fine.
            # Stop it there and run it again; repeated timeouts count towards MAX_CHUNK_ATTEMPTS.
            if not r.dropped:
                log.warning("chunk past its deadline; aborting it and re-dispatching",
                            extra=kv(worker_id=w.worker_id, error=str(e)))
                with self._cond:
                    registered = self._workers.get(w.worker_id) is w
                if registered:  # a removed worker's link may be closed already
                    with contextlib.suppress(SeerError, ValueError):
                        w.link.abort(d.request_id, dispatch_epoch=req.dispatch_epoch)
            self._finish_chunk(r, w, token, failed=True, count_attempt=True,
                               worker_fault=f"past the chunk deadline ({self.cfg.chunk_timeout:g} s)")
            return
        except SeerError as e:
            if not r.dropped:
                log.warning("chunk stream failed; re-dispatching", extra=kv(worker_id=w.worker_id, error=str(e)))
            if isinstance(e, Unavailable) and not r.dropped:
                # The worker is gone (connection refused/reset), or stopping before its draining
                # notice reached us: remove it now instead of after 3 missed heartbeats. A live
                # worker learns from its next heartbeat that it is unknown and registers again.
                # A draining worker refusing a chunk placed before its notice arrived, or ending its
                # streams as its server stops, is leaving on its own: only this chunk runs again
                # elsewhere; removing the worker would cut its other chunks in flight, which its
                # drain lets finish (it is dropped after its heartbeats stop).
                with self._cond:
                    gone = self._workers.get(w.worker_id) is w and not w.draining
                    if gone:
                        self._remove_worker_locked(w.worker_id, reason=f"chunk stream failed: {e}")
                if gone:
                    w.link.close()
                self._finish_chunk(r, w, token, failed=True)
                return
            if isinstance(e, ResourceExhausted) and e.field == "max_streams" and not r.dropped:
                # The worker has no stream slot free (its max_streams): busy, not broken, so the
                # attempt is not counted (any other RESOURCE_EXHAUSTED, e.g. a message over gRPC's
                # size limit, may come every time and is counted below). The slot stays reserved
                # for a moment first, so the request is not placed straight back on the same full
                # worker.
                self._stopping.wait(_BUSY_BACKOFF_S)
                self._finish_chunk(r, w, token, failed=True)
                return
            if isinstance(e, Aborted | Cancelled):
                # Ours when we cancelled the stream (`local`: a dropped request, stopping) or the
                # dispatch moved on. A worker ending the stream ABORTED (it aborted the attempt
                # itself), or a call cancelled at its end, while we still want the chunk breaks the
                # protocol, as a ChunkDone ABORTED unasked does (below).
                if isinstance(e, Cancelled) and e.local:
                    self._finish_chunk(r, w, token, failed=True)
                else:
                    self._chunk_ended_unasked(r, w, token, f"the chunk stream ended {e.code_name} unasked",
                                              error=str(e))
                return
            # Anything but a vanished worker (Unavailable) or a cancellation counts towards
            # MAX_CHUNK_ATTEMPTS: an error a worker gives every time (INVALID_ARGUMENT,
            # ALREADY_EXISTS, a version refusal that catching up does not cure...) must end the
            # request as ABORTED, not loop forever. Counted first: recycling the worker below
            # releases the dispatch, after which _finish_chunk would count nothing.
            self._finish_chunk(r, w, token, failed=True, count_attempt=True,
                               worker_fault=str(e) if _worker_fault(e) else "")
            if (isinstance(e, FailedPrecondition) and e.field == "policy_version" and not r.dropped
                    and w.policy_version <= r.item.policy_version):
                # The worker refused the chunk for its version: it serves an older one (e.g. it
                # restarted and registered at its default while the buffer is at N). Out of
                # placement until it has caught up, as when it reports an old version after a chunk.
                self._recycle_stale_worker(w, r.item.policy_version)
            return
        reason = done.finish_reason if done is not None else common_pb2.FINISH_REASON_UNSPECIFIED
        if done is None or reason in (common_pb2.FINISH_REASON_ABORTED, common_pb2.FINISH_REASON_UNSPECIFIED):
            # We abort only chunks we no longer want: a dropped request, a chunk past its deadline
            # (handled above) or a dispatch that moved on (its token is stale, so _finish_chunk
            # ignores it). Anything else is the worker breaking the protocol, counted here (it was
            # not: a worker doing it every time kept the request looping for ever, never quarantined).
            self._chunk_ended_unasked(r, w, token, "the stream ended without a ChunkDone" if done is None
                                      else f"the chunk ended {common_pb2.FinishReason.Name(reason)} unasked")
            return
        # LENGTH means the response reached max_tokens (the worker turns the engine's LENGTH at a
        # chunk's own limit into CHUNK); anything else would end the response short.
        early_length = (reason == common_pb2.FINISH_REASON_LENGTH
                        and len(req.output_token_ids) + len(tokens) != req.max_tokens)
        # Impossible values too: a negative token id, a log-probability that is NaN or above 0.
        # The buffer refuses such a commit (INVALID_ARGUMENT), but that refusal was blamed on
        # nobody: the attempt counted and a worker streaming them every time was never quarantined.
        # (Token ids beyond the vocabulary only the buffer can judge.)
        bad_values = bool(tokens) and (min(tokens) < 0 or not all(lp <= MAX_LOGPROB for lp in logprobs))
        if len(tokens) > req.max_new_tokens or len(logprobs) != len(tokens) or early_length or bad_values:
            log.error("worker returned a malformed chunk", extra=kv(
                worker_id=w.worker_id, tokens=len(tokens), logprobs=len(logprobs), max_new=req.max_new_tokens,
                finish_reason=common_pb2.FinishReason.Name(reason), generated=len(req.output_token_ids),
                max_tokens=req.max_tokens, impossible_values=bad_values))
            self._finish_chunk(r, w, token, failed=True, count_attempt=True, worker_fault="a malformed chunk")
            return
        problem = chunk_stats_problem(
            {f.name: getattr(done.stats, f.name) for f in dataclasses.fields(ChunkStats)}, len(tokens),
            len(req.prompt_token_ids) + len(req.output_token_ids))
        if problem:
            # A worker that reports impossible stats cannot be trusted with its tokens either: the
            # chunk runs again elsewhere and the worker gets no chunks until its telemetry is sane.
            # (The core logs the quarantine with the worker's offence count.)
            log.warning("impossible chunk stats", extra=kv(worker_id=w.worker_id, reason=problem))
            with self._cond:
                if self._workers.get(w.worker_id) is w and w.active:
                    self.core.quarantine_worker(w.worker_id, f"impossible chunk stats: {problem}")
            self._finish_chunk(r, w, token, failed=True, count_attempt=True)
            return
        if done.policy_version != r.item.policy_version:
            # Every token of a response must come from the batch's policy version: drop the chunk.
            log.error("worker ran a different policy version", extra=kv(
                worker_id=w.worker_id, worker_version=done.policy_version, request_version=r.item.policy_version))
            self._finish_chunk(r, w, token, failed=True, count_attempt=True)  # first: see above
            if done.policy_version < r.item.policy_version:
                self._recycle_stale_worker(w, r.item.policy_version)
            return
        commit = buffer_pb2.CommitChunkRequest(
            request_id=req.request_id,
            seq=req.seq,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            policy_version=done.policy_version,
            worker_id=w.worker_id,
            stats=done.stats,
            submit_seq=r.item.submit_seq,
        )
        with self._cond:
            if r.dispatch_token != token:
                return  # the worker was removed meanwhile and the request re-queued: drop this chunk
        self._commit(r, w, token, commit, req.max_new_tokens)

    def _chunk_ended_unasked(self, r: TrackedRequest, w: WorkerState, token: int, problem: str,
                             error: str = "") -> None:
        """A chunk ended aborted (a ChunkDone ABORTED or without a reason, a stream ended ABORTED
        or CANCELLED, no ChunkDone at all): ours when we stopped it (a dropped request, stopping)
        or the dispatch moved on, and then settled free. Otherwise the worker broke the protocol:
        the attempt counts, as a worker fault (retried free, a worker doing it every time looped
        the request for ever, never quarantined)."""
        with self._cond:
            ours = r.dispatch_token != token or r.dropped or self._stopping.is_set()
        if ours:
            self._finish_chunk(r, w, token, failed=True)
            return
        log.warning("worker broke the chunk protocol", extra=kv(
            worker_id=w.worker_id, problem=problem, **({"error": error} if error else {})))
        self._finish_chunk(r, w, token, failed=True, count_attempt=True, worker_fault=problem)

    def _commit(
        self, r: TrackedRequest, w: WorkerState, token: int, commit: buffer_pb2.CommitChunkRequest, max_new: int
    ) -> None:
        assert self._buffer is not None
        deadline = time.monotonic() + self.cfg.commit_timeout
        backoff = 0.05
        while True:
            with self._cond:
                if r.dispatch_token == token:
                    r.committing = True
                if r.dispatch_token != token:
                    # The worker was removed (the request re-queued) while we waited for the
                    # buffer: the request's new dispatch owns its next chunk now; never commit this one.
                    log.info("commit dropped: the request moved on", extra=kv(worker_id=w.worker_id))
                    return
                if r.dropped:
                    # Cancelled, or its id now names a new submission of its batch (a commit would
                    # land in that request): nothing to keep.
                    self._finish_chunk(r, w, token, failed=False, drop=True)
                    return
            try:
                resp = self._buffer.commit(commit, timeout=10.0)
                break
            except (Unavailable, DeadlineExceeded) as e:
                if self._stopping.is_set() or r.dropped or time.monotonic() > deadline:
                    log.warning("commit abandoned", extra=kv(error=str(e)))
                    self._finish_chunk(r, w, token, failed=True)
                    return
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except (FailedPrecondition, NotFound, Aborted, Cancelled) as e:
                # Our view of the request diverged from the buffer's (a gap, an unknown request, or
                # this seq already committed with other tokens): retrying cannot succeed, re-read
                # the feed.
                log.warning("commit refused; resyncing with the buffer", extra=kv(error=str(e)))
                self._hold_for_resync(r, w, token, commit, max_new)
                return
            except SeerError as e:
                log.error("commit rejected", extra=kv(error=str(e)))
                self._finish_chunk(r, w, token, failed=True, count_attempt=True)
                return
        COMMITTED_TOKENS.inc(len(commit.token_ids))
        if resp.duplicate:
            # The buffer already had this seq (our earlier ack was lost in a restart); our copy of
            # the output may differ from what it kept, so take its state from a fresh snapshot.
            self._hold_for_resync(r, w, token, commit, max_new)
            return
        if not resp.accepted:
            self._finish_chunk(r, w, token, failed=False, drop=True)
            return
        with self._cond:
            if r.dispatch_token == token:
                r.output.extend(commit.token_ids)
                r.next_seq = resp.next_seq
                r.attempts = 0
                r.acked_at = time.monotonic()
        self._finish_chunk(r, w, token, failed=False, new_tokens=len(commit.token_ids),
                           finished=resp.request_finished)

    def _hold_for_resync(
        self, r: TrackedRequest, w: WorkerState, token: int, commit: buffer_pb2.CommitChunkRequest, max_new: int
    ) -> None:
        """Keep the chunk in flight until the next snapshot says what the buffer kept."""
        with self._cond:
            if r.dispatch_token != token:
                return
            if r.dropped or self._requests.get(r.item.request_id) is not r:
                # Cancelled meanwhile: no snapshot will resolve an untracked request, so settle now.
                self._finish_chunk(r, w, token, failed=False, drop=True)
                return
            r.resync = Resync(token, w, len(r.output), len(commit.token_ids), max_new,
                              final=commit.finish_reason != common_pb2.FINISH_REASON_CHUNK)
        self._request_resync()

    def _finish_chunk(
        self,
        r: TrackedRequest,
        w: WorkerState,
        token: int,
        *,
        failed: bool,
        new_tokens: int = 0,
        finished: bool = False,
        drop: bool = False,
        count_attempt: bool = False,
        worker_fault: str = "",
    ) -> None:
        """worker_fault: the error, when the chunk failed by the worker's fault (not the request's,
        nor a cancellation): counted towards quarantining a worker whose chunks keep failing
        (SchedulerCore.on_worker_fault)."""
        rid = r.item.request_id
        abort_seq: int | None = None
        with self._cond:
            if r.dispatch_token != token:
                return  # already accounted for (worker removed, request re-queued)
            self._release_locked(r, w)
            if failed and worker_fault and not r.dropped and self._workers.get(w.worker_id) is w and w.active:
                self.core.on_worker_fault(w.worker_id, rid, worker_fault, r.item.group_id)
            tracked = self._requests.get(rid) is r
            if not tracked or r.dropped:
                pass
            elif drop:
                self.core.cancel_request(rid)
                del self._requests[rid]
            elif failed:
                r.attempts += 1 if count_attempt else 0
                if r.attempts >= MAX_CHUNK_ATTEMPTS:
                    log.error("request dropped after repeated chunk failures",
                              extra=kv(request_id=rid, attempts=r.attempts, seq=r.next_seq))
                    self.core.cancel_request(rid)
                    del self._requests[rid]
                    abort_seq = r.next_seq
                    self._abandoned[rid] = r.item.submit_seq
                    self._aborting.add(rid)
                else:
                    self.core.on_chunk_failed(rid, w.worker_id)
                    self._redispatched += 1
                    REDISPATCHED.inc()
            else:
                self.core.on_chunk_done(rid, w.worker_id, new_tokens, finished)
                if finished:
                    del self._requests[rid]
            IN_FLIGHT.set(self._in_flight)
            PENDING.set(self.core.pending_count())
            self._wake_locked()
        if abort_seq is not None:
            self._send_aborts([(r.item, abort_seq)], resync_on_refusal=True)

    def _commit_abort(self, item: buffer_pb2.WorkItem, seq: int, *, resync_on_refusal: bool) -> None:
        """Fails a request we gave up on: an ABORTED commit (no tokens) at the next seq makes the
        buffer end it with the tokens committed so far, so its batch completes and the trainer sees
        finish_reason ABORTED (without it the batch would wait for the request forever).

        The request is in _abandoned (and _aborting) meanwhile. When the abort does not get
        through, it stays abandoned: the next snapshot that lists it sends the abort again, at the
        buffer's next_seq. `resync_on_refusal`: ask for that snapshot now when the buffer refused
        the abort (our seq may be stale); not for an abort whose seq came from a snapshot."""
        rid = item.request_id
        settled = False
        try:
            if self._buffer is None:
                return
            commit = buffer_pb2.CommitChunkRequest(
                request_id=rid, seq=seq, finish_reason=common_pb2.FINISH_REASON_ABORTED,
                policy_version=item.policy_version, submit_seq=item.submit_seq,
            )
            deadline = time.monotonic() + self.cfg.commit_timeout
            backoff = 0.05
            while True:
                try:
                    resp = self._buffer.commit(commit, timeout=10.0)
                    settled = True
                    log.error("request failed in the buffer (ABORTED)", extra=kv(
                        request_id=rid, seq=seq, duplicate=resp.duplicate, accepted=resp.accepted))
                    return
                except (Unavailable, DeadlineExceeded) as e:
                    if self._stopping.is_set() or time.monotonic() > deadline:
                        log.error("abort commit abandoned; sent again when the buffer lists the request",
                                  extra=kv(request_id=rid, error=str(e)))
                        # A snapshot applied while this abort was on its way skipped the request
                        # (_track_locked): ask for one that sends it again.
                        self._abort_not_sent(rid, resync=not self._stopping.is_set())
                        return
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                except SeerError as e:
                    log.error("abort commit refused", extra=kv(request_id=rid, seq=seq, error=str(e)))
                    self._abort_not_sent(rid, resync=resync_on_refusal and not self._stopping.is_set())
                    return
        finally:
            with self._cond:
                self._aborting.discard(rid)
                if settled and self._abandoned.get(rid) == item.submit_seq:
                    del self._abandoned[rid]

    def _abort_not_sent(self, rid: str, *, resync: bool) -> None:
        """The abort did not get through: the request is no longer "abort on its way" before any
        resync is asked for, or the snapshot it brings would skip the request (its abort pending)
        and nothing would send it again: its batch would wait for it forever."""
        with self._cond:
            self._aborting.discard(rid)
        if resync:
            self._request_resync()

    # ---- stats -------------------------------------------------------------------------------

    def _serving_workers(self) -> int:
        """Workers a chunk can be placed on now (the seer_scheduler_serving_workers gauge): active
        (in the core, at the suite's version), not quarantined, not draining, engine not broken."""
        with self._cond:
            return sum(1 for w in self._workers.values()
                       if w.active and not w.draining and not w.engine_broken
                       and not self.core.is_quarantined(w.worker_id))

    def _count_workers(self, which: Callable[[WorkerState], bool]) -> int:
        """Registered workers `which` holds for (a gauge read at scrape, e.g. engine broken): every
        registration, active or not, as WorkerInfo lists them."""
        with self._cond:
            return sum(1 for w in self._workers.values() if which(w))

    def _quarantine_locked(self, w: WorkerState) -> tuple[bool, str]:
        """(quarantined, reason) for the listing. A worker out of the core (catching up on weights
        after a re-registration or a recycle) keeps the quarantine it carries (_quarantine_carry,
        applied again when it is activated): it was listed as trusted meanwhile."""
        if w.active:
            return self.core.is_quarantined(w.worker_id), self.core.quarantine_reason(w.worker_id)
        reason = self._quarantine_carry.get(w.worker_id, "")
        return bool(reason), reason

    def stats(self) -> SchedulerStats:
        now = time.monotonic()
        with self._cond:
            workers = [
                WorkerView(
                    worker_id=w.worker_id,
                    address=w.address,
                    healthy=w.active and now - w.last_seen <= 3 * self.cfg.heartbeat_interval,
                    quarantined=quarantined,
                    in_flight_chunks=w.in_flight,
                    # A copy: the listing is read outside the lock while heartbeats update it.
                    telemetry=_copy(w.telemetry),
                    draining=w.draining,
                    quarantine_reason=reason,
                    engine_broken=w.engine_broken,
                    engine_failing=w.engine_failing,
                )
                for w in self._workers.values()
                for quarantined, reason in [self._quarantine_locked(w)]
            ]
            return SchedulerStats(
                policy=self.cfg.policy,
                pending_requests=self.core.pending_count(),
                in_flight_chunks=self._in_flight,
                dispatched_chunks=self._dispatched,
                redispatched_chunks=self._redispatched,
                workers=workers,
                policy_version=self._version,
            )


def _copy(t: scheduler_pb2.WorkerTelemetry) -> scheduler_pb2.WorkerTelemetry:
    c = scheduler_pb2.WorkerTelemetry()
    c.CopyFrom(t)
    return c


def _trace_parent(item: buffer_pb2.WorkItem) -> Any:
    """The trace context the buffer captured at SubmitBatch (WorkItem.trace_context), so a
    dispatch joins the submitting trainer's trace; None (a new trace) when it carries none."""
    return context_from(item.trace_context)


def _worker_fault(e: SeerError) -> bool:
    """Whether a chunk's error is the worker's, not the request's: INTERNAL / UNKNOWN (an engine
    failure: plain SeerError), DATA_LOSS, RESOURCE_EXHAUSTED other than a full stream table
    (handled before: busy). Not INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION (a
    request the worker cannot run, or a version it does not serve yet), nor a cancellation."""
    return type(e) is SeerError or isinstance(e, DataLoss | ResourceExhausted)


def _events(stream: object) -> Iterator[worker_pb2.RunChunkResponse]:
    yield from stream  # type: ignore[misc]


def _check_address(address: str) -> None:
    """RegisterWorkerRequest.address: host:port ("[v6]:port" for IPv6), port 1-65535. Checked here,
    not at the first RunChunk: a port that is no number made every dispatch to the worker fail
    UNAVAILABLE, each costing a chunk, until its heartbeats stopped. A unix-socket target
    (unix:PATH, unix-abstract:NAME) has no port: taken as given, as grpcutil.bracket_ipv6 dials it."""
    for scheme in ("unix:", "unix-abstract:"):
        if address.startswith(scheme):
            if len(address) == len(scheme):
                raise InvalidArgument(f"{address!r} names no socket", field="address")
            return
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise InvalidArgument(f"{address!r} is not host:port", field="address")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"{address!r}: the port must be a number in 1-65535", field="address")


def _check_capacity(capacity: scheduler_pb2.WorkerCapacity) -> None:
    """RegisterWorkerRequest.capacity, with the request's own field paths in errors."""
    for name in ("total_kv_pages", "page_size", "max_batch_size"):
        value = getattr(capacity, name)
        if value < 1:
            raise InvalidArgument(f"must be >= 1, got {value}", field=f"capacity.{name}")
    if capacity.max_context < 0:
        raise InvalidArgument(f"must be >= 0 (0 = unknown), got {capacity.max_context}", field="capacity.max_context")


def _telemetry_report(t: scheduler_pb2.WorkerTelemetry) -> dict[str, Any]:
    """A heartbeat's telemetry as SchedulerCore.update_worker's keywords: every number the listing
    shows is among them, so none is shown unchecked (policy_version as a count: a negative one is
    impossible)."""
    return {
        "free_pages": t.free_kv_pages, "running": t.running, "waiting": t.waiting,
        "used_pages": t.used_kv_pages, "tokens_per_second": t.tokens_per_second,
        "policy_version": t.policy_version,
        "accepted_per_position": list(t.accepted_per_position),
        "proposed_per_position": list(t.proposed_per_position),
    }


def _report_problem(spec: WorkerSpec, report: dict[str, Any]) -> str:
    """telemetry_problem of a _telemetry_report (what update_worker checks), for a worker the core
    does not know yet."""
    extra = {k: v for k, v in report.items()
             if k not in ("free_pages", "running", "waiting", "accepted_per_position", "proposed_per_position")}
    return telemetry_problem(spec, report["free_pages"], report["running"], report["waiting"], extra,
                             report["accepted_per_position"], report["proposed_per_position"])
