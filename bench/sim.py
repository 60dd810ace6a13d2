"""Cluster simulator: the real scheduler core over simulated instances, beside the Seer paper.

    python -m bench.sim [--quick] [--workloads moonlight,qwen2-vl-72b,kimi-k2] [--out docs/plots]

Per workload it runs one rollout iteration under: baseline (veRL-like), +divided, +context (seer:
Algorithm 2 plus two additions the paper does not have, both the scheduler service's defaults: the
learned correction of group estimates, estimate_quantile 0.9, and KV aging of paused requests,
kv_aging 12; "seer-alg2" is plain Algorithm 2 with both off), +grouped SD (seer with the speculative
acceptance model), seer+history (RhymeRL priors) and oracle (true lengths), all on the same sampled
lengths, and prints the ablation, fraction of oracle and tail time beside the published numbers
(the paper's ablation is for Moonlight and Qwen2-VL-72B only, so only those are averaged against
it). The header lists every scheduler setting where the runs differ from the service's defaults.
--quick scales every workload to 1/8 of its prompts and instances. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.simlib.analysis import tail_report
from bench.simlib.cluster import RunConfig, SimResult, policy_config, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.plots import plot_runs
from bench.simlib.workload import WORKLOADS, describe, make_workload, rank_change_fraction
from services.scheduler.config import SchedulerConfig

# Seer paper: ablation over veRL (Moonlight and Qwen2-VL-72B), fraction of oracle, tail vs veRL.
PAPER = {
    "divided": "1.41-1.42",
    "seer": "1.47-1.56",
    "seer+sd": "1.90-2.04",
    "frac_oracle_context": "0.96",
    "tail_context": "0.11",
}
# The workloads the paper's ablation (and its fraction of oracle) is measured on: only these are
# averaged for the comparison. Kimi-K2's figures are printed as its own, with no paper column.
PAPER_WORKLOADS = ("moonlight", "qwen2-vl-72b")
TARGETS = {"frac_oracle_context": 0.95, "frac_oracle_history": 0.98, "tail_max": 0.10}

RUNS: list[tuple[str, RunConfig]] = [
    ("baseline", RunConfig("baseline")),
    ("divided", RunConfig("divided")),
    ("seer", RunConfig("seer")),
    ("seer+sd", RunConfig("seer", speculative=True)),
    ("seer_history", RunConfig("seer_history")),
    ("oracle", RunConfig("oracle")),
]
# Variants and bounds (not plotted): plain Algorithm 2 (seer without the learned estimate correction
# and without KV aging: what the paper describes); seer and seer_history without aging of paused requests under KV
# contention (kv_aging 0: the order of session 3); seer ranked by estimated remaining length (LRPT); seer that
# resumes a request paused mid-response after half a chunk's duration (starvation_chunks); the oracle
# by true remaining length (LRPT: the paper's oracle ranks by total length, which is not the best
# schedule with full knowledge); the oracle ranking every member by its group's true maximum (what
# perfect group estimates give: the ceiling of Algorithm 2's group-level ranking); the
# history-oracle ranking by the previous iteration's exact group maximum (the ceiling of any
# longest-first ranking by last iteration's lengths; seer_history can beat it where those lengths
# say the KV demand binds, not the critical path, and it serves FIFO there).
BOUNDS: list[tuple[str, RunConfig]] = [
    ("seer-alg2", RunConfig("seer", estimate_quantile=0.0, kv_aging=0.0)),
    ("seer-no-aging", RunConfig("seer", kv_aging=0.0)),
    ("history-no-aging", RunConfig("seer_history", kv_aging=0.0)),
    ("seer-lrpt", RunConfig("seer", order="remaining")),
    ("seer-resume", RunConfig("seer", starvation_chunks=0.5)),
    ("oracle-lrpt", RunConfig("oracle", order="remaining")),
    ("group-oracle", RunConfig("oracle", oracle_rank="group_max")),
    ("history-oracle", RunConfig("oracle", oracle_rank="prev_group_max")),
]
PLOTTED = [label for label, _ in RUNS]


def run_workload(
    name: str, scale: float, chunk_size: int, seed: int, out: Path | None, bounds: bool = True
) -> dict[str, object]:
    spec = WORKLOADS[name].scaled(scale) if scale != 1.0 else WORKLOADS[name]
    w = make_workload(spec, seed=seed)
    model = INSTANCE_MODELS[name]
    results: dict[str, SimResult] = {}
    for label, rc in RUNS + (BOUNDS if bounds else []):
        results[label] = simulate(w, model, dataclasses.replace(rc, chunk_size=chunk_size), label=label)
    base, oracle = results["baseline"], results["oracle"]
    row: dict[str, object] = {
        "key": name,
        "workload": spec.name,
        "model": describe(spec),
        "requests": w.num_requests,
        "instances": spec.instances,
        "mean_len": round(float(w.lengths.mean())),
        "group_rank_changes": round(rank_change_fraction(w), 3),
        "makespan_s": {k: round(r.makespan, 1) for k, r in results.items()},
        "speedup": {k: round(base.makespan / r.makespan, 3) for k, r in results.items()},
        "frac_oracle": {k: round(oracle.makespan / r.makespan, 3) for k, r in results.items()},
        "tail_vs_baseline": {k: round(r.tail_time / base.tail_time, 3) for k, r in results.items()},
        "tail_analysis": {k: tail_report(w, model, results[k], base) for k in ("seer", "seer_history", "oracle")},
        "baseline_preemptions": base.preemptions,
        "wall_s": {k: round(r.wall_seconds, 1) for k, r in results.items()},
    }
    if out is not None:
        peak = spec.instances * model.max_batch / model.step_time(model.max_batch, model.max_batch * spec.prompt_mean)
        path = plot_runs(
            f"{spec.name}: {w.num_requests} requests, {spec.instances} instances (simulated)",
            [results[k] for k in PLOTTED],
            out / f"sim_{name}.png",
            peak,
        )
        row["plot"] = str(path)
    return row


def print_row(row: dict[str, object]) -> None:
    sp, fo, tv, mk = (row[k] for k in ("speedup", "frac_oracle", "tail_vs_baseline", "makespan_s"))
    assert isinstance(sp, dict) and isinstance(fo, dict) and isinstance(tv, dict) and isinstance(mk, dict)
    print(
        f"\n== {row['workload']}: {row['requests']} requests, {row['instances']} instances, "
        f"mean {row['mean_len']} tokens, baseline preemptions {row['baseline_preemptions']}"
    )
    print(f"   {row['model']}; groups changing rank by >25%: {row['group_rank_changes']}")
    # The paper's ablation column only beside the workloads it was measured on.
    paper: dict[str, str] | None = (
        {"baseline": "1.00", **{k: v for k, v in PAPER.items() if k in ("divided", "seer", "seer+sd")}}
        if row["key"] in PAPER_WORKLOADS
        else None
    )
    pcol = f" {'paper':>10s}" if paper is not None else ""
    print(f"{'policy':16s} {'makespan s':>10s} {'speedup':>8s}{pcol} {'of oracle':>9s} {'tail/base':>9s}")
    for k in mk:
        pcell = f" {paper.get(k, '-'):>10s}" if paper is not None else ""
        print(f"{k:16s} {mk[k]:10.0f} {sp[k]:8.2f}{pcell} {fo[k]:9.3f} {tv[k]:9.2f}")
    ta = row["tail_analysis"]
    assert isinstance(ta, dict)
    print("   where the tail comes from (the last 10% of requests to finish):")
    for k, a in ta.items():
        est = a["tail_median_estimate_over_true"]
        est_s = "n/a (no tail request waited)" if est is None else f"{est:.2f}"
        print(
            f"   {k:13s} tail {a['tail_s']:.0f} s; group's longest member {a['tail_group_longest_frac']:.0%}; "
            f"median length {a['tail_median_len']}; median queued between chunks {a['tail_median_queued_s']:.0f} s "
            f"({a['tail_median_queued_frac_of_makespan']:.0%} of makespan); group estimate at its longest pause / "
            f"true length {est_s}; started after 10% of makespan "
            f"{a['tail_started_after_10pct_frac']:.0%}; instances ran dry over {a['instances_idle_spread_s']:.0f} s"
        )
    a0 = next(iter(ta.values()))
    print(
        f"   floor: the longest response alone at batch 1 takes {a0['longest_alone_s']:.0f} s "
        f"({a0['longest_alone_vs_baseline_tail']:.2f}x the baseline tail); only starting it early hides it"
    )


def setting_differences(runs: list[tuple[str, RunConfig]], chunk_size: int) -> dict[str, dict[str, list[object]]]:
    """Per run label: {setting: [simulator value, service default]} for every scheduler policy
    setting where the run differs from the scheduler service's defaults (SchedulerConfig(), read
    here rather than copied, so a changed service default shows up). The policy itself is left out:
    each row is named by it."""
    service = SchedulerConfig().policy_config()
    out: dict[str, dict[str, list[object]]] = {}
    for label, rc in runs:
        cfg = policy_config(dataclasses.replace(rc, chunk_size=chunk_size))
        out[label] = {
            f.name: [getattr(cfg, f.name), getattr(service, f.name)]
            for f in dataclasses.fields(cfg)
            if f.name != "policy" and getattr(cfg, f.name) != getattr(service, f.name)
        }
    return out


# Why the simulator departs from a service default (printed beside the setting).
_WHY = {
    "use_worker_free_pages": "no other tenant's KV to subtract",
}


def print_settings(diffs: dict[str, dict[str, list[object]]]) -> dict[str, dict[str, list[object]]]:
    """Print the differences shared by every run, then each run's own; returns them in that shape."""
    runs = list(diffs.values())
    common = {k: v for k, v in runs[0].items() if all(r.get(k) == v for r in runs)} if runs else {}
    own = {label: {k: v for k, v in d.items() if k not in common} for label, d in diffs.items()}
    own = {label: d for label, d in own.items() if d}

    def fmt_settings(d: dict[str, list[object]]) -> str:
        def setting(x: object) -> str:
            return f"{x:g}" if isinstance(x, float) else str(x)

        return "; ".join(
            f"{k} {setting(v[0])} (service {setting(v[1])}{': ' + _WHY[k] if k in _WHY else ''})"
            for k, v in d.items()
        )

    print(
        "scheduler settings that differ from the service's defaults (SchedulerConfig(), services/scheduler/config.py):"
    )
    print(f"   every run: {fmt_settings(common) or 'none'}")
    for label, d in own.items():
        print(f"   {label}: {fmt_settings(d)}")
    return {"every_run": common, **own}


