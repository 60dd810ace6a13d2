"""bench/sim.py and bench/simlib: the baseline engine's preemption victim and prefix cache, the
summary's scope against the paper, the printed settings that differ from the service's defaults,
and n/a where no tail request waited (the simulator audit, docs/research/sim_audit/)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench import sim
from bench.simlib.analysis import tail_report
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.instance import Instance, Slot
from bench.simlib.model import INSTANCE_MODELS, InstanceModel
from bench.simlib.timeline import Timeline
from bench.simlib.workload import WORKLOADS, make_workload
from services.scheduler.config import SchedulerConfig


def _run_until_first_preemption(inst: Instance) -> None:
    while inst.preemptions == 0:
        t = inst.next_event()
        assert t is not None
        inst.on_event(t)


def test_baseline_preempts_the_most_recently_admitted_request() -> None:
    """A short request finishing swaps the last slot into its place; the victim must still be the
    newest admission (vLLM's), not whichever request now sits last."""
    m = InstanceModel(a=0.01, b=0.0, c=0.0, prefill_tps=1e12, kv_tokens=10_000, max_batch=8)
    inst = Instance("i0", m, Timeline(1.0), speculative=False, engine_admission=True)
    lens = {"A": 4000, "B": 10, "C": 4000, "D": 4000}  # admitted A, B, C, D; B finishes first
    for rid in "ABCD":
        inst.add(Slot(rid, lens[rid], True, 100, 0, 1.0), 0.0, 0, 0)
    t = inst.next_event()
    assert t is not None
    assert [s.rid for s in inst.on_event(t)] == ["B"]
    _run_until_first_preemption(inst)
    assert inst.waiting[0].rid == "D"


def test_baseline_prefix_cache_prefills_a_prompt_once_and_recomputes_generated_tokens() -> None:
    """Siblings of one prompt share its prefix on the instance; a recompute after preemption pays
    only the request's generated tokens (the prompt stays cached)."""
    m = InstanceModel(a=0.01, b=0.0, c=0.0, prefill_tps=1e12, kv_tokens=1000, max_batch=8)
    inst = Instance("i0", m, Timeline(1.0), speculative=False, engine_admission=True)
    starts: list[tuple[str, int, int]] = []  # (rid, generated before, prefill tokens)
    real_start = inst._start

    def record(slot: Slot, now: float, prefill_tokens: int, fetch_tokens: int) -> None:
        starts.append((slot.rid, slot.generated, prefill_tokens))
        real_start(slot, now, prefill_tokens, fetch_tokens)

    inst._start = record  # type: ignore[method-assign]
    for k in range(3):
        inst.add(Slot(str(k), 400, True, 100, 0, 1.0, prompt_key="p0"), 0.0, 0, 0)
    inst.add(Slot("other", 50, True, 60, 0, 1.0, prompt_key="p1"), 0.0, 0, 0)
    done: list[str] = []
    while inst.batch or inst.waiting:
        t = inst.next_event()
        assert t is not None
        done += [s.rid for s in inst.on_event(t)]
    assert sorted(done) == ["0", "1", "2", "other"] and inst.preemptions > 0
    recomputes = [(rid, g, p) for rid, g, p in starts if g > 0]
    assert recomputes, starts
    # First admissions: the first of each prompt prefills it, its siblings nothing.
    assert [(rid, p) for rid, g, p in starts if g == 0] == [("0", 100), ("1", 0), ("2", 0), ("other", 60)]
    assert all(p == g for _, g, p in recomputes), recomputes
    assert inst.prefill_tokens == 160 + sum(g for _, g, _ in recomputes)


def test_baseline_run_prefills_each_prompt_once_per_instance() -> None:
    """Through the cluster loop: with KV to spare (no preemption), the baseline prefills each
    prompt once on each instance its group landed on, as the chunked policies do."""
    spec = dataclasses.replace(WORKLOADS["qwen2-vl-72b"], prompts=12, group_size=4, instances=2)
    w = make_workload(spec, seed=0)
    m = dataclasses.replace(INSTANCE_MODELS["qwen2-vl-72b"], kv_tokens=10**9)
    r = simulate(w, m, RunConfig("baseline"))
    assert r.preemptions == 0
    groups = np.arange(w.num_requests) // spec.group_size
    pairs = {(int(g), int(i)) for g, i in zip(groups, r.last_instance, strict=True)}
    assert r.prefill_tokens == sum(int(w.prompt_len[g]) for g, _ in pairs)


def test_tail_report_says_none_where_no_tail_request_waited() -> None:
    # One chunk per request (chunk over max_tokens) and KV to spare: nobody waits between chunks.
    spec = dataclasses.replace(WORKLOADS["qwen2-vl-72b"], prompts=8, group_size=4, instances=1)
    w = make_workload(spec, seed=0)
    m = dataclasses.replace(INSTANCE_MODELS["qwen2-vl-72b"], kv_tokens=10**9)
    r = simulate(w, m, RunConfig("divided", chunk_size=spec.max_tokens))
    base = simulate(w, m, RunConfig("baseline"))
    assert (r.max_wait == 0).all()
    assert tail_report(w, m, r, base)["tail_median_estimate_over_true"] is None


def test_setting_differences_read_the_service_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every policy setting a run changes from SchedulerConfig() is listed, and the defaults are
    read from SchedulerConfig (a changed service default shows up), not copied."""
    service = SchedulerConfig()
    diffs = sim.setting_differences(sim.RUNS + sim.BOUNDS, 4096)
    # The simulator runs the service's anti-starvation rule and default (no override).
    assert all("starvation_seconds" not in d for d in diffs.values())
    assert diffs["seer"]["chunk_size"] == [4096, service.chunk_size]
    assert "kv_aging" not in diffs["seer"] and "estimate_quantile" not in diffs["seer"]
    # Plain Algorithm 2: the service's two additions off.
    assert diffs["seer-alg2"]["kv_aging"] == [0.0, service.kv_aging]
    assert diffs["seer-alg2"]["estimate_quantile"] == [0.0, service.estimate_quantile]
    monkeypatch.setattr(sim, "SchedulerConfig", lambda: dataclasses.replace(service, kv_aging=5.0))
    assert sim.setting_differences(sim.RUNS, 4096)["seer"]["kv_aging"] == [12.0, 5.0]


def test_summary_compares_only_the_papers_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--quick", "--no-bounds", "--out", ""]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    res = json.loads(lines[-1][len("RESULT ") :])
    rows = {r["workload"]: r for r in res["workloads"]}
    assert set(rows) == {"Moonlight", "Qwen2-VL-72B", "Kimi-K2"}
    # The ablation means: Moonlight and Qwen2-VL-72B only (the paper's), Kimi-K2 left out.
    keys = {"speedup_divided": "divided", "speedup_context": "seer", "speedup_grouped_sd": "seer+sd"}
    expect = {k: (rows["Moonlight"]["speedup"][p] + rows["Qwen2-VL-72B"]["speedup"][p]) / 2 for k, p in keys.items()}
    assert {k: res[k] for k in keys} == pytest.approx(expect, abs=1e-3)
    assert res["paper_workloads"] == ["Moonlight", "Qwen2-VL-72B"]
    both = (rows["Moonlight"]["frac_oracle"]["seer"] + rows["Qwen2-VL-72B"]["frac_oracle"]["seer"]) / 2
    assert res["frac_oracle_context_paper_workloads"] == pytest.approx(both, abs=1e-3)
    three = (both * 2 + rows["Kimi-K2"]["frac_oracle"]["seer"]) / 3
    assert res["frac_oracle_context"] == pytest.approx(three, abs=1e-3)
    # Kimi-K2's table carries no paper column; the paper's workloads' tables do.
    tables = out.split("\n== ")
    kimi = next(t for t in tables if t.startswith("Kimi-K2"))
    moon = next(t for t in tables if t.startswith("Moonlight"))
    assert "paper" not in kimi.splitlines()[2] and "1.41-1.42" not in kimi
    assert "paper" in moon.splitlines()[2] and "1.41-1.42" in moon
    assert "starvation_seconds" not in out.split("\n== ")[0]  # not a setting the simulator changes
    # The paper's fraction of oracle and tail sit beside the means over its own workloads, not
    # beside the mean over all three (Kimi-K2 included).
    frac_all = next(ln for ln in lines if ln.startswith("fraction of oracle, mean over all"))
    frac_paper = next(ln for ln in lines if ln.startswith("fraction of oracle, mean over Moonlight"))
    assert "paper" not in frac_all and f"(paper {sim.PAPER['frac_oracle_context']})" in frac_paper
    tail = next(ln for ln in lines if ln.startswith("tail time vs baseline"))
    over_all, over_paper = tail.split("; over ")
    assert "paper" not in over_all and f"(paper {sim.PAPER['tail_context']})" in over_paper
