"""The event loop: simulated instances driven by the real SchedulerCore.

Every decision comes from services.scheduler.core (the same object the scheduler service runs);
the simulator only plays the instances: it turns Dispatches into running chunks, advances time to
the next chunk end, and reports outcomes back with on_chunk_done.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec

from .instance import Instance, Slot
from .model import InstanceModel, accepted_per_step
from .timeline import Timeline
from .workload import Workload

PAGE = 256  # tokens per KV page in the simulation (coarse pages keep the bookkeeping cheap)


@dataclass
class RunConfig:
    policy: str
    chunk_size: int = 4096
    speculative: bool = False
    # The service's rule and default: one synchronous iteration is one submission (every request
    # below has incarnation 0), in which nothing is newer, so it never serves a request early.
    starvation_seconds: float = SchedulerPolicyConfig.starvation_seconds
    starvation_chunks: float = 0.0
    load_imbalance_threshold: int = 32
    prefix_gap_margin: int = 512
    order: str = "total"
    admission_lookahead: int = 16
    kv_aging: float = 12.0
    history_probes: bool = False
    estimate_quantile: float = 0.9
    estimate_min_samples: int = 16
    history_estimate: str = "scaled"
    # What the oracle policy ranks by (bounds, simulator only): "true" (each request's own length,
    # the paper's oracle), "group_max" (its group's true maximum: perfect group estimates),
    # "prev_group_max" (its group's maximum in the previous iteration: the history-oracle).
    oracle_rank: str = "true"


@dataclass
class SimResult:
    label: str
    policy: str
    makespan: float
    total_tokens: int
    finish_times: np.ndarray  # [requests] seconds
    start_times: np.ndarray  # [requests] seconds of the first dispatch
    timeline: Timeline
    preemptions: int
    stats: dict[str, object]
    wall_seconds: float
    prefill_tokens: int = 0
    fetch_tokens: int = 0
    # [requests] seconds spent queued between chunks (after the first dispatch), and chunks run.
    wait_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    chunks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [requests] instance index of the last chunk.
    last_instance: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [requests] the longest single wait between chunks, and the group estimate the core had
    # when that wait began (0 where it never waited).
    max_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))
    est_at_max_wait: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [instances] time the instance finished its last chunk.
    instance_idle_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.total_tokens / self.makespan

    @property
    def tail_time(self) -> float:
        """Time spent on the last 10% of requests (Seer's tail definition)."""
        t90 = float(np.quantile(self.finish_times, 0.9, method="lower"))
        return self.makespan - t90


def policy_config(rc: RunConfig) -> SchedulerPolicyConfig:
    """The scheduler core's configuration for a run (bench/sim.py prints where it differs from the
    service's defaults)."""
    return SchedulerPolicyConfig(
        policy=rc.policy,
        chunk_size=rc.chunk_size,
        starvation_seconds=rc.starvation_seconds,
        starvation_chunks=rc.starvation_chunks,
        load_imbalance_threshold=rc.load_imbalance_threshold,
        prefix_gap_margin=rc.prefix_gap_margin,
        order=rc.order,
        admission_lookahead=rc.admission_lookahead,
        kv_aging=rc.kv_aging,
        history_probes=rc.history_probes,
        estimate_quantile=rc.estimate_quantile,
        estimate_min_samples=rc.estimate_min_samples,
        history_estimate=rc.history_estimate,
        use_worker_free_pages=False,
    )


def simulate(w: Workload, model: InstanceModel, rc: RunConfig, label: str | None = None) -> SimResult:
    wall0 = time.perf_counter()
    spec = w.spec
    now = 0.0
    core = SchedulerCore(policy_config(rc), clock=lambda: now)
    timeline = Timeline(bin_seconds=max(1.0, spec.max_tokens * model.a / 400))
    instances: dict[str, Instance] = {}
    for k in range(spec.instances):
        iid = f"i{k:02d}"
        core.add_worker(
            WorkerSpec(iid, total_pages=model.kv_tokens // PAGE, page_size=PAGE, max_batch_size=model.max_batch)
        )
        instances[iid] = Instance(
            iid, model, timeline, speculative=rc.speculative, engine_admission=rc.policy == "baseline"
        )
    if rc.policy == "seer_history":
        for p in range(spec.prompts):
            core.set_history(f"p{p}", [int(x) for x in w.prev_lengths[p]])
    G = spec.group_size
    n_req = spec.prompts * G
    true_len = w.lengths.reshape(-1)  # [requests]
    prompt_len = np.repeat(w.prompt_len, G)  # [requests]
    generated = np.zeros(n_req, dtype=np.int64)
    last_inst: list[str | None] = [None] * n_req
    group_insts: list[set[str]] = [set() for _ in range(spec.prompts)]
    finished_in_group = np.zeros(spec.prompts, dtype=np.int64)
    finish_times = np.zeros(n_req)
    start_times = np.full(n_req, -1.0)
    pending_since = np.zeros(n_req)
    wait_times = np.zeros(n_req)
    chunks = np.zeros(n_req, dtype=np.int64)
    idle_at = {iid: 0.0 for iid in instances}
    max_wait = np.zeros(n_req)
    est_at_enq = np.zeros(n_req, dtype=np.int64)
    est_at_max_wait = np.zeros(n_req, dtype=np.int64)
    rank_len = {
        "true": w.lengths,
        "group_max": np.repeat(w.lengths.max(axis=1, keepdims=True), G, axis=1),
        "prev_group_max": np.repeat(w.prev_lengths.max(axis=1, keepdims=True), G, axis=1),
    }[rc.oracle_rank]  # [prompts, G]
    for p in range(spec.prompts):
        for s in range(G):
            core.add_request(
                RequestInfo(
                    request_id=str(p * G + s),
                    group_id=f"g{p}",
                    prompt_key=f"p{p}",
                    sample_index=s,
                    group_size=G,
                    prompt_len=int(w.prompt_len[p]),
                    max_tokens=spec.max_tokens,
                    true_length=int(rank_len[p, s]),
                )
            )
    events: list[tuple[float, int, str]] = []

    def schedule(inst: Instance) -> None:
        t = inst.next_event()
        if t is not None:
            heapq.heappush(events, (t, inst.version, inst.iid))

    remaining = n_req
    changed = True
    while remaining:
        touched: set[str] = set()
        for d in core.next_dispatches() if changed else ():
            r = int(d.request_id)
            p = r // G
            if start_times[r] < 0:
                start_times[r] = now
            else:
                waited = now - pending_since[r]
                wait_times[r] += waited
                if waited > max_wait[r]:
                    max_wait[r], est_at_max_wait[r] = waited, est_at_enq[r]
            chunks[r] += 1
            inst = instances[d.worker_id]
            rem = int(true_len[r] - generated[r])
            new = min(d.max_new_tokens, rem)
            ctx = int(prompt_len[r] + generated[r])
            prefill = fetch = 0
            if last_inst[r] != d.worker_id:
                if d.fetch_kv:
                    fetch = ctx
                else:
                    cached = int(prompt_len[r]) if d.worker_id in group_insts[p] else 0
                    prefill = ctx - cached
            group_insts[p].add(d.worker_id)
            slot = Slot(
                d.request_id,
                new,
                new == rem,
                int(prompt_len[r]),
                int(generated[r]),
                accepted_per_step(int(finished_in_group[p])),
                prompt_key=f"p{p}",
            )
            inst.add(slot, now, prefill, fetch)
            touched.add(d.worker_id)
        for iid in touched:
            schedule(instances[iid])
        if not events:
            raise RuntimeError(f"deadlock: {core.pending_count()} pending, nothing running")
        t, version, iid = heapq.heappop(events)
        inst = instances[iid]
        changed = version == inst.version
        if not changed:
            continue
        now = t
        for done in inst.on_event(now):
            r = int(done.rid)
            generated[r] = done.generated + done.new_tokens
            last_inst[r] = iid
            pending_since[r] = now
            idle_at[iid] = now
            core.on_chunk_done(
                done.rid, iid, done.new_tokens if rc.policy != "baseline" else int(generated[r]), done.finished
            )
            if not done.finished and rc.policy != "baseline":
                est_at_enq[r] = core.group_estimate(f"g{r // G}")
            if done.finished:
                finish_times[r] = now
                finished_in_group[r // G] += 1
                remaining -= 1
        schedule(inst)
    makespan = float(finish_times.max())
    return SimResult(
        label=label or rc.policy,
        policy=rc.policy,
        makespan=makespan,
        total_tokens=int(true_len.sum()),
        finish_times=finish_times,
        start_times=start_times,
        timeline=timeline,
        preemptions=sum(i.preemptions for i in instances.values()),
        stats=core.stats(),
        wall_seconds=time.perf_counter() - wall0,
        prefill_tokens=sum(i.prefill_tokens for i in instances.values()),
        fetch_tokens=sum(i.fetch_tokens for i in instances.values()),
        wait_times=wait_times,
        chunks=chunks,
        max_wait=max_wait,
        est_at_max_wait=est_at_max_wait,
        last_instance=np.array([int(x[1:]) if x else -1 for x in last_inst], dtype=np.int64),
        instance_idle_at=np.array([idle_at[iid] for iid in sorted(instances)]),
    )
