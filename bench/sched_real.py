"""Real measurement of the scheduling policies through the whole suite (issue 5, item 5).

    python -m bench.sched_real [--quick] [--reps N] [--policies baseline,divided,seer,seer_history]

Starts the suite once (`services.cli.up.Suite`: buffer, scheduler, kvstore, draft, 2 workers on
the embedded SmolLM2-135M, worker i pinned to CPU i with one thread, so the two workers never share
a core), runs one warm-up batch (model warm-up; its lengths become the history of every prompt
key), then interleaved repetitions: in every repetition each policy in turn (the scheduler alone
is restarted with that policy) runs the same measured batch (same prompts, same base seeds and one
seed scope per repetition, so every arm samples the same responses and does the same work; a new
seed per repetition; seer_history runs first so its priors are another sample's, and the other
arms rotate, see arm_order).
Speculation is off so that only scheduling differs. Ratios are taken within a
repetition (side by side, seconds apart); the summary gives their median and range over reps.

Workload: group-correlated long tail that the scheduler cannot see in advance (every group has
the same max_tokens): most prompts stop at the first '.' or newline (short), every n-th prompt
never stops (ignore_eos: it runs to max_tokens, the tail); long-ness belongs to the prompt key, so
the warm-up's history predicts it. The submission order is shuffled per repetition and stratified:
in even repetitions the baseline's round-robin puts the long groups on the same worker (the
collision random placement makes half of the time), in odd ones it spreads them; the summary gives
both strata and the pooled tail ratio (sum of tails over repetitions / sum of baseline tails), so
the result does not hang on placement luck or on a few seconds of noise in one tail. Workers take
at most --max-batch requests at a time, so requests queue and the order matters. Throughput =
generated tokens / wall time of the batch; tail = time from the 90th-percentile finish to the last
one. Last line: RESULT {json}.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seer_client.types import PromptGroup

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_SHORT = [30, 198]  # '.', '\n' in the SmolLM2 tokenizer

_TOPICS = [
    "the sea",
    "a red fox",
    "mountains",
    "a old clock",
    "rain",
    "the moon",
    "a library",
    "bread",
    "a river",
    "winter",
    "a violin",
    "the desert",
    "a lighthouse",
    "bees",
    "a train",
    "snow",
]


@dataclass(frozen=True)
class RealWorkload:
    groups: int
    group_size: int
    max_tokens: int
    long_every: int  # every n-th prompt is a long (never-stopping) one

    def is_long(self, i: int) -> bool:
        """Long-ness belongs to the prompt (its key), as in RL data: the history of a key predicts it."""
        return i % self.long_every == self.long_every - 1

    def submission_order(self, rep: int, workers: int) -> list[int]:
        """Prompt indices in the order of submission for repetition `rep`: shuffled (seeded), with
        the long prompts landing on the same round-robin worker in even repetitions and spread in
        odd ones, so that the baseline's placement luck is stratified, not drawn."""
        order = list(range(self.groups))
        random.Random(rep).shuffle(order)
        want_collide = rep % 2 == 0
        if workers > 1 and self.collides(order, workers) != want_collide:
            longs = [p for p, i in enumerate(order) if self.is_long(i)]
            if len(longs) >= 2:
                # Move the last long prompt to a position with the wanted residue (swap with a short one).
                target = longs[0] % workers
                for p in range(len(order)):
                    if self.is_long(order[p]):
                        continue
                    if (p % workers == target) == want_collide:
                        order[p], order[longs[-1]] = order[longs[-1]], order[p]
                        if self.collides(order, workers) == want_collide:
                            break
                        order[p], order[longs[-1]] = order[longs[-1]], order[p]
        return order

    def collides(self, order: list[int], workers: int) -> bool:
        """Whether the baseline's round-robin puts every long prompt on the same worker."""
        longs = [p for p, i in enumerate(order) if self.is_long(i)]
        return len(longs) >= 2 and len({p % workers for p in longs}) == 1

    def prompt_groups(self, seed: int, order: list[int] | None = None) -> list[PromptGroup]:
        from seer_client.types import PromptGroup, Sampling

        out: list[PromptGroup] = []
        for i in order if order is not None else range(self.groups):
            topic = _TOPICS[i % len(_TOPICS)]
            long = self.is_long(i)
            sampling = Sampling(
                temperature=1.0, seed=seed * 1000 + i, ignore_eos=long, stop_token_ids=() if long else _SHORT
            )
            out.append(
                PromptGroup(
                    prompt=f"Write about {topic}.",
                    group_size=self.group_size,
                    max_tokens=self.max_tokens,
                    prompt_key=f"real-{i}",
                    sampling=sampling,
                )
            )
        return out


