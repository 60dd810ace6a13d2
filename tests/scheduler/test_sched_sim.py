"""The cluster simulator (bench/simlib) driving the real scheduler core."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench import sim
from bench.simlib.analysis import longest_alone_seconds, tail_report
from bench.simlib.cluster import RunConfig, SimResult, simulate
from bench.simlib.instance import Instance, Slot
from bench.simlib.model import INSTANCE_MODELS, InstanceModel, accepted_per_step
from bench.simlib.timeline import Timeline
from bench.simlib.workload import WORKLOADS, Workload, make_workload, rank_change_fraction

SMALL = dataclasses.replace(WORKLOADS["qwen2-vl-72b"], prompts=96, instances=4)


@dataclasses.dataclass
class Runs:
    w: Workload
    m: InstanceModel
    r: dict[str, SimResult]


@pytest.fixture(scope="module")
def small_runs() -> Runs:
    w = make_workload(SMALL, seed=0)
    m = INSTANCE_MODELS["qwen2-vl-72b"]
    runs = {p: simulate(w, m, RunConfig(p)) for p in ("baseline", "divided", "seer", "seer_history", "oracle")}
    runs["seer+sd"] = simulate(w, m, RunConfig("seer", speculative=True))
    return Runs(w, m, runs)


def test_workload_calibration() -> None:
    for spec in WORKLOADS.values():
        w = make_workload(dataclasses.replace(spec, prompts=min(spec.prompts, 300)), seed=1)
        assert abs(w.lengths.mean() / spec.mean_len - 1) < 0.15, spec.name
        assert w.lengths.max() <= spec.max_tokens and w.lengths.min() >= spec.min_len
        # Group-correlated: the between-group share of the log-length variance dominates.
        logl = np.log(w.lengths)
        assert logl.mean(axis=1).var() > logl.var(axis=1).mean()
        # Iteration-to-iteration: few groups change rank much.
        assert rank_change_fraction(w) < 0.1


def test_acceptance_model_follows_seer_table_2() -> None:
    assert accepted_per_step(0) == pytest.approx(1.70)
    assert accepted_per_step(1) == pytest.approx(2.04)
    assert accepted_per_step(15) == pytest.approx(2.53)
    assert 2.04 < accepted_per_step(3) < 2.32


def test_instance_jump_matches_step_by_step() -> None:
    """The analytic jump to the next event equals summing the per-step times one by one."""
    m = InstanceModel(kv_tokens=10**9)
    inst = Instance("i", m, Timeline(1.0), speculative=False, engine_admission=False)
    inst.add(Slot("a", 300, True, 100, 0, 1.7), 0.0, 0, 0)
    inst.add(Slot("b", 500, True, 50, 0, 1.7), 0.0, 0, 0)
    t = inst.next_event()
    assert t is not None
    expected = sum(m.step_time(2, 150 + 2 * j) for j in range(300))
    assert t == pytest.approx(expected, rel=1e-3)
    done = inst.on_event(t)
    assert [s.rid for s in done] == ["a"] and inst.batch == 1


def test_baseline_engine_preempts_by_recompute_when_kv_runs_out() -> None:
    m = InstanceModel(kv_tokens=1000, max_batch=8)
    inst = Instance("i", m, Timeline(1.0), speculative=False, engine_admission=True)
    for k in range(3):
        inst.add(Slot(str(k), 400, True, 100, 0, 1.7), 0.0, 0, 0)
    finished: list[str] = []
    now = 0.0
    while inst.batch or inst.waiting:
        t = inst.next_event()
        assert t is not None
        now = t
        finished += [s.rid for s in inst.on_event(now)]
    assert sorted(finished) == ["0", "1", "2"] and inst.preemptions > 0
    assert inst.prefill_tokens > 300  # re-prefill of the preempted requests


def test_every_policy_generates_every_token(small_runs: Runs) -> None:
    w, m = small_runs.w, small_runs.m
    for name, r in small_runs.r.items():
        assert r.total_tokens == w.total_tokens
        assert (r.finish_times > 0).all()
        # No schedule beats the longest response decoded alone at the floor step time (speculation
        # accepts at most ~2.6 tokens per step).
        floor = w.lengths.max() * m.a / (2.6 if name == "seer+sd" else 1.0)
        assert r.makespan > floor


def test_policy_ordering_on_a_long_tail_workload(small_runs: Runs) -> None:
    r = small_runs.r
    base, div, seer, hist, orc, sd = (
        r[k] for k in ("baseline", "divided", "seer", "seer_history", "oracle", "seer+sd")
    )
    assert base.preemptions > 0 and div.preemptions == 0
    assert div.makespan < base.makespan
    assert seer.tail_time < div.tail_time < base.tail_time
    assert hist.makespan <= seer.makespan * 1.02
    assert orc.makespan <= min(div.makespan, seer.makespan, hist.makespan) * 1.02
    assert orc.tail_time < 0.5 * div.tail_time
    assert sd.makespan < seer.makespan


def test_bench_sim_main_writes_plots_and_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--quick", "--workloads", "qwen2-vl-72b", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("RESULT ")
    res = json.loads(out[-1][len("RESULT ") :])
    assert res["workloads"][0]["requests"] == 75 * 16
    png = tmp_path / "quick" / "sim_qwen2-vl-72b.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_run_records_chunks_waits_and_idle_times(small_runs: Runs) -> None:
    w = small_runs.w
    lengths = w.lengths.reshape(-1)
    for name in ("divided", "seer", "seer_history", "oracle"):
        r = small_runs.r[name]
        # Every chunk of a chunked policy produces min(chunk, remaining) tokens.
        assert (r.chunks == -(-lengths // 4096)).all(), name
        assert (r.wait_times >= 0).all() and (r.max_wait <= r.wait_times + 1e-9).all()
        # A request is queued only between its chunks: never longer than it was alive.
        assert (r.wait_times <= r.finish_times - r.start_times + 1e-6).all()
        assert r.instance_idle_at.max() == pytest.approx(r.makespan)
    seer = small_runs.r["seer"]
    paused = seer.max_wait > 0
    assert paused.any() and (seer.est_at_max_wait[paused] > 0).all()


def test_tail_report_and_its_floor(small_runs: Runs) -> None:
    w, m, r = small_runs.w, small_runs.m, small_runs.r
    floor = longest_alone_seconds(w, m)
    # The floor is a sum of per-step times of the longest response at batch 1.
    n = int(w.lengths.max())
    g = int(np.argmax(w.lengths.max(axis=1)))
    assert floor == pytest.approx(sum(m.step_time(1, int(w.prompt_len[g]) + j) for j in range(n)), rel=1e-6)
    for name in ("divided", "seer", "oracle"):
        rep = tail_report(w, m, r[name], r["baseline"])
        # tail_report's values are None only where a quantity is undefined (none of these here).
        tail, longest, late = rep["tail_requests"], rep["tail_group_longest_frac"], rep["tail_started_after_10pct_frac"]
        assert tail is not None and longest is not None and late is not None
        assert tail >= 0.1 * w.num_requests - 1
        assert 0 <= longest <= 1 and 0 <= late <= 1
        assert rep["tail_vs_baseline"] == pytest.approx(r[name].tail_time / r["baseline"].tail_time, abs=1e-3)
        assert r[name].makespan > floor


def test_oracle_bounds_rank_by_group_or_previous_lengths() -> None:
    """The bound runs change only what the oracle ranks by, never what is generated."""
    # No length reaches max_tokens in this draw (no ties at the top).
    spec = dataclasses.replace(WORKLOADS["qwen2-vl-72b"], prompts=24, group_size=8, instances=1)
    w = make_workload(spec, seed=0)
    m = dataclasses.replace(INSTANCE_MODELS["qwen2-vl-72b"], max_batch=8)  # 8 slots = one group at a time
    runs = {k: simulate(w, m, RunConfig("oracle", oracle_rank=k)) for k in ("true", "group_max", "prev_group_max")}
    for r in runs.values():
        assert r.total_tokens == w.total_tokens and (r.finish_times > 0).all()
    first = {k: set(np.nonzero(r.start_times == 0)[0].tolist()) for k, r in runs.items()}
    top = np.argsort(w.lengths.reshape(-1))[::-1]
    assert first["true"] == set(top[:8].tolist())  # the 8 longest requests
    g = int(np.argmax(w.lengths.max(axis=1)))
    assert first["group_max"] == set(range(8 * g, 8 * g + 8))  # the group with the longest response
    h = int(np.argmax(w.prev_lengths.max(axis=1)))
    assert first["prev_group_max"] == set(range(8 * h, 8 * h + 8))  # the longest group last iteration
    with pytest.raises(KeyError):
        simulate(w, m, RunConfig("oracle", oracle_rank="future"))
