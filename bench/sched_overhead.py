"""Scheduling overhead: the time of one decision with 10,000 pending requests (target <= 1 ms).

    python -m bench.sched_overhead [--quick] [--pending 10000] [--workers 32]

For each policy: fill the core with `pending` requests (groups of 8, lengths and history priors
random) over `workers` workers, then time single decisions (next_dispatches(limit=1)) each followed
by the chunk outcome, so the queue stays at its size while estimates change. Reports p50/p99/max.
Then, for seer and seer_history, decision rounds while the workers are KV-bound with every waiting
request started (paused requests age, services/scheduler/core/pressure.py), and the cost of the
round that switches into that state (a switch of queue: the aged keys are kept as requests are
queued, and those queued before the aging unit was known are keyed 128 per decision).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque

from services.scheduler.core import POLICIES, RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec


def measure(policy: str, pending: int, workers: int, decisions: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    core = SchedulerCore(SchedulerPolicyConfig(policy=policy, chunk_size=512), clock=time.monotonic)
    for k in range(workers):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=1_000_000, page_size=16, max_batch_size=10**6))
    g = 8
    for p in range(pending // g):
        core.set_history(f"k{p}", [rng.randint(16, 32_000) for _ in range(g)])
        for s in range(g):
            core.add_request(
                RequestInfo(
                    f"{p}-{s}",
                    f"g{p}",
                    f"k{p}",
                    s,
                    g,
                    prompt_len=rng.randint(64, 2048),
                    max_tokens=32_768,
                    true_length=rng.randint(16, 32_768),
                )
            )
    times: list[float] = []
    cpu: list[float] = []
    for i in range(decisions):
        t0, c0 = time.perf_counter(), time.thread_time()
        ds = core.next_dispatches(limit=1)
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        for d in ds:
            # Half of the chunks end their request, so group estimates change and siblings re-key.
            core.on_chunk_done(d.request_id, d.worker_id, d.max_new_tokens, finished=i % 2 == 0)
    times.sort()
    cpu.sort()
    return {
        "pending_at_end": core.pending_count(),
        # CPU time of the deciding thread: what the decision costs, without the waits for a core
        # on this shared 2-core machine (wall-clock percentiles below include them).
        "cpu_p50_ms": round(cpu[len(cpu) // 2] * 1e3, 4),
        "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1e3, 4),
        "cpu_mean_ms": round(sum(cpu) / len(cpu) * 1e3, 4),
        "p50_ms": round(times[len(times) // 2] * 1e3, 4),
        "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 4),
        "max_ms": round(times[-1] * 1e3, 4),
    }


def measure_kv_bound(policy: str, pending: int, workers: int, decisions: int, seed: int = 0) -> dict[str, float]:
    """Decision rounds while the cluster is KV-bound with every waiting request started (the state
    in which seer ages paused requests): each round follows one chunk's completion and dispatches
    what fits (next_dispatches() without a limit), so it includes the admission lookahead over
    candidates that do not fit and the detector's observations. The switch into contention
    happens during the warm-up rounds, which are timed separately (`switch_round_ms`)."""
    rng = random.Random(seed)
    core = SchedulerCore(SchedulerPolicyConfig(policy=policy, chunk_size=512, starvation_seconds=1e9))
    # About 16 requests' KV per worker (pages of 16 tokens): most of the pending ones wait for KV.
    for k in range(workers):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=4_000, page_size=16, max_batch_size=10**6))
    g = 8
    for p in range(pending // g):
        core.set_history(f"k{p}", [rng.randint(16, 32_000) for _ in range(g)])
        for s in range(g):
            core.add_request(
                RequestInfo(
                    f"{p}-{s}",
                    f"g{p}",
                    f"k{p}",
                    s,
                    g,
                    prompt_len=rng.randint(64, 2048),
                    max_tokens=32_768,
                    generated=rng.randint(1, 4096),  # started before: paused at a chunk boundary
                    true_length=rng.randint(4097, 32_768),
                )
            )
    in_flight = deque(core.next_dispatches())
    cpu: list[float] = []
    switch_round = 0.0
    for i in range(100 + decisions):
        d = in_flight.popleft()
        core.on_chunk_done(d.request_id, d.worker_id, d.max_new_tokens, finished=i % 2 == 0)
        c0 = time.thread_time()
        ds = core.next_dispatches()
        dt = time.thread_time() - c0
        switches = core.stats()["contention_switches"]
        if i < 100:
            if switches and not switch_round:
                switch_round = dt
        else:
            cpu.append(dt)
        in_flight.extend(ds)
    cpu.sort()
    st = core.stats()
    return {
        "pending_at_end": core.pending_count(),
        "in_flight": core.in_flight_count(),
        "started_contention": float(bool(st["started_contention"])),
        "switch_round_ms": round(switch_round * 1e3, 3),
        "cpu_p50_ms": round(cpu[len(cpu) // 2] * 1e3, 4),
        "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1e3, 4),
        "cpu_mean_ms": round(sum(cpu) / len(cpu) * 1e3, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sched_overhead")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--decisions", type=int, default=0, help="decisions to time (default 2000, quick 500)")
    args = ap.parse_args(argv)
    decisions = args.decisions or (500 if args.quick else 2000)
    out: dict[str, object] = {"pending": args.pending, "workers": args.workers, "decisions": decisions}
    worst = 0.0
    for policy in POLICIES:
        if policy == "baseline":
            continue  # no per-chunk decisions: every request is dispatched once, to completion
        r = measure(policy, args.pending, args.workers, decisions)
        worst = max(worst, r["cpu_p99_ms"])
        out[policy] = r
        print(
            f"{policy:13s} cpu p50 {r['cpu_p50_ms']:.3f} ms p99 {r['cpu_p99_ms']:.3f} ms | wall p50 "
            f"{r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms max {r['max_ms']:.3f} ms "
            f"({r['pending_at_end']} pending)"
        )
    for policy in ("seer", "seer_history"):
        r = measure_kv_bound(policy, args.pending, args.workers, decisions)
        worst = max(worst, r["cpu_p99_ms"])
        out[f"{policy}_kv_bound"] = r
        print(
            f"{policy + ' KV-bound':22s} cpu p50 {r['cpu_p50_ms']:.3f} ms p99 {r['cpu_p99_ms']:.3f} ms "
            f"(contention {bool(r['started_contention'])}, the switch round {r['switch_round_ms']:.1f} ms; "
            f"{r['in_flight']} in flight, {r['pending_at_end']} pending)"
        )
    out["worst_cpu_p99_ms"] = worst
    out["target_ms"] = 1.0
    out["ok"] = worst <= 1.0
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