def switch_policy(suite: object, policy: str, workers: int) -> None:
    s = suite.services["scheduler"]  # type: ignore[attr-defined]
    i = s.args.index("--policy")
    if s.args[i + 1] == policy:
        return
    s.args[i + 1] = policy
    suite.restart("scheduler")  # type: ignore[attr-defined]
    suite.wait_workers(workers, timeout=120)  # type: ignore[attr-defined]


def contention_events(suite: object) -> int:
    """How many times the scheduler has logged entering KV contention among started requests (the
    state in which seer ages paused requests, services/scheduler/core/pressure.py) so far."""
    path = suite.services["scheduler"].stderr_path  # type: ignore[attr-defined]
    try:
        return path.read_text(errors="replace").count("contention among started requests")
    except OSError:
        return 0


def run_batch(client: object, batch_id: str, groups: list[PromptGroup], seed_scope: str = "") -> dict[str, float]:
    t0 = time.monotonic()
    client.submit_batch(batch_id, groups, seed_scope=seed_scope)  # type: ignore[attr-defined]
    finish: list[float] = []
    tokens = 0
    lengths: list[int] = []
    kv = dict.fromkeys(("prefill_tokens", "cached_tokens", "kv_loaded_tokens"), 0)
    for r in client.iter_results(batch_id):  # type: ignore[attr-defined]
        finish.append(time.monotonic() - t0)
        tokens += len(r.token_ids)
        lengths.append(len(r.token_ids))
        for k in kv:
            kv[k] += int(r.stats.get(k, 0))
    finish.sort()
    makespan = finish[-1]
    t90 = finish[max(0, int(0.9 * len(finish)) - 1)]
    return {
        "makespan_s": round(makespan, 2),
        "tokens": tokens,
        "throughput_tps": round(tokens / makespan, 2),
        "tail_s": round(makespan - t90, 2),
        "requests": len(finish),
        "mean_len": round(tokens / len(finish), 1),
        "max_len": max(lengths),
        # Where resumed contexts came from: computed, found in the worker's prefix cache, or
        # loaded from the KV store. Arms of one repetition sample the same tokens, so pages an
        # earlier arm left cached can serve a later one (arm_order rotates who comes later).
        **kv,
    }


