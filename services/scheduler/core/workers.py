"""Worker state as the scheduler sees it: capacity, our own KV reservations, telemetry, and the
quarantine of workers whose telemetry or chunk results are impossible, or whose chunks keep failing
(not trusted, not dispatched to). Repeat offences escalate: each one doubles the sane period needed
to be trusted again (up to a cap), and a long clean period forgives one offence."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.log import get_logger, kv

from .types import WorkerSpec

log = get_logger(__name__)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class OffenceRecord:
    """A worker's quarantine history. Kept by worker id across removal and re-registration (a worker
    that lies, is removed and registers again is the same offender)."""

    offences: int = 0
    # Consecutive sane reports while trusted since its last offence or forgiveness.
    clean_reports: int = 0
    # Groups whose chunks failed on it by its own fault since its last completed chunk (kept through
    # a quarantine and a re-registration: released, the worker is on probation until a chunk
    # completes). Groups, not requests: siblings share one prompt, so one prompt the engine cannot
    # run fails all of them, on any worker.
    failed_groups: set[str] = field(default_factory=set)
    # Quarantined for failing chunks, and no chunk completed since: one chunk at a time (a circuit
    # breaker's half-open state), so a worker still broken when released costs one request one
    # attempt, not one per batch slot.
    probation: bool = False
    # dispatched_chunks (SchedulerCore's counter) at its last quarantine for failing chunks: only a
    # chunk dispatched after it counts as one that completed on the released worker.
    quarantined_seq: int = 0


@dataclass(frozen=True)
class QuarantineRule:
    """How long a quarantine lasts: `clear_after` sane reports for a first offence, doubled for each
    repeat, capped at `max_reports`; `decay_reports` clean reports while trusted forgive one."""

    clear_after: int = 3
    max_reports: int = 96
    decay_reports: int = 900

    def needed(self, offences: int) -> int:
        """Consecutive sane reports that release a worker with this many offences."""
        doublings = min(max(offences - 1, 0), 30)
        return max(self.clear_after, min(self.max_reports, self.clear_after << doublings))


@dataclass
class WorkerState:
    spec: WorkerSpec
    # request_id -> KV pages reserved for its in-flight chunk (context + max_new_tokens).
    in_flight: dict[str, int] = field(default_factory=dict)
    reserved_pages: int = 0
    # Pages the worker reports in use beyond our reservations at report time (not ours to free).
    external_pages: int = 0
    quarantined: bool = False
    quarantine_reason: str = ""
    sane_reports: int = 0
    telemetry: dict[str, float] = field(default_factory=dict)
    record: OffenceRecord = field(default_factory=OffenceRecord)
    # A starved request that fits nowhere yet holds pages here (SchedulerCore._hold_for): the others
    # are admitted only from the pages beyond `held_pages` and leave it a batch slot, so the pages
    # finishing chunks free add up to its need instead of going to newer, smaller requests.
    held_for: str | None = None
    held_pages: int = 0
    # Its last heartbeat said it is stopping (SchedulerCore.set_draining): it refuses new chunks, so
    # none is placed there; its chunks in flight run to their end.
    draining: bool = False
    # Why its engine can serve nothing until the worker restarts (SchedulerCore.set_engine_broken,
    # from its heartbeat); "" = not broken. Like draining, no new chunk is placed there.
    engine_broken: str = ""

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def load(self) -> int:
        return len(self.in_flight)

    @property
    def placeable(self) -> bool:
        """Whether a new chunk may go here: trusted, not stopping, its engine not broken."""
        return not self.quarantined and not self.draining and not self.engine_broken

    @property
    def slots(self) -> int:
        """Chunks it may run at once: its batch, or one while on probation."""
        return 1 if self.record.probation else self.spec.max_batch_size

    def free_pages(self) -> int:
        return self.spec.total_pages - self.reserved_pages - self.external_pages

    def open_slots(self) -> int:
        """Batch slots open to any request: one is kept while pages are held for a starved one."""
        return self.slots - 1 if self.held_for is not None else self.slots

    def can_admit(self, pages: int, request_id: str | None = None) -> bool:
        """Admission control (DESIGN.md section 4): a batch slot and KV for context + chunk, beyond
        what is held for a starved request other than `request_id`."""
        if not self.placeable:
            return False
        if self.held_for is None or self.held_for == request_id:
            return len(self.in_flight) < self.slots and self.free_pages() >= pages
        return len(self.in_flight) < self.slots - 1 and self.free_pages() - self.held_pages >= pages

    def fits_context(self, tokens: int) -> bool:
        """Whether a chunk whose context + max_new is `tokens` is within the worker's max_context
        (0 = unknown: assumed so). The worker refuses one past it, on every attempt."""
        return not self.spec.max_context or tokens <= self.spec.max_context

    def reserve(self, request_id: str, pages: int) -> None:
        self.in_flight[request_id] = pages
        self.reserved_pages += pages

    def release(self, request_id: str) -> None:
        self.reserved_pages -= self.in_flight.pop(request_id, 0)


def counts_problem(values: Mapping[str, float]) -> str:
    """The first value that is not a finite non-negative number, said ("" when none): what any count
    or duration a worker reports must be."""
    for name, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"{name} is not a number: {value!r}"
        if math.isnan(value) or math.isinf(value):
            return f"{name} is not finite: {value}"
        if value < 0:
            return f"{name} is negative: {value}"
    return ""


def telemetry_problem(
    spec: WorkerSpec,
    free_pages: int,
    running: int,
    waiting: int,
    extra: dict[str, float],
    accepted_per_position: Sequence[int] = (),
    proposed_per_position: Sequence[int] = (),
) -> str:
    """Why a telemetry report cannot be true ("" when it is plausible). The per-position draft
    counts (WorkerTelemetry.accepted_per_position / proposed_per_position) are pairs: one list per
    draft depth each, and a draft token accepted at a depth was proposed there, so accepted <=
    proposed at every position (services/worker/core.py counts both from the same drafts)."""
    problem = counts_problem({"free_pages": free_pages, "running": running, "waiting": waiting, **extra})
    if problem:
        return problem
    if len(accepted_per_position) != len(proposed_per_position):
        return (f"accepted_per_position has {len(accepted_per_position)} positions, "
                f"proposed_per_position {len(proposed_per_position)}")
    for i, (a, p) in enumerate(zip(accepted_per_position, proposed_per_position, strict=True)):
        problem = counts_problem({f"accepted_per_position[{i}]": a, f"proposed_per_position[{i}]": p})
        if problem:
            return problem
        if a > p:
            return f"accepted_per_position[{i}] {a} exceeds proposed_per_position[{i}] {p}"
    if free_pages > spec.total_pages:
        return f"free_pages {free_pages} exceeds total_pages {spec.total_pages}"
    used = extra.get("used_pages")
    if used is not None and used + free_pages > spec.total_pages:
        return f"used_pages {used} + free_pages {free_pages} exceeds total_pages {spec.total_pages}"
    if running > spec.max_batch_size:
        return f"running {running} exceeds max_batch_size {spec.max_batch_size}"
    return ""


def quarantine(w: WorkerState, reason: str, rule: QuarantineRule, *, offence: bool = True) -> None:
    """Stop trusting `w`. A new offence (a trusted worker caught now; not a quarantine carried over a
    re-registration, nor another bad report while quarantined) raises the sane period it needs.
    Why escalate: a worker that lies only in its chunk stats has sane telemetry, so a fixed period
    would release it every few heartbeats and each lie would cost a chunk attempt forever."""
    if offence and not w.quarantined:
        w.record.offences += 1
        w.record.clean_reports = 0
        log.warning(
            "worker quarantined",
            extra=kv(
                worker_id=w.worker_id,
                reason=reason,
                offences=w.record.offences,
                sane_reports_needed=rule.needed(w.record.offences),
            ),
        )
    w.quarantined, w.quarantine_reason, w.sane_reports = True, reason, 0


def apply_telemetry(
    w: WorkerState,
    free_pages: int,
    running: int,
    waiting: int,
    extra: dict[str, float],
    use_free_pages: bool,
    rule: QuarantineRule,
    accepted_per_position: Sequence[int] = (),
    proposed_per_position: Sequence[int] = (),
) -> bool:
    """Whether the report is trusted (plausible: telemetry_problem). An impossible one quarantines
    the worker and changes nothing else: the last trusted report stands (w.telemetry), and the
    caller must not show or export the rejected figures either."""
    problem = telemetry_problem(w.spec, free_pages, running, waiting, extra,
                                accepted_per_position, proposed_per_position)
    if problem:
        quarantine(w, f"impossible telemetry: {problem}", rule)
        return False
    w.telemetry = {"free_pages": free_pages, "running": running, "waiting": waiting, **extra}
    if w.quarantined:
        w.sane_reports += 1
        if w.sane_reports < rule.needed(w.record.offences):
            return True
        log.info(
            "worker released from quarantine",
            extra=kv(worker_id=w.worker_id, offences=w.record.offences, sane_reports=w.sane_reports),
        )
        w.quarantined = False
        w.quarantine_reason = ""
    elif w.record.offences:
        w.record.clean_reports += 1
        if w.record.clean_reports >= rule.decay_reports:
            w.record.offences -= 1
            w.record.clean_reports = 0
            log.info(
                "worker quarantine offence forgiven after a clean period",
                extra=kv(worker_id=w.worker_id, offences=w.record.offences),
            )
    if use_free_pages:
        used = w.spec.total_pages - free_pages
        w.external_pages = max(0, used - w.reserved_pages)
    return True
