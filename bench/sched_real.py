"""Real measurement of the scheduling policies through the whole suite (issue 5, item 5).

    python -m bench.sched_real [--quick] [--policies baseline,divided,seer,seer_history]

Starts the suite once (`services.cli.up.Suite`: buffer, scheduler, kvstore, draft, 2 workers on
the embedded SmolLM2-135M, each worker pinned to its own core), then for each policy restarts only
the scheduler with that policy and runs the same two iterations: a warm-up batch (its lengths
become the history priors of seer_history) and the measured batch (same prompt keys, new seeds).
Speculation is off so that only scheduling differs.

Workload: group-correlated long tail that the scheduler cannot see in advance (every group has
the same max_tokens): most groups stop at the first '.' or newline (short), a few never stop
(ignore_eos: they run to max_tokens, the tail). Throughput = generated tokens / wall time of the
measured batch; tail = time from the 90th-percentile finish to the last one. Last line:
RESULT {json}.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seer_client.types import PromptGroup

import argparse
import contextlib
import json
import os
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
    long_every: int  # every n-th group is a long (never-stopping) one

    def prompt_groups(self, seed: int) -> list[PromptGroup]:
        from seer_client.types import PromptGroup, Sampling

        out: list[PromptGroup] = []
        for i in range(self.groups):
            topic = _TOPICS[i % len(_TOPICS)]
            long = i % self.long_every == self.long_every - 1
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


def pin_workers(suite: object) -> dict[str, int]:
    """Pin every thread of each worker process to its own core (round-robin over the cores)."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = {}
    for k, name in enumerate(suite.worker_names):  # type: ignore[attr-defined]
        pid = suite.services[name].pid  # type: ignore[attr-defined]
        core = cores[k % len(cores)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # a thread that just exited
                os.sched_setaffinity(int(tid), {core})
        pinned[name] = core
    return pinned


def switch_policy(suite: object, policy: str, workers: int) -> None:
    s = suite.services["scheduler"]  # type: ignore[attr-defined]
    i = s.args.index("--policy")
    s.args[i + 1] = policy
    suite.restart("scheduler")  # type: ignore[attr-defined]
    suite.wait_workers(workers, timeout=120)  # type: ignore[attr-defined]


def run_batch(client: object, batch_id: str, groups: list[PromptGroup]) -> dict[str, float]:
    t0 = time.monotonic()
    client.submit_batch(batch_id, groups)  # type: ignore[attr-defined]
    finish: list[float] = []
    tokens = 0
    lengths: list[int] = []
    for r in client.iter_results(batch_id):  # type: ignore[attr-defined]
        finish.append(time.monotonic() - t0)
        tokens += len(r.token_ids)
        lengths.append(len(r.token_ids))
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
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sched_real")
    ap.add_argument("--quick", action="store_true", help="a small workload (still starts the whole suite)")
    ap.add_argument("--policies", default="baseline,divided,seer,seer_history")
    ap.add_argument("--groups", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--long-every", type=int, default=0, help="every n-th group never stops (default 6/8)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--warmup",
        choices=("all", "history"),
        default="all",
        help="run the warm-up batch for every policy, or only where it is the history prior",
    )
    args = ap.parse_args(argv)
    from seer_client import SeerClient

    from services.cli.up import Suite
    from services.worker.model.prepare import ensure_model

    wl = RealWorkload(
        groups=args.groups or (6 if args.quick else 16),
        group_size=args.group_size,
        max_tokens=args.max_tokens or (64 if args.quick else 192),
        long_every=args.long_every or (6 if args.quick else 8),
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results: dict[str, dict[str, float]] = {}
    model = ensure_model()
    t_start = time.monotonic()
    with Suite(
        workers=args.workers,
        policy=policies[0],
        speculation=False,
        model_dir=Path(model),
        chunk_size=args.chunk_size,
        threads_per_worker=1,
    ) as suite:
        pinned = pin_workers(suite)
        print(f"suite up in {time.monotonic() - t_start:.1f} s; workers pinned to cores {pinned}", flush=True)
        for n, policy in enumerate(policies):
            if n > 0:
                switch_policy(suite, policy, args.workers)
            with SeerClient(suite.address) as client:
                if args.warmup == "all" or policy == "seer_history":
                    run_batch(client, f"{policy}-warmup", wl.prompt_groups(seed=1))
                res = run_batch(client, f"{policy}-measured", wl.prompt_groups(seed=2))
                stats = suite.scheduler_stats()
                res["dispatched_chunks"] = int(stats.dispatched_chunks)
            results[policy] = res
            print(f"{policy:13s} {json.dumps(res)}", flush=True)
    base = results.get("baseline")
    summary: dict[str, object] = {}
    if base is not None:
        for p, r in results.items():
            summary[f"{p}_throughput_vs_baseline"] = round(r["throughput_tps"] / base["throughput_tps"], 3)
            summary[f"{p}_tail_vs_baseline"] = round(r["tail_s"] / max(1e-9, base["tail_s"]), 3)
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(
        "RESULT "
        + json.dumps(
            {
                "quick": args.quick,
                "workload": wl.__dict__,
                "chunk_size": args.chunk_size,
                "workers": args.workers,
                "warmup": args.warmup,
                **summary,
                "runs": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