def arm_order(policies: list[str], rep: int) -> list[str]:
    """The arms of repetition `rep`: seer_history first, the others rotated by `rep`.

    All arms of a repetition share a seed scope (the same samples, so the same work: only the
    schedule differs), and a finished batch becomes its prompt keys' history. Run after another
    arm of its repetition, seer_history's priors would be this very batch's lengths (an oracle);
    run first, they come from the previous repetition (or the warm-up), another sample of the same
    prompts, as a previous RL iteration would be. The others rotate because identical samples give
    identical KV pages: a later arm may find pages an earlier one left in a prefix cache or the KV
    store, and no policy should always be the one that does."""
    rest = [p for p in policies if p != "seer_history"]
    k = rep % len(rest) if rest else 0
    return [p for p in policies if p == "seer_history"] + rest[k:] + rest[:k]


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sched_real")
    ap.add_argument("--quick", action="store_true", help="a small workload, one repetition (under 60 s)")
    ap.add_argument("--policies", default="baseline,divided,seer,seer_history")
    ap.add_argument("--reps", type=int, default=0, help="interleaved repetitions (default 1 quick, 4 full)")
    ap.add_argument("--groups", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=0,
        help="max new tokens per chunk (default max_tokens // 3: a long response runs in 3 chunks; smaller "
        "chunks add per-chunk round trips that compete with the workers for the 2 cores)",
    )
    ap.add_argument("--max-batch", type=int, default=4, help="max requests a worker decodes at once")
    ap.add_argument("--long-every", type=int, default=0, help="every n-th group never stops (default 4)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    from seer_client import SeerClient

    from services.cli.up import Suite
    from services.worker.model.prepare import ensure_model

    wl = RealWorkload(
        groups=args.groups or (4 if args.quick else 10),
        group_size=args.group_size,
        max_tokens=args.max_tokens or (24 if args.quick else 96),
        long_every=args.long_every or 4,
    )
    reps = args.reps or (1 if args.quick else 4)
    chunk_size = args.chunk_size or max(1, wl.max_tokens // 3)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or reps < 1:
        ap.error("need at least one policy and one repetition")
    cores = sorted(os.sched_getaffinity(0))
    pins = [cores[i % len(cores)] for i in range(args.workers)]
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    model = ensure_model()
    t_start = time.monotonic()
    # The warm-up runs under a policy without priors: a scheduler fetches a key's history once,
    # so one started as seer_history would have fetched "none yet" for every key before it.
    start_policy = next((p for p in policies if p != "seer_history"), "divided")
    with Suite(
        workers=args.workers,
        policy=start_policy,
        speculation=False,
        model_dir=Path(model),
        chunk_size=chunk_size,
        threads_per_worker=1,
        cpu_affinity=pins,
        extra_args={f"worker-{i}": ["--max-batch-size", str(args.max_batch)] for i in range(args.workers)},
    ) as suite:
        print(f"suite up in {time.monotonic() - t_start:.1f} s; worker i pinned to CPU {pins}", flush=True)
        with SeerClient(suite.address) as client:
            run_batch(client, "warmup", wl.prompt_groups(seed=1))
        for rep in range(reps):
            order = wl.submission_order(rep, args.workers)
            for policy in arm_order(policies, rep):
                switch_policy(suite, policy, args.workers)
                before = contention_events(suite)
                chunks_before = int(suite.scheduler_stats().dispatched_chunks)
                with SeerClient(suite.address) as client:
                    res = run_batch(client, f"{policy}-{rep}", wl.prompt_groups(seed=100 + rep, order=order),
                                    seed_scope=f"rep-{rep}")
                # The counter runs since the scheduler started (the warm-up, or an earlier
                # repetition when the policy did not change): this batch's chunks only.
                res["dispatched_chunks"] = int(suite.scheduler_stats().dispatched_chunks) - chunks_before
                # 0 where the workers were never KV-bound with every waiting request started: then
                # seer's order is Algorithm 2's, unchanged by kv_aging.
                res["kv_contention_events"] = contention_events(suite) - before
                res["long_collide"] = wl.collides(order, args.workers)
                runs[policy].append(res)
                print(f"rep {rep} {policy:13s} {json.dumps(res)}", flush=True)
    summary: dict[str, object] = {}
    if "baseline" in runs:
        for p, rs in runs.items():
            thr = [r["throughput_tps"] / b["throughput_tps"] for r, b in zip(rs, runs["baseline"], strict=True)]
            tail = [r["tail_s"] / max(1e-9, b["tail_s"]) for r, b in zip(rs, runs["baseline"], strict=True)]
            summary[f"{p}_throughput_vs_baseline"] = spread(thr)
            summary[f"{p}_tail_vs_baseline"] = spread(tail)
            # Pooled over repetitions (sum of tails / sum of baseline tails): robust to the few
            # seconds of noise on a single short tail.
            summary[f"{p}_tail_vs_baseline_pooled"] = round(
                sum(r["tail_s"] for r in rs) / max(1e-9, sum(b["tail_s"] for b in runs["baseline"])), 3
            )
            for name, want in (("collide", True), ("spread", False)):
                sel = [i for i, b in enumerate(runs["baseline"]) if b["long_collide"] == want]
                if sel:
                    summary[f"{p}_throughput_vs_baseline_{name}"] = spread([thr[i] for i in sel])
                    summary[f"{p}_tail_vs_baseline_{name}"] = spread([tail[i] for i in sel])
    # With one seed scope per repetition the arms sample the same responses: a repetition whose arms
    # generated different token counts had a sample flip (float rounding) and compares unequal work.
    summary["reps_with_equal_work"] = sum(
        len({runs[p][r]["tokens"] for p in policies}) == 1 for r in range(reps))
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"wall {time.monotonic() - t_start:.1f} s")
    print(
        "RESULT "
        + json.dumps(
            {
                "quick": args.quick,
                "workload": wl.__dict__,
                "chunk_size": chunk_size,
                "max_batch": args.max_batch,
                "workers": args.workers,
                "pinned_cpus": pins,
                "reps": reps,
                **summary,
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