def _mean(rows: list[dict[str, object]], key: str, policy: str) -> float | None:
    vals = [float(r[key][policy]) for r in rows]  # type: ignore[index]
    return round(sum(vals) / len(vals), 3) if vals else None


def _fmt(x: object) -> str:
    """A summary figure, or n/a when no workload contributed to it."""
    return "n/a" if x is None else f"{x}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/8 scale (under 60 s)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/plots", help="directory for PNG plots ('' = none)")
    ap.add_argument("--no-bounds", action="store_true", help="skip the variant and bound runs (LRPT, oracles)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {n!r} (known: {', '.join(WORKLOADS)})")
    out = Path(args.out) if args.out else None
    if out is not None and args.quick:
        out = out / "quick"
    t0 = time.perf_counter()
    settings = print_settings(setting_differences(RUNS + ([] if args.no_bounds else BOUNDS), args.chunk_size))
    rows = []
    for n in names:
        row = run_workload(n, 0.125 if args.quick else 1.0, args.chunk_size, args.seed, out, bounds=not args.no_bounds)
        print_row(row)
        rows.append(row)
    paper_rows = [r for r in rows if r["key"] in PAPER_WORKLOADS]
    other_rows = [r for r in rows if r["key"] not in PAPER_WORKLOADS]
    paper_names = [str(r["workload"]) for r in paper_rows]
    other_names = [str(r["workload"]) for r in other_rows]

    ablation = ["divided", "seer", "seer-alg2", "seer+sd"] if not args.no_bounds else ["divided", "seer", "seer+sd"]
    summary: dict[str, object] = {
        "paper_workloads": paper_names,
        # Ablation: means over the paper's workloads only (None where none of them ran).
        "speedup_divided": _mean(paper_rows, "speedup", "divided"),
        "speedup_context": _mean(paper_rows, "speedup", "seer"),
        "speedup_context_alg2": _mean(paper_rows, "speedup", "seer-alg2") if not args.no_bounds else None,
        "speedup_grouped_sd": _mean(paper_rows, "speedup", "seer+sd"),
        # Fraction of oracle and tail: means over every workload run, Kimi-K2 included as measured
        # (its fraction can exceed 1: the oracle is not an upper bound there), and over the paper's
        # workloads only.
        "frac_oracle_context": _mean(rows, "frac_oracle", "seer"),
        "frac_oracle_history": _mean(rows, "frac_oracle", "seer_history"),
        "tail_context": _mean(rows, "tail_vs_baseline", "seer"),
        "tail_grouped_sd": _mean(rows, "tail_vs_baseline", "seer+sd"),
        "tail_history": _mean(rows, "tail_vs_baseline", "seer_history"),
        "frac_oracle_context_paper_workloads": _mean(paper_rows, "frac_oracle", "seer"),
        "frac_oracle_history_paper_workloads": _mean(paper_rows, "frac_oracle", "seer_history"),
        "tail_context_paper_workloads": _mean(paper_rows, "tail_vs_baseline", "seer"),
        "tail_history_paper_workloads": _mean(paper_rows, "tail_vs_baseline", "seer_history"),
    }
    print(
        "\noracle = longest-first by true total length (Seer section 5); tail = makespan - 90th "
        "percentile finish (time spent on the last 10% of requests); anti-starvation as in the service (one "
        "iteration is one submission: nothing newer postpones a request, so it never applies). seer = Algorithm 2 "
        "+ the learned correction of group estimates (estimate_quantile) + KV aging of paused requests "
        "(kv_aging), the service's defaults; seer-alg2 = plain "
        "Algorithm 2 (both off). The paper's oracle is not an upper bound where the cluster is KV-bound (Kimi-K2): "
        "longest-first fills the KV with the longest contexts, so fewer requests share a step; oracle-lrpt and even "
        "divided (FIFO) can beat it there"
    )
    paper_all = ", ".join(WORKLOADS[k].name for k in PAPER_WORKLOADS)
    print(f"\n== ablation vs paper (speedup over baseline; paper: {paper_all} only)")
    print(f"{'workload':14s} " + " ".join(f"{k:>10s}" for k in ablation))
    for r in rows:
        sp = r["speedup"]
        assert isinstance(sp, dict)
        tag = "" if r["key"] in PAPER_WORKLOADS else "  (not in the paper's ablation)"
        print(f"{r['workload']!s:14s} " + " ".join(f"{sp[k]:10.3f}" for k in ablation) + tag)
    if paper_rows:
        print(
            f"mean over {', '.join(paper_names)}: divided {summary['speedup_divided']} (paper {PAPER['divided']}), "
            f"+context {summary['speedup_context']} (paper {PAPER['seer']}; plain Algorithm 2: "
            f"{_fmt(summary['speedup_context_alg2'])}), "
            f"+grouped SD {summary['speedup_grouped_sd']} (paper {PAPER['seer+sd']})"
        )
    else:
        print("mean over the paper's workloads: n/a (none of them ran)")
    excl = f" (without {', '.join(other_names)})" if other_names else ""
    print("\n== fraction of oracle / tail vs baseline vs paper / targets")
    kimi_note = (
        f" ({', '.join(other_names)} included as measured: its oracle is no upper bound, so its fraction may exceed 1)"
        if other_names
        else ""
    )
    print(
        f"fraction of oracle, mean over all {len(rows)} workloads{kimi_note}: "
        f"context-aware {summary['frac_oracle_context']} (target >= {TARGETS['frac_oracle_context']}), "
        f"history-aware {summary['frac_oracle_history']} (target >= {TARGETS['frac_oracle_history']})"
    )
    # The paper's figures sit beside the means over the paper's own workloads only (PAPER_WORKLOADS).
    print(
        f"fraction of oracle, mean over {', '.join(paper_names) or 'none'}{excl}: context-aware "
        f"{_fmt(summary['frac_oracle_context_paper_workloads'])} (paper {PAPER['frac_oracle_context']}), "
        f"history-aware {_fmt(summary['frac_oracle_history_paper_workloads'])}"
    )
    print(
        f"tail time vs baseline, mean over all: context-aware {summary['tail_context']}, +grouped SD "
        f"{summary['tail_grouped_sd']}, history-aware {summary['tail_history']} (target <= {TARGETS['tail_max']}); "
        f"over {', '.join(paper_names) or 'none'}: context-aware {_fmt(summary['tail_context_paper_workloads'])} "
        f"(paper {PAPER['tail_context']}), history-aware {_fmt(summary['tail_history_paper_workloads'])}"
    )
    per_workload = {
        str(r["workload"]): {
            "speedup": {k: v for k, v in r["speedup"].items() if k != "baseline"},  # type: ignore[attr-defined]
            "frac_oracle": {k: v for k, v in r["frac_oracle"].items() if k != "baseline"},  # type: ignore[attr-defined]
            "tail_vs_baseline": {k: v for k, v in r["tail_vs_baseline"].items() if k != "baseline"},  # type: ignore[attr-defined]
        }
        for r in rows
    }
    print("\n== per workload (the targets apply to each): fraction of oracle / tail vs baseline")
    cols = [
        "seer",
        "seer-alg2",
        "seer-no-aging",
        "seer-lrpt",
        "seer-resume",
        "seer_history",
        "history-no-aging",
        "history-oracle",
        "group-oracle",
        "oracle-lrpt",
    ]
    print(f"{'workload':14s} " + " ".join(f"{c:>16s}" for c in cols))
    for wname, v in per_workload.items():
        cells = [
            f"{v['frac_oracle'][c]:.3f} / {v['tail_vs_baseline'][c]:.2f}" if c in v["frac_oracle"] else "-"
            for c in cols
        ]
        print(f"{wname:14s} " + " ".join(f"{x:>16s}" for x in cells))
    print(
        "seer-alg2: plain Algorithm 2 (estimate_quantile 0, kv_aging 0); "
        "history-oracle: ranks by the previous iteration's exact group maximum (the ceiling of ranking by "
        "history priors under the modelled correlation; seer_history serves FIFO instead while KV-bound where "
        "the history's KV demand exceeds what the KV serves within the longest response); "
        "group-oracle: ranks by this iteration's true group maximum "
        "(perfect group estimates); oracle-lrpt: true remaining length first; seer-resume: seer resuming a "
        "request paused mid-response after half a chunk's duration; *-no-aging: kv_aging 0 (paused requests do "
        "not age under KV contention among started requests)"
    )
    print(f"wall {time.perf_counter() - t0:.1f} s")
    summary["per_workload"] = per_workload
    summary["settings_vs_service"] = settings
    print("RESULT " + json.dumps({"quick": args.quick, "chunk_size": args.chunk_size, **summary, "workloads": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
