"""SchedulerCore: which chunk runs where, next (DESIGN.md sections 3-4).

Pure and single-threaded: the service (over gRPC workers) and the simulator (bench/simlib) drive
the same object. The driver reports requests, workers, telemetry and chunk outcomes, and asks
`next_dispatches()` for the decisions to make now.

Policies:
- baseline (veRL-like): each request runs to completion where its group was placed round-robin;
  no admission control (the engine queues and preempts by recompute when KV runs out).
- divided: chunks of `chunk_size` tokens, FIFO, least-loaded placement, admission control.
- seer (Seer Algorithm 2): one probe per group served first, smallest generated length first; the
  others longest-first by group estimate (max length of finished siblings, else max_tokens);
  anti-starvation; cache-aware placement. While the cluster is KV-bound and every waiting request
  has started (pressure.py), paused requests age (`kv_aging`), so that estimate errors do not
  starve them until the KV drains.
- seer_history: seer with the previous iteration's lengths per prompt key as priors (RhymeRL).
  While KV-bound, when those lengths say that the KV demand exceeds what the KV serves within the
  longest response (the makespan is bound by KV throughput, not by the critical path), the order
  is FIFO: the order that keeps the most requests sharing a step (_demand_ratio).
- oracle: longest-first by the true lengths (simulator only).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.common.log import get_logger, kv

from .config import SchedulerPolicyConfig
from .groups import GroupState, history_prior, kv_demand, log_spread
from .pressure import BindingResource
from .queues import AgeQueue, Key, PendingQueue
from .ratios import SiblingRatios
from .starvation import Starvation
from .types import Dispatch, RequestInfo, Unschedulable, WorkerSpec
from .workers import OffenceRecord, QuarantineRule, WorkerState, apply_telemetry, pages_for, quarantine

log = get_logger(__name__)

_FINISHED_MEMORY = 200_000
# Started requests keyed into the aged queue per decision while it fills (~0.2 ms of keying).
_AGED_FILL_PER_DECISION = 128


@dataclass
class _Request:
    info: RequestInfo
    generated: int
    state: str = "pending"  # pending | in_flight | done | cancelled
    worker: str | None = None  # the worker running its in-flight chunk
    max_new: int = 0  # max_new_tokens of the in-flight chunk
    last_worker: str | None = None  # the worker that ran its previous chunk (holds its KV prefix)
    version: int = 0  # version of its live priority-queue entries
    enq: int = 0  # entry sequence number (core-wide, _entry_seq) of its live anti-starvation entry
    enqueued_at: float = 0.0  # clock time its current wait began
    fifo: int = 0  # place of its current wait in the enqueue order (kept when only re-keyed)
    chunks: int = 0
    dispatched_at: float = 0.0  # clock time its in-flight chunk was dispatched
    dispatch_seq: int = 0  # dispatched_chunks when its in-flight chunk was dispatched (order, not time)


class SchedulerCore:
    def __init__(self, cfg: SchedulerPolicyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        cfg.validate()
        self.cfg = cfg
        self.clock = clock
        self._requests: dict[str, _Request] = {}
        self._groups: dict[str, GroupState] = {}
        self._groups_by_key: dict[str, set[str]] = {}
        self._workers: dict[str, WorkerState] = {}
        # Quarantine history by worker id, kept across removal and re-registration (workers.py).
        self._offences: dict[str, OffenceRecord] = {}
        self._quarantine_rule = QuarantineRule(
            cfg.quarantine_clear_reports, cfg.quarantine_max_reports, cfg.quarantine_decay_reports
        )
        # prompt key -> last iteration's lengths, least recently used first (bounded by
        # cfg.history_max_prompts: _remember_history).
        self._history: OrderedDict[str, list[int]] = OrderedDict()
        self._history_evicted = 0
        # Called with a prompt key each time its history is recorded (the service forgets that the
        # buffer had none for it: once dropped by the bound, it is to be asked for again).
        self.on_history_recorded: Callable[[str], None] | None = None
        # Pooled spread of log lengths within the history's groups (history_estimate="posterior"):
        # sum of squared deviations and degrees of freedom over the keys set_history gave a history
        # and the core still holds, and each such key's share. One share per key: a key dropped by
        # history_max_prompts and fetched again when its prompt comes back (or set again) would
        # otherwise add its spread once per fetch, weighting the prompts that come back most.
        self._log_ss, self._log_dof = 0.0, 0
        self._log_parts: dict[str, tuple[float, int]] = {}
        self._ratios = SiblingRatios(cfg.estimate_quantile, cfg.estimate_min_samples)
        # request_id -> incarnation of settled requests (re-deliveries are recognised by both).
        self._finished: OrderedDict[str, int] = OrderedDict()
        # request_id -> version of its live queue entries (pending requests only).
        self._live: dict[str, int] = {}
        self._probe_q = PendingQueue()
        # Non-probe chunks, split by whether the request has started (generated > 0): one
        # priority order over both, merged by their heads; the started ones age while the cluster
        # is KV-bound with every waiting request started (see _aging).
        self._fresh_q = PendingQueue()
        self._started_q = PendingQueue()
        # The started ones again, keyed with aging (kept from the moment the aging unit is known,
        # so that turning aging on or off is a switch of queue, not an O(pending) re-keying: one
        # decision stays under 1 ms with 10,000 pending, the switching one included).
        self._aged_q = PendingQueue()
        # Started requests queued before the aging unit was known, still to be keyed into _aged_q
        # (a few per decision; aging waits until none is left).
        self._aged_backlog: list[tuple[Key, int, str, int]] = []
        self._fresh_live: set[str] = set()  # pending requests that have not started
        self._binding = BindingResource()
        # seer_history: every non-probe pending request in enqueue order, read while the cluster is
        # bound by KV demand (pressure.py); plus the expected KV demand of the live groups with a
        # prior (token-steps x 2, groups.kv_demand) and how many such groups have each max_tokens.
        self._fifo_q = PendingQueue()
        self._fifo_seq = 0
        self._kv_demand = 0
        self._demand_caps: dict[int, int] = {}
        self._age_unit: float | None = None  # seconds per token of the first full chunk (frozen)
        # Anti-starvation: per-submission clocks of postponement by newer work (starvation.py).
        self._starvation = Starvation(cfg.starvation_seconds, clock, self._waiting_since)
        self._paused_q = AgeQueue()  # requests paused mid-response, in enqueue order
        self._in_flight = 0
        self._rr = 0  # baseline round-robin cursor
        self._chunk_token_s: float | None = None  # EMA of seconds per token of a full chunk
        self._group_worker: dict[str, str] = {}  # baseline placement of each group
        # The worker holding pages for a starved request that fits nowhere yet (_hold_for; one
        # at a time, the first starved one): None when no request is held for.
        self._hold: WorkerState | None = None
        self._entry_seq = 0  # versions and enqueue counts of queue entries (_enqueue)
        # The held request itself: its id may come back as another request (a batch id submitted
        # again after a cancel), which is not starved and must not inherit the hold.
        self._hold_req: _Request | None = None
        # Requests dropped because no worker can hold them, until the driver takes them.
        self._unschedulable: list[Unschedulable] = []
        # The largest whole KV (tokens) of any worker ever registered: a worker that restarts,
        # misses heartbeats or is still catching up on weights is gone from _workers for a while,
        # and a request only it can hold must wait for it, not fail.
        self._max_kv_seen = 0
        # The same for what a worker can hold at all (its KV capped by its max_context), and the
        # largest max_context declared (for the error line only).
        self._max_room_seen = 0
        self._max_context_seen = 0
        self._counters = {
            "dispatched_chunks": 0,
            "redispatched_chunks": 0,
            "probe_dispatches": 0,
            "starvation_dispatches": 0,
            "starvation_holds": 0,
            "kv_fetch_dispatches": 0,
            "moved_dispatches": 0,
            "finished_requests": 0,
            "stale_reports": 0,
            "admission_skips": 0,
            "contention_switches": 0,
            "demand_switches": 0,
            "unschedulable_requests": 0,
            "worker_fault_quarantines": 0,
        }

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, r: RequestInfo) -> bool:
        """Track a request. Returns whether it is now queued to run: False for a re-delivery of a
        request already known or settled (idempotent) and for one that has nothing left to
        generate. A driver must not wait for a request this returned False for: it never runs."""
        r.validate()
        old = self._groups.get(r.group_id)
        if old is not None and old.incarnation != r.incarnation:
            # Its batch was deleted and submitted again while we still held the old group (its
            # cancellation never reached us): the old requests will never report; drop them.
            for m in list(old.members):
                prev = self._requests.get(m)
                if prev is not None and prev.state in ("pending", "in_flight"):
                    self.cancel_request(m)
        if r.request_id in self._requests:
            return False  # re-delivery from the work feed: idempotent
        settled = self._finished.get(r.request_id)
        if settled is not None:
            if settled == r.incarnation:
                return False  # re-delivery from the work feed: idempotent
            del self._finished[r.request_id]  # a new submission of a batch id used before
        g = self._groups.get(r.group_id)
        if g is None:
            g = GroupState(r.group_id, r.prompt_key, r.group_size, r.max_tokens, incarnation=r.incarnation)
            g.history_estimate = self.cfg.history_estimate
            g.prompt_len = r.prompt_len
            if r.prompt_key in self._history and self.cfg.policy == "seer_history":
                self._history.move_to_end(r.prompt_key)  # used: the last to be dropped
                self._set_prior(g, self._history[r.prompt_key])
                self._set_demand(g)
            self._groups[r.group_id] = g
            self._groups_by_key.setdefault(r.prompt_key, set()).add(r.group_id)
        else:
            for name in ("prompt_key", "group_size", "max_tokens"):
                if getattr(g, name) != getattr(r, name):
                    raise InvalidArgument(
                        f"{getattr(r, name)!r} differs from {getattr(g, name)!r} of its group {r.group_id}",
                        field=name,
                    )
            if len(g.members) >= g.group_size:
                raise AlreadyExists(f"group {r.group_id} already has {g.group_size} requests", field="group_size")
        g.members.append(r.request_id)
        if g.probe_id is None and r.generated < r.max_tokens:
            g.probe_id = r.request_id
        req = _Request(info=r, generated=r.generated)
        self._requests[r.request_id] = req
        self._starvation.track(r.incarnation)
        if r.generated >= r.max_tokens:
            self._finish(req)
            return False
        self._enqueue(req)
        return True

    def cancel_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self._finished:
                return
            raise NotFound(f"unknown request {request_id}", field="request_id")
        if req.state == "in_flight":
            self._release(req)
        self._live.pop(request_id, None)
        self._fresh_live.discard(request_id)
        self._groups[req.info.group_id].running.pop(request_id, None)
        req.state = "cancelled"
        self._retire(req)

    def resync_generated(self, request_id: str, generated: int) -> None:
        """The driver learnt the request's true generated count from elsewhere (a fresh snapshot
        of the buffer, e.g. after a late commit of a chunk the core had re-queued): take it, so
        that KV reservations, estimates and the group's lengths follow the buffer. Only for a
        queued request (an in-flight chunk settles through on_chunk_done)."""
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"unknown or settled request {request_id}", field="request_id")
        if req.state != "pending":
            raise FailedPrecondition(f"request {request_id} is {req.state}, not queued", field="request_id")
        if not 0 <= generated < req.info.max_tokens:
            # A response at max_tokens is finished in the buffer and would not be listed.
            raise InvalidArgument(f"must be in [0, {req.info.max_tokens}), got {generated}", field="generated")
        if generated == req.generated:
            return
        req.generated = generated
        if generated > 0:
            self._fresh_live.discard(request_id)
        g = self._groups[req.info.group_id]
        if request_id in g.running:
            g.running[request_id] = generated
        if request_id in self._live:
            self._enqueue(req, fresh=False)  # re-keyed: the estimate and queue depend on it

    def set_history(self, prompt_key: str, lengths: Sequence[int]) -> None:
        prior = history_prior(lengths)  # validates
        if prior is None:
            self._history.pop(prompt_key, None)
            self._drop_log_part(prompt_key)
        else:
            if self.cfg.history_estimate == "posterior":
                self._drop_log_part(prompt_key)  # replaced, not added to
                ss, dof = log_spread(lengths)
                self._log_parts[prompt_key] = (ss, dof)
                self._log_ss += ss
                self._log_dof += dof
            self._remember_history(prompt_key, lengths)  # after: a key it drops gives its share back
        if self.cfg.policy != "seer_history":
            return
        for gid in self._groups_by_key.get(prompt_key, ()):
            g = self._groups[gid]
            self._set_prior(g, lengths if prior is not None else None)
            self._set_demand(g)
            self._rekey_group(g)

    def _remember_history(self, prompt_key: str, lengths: Sequence[int]) -> None:
        """Keeps lengths as prompt_key's history, dropping the least recently used keys beyond
        history_max_prompts: one entry per distinct prompt ever seen grew with the dataset."""
        self._history[prompt_key] = list(lengths)
        self._history.move_to_end(prompt_key)
        if self.on_history_recorded is not None:
            self.on_history_recorded(prompt_key)
        while len(self._history) > self.cfg.history_max_prompts:
            dropped, _ = self._history.popitem(last=False)
            self._drop_log_part(dropped)
            self._history_evicted += 1

    def _drop_log_part(self, prompt_key: str) -> None:
        """Takes the key's share out of the pooled log-length spread (none: nothing to do)."""
        part = self._log_parts.pop(prompt_key, None)
        if part is None:
            return
        self._log_dof -= part[1]
        # Clamped, and exact once nothing is left: float sums subtracted back need not reach 0.
        self._log_ss = max(0.0, self._log_ss - part[0]) if self._log_dof else 0.0

    @property
    def history_evicted(self) -> int:
        """History priors dropped by the history_max_prompts bound so far."""
        return self._history_evicted

    def _set_prior(self, g: GroupState, lengths: Sequence[int] | None) -> None:
        if not lengths:
            g.prior, g.prior_lengths = None, None
            return
        if self._log_dof:
            g.log_sd = (self._log_ss / self._log_dof) ** 0.5
        g.prior = history_prior(lengths, g.max_tokens)
        g.prior_lengths = sorted(min(n, g.max_tokens) for n in lengths)

    def _set_demand(self, g: GroupState) -> None:
        """Replace the group's share of the expected KV demand by its prior's (None: no share)."""
        self._drop_demand(g)
        if g.prior_lengths:
            g.kv_demand = kv_demand(g.prior_lengths, g.group_size, g.prompt_len, g.max_tokens)
            self._kv_demand += g.kv_demand
            self._demand_caps[g.max_tokens] = self._demand_caps.get(g.max_tokens, 0) + 1

    def _drop_demand(self, g: GroupState) -> None:
        if not g.kv_demand:
            return
        self._kv_demand -= g.kv_demand
        g.kv_demand = 0
        left = self._demand_caps[g.max_tokens] - 1
        if left:
            self._demand_caps[g.max_tokens] = left
        else:
            del self._demand_caps[g.max_tokens]

    def _demand_ratio(self) -> float | None:
        """Expected KV demand of the live groups with a prior over what the cluster's KV serves
        within the longest response (max_tokens steps, each step holding at most the whole KV).
        Both are lower bounds of the makespan in decode steps; above 1 the KV throughput binds, not
        the critical path, so longest-first protects nothing and only packs the KV with the
        longest contexts (fewer requests per step). None: no prior known (not seer_history)."""
        if not self._demand_caps:
            return None
        kv = sum(w.spec.total_pages * w.spec.page_size for w in self._workers.values() if w.placeable)
        return self._kv_demand / (2 * kv * max(self._demand_caps)) if kv else None

    def has_history(self, prompt_key: str) -> bool:
        return prompt_key in self._history

    def history(self, prompt_key: str) -> list[int] | None:
        h = self._history.get(prompt_key)
        return None if h is None else list(h)

    # ---- workers --------------------------------------------------------------------------

    def add_worker(self, w: WorkerSpec) -> None:
        w.validate()
        old = self._workers.get(w.worker_id)
        if old is not None:
            if old.spec == w:
                return  # re-registration with the same capacity
            self.remove_worker(w.worker_id)
        state = WorkerState(spec=w, record=self._offences.setdefault(w.worker_id, OffenceRecord()))
        self._max_kv_seen = max(self._max_kv_seen, w.kv_tokens)
        self._max_room_seen = max(self._max_room_seen, w.room_tokens())
        self._max_context_seen = max(self._max_context_seen, w.max_context)
        if old is not None and old.quarantined:
            # A new capacity does not make its telemetry trustworthy again.
            state.quarantined, state.quarantine_reason = True, old.quarantine_reason
        self._workers[w.worker_id] = state

    def remove_worker(self, worker_id: str) -> list[str]:
        """Forget a worker. Its in-flight chunks are re-queued here (same chunk, same generated
        count); the returned ids let the driver drop any late result of those chunks."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            raise NotFound(f"unknown worker {worker_id}", field="worker_id")
        self._recheck_hold()  # one on it is released now, taken again on another worker next decision
        lost = list(w.in_flight)
        for rid in lost:
            req = self._requests[rid]
            self._in_flight -= 1
            req.state, req.worker = "pending", None
            self._counters["redispatched_chunks"] += 1
            self._enqueue(req)
        for gid, wid in list(self._group_worker.items()):
            if wid == worker_id:
                del self._group_worker[gid]
        if lost:
            log.warning(
                "worker removed with chunks in flight; re-queued", extra=kv(worker_id=worker_id, requeued=len(lost))
            )
        return lost

    def update_worker(self, worker_id: str, *, free_pages: int, running: int, waiting: int,
                      accepted_per_position: Sequence[int] = (), proposed_per_position: Sequence[int] = (),
                      **extra: float) -> bool:
        """A telemetry report (impossible values quarantine the worker: workers.telemetry_problem).
        Whether it was trusted: a rejected report changes nothing but the quarantine, and its
        figures must not be shown or exported as the worker's (the service keeps the last trusted
        report in its listing and gauges)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise NotFound(f"unknown worker {worker_id}", field="worker_id")
        return apply_telemetry(w, free_pages, running, waiting, extra, self.cfg.use_worker_free_pages,
                               self._quarantine_rule, accepted_per_position, proposed_per_position)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        """The worker is stopping (its heartbeat says so): no new chunk is placed there, and it holds
        no pages for a starved request (_holds_on). Its chunks in flight are neither aborted nor
        re-queued: they run to their end, and the worker leaves when its drain ends (removed after
        missed heartbeats, or by a closed stream like any other)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise NotFound(f"unknown worker {worker_id}", field="worker_id")
        if w.draining != draining:
            log.info("worker draining" if draining else "worker no longer draining",
                     extra=kv(worker_id=worker_id, in_flight=w.load))
        w.draining = draining
        self._recheck_hold()  # one on it is released now (no longer _holds_on), taken again elsewhere

    def set_engine_broken(self, worker_id: str, reason: str) -> None:
        """The worker's engine can serve nothing until the worker restarts (its heartbeat says why):
        handled as draining (set_draining), for good. A broken engine is never mended, so an empty
        `reason` clears nothing: only a new registration (remove_worker, add_worker) does. Only
        the permanent state is taken: a transiently failing engine is mended by a chunk that gets a
        token, which no chunk could if none were placed there (its failed chunks quarantine it,
        on_worker_fault, and its probation is the re-probe)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise NotFound(f"unknown worker {worker_id}", field="worker_id")
        if not reason or w.engine_broken:
            return
        w.engine_broken = reason
        self._recheck_hold()  # one on it is released now (no longer _holds_on), taken again elsewhere

    def engine_broken(self, worker_id: str) -> str:
        """Why the worker's engine is broken ("" when it is not, or the worker is unknown)."""
        w = self._workers.get(worker_id)
        return w.engine_broken if w is not None else ""

    def is_draining(self, worker_id: str) -> bool:
        """For tests and introspection: the service reads WorkerState.draining (and stats() shows it)."""
        w = self._workers.get(worker_id)
        return w is not None and w.draining

    def is_quarantined(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.quarantined

    def quarantine_reason(self, worker_id: str) -> str:
        """Why the worker is quarantined ("" when it is trusted or unknown)."""
        w = self._workers.get(worker_id)
        return w.quarantine_reason if w is not None and w.quarantined else ""

    def quarantine_worker(self, worker_id: str, reason: str, *, offence: bool = True) -> None:
        """Stop trusting a worker for a reason its driver found (impossible chunk results; with
        offence=False a quarantine carried over a re-registration, which is no new offence). It is
        trusted again like after impossible telemetry: after consecutive sane telemetry reports,
        quarantine_clear_reports for a first offence, doubled per repeat (workers.QuarantineRule)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise NotFound(f"unknown worker {worker_id}", field="worker_id")
        if not reason:
            raise InvalidArgument("must not be empty", field="reason")
        quarantine(w, reason, self._quarantine_rule, offence=offence)

    # ---- decisions ------------------------------------------------------------------------

    def next_dispatches(self, limit: int | None = None) -> list[Dispatch]:
        out: list[Dispatch] = []
        if not self._workers or not self._live:
            return out
        if not self.cfg.chunked:
            return self._baseline_dispatches(limit)
        if self._aged_backlog:
            self._fill_aged_queue(_AGED_FILL_PER_DECISION)
        now = self.clock()
        kv_refused: bool | None = None  # why the decisions stopped, if for lack of a resource
        while (limit is None or len(out) < limit) and self._live:
            if not any(w.load < w.open_slots() and w.placeable for w in self._workers.values()):
                # Batch-bound: no free slot. A slot kept for a held starved request is not free to
                # the others (can_admit): counted as free, every decision of a hold read as KV-bound
                # and switched the KV-bound rules on (aging, seer_history's FIFO) for one request.
                kv_refused = False
                if self._hold is None or not any(w.load < w.slots and w.placeable
                                                 for w in self._workers.values()):
                    break
                # Only the held slot is free: the starved request may still go (_starving).
                d = self._starving(now)
                if d is None:
                    break
                out.append(d)
                continue
            d = self._starving(now) or self._next_by_priority()
            if d is None:
                kv_refused = True  # a slot is free, but no queued candidate fits the free KV
                break
            out.append(d)
        if (
            kv_refused is not None
            and self.cfg.chunked
            and self._binding.observe(kv_refused, len(self._fresh_live), len(self._live))
        ):
            self._counters["contention_switches"] += 1
            log.info(
                "contention among started requests" if self._binding.started_contention else "contention ended",
                extra=kv(kv_bound=self._binding.kv_bound, level=round(self._binding.level, 3)),
            )
        if kv_refused is not None and self._binding.observe_demand(
            self._demand_ratio() if self._binding.kv_bound and not self._binding.demand_bound else None
        ):
            self._counters["demand_switches"] += 1
            log.info(
                "bound by KV demand: FIFO" if self._binding.demand_bound else "no longer bound by KV demand",
                extra=kv(kv_bound=self._binding.kv_bound, kv_demand=self._kv_demand),
            )
        for q in (self._probe_q, self._fresh_q, self._started_q, self._aged_q, self._fifo_q):
            q.compact(self._live)
        return out

    def kv_bound(self) -> bool:
        """Whether the cluster is KV-bound now (pressure.py)."""
        return self._binding.kv_bound

    def _aging(self) -> float:
        """Tokens of estimate a paused request gains per token-time it waits (0: no aging).

        Aging applies while the cluster is KV-bound and (nearly) every waiting request has
        already started (pressure.py). Then longest-first no longer decides which requests start
        early (its purpose: Seer section 4.2); it only decides which started request waits for
        KV at each chunk boundary, and strict ranking by estimates starves the requests that
        rank low by error until the KV drains, when they run as the tail (bench.sim, Kimi-K2:
        median queued 60% of the makespan). With aging, a request that waited w token-times
        ranks as if its estimate were `kv_aging * w` tokens longer, which bounds that wait."""
        if not self._binding.started_contention or self._aged_backlog:
            return 0.0
        return self._aging_rate()

    def _aging_rate(self) -> float:
        """The aging rate once its unit is known, whether or not aging applies now (_aged_q)."""
        return self.cfg.kv_aging / self._age_unit if self._ages() and self._age_unit else 0.0

    def _ages(self) -> bool:
        """Whether this policy ages paused requests at all (the estimate-ranked ones)."""
        return self.cfg.kv_aging > 0 and self.cfg.policy in ("seer", "seer_history")

    def _start_aged_queue(self) -> None:
        """The aging unit just became known (once per rollout, at its first full chunk): the
        started requests already queued go into _aged_q a few per decision (_fill_aged_queue),
        since there can be many (a restarted scheduler resumes every request at once: 8,750 took
        21 ms in one go). Later ones are keyed into both queues as they are queued."""
        self._aged_backlog = self._started_q.heap[:]  # a copy of the pointers only

    def _fill_aged_queue(self, budget: int) -> None:
        rate = self._aging_rate()
        backlog = self._aged_backlog
        for _ in range(min(budget, len(backlog))):
            _key, _seq, rid, version = backlog.pop()
            req = self._requests.get(rid)
            # Entries re-queued since the copy are stale here and already in _aged_q.
            if req is not None and self._live.get(rid) == version and req.generated > 0:
                self._aged_q.push(self._aged_key(req, rate), rid, version)

    def _pop_candidate(self) -> tuple[PendingQueue, tuple[Key, int, str, int]] | None:
        """The next live candidate: probes first; then the better head of the fresh and started
        queues (the order of one queue; a started head's key is aged up to now)."""
        live = self._live
        if self._probe_q.peek_live(live) is not None:
            q = self._probe_q
        elif self._binding.demand_bound:
            # Bound by KV demand (seer_history, _demand_ratio): FIFO, like divided. Measured in
            # bench.sim (Kimi-K2): ranking by priors defers the groups the history says are short,
            # and those under-estimated start late and become the tail (seer_history 0.914 of the
            # oracle, its tail queued 0 s but 61% started after 10% of the makespan).
            if self._fifo_q.peek_live(live) is None:
                return None
            q = self._fifo_q
        else:
            rate = self._aging()
            started_q = self._aged_q if rate else self._started_q
            started, fresh = started_q.peek_live(live), self._fresh_q.peek_live(live)
            if started is None and fresh is None:
                return None
            if started is None:
                q = self._fresh_q
            elif fresh is None:
                q = started_q
            else:
                # Aged keys hold -(estimate + rate * (now - enqueued_at)) without the common
                # "- rate * now", which is added here to compare with a fresh (unaged) key.
                head = started[0][0] - rate * self.clock()
                q = started_q if (head, started[1]) < (fresh[0][0], fresh[1]) else self._fresh_q
        entry = q.pop()
        assert entry is not None
        return q, entry

    def _starving(self, now: float) -> Dispatch | None:
        """The starved request to serve ahead of the priority order, if one fits now (else it may
        take a hold). Starvation means indefinite postponement by NEWER work: a request's clock
        starts when it waits AND a chunk of a later submission has been dispatched (its
        submission's newer_since), and it is starved past starvation_seconds on that clock.
        Within one submission nothing is newer: the order is the policy's choice and every
        request finishes anyway. Counted from the wait alone, the rule served every request that
        waited 30 s first, and in one synchronous RL iteration longest-first defers the short
        ones far longer than that by design: bench.sim, Qwen2-VL-72B, seer 0.957 -> 0.874 of the
        oracle, its tail 0.098 -> 0.769 of the baseline's (16,394 starvation dispatches)."""
        self._recheck_hold(now)
        for oldest, latency in ((self._starvation.starved_entry(now), True), (self._paused_entry(now), False)):
            if oldest is None:
                continue
            req = self._requests[oldest[1]]
            if self._drop_if_unschedulable(req):
                return None  # the priority order decides now; the next decision looks again
            d = self._try_place(req)
            if d is not None:
                self._counters["starvation_dispatches"] += 1
                return d
            if self._hold is None and latency:
                # Only for the latency bound (starvation_seconds), not for starvation_chunks: that
                # rule is an order heuristic (resume paused requests first where they fit), and
                # holding pages for it cost bench.sim's seer-resume row 0.905 -> 0.892 of the
                # oracle on Qwen2-VL-72B and 1.018 -> 1.008 on Kimi-K2.
                self._hold_for(req)
        return None

    def _paused_entry(self, now: float) -> tuple[float, str, int] | None:
        """The request paused mid-response that waited longest, if past paused_threshold()."""
        oldest = self._paused_q.oldest(self._waiting_since)
        limit = self.paused_threshold()
        return None if oldest is None or limit is None or now - oldest[0] <= limit else oldest

    def _hold_for(self, req: _Request) -> None:
        """A starved request that fits no worker's free KV now: without a hold, the pages each
        finishing chunk frees went to the newer, smaller requests the priority order admits next,
        and it could starve for as long as they kept coming. One worker holds its pages (and a batch
        slot) until it is dispatched: the one with the most free pages among those that can hold it
        once our own chunks there end (KV the worker reports in use beyond ours may never free).
        The others still run there, from the pages beyond the held ones, and on every other worker.
        Never a worker on probation (_holds_on): its one slot runs its trial chunk, which may hang
        to the chunk deadline or fail, so the request would wait there while the others could
        gather its pages."""
        need = self._need_tokens(req)
        best: WorkerState | None = None
        for w in self._workers.values():
            pages = pages_for(need, w.spec.page_size)
            if not self._holds_on(w) or not w.fits_context(need) or w.spec.total_pages - w.external_pages < pages:
                continue
            if best is None or w.free_pages() > best.free_pages():
                best = w
        if best is None:
            return
        best.held_for, best.held_pages = req.info.request_id, pages_for(need, best.spec.page_size)
        self._hold, self._hold_req = best, req
        self._counters["starvation_holds"] += 1
        log.info("pages held for a starved request", extra=kv(
            request_id=req.info.request_id, worker_id=best.worker_id, pages=best.held_pages,
            free_pages=best.free_pages()))

    def _holds_on(self, w: WorkerState) -> bool:
        """Whether `w` may hold pages for a starved request: registered, trusted, and not on
        probation. A worker on probation runs one chunk at a time, and that slot is the trial of a
        worker that just failed chunks: a hold there made the starved request wait for the trial
        to end (up to the chunk deadline, or for ever if it fails and the worker is quarantined
        between two decisions and released again), while one hold at a time kept every healthy
        worker from gathering its pages."""
        return self._workers.get(w.worker_id) is w and w.placeable and not w.record.probation

    def _check_hold(self, now: float) -> None:
        """Releases a hold whose request is no longer queued (dispatched, cancelled, finished), no
        longer starved at `now` (the later submissions that postponed it are gone:
        Starvation.untrack) or whose worker can no longer serve it (gone, quarantined, draining,
        on probation: it may have failed chunks, been quarantined and released between two
        decisions); otherwise follows the
        request's need (a resync). A released hold is taken again in this decision (_starving)."""
        w = self._hold
        assert w is not None and w.held_for is not None
        req = self._requests.get(w.held_for)
        if (
            req is None
            or req is not self._hold_req
            or req.state != "pending"
            or not self._starved(req, now)
            or not self._holds_on(w)
        ):
            self._release_hold()
            return
        need = self._need_tokens(req)
        pages = pages_for(need, w.spec.page_size)
        if not w.fits_context(need) or w.spec.total_pages - w.external_pages < pages:
            self._release_hold()  # taken again where it can be served, in this decision
            return
        w.held_pages = pages

    def _starved(self, req: _Request, now: float) -> bool:
        """Whether a waiting request is past starvation_seconds on its clock at `now` (_starving)."""
        return self._starvation.is_starved(req.info.incarnation, req.enqueued_at, now)

    def _recheck_hold(self, now: float | None = None) -> None:
        """_check_hold now (`now`: the decision's time; None outside a decision): a worker's change
        (quarantined, removed, draining) releases a hold on it at once, by the same rule as the
        next decision would."""
        if self._hold is not None:
            self._check_hold(self.clock() if now is None else now)

    def _release_hold(self) -> None:
        if self._hold is not None:
            self._hold.held_for, self._hold.held_pages = None, 0
            self._hold, self._hold_req = None, None

    def paused_threshold(self) -> float | None:
        """Seconds a request paused mid-response (it has generated tokens) may wait before it is
        resumed ahead of the priority order: `starvation_chunks` times the measured duration of
        a full chunk (None: off, or no chunk measured yet). Measured in chunks, the rule is
        scale-free. Why: in a KV-bound cluster a request pushed out at a chunk boundary by
        higher-ranked ones (often the long member of a group whose first sibling finished short)
        otherwise waits until the KV drains; in bench.sim (Kimi-K2) the tail's median queued time
        was 60% of the makespan. Requests not started yet are not covered: deferring them is what
        longest-first is for. Measured (bench.sim, full scale, 0.5 chunks): seer 0.873 -> 1.01 of
        the oracle on Kimi-K2, but 0.957 -> 0.905 on Qwen2-VL-72B, so it is off by default."""
        if self.cfg.starvation_chunks <= 0 or self._chunk_token_s is None:
            return None
        return self.cfg.starvation_chunks * self._chunk_token_s * self.cfg.chunk_size

    def _next_by_priority(self) -> Dispatch | None:
        skipped: list[tuple[PendingQueue, tuple[Key, int, str, int]]] = []
        tries = 0
        # Largest context + chunk any worker with a free batch slot could take (tokens): a cheap
        # pre-check so that candidates that fit nowhere skip the O(workers) placement.
        room = max(
            (
                min(w.free_pages() * w.spec.page_size, w.spec.max_context or w.spec.kv_tokens)
                for w in self._workers.values()
                if w.placeable and w.load < w.slots
            ),
            default=0,
        )
        chosen: Dispatch | None = None
        while chosen is None and tries < self.cfg.admission_lookahead:
            cand = self._pop_candidate()
            if cand is None:
                break
            q, entry = cand
            req = self._requests[entry[2]]
            if self._drop_if_unschedulable(req):
                # Not a skip: a request that can never be placed must not use up the lookahead
                # (admission_lookahead of them at the head would block every request behind them).
                continue
            tries += 1
            need = self._need_tokens(req)
            chosen = self._try_place(req) if need <= room else None
            if chosen is None:
                skipped.append((q, entry))
                self._counters["admission_skips"] += 1
        for q, entry in skipped:
            q.restore(entry)
        return chosen

    def _need_tokens(self, req: _Request) -> int:
        """KV (tokens) its next chunk needs: context + the chunk (baseline: the rest of the
        response, its one dispatch). It is also what the worker checks against its max_context."""
        left = req.info.max_tokens - req.generated
        return req.info.prompt_len + req.generated + (min(self.cfg.chunk_size, left) if self.cfg.chunked else left)

    def _drop_if_unschedulable(self, req: _Request) -> bool:
        """Drop a request whose next chunk exceeds what every worker registered so far can hold
        (_max_room_seen: the whole KV, capped by max_context; none yet: nothing is unschedulable
        for lack of workers): it would wait forever, or be refused by its worker on every attempt.
        The driver learns of it through take_unschedulable() and fails it."""
        need = self._need_tokens(req)
        if not self._max_room_seen or need <= self._max_room_seen:
            return False
        self.cancel_request(req.info.request_id)
        self._unschedulable.append(
            Unschedulable(req.info.request_id, need, self._max_kv_seen, self._max_context_seen, self._max_room_seen)
        )
        self._counters["unschedulable_requests"] += 1
        return True

    def take_unschedulable(self) -> list[Unschedulable]:
        """The requests dropped as unschedulable since the last call (the driver fails them)."""
        out, self._unschedulable = self._unschedulable, []
        return out

    def _baseline_dispatches(self, limit: int | None) -> list[Dispatch]:
        out: list[Dispatch] = []
        # Quarantined workers are not trusted with chunks under any policy; draining ones refuse them.
        trusted = sorted(wid for wid, w in self._workers.items() if w.placeable)
        skipped: list[tuple[PendingQueue, tuple[Key, int, str, int]]] = []
        while trusted and (limit is None or len(out) < limit):
            cand = self._pop_candidate()
            if cand is None:
                break
            req = self._requests[cand[1][2]]
            if self._drop_if_unschedulable(req):
                continue
            # No KV admission here (the engine queues and preempts), but a worker refuses a request
            # past its max_context or its whole KV outright: only those that can run it are candidates.
            need = self._need_tokens(req)
            fitting = [
                wid
                for wid in trusted
                if self._workers[wid].fits_context(need) and need <= self._workers[wid].spec.kv_tokens
            ]
            if not fitting:
                skipped.append(cand)  # only a worker that is away now can run it: wait for it
                continue
            # The baseline has no batch limit (the engine queues), except on a worker on probation
            # after failing chunks: one chunk at a time there until one completes (see
            # on_worker_fault), so a worker still broken costs one request, not a batch.
            open_ = [wid for wid in fitting if not (self._workers[wid].record.probation and self._workers[wid].load)]
            gid = req.info.group_id
            wid = self._group_worker.get(gid)
            placed = self._workers.get(wid) if wid is not None else None
            if placed is None or not placed.placeable or wid not in open_:
                # New group, or its worker is gone, quarantined, too small or on probation and busy:
                # the rest of the group moves.
                if not open_:
                    skipped.append(cand)  # every worker that can run it is on probation and busy
                    continue
                wid = open_[self._rr % len(open_)]
                self._rr += 1
                self._group_worker[gid] = wid
                placed = self._workers[wid]
            out.append(self._dispatch(req, placed, req.info.max_tokens - req.generated, fetch_kv=False, pages=0))
        for q, entry in skipped:
            q.restore(entry)
        return out

    def _try_place(self, req: _Request) -> Dispatch | None:
        """Cache-aware placement with admission control (Seer OSDI, DESIGN.md section 4)."""
        info = req.info
        max_new = min(self.cfg.chunk_size, info.max_tokens - req.generated)
        ctx = info.prompt_len + req.generated
        g = self._groups[info.group_id]
        least: WorkerState | None = None
        preferred: WorkerState | None = None
        preferred_prefix = 0
        best_prefix = 0  # longest prefix cached on any live worker, admissible or not
        for w in self._workers.values():
            prefix = self._cached_prefix(req, g, w.worker_id)
            best_prefix = max(best_prefix, prefix)
            if not w.fits_context(ctx + max_new) or not w.can_admit(
                pages_for(ctx + max_new, w.spec.page_size), info.request_id
            ):
                continue
            if least is None or (w.load, -w.free_pages()) < (least.load, -least.free_pages()):
                least = w
            if prefix > preferred_prefix or (
                prefix == preferred_prefix and prefix > 0 and preferred is not None and w.load < preferred.load
            ):
                preferred, preferred_prefix = w, prefix
        if least is None:
            return None
        if req.last_worker is not None and req.last_worker not in self._workers:
            # The worker that ran its previous chunk is gone (died, restarted, recycled), but it
            # offloaded the request's KV (prompt + generated) to the KV pool when that chunk ended:
            # moving away from a dead worker is a move like any other, and pulling the prefix beats
            # re-prefilling it (a worker that finds nothing in the pool recomputes it anyway).
            best_prefix = max(best_prefix, info.prompt_len + req.generated)
        chosen = least
        if (
            self.cfg.policy != "divided"
            and preferred is not None
            and preferred.load - least.load <= self._imbalance_threshold(preferred)
        ):
            chosen = preferred
        here = self._cached_prefix(req, g, chosen.worker_id)
        fetch_kv = best_prefix - here > self.cfg.prefix_gap_margin
        return self._dispatch(
            req, chosen, max_new, fetch_kv=fetch_kv, pages=pages_for(ctx + max_new, chosen.spec.page_size)
        )

    def _imbalance_threshold(self, w: WorkerState) -> int:
        """The paper's 32 in-flight requests is for batches of hundreds; small workers (a CPU
        engine with 32 slots) would never reach it and pile a group onto one worker, so the
        threshold is capped at an eighth of the worker's batch slots."""
        return min(self.cfg.load_imbalance_threshold, max(1, w.spec.max_batch_size // 8))

    def _cached_prefix(self, req: _Request, g: GroupState, worker_id: str) -> int:
        if req.last_worker == worker_id:
            return req.info.prompt_len + req.generated
        if worker_id in g.workers:
            return req.info.prompt_len  # a sibling ran there: the shared prompt is cached
        return 0

    def _dispatch(self, req: _Request, w: WorkerState, max_new: int, *, fetch_kv: bool, pages: int) -> Dispatch:
        rid = req.info.request_id
        if self._hold is not None and self._hold.held_for == rid:
            self._release_hold()
        probe = self._is_active_probe(req)
        del self._live[rid]
        self._fresh_live.discard(rid)
        req.state, req.worker, req.max_new = "in_flight", w.worker_id, max_new
        req.dispatched_at = self.clock()
        self._starvation.dispatched(req.info.incarnation, req.dispatched_at)
        w.reserve(rid, pages)
        self._in_flight += 1
        g = self._groups[req.info.group_id]
        g.workers.add(w.worker_id)
        c = self._counters
        c["dispatched_chunks"] += 1
        req.dispatch_seq = c["dispatched_chunks"]
        c["probe_dispatches"] += probe
        c["kv_fetch_dispatches"] += fetch_kv
        c["moved_dispatches"] += req.last_worker is not None and req.last_worker != w.worker_id
        return Dispatch(rid, w.worker_id, max_new, is_probe=probe, fetch_kv=fetch_kv)

    # ---- outcomes -------------------------------------------------------------------------

    def on_chunk_done(self, request_id: str, worker_id: str, new_tokens: int, finished: bool) -> None:
        req = self._in_flight_on(request_id, worker_id)
        if req is None:
            return
        if not 0 <= new_tokens <= req.max_new:
            raise InvalidArgument(f"must be in [0, {req.max_new}], got {new_tokens}", field="new_tokens")
        self._release(req)
        w = self._workers.get(worker_id)
        if w is not None and req.dispatch_seq > w.record.quarantined_seq:
            # It completed a chunk: what failed before was not all of it. Only a chunk dispatched
            # after its last quarantine for failures proves that: one that was running when the
            # engine broke can still finish (tokens it got before the fault), and it would end the
            # probation of a worker that fails everything new.
            w.record.failed_groups.clear()
            w.record.probation = False
        if new_tokens == req.max_new and new_tokens > 0:
            # A full chunk: how long one token of a chunk takes on this cluster now (EMA), the
            # unit of the anti-starvation threshold.
            per_token = max(0.0, self.clock() - req.dispatched_at) / new_tokens
            self._chunk_token_s = (
                per_token if self._chunk_token_s is None else 0.9 * self._chunk_token_s + 0.1 * per_token
            )
            if self._age_unit is None and per_token > 0:
                # The unit of aging: one token-time of the first full chunk, frozen so that the
                # aged keys already queued stay comparable.
                self._age_unit = per_token
                if self._ages():
                    self._start_aged_queue()
        req.generated += new_tokens
        req.chunks += 1
        req.last_worker = worker_id
        if finished or req.generated >= req.info.max_tokens:
            self._finish(req)
        else:
            g = self._groups[req.info.group_id]
            if g.history_estimate == "posterior" and g.prior is not None:
                g.running[request_id] = req.generated
            self._enqueue(req)

    def on_chunk_failed(self, request_id: str, worker_id: str) -> None:
        """The chunk produced nothing durable: run the same chunk again (possibly elsewhere)."""
        req = self._in_flight_on(request_id, worker_id)
        if req is None:
            return
        self._release(req)
        self._counters["redispatched_chunks"] += 1
        self._enqueue(req)

    def on_worker_fault(self, worker_id: str, request_id: str, error: str, group_id: str = "") -> bool:
        """A chunk of `request_id` failed on `worker_id` with an error of the worker, not of the
        request (an engine failure, a hung step past the chunk deadline, a malformed result; the
        driver decides which errors those are). Called besides on_chunk_failed, also for a request
        the driver gives up on. When chunks of `worker_failure_limit` different groups failed there
        in a row (no chunk completed in between), the worker is quarantined: a broken engine fails
        every chunk at once, looks free and would draw most dispatches (each failure costs a
        request an attempt). Different groups (the request's own group_id, else the core's record
        of it, else the request id), so that one prompt the engine cannot run, which fails all of
        its siblings on any worker, is not taken for a broken worker. Never the last trusted
        worker (a draining one is leaving: not counted): when every worker fails, the requests run
        out of attempts and fail as before, rather than wait for a worker that may never come. Once
        released (sane heartbeats) it is on probation until a chunk completes there: one chunk at a
        time, and one more failure quarantines it again (the streak is kept, across
        re-registrations too), for twice as long.
        Returns whether the worker was quarantined now."""
        w = self._workers.get(worker_id)
        if w is None or not self.cfg.worker_failure_limit:
            return False
        req = self._requests.get(request_id)
        w.record.failed_groups.add(group_id or (req.info.group_id if req is not None else request_id))
        if w.quarantined or len(w.record.failed_groups) < self.cfg.worker_failure_limit:
            return False
        if not any(o.placeable for wid, o in self._workers.items() if wid != worker_id):
            return False
        self._counters["worker_fault_quarantines"] += 1
        quarantine(w, f"chunks of {len(w.record.failed_groups)} groups failed in a row: {error}", self._quarantine_rule)
        w.record.probation = True
        w.record.quarantined_seq = self._counters["dispatched_chunks"]
        self._recheck_hold()  # released now (no longer _holds_on), taken again on a trusted worker
        return True

    def _in_flight_on(self, request_id: str, worker_id: str) -> _Request | None:
        req = self._requests.get(request_id)
        if req is None and request_id not in self._finished:
            raise NotFound(f"unknown request {request_id}", field="request_id")
        if req is None or req.state != "in_flight" or req.worker != worker_id:
            # A late report of a chunk already re-queued (worker removed) or cancelled: ignoring
            # it is what keeps tokens from being counted twice.
            self._counters["stale_reports"] += 1
            log.info("stale chunk report ignored", extra=kv(request_id=request_id, worker_id=worker_id))
            return None
        return req

    def _release(self, req: _Request) -> None:
        w = self._workers.get(req.worker or "")
        if w is not None:
            w.release(req.info.request_id)
        self._in_flight -= 1
        req.state, req.worker = "pending", None

    def _finish(self, req: _Request) -> None:
        req.state = "done"
        self._live.pop(req.info.request_id, None)
        self._fresh_live.discard(req.info.request_id)
        self._counters["finished_requests"] += 1
        g = self._groups[req.info.group_id]
        g.running.pop(req.info.request_id, None)
        g.finished_lengths.append(req.generated)
        self._rekey_group(g)
        self._retire(req)

    def _retire(self, req: _Request) -> None:
        """Drop a finished/cancelled request; when its whole group is settled, record the group's
        lengths as the history of its prompt key (the next iteration's prior) and drop the group."""
        g = self._groups[req.info.group_id]
        if any(self._requests[m].state in ("pending", "in_flight") for m in g.members):
            return
        # Only a group whose every member finished: a cancelled member's siblings are its
        # shortest (the first to finish), and as the prompt's prior they would rank it too low
        # next iteration, where its long members are the tail (the buffer, too, records history
        # only for completed responses).
        if len(g.members) == g.group_size and len(g.finished_lengths) == g.group_size:
            self._remember_history(g.prompt_key, g.finished_lengths)
            self._ratios.observe(g.finished_lengths, g.group_size)
        self._drop_demand(g)
        for m in g.members:
            done = self._requests.pop(m, None)
            self._finished[m] = done.info.incarnation if done is not None else 0
            if done is not None and self._starvation.untrack(done.info.incarnation):
                # Clocks stopped (the newest submission that ran is gone): a hold taken for a
                # request of an earlier one is released now.
                self._recheck_hold()
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        del self._groups[g.group_id]
        same_key = self._groups_by_key.get(g.prompt_key)
        if same_key is not None:
            same_key.discard(g.group_id)
            if not same_key:
                del self._groups_by_key[g.prompt_key]
        self._group_worker.pop(g.group_id, None)

    # ---- queues ---------------------------------------------------------------------------

    def _is_active_probe(self, req: _Request) -> bool:
        if self.cfg.policy not in ("seer", "seer_history"):
            return False
        g = self._groups[req.info.group_id]
        if g.probe_id != req.info.request_id or g.finished_lengths:
            return False
        return self.cfg.policy == "seer" or g.prior is None or self.cfg.history_probes

    def _key(self, req: _Request) -> Key:
        policy = self.cfg.policy
        if policy in ("seer", "seer_history"):
            # Longest-first by group estimate (Algorithm 2); ties in enqueue order (FIFO). Measured
            # in bench.sim: breaking ties by most-generated-first (depth-first) or ranking by the
            # remaining estimate (order="remaining") was equal or worse on all three workloads.
            # Started requests age under KV contention (_aging).
            return (-self._rank(req),)
        if policy == "oracle":
            t = req.info.max_tokens if req.info.true_length is None else req.info.true_length
            if self.cfg.order == "remaining":
                return (-float(t - req.generated),)
            return (-float(t),)
        return (0.0,)  # baseline / divided: FIFO by enqueue order

    def _rank(self, req: _Request) -> float:
        g = self._groups[req.info.group_id]
        est = g.request_estimate(req.generated, self._factor(g))
        return float(est - req.generated if self.cfg.order == "remaining" else est)

    def _aged_key(self, req: _Request, rate: float) -> Key:
        # Aged: -(rank + rate * (now - enqueued_at)) = -rank + rate * enqueued_at - rate * now; the
        # last term is common to all started requests and added when comparing (_pop_candidate).
        return (-self._rank(req) + rate * req.enqueued_at,)

    def _factor(self, g: GroupState) -> float | None:
        return self._ratios.factor(g.group_size, len(g.finished_lengths))

    def _enqueue(self, req: _Request, fresh: bool = True) -> None:
        """Queue the request's next chunk. `fresh=False` only re-keys it (estimate changed) and
        keeps its place in the anti-starvation order."""
        rid = req.info.request_id
        req.state = "pending"
        # Versions and enqueue counts come from core-wide sequences, not per request: a request id
        # can come back as another request (a batch id submitted again after a cancel), and a stale
        # queue entry of the old one (same id, same per-request count) then read as the new one's,
        # e.g. its anti-starvation entry made a request added now look starved since the old one's
        # enqueue (and take a starvation hold).
        self._entry_seq += 1
        req.version = self._entry_seq
        self._live[rid] = req.version
        now = self.clock()
        if fresh:
            req.enq = self._entry_seq
            req.enqueued_at = now  # before keying: an aged key counts the wait from here
            self._fifo_seq += 1
            req.fifo = self._fifo_seq
        if req.generated == 0:
            self._fresh_live.add(rid)
        probe = self._is_active_probe(req)
        if probe:
            # Probes: smallest generated length first (Seer Algorithm 2).
            self._probe_q.push((float(req.generated),), rid, req.version)
        elif req.generated > 0:
            self._started_q.push(self._key(req), rid, req.version)
            rate = self._aging_rate()
            if rate:
                self._aged_q.push(self._aged_key(req, rate), rid, req.version)
        else:
            self._fresh_q.push(self._key(req), rid, req.version)
        if self.cfg.policy == "seer_history" and not probe:
            self._fifo_q.push((float(req.fifo),), rid, req.version)
        # Only the chunked policies read (and so prune) the age queues (_starving): under the
        # baseline every enqueue would stay in them for the scheduler's life.
        if fresh and self.cfg.chunked:
            self._starvation.wait(req.info.incarnation, now, rid, req.enq)
            if req.generated > 0 and self.cfg.starvation_chunks > 0:
                self._paused_q.push(now, rid, req.enq)
                self._paused_q.compact(self._waiting_since, len(self._live))

    def _rekey_group(self, g: GroupState) -> None:
        for m in g.members:
            req = self._requests.get(m)
            if req is not None and req.state == "pending" and m in self._live:
                self._enqueue(req, fresh=False)

    def _waiting_since(self, entry: tuple[float, str, int]) -> bool:
        req = self._requests.get(entry[1])
        return req is not None and req.state == "pending" and req.enq == entry[2] and entry[1] in self._live

    # ---- introspection --------------------------------------------------------------------

    def pending_count(self) -> int:
        return len(self._live)

    def in_flight_count(self) -> int:
        return self._in_flight

    def group_estimate(self, group_id: str) -> int:
        g = self._groups.get(group_id)
        if g is None:
            raise NotFound(f"unknown or finished group {group_id}", field="group_id")
        return g.estimate(self._factor(g) if self.cfg.context_aware else None)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.cfg.policy,
            "pending_requests": self.pending_count(),
            "in_flight_chunks": self._in_flight,
            "active_groups": len(self._groups),
            **self._counters,
            "kv_bound": self._binding.kv_bound,
            "kv_pressure": round(self._binding.level, 3),
            "started_contention": self._binding.started_contention,
            "kv_demand_bound": self._binding.demand_bound,
            "workers": {
                wid: {
                    "in_flight": w.load,
                    "reserved_pages": w.reserved_pages,
                    "free_pages": w.free_pages(),
                    "quarantined": w.quarantined,
                    "quarantine_reason": w.quarantine_reason,
                    "draining": w.draining,
                    "engine_broken": w.engine_broken,
                }
                for wid, w in self._workers.items()
            },
        }
