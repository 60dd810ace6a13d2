"""AdaptiveSpeculation (Seer Algorithm 1) and the step-time table."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest

from services.worker.adaptive import AdaptiveSpeculation, StepTimeTable


def _table(fixed: float, per_token: float) -> StepTimeTable:
    bs, gs = (1, 8, 64, 256), (0, 1, 2, 4, 8)
    return StepTimeTable(bs, gs, tuple(tuple(fixed + per_token * b * (1 + g) for g in gs) for b in bs))


def _observe(spec: AdaptiveSpeculation, rate: float, n: int = 2000) -> None:
    # Position i accepted with probability rate ** (i + 1) (all of 0..i accepted).
    spec.observe([n] * spec.gamma_max, [int(n * rate ** (i + 1)) for i in range(spec.gamma_max)])


def test_memory_bound_small_batch_drafts_long() -> None:
    spec = AdaptiveSpeculation(_table(0.05, 0.0001), gamma_max=8)
    _observe(spec, 0.8)
    plan = spec.plan([(f"r{i}", False) for i in range(4)])
    assert set(plan.values()) == {8}


def test_compute_bound_large_batch_turns_speculation_off() -> None:
    spec = AdaptiveSpeculation(_table(0.01, 0.002), gamma_max=8, explore_interval=0)
    _observe(spec, 0.2)
    plan = spec.plan([(f"r{i}", False) for i in range(256)])
    assert set(plan.values()) == {0}
    assert spec.last_budget == 0


def test_probes_favoured_and_budget_shrinks_with_batch() -> None:
    spec = AdaptiveSpeculation(_table(0.03, 0.0006), gamma_max=8, explore_interval=0)
    _observe(spec, 0.6)
    small = spec.plan([("p", True)] + [(f"r{i}", False) for i in range(7)])
    big_reqs = [("p", True)] + [(f"r{i}", False) for i in range(127)]
    big = spec.plan(big_reqs)
    assert small["p"] >= small["r0"] and small["p"] > 0
    assert big["p"] >= big["r0"]
    assert sum(big.values()) / len(big) < sum(small.values()) / len(small)
    assert max(small.values()) <= 8


def test_acceptance_tracking_changes_the_plan() -> None:
    spec = AdaptiveSpeculation(_table(0.03, 0.0006), gamma_max=8, explore_interval=0)
    reqs = [(f"r{i}", False) for i in range(16)]
    _observe(spec, 0.9)
    high = sum(spec.plan(reqs).values())
    spec2 = AdaptiveSpeculation(_table(0.03, 0.0006), gamma_max=8, explore_interval=0)
    _observe(spec2, 0.05)
    low = sum(spec2.plan(reqs).values())
    assert high > low
    alpha = spec.acceptance()
    assert all(a >= b for a, b in itertools.pairwise(alpha))


def test_explores_when_off() -> None:
    spec = AdaptiveSpeculation(_table(0.01, 0.002), gamma_max=8, explore_interval=3)
    _observe(spec, 0.1)
    reqs = [(f"r{i}", i == 5) for i in range(200)]
    plans = [spec.plan(reqs) for _ in range(6)]
    assert [sum(p.values()) for p in plans] == [0, 0, 2, 0, 0, 2]
    # One request per exploring step, in turn (a request without a match must not stall learning).
    explored = [next(r for r, n in p.items() if n) for p in (plans[2], plans[5])]
    assert explored[0] != explored[1]


def test_table_roundtrip_and_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = _table(0.02, 0.001)
    p = tmp_path / "t.json"
    t.save(p)
    t2 = StepTimeTable.load(p)
    assert t2.time(8, 16) == pytest.approx(t.time(8, 16))
    assert t.time(8, 16) == pytest.approx(0.02 + 0.001 * 8 * 3)
    assert t.time(512, 0) > t.time(256, 0)  # extrapolates
    spec = AdaptiveSpeculation(json.loads(p.read_text()))  # the worker passes the parsed JSON
    assert spec.table == t2
    with pytest.raises(ValueError, match="times_s"):
        StepTimeTable((1, 2), (0,), ((0.1,),))
    with pytest.raises(ValueError, match="gammas"):
        StepTimeTable.from_dict({"batch_sizes": [1], "times_s": [[1.0]]})


def test_min_gain_keeps_speculation_off_on_a_marginal_prediction() -> None:
    # T = 0.1 s + 3 ms per token; B = 16, alpha_0 = 0.4: the best budget (gamma 1) predicts 1.057x.
    table = _table(0.1, 0.003)
    reqs = [(f"r{i}", False) for i in range(16)]
    eager = AdaptiveSpeculation(table, gamma_max=8, min_gain=0.0, explore_interval=0)
    careful = AdaptiveSpeculation(table, gamma_max=8, min_gain=0.1, explore_interval=0)
    for s in (eager, careful):
        _observe(s, 0.4)
    assert sum(eager.plan(reqs).values()) > 0
    assert sum(careful.plan(reqs).values()) == 0


def test_exploration_waits_for_a_cheap_step() -> None:
    # B = 1 costs 2x with 2 draft tokens (the CPU small-M matmul cliff); at B = 64 (compute bound,
    # every draft token costs a row) one request's 2 draft tokens cost ~3% more.
    table = StepTimeTable((1, 64), (0, 1, 2), ((0.07, 0.13, 0.14), (0.30, 0.60, 0.90)))
    spec = AdaptiveSpeculation(table, gamma_max=8, explore_interval=4, prior_accept=0.2, explore_until=0)
    one = [("r0", False)]
    plans = [spec.plan(one) for _ in range(15)]
    assert all(sum(p.values()) == 0 for p in plans)  # off, and exploring at B = 1 would cost ~2x
    assert spec.plan(one)["r0"] == 2  # forced after 4 x explore_interval plans off
    big = [(f"r{i}", i == 3) for i in range(64)]
    plans = [spec.plan(big) for _ in range(4)]
    assert [sum(p.values()) for p in plans] == [0, 0, 0, 2]


def test_cold_estimate_explores_every_cheap_step() -> None:
    table = StepTimeTable((1, 64), (0, 1, 2), ((0.07, 0.13, 0.14), (0.30, 0.60, 0.90)))
    spec = AdaptiveSpeculation(table, gamma_max=8, explore_interval=16, prior_accept=0.2, explore_until=8)
    big = [(f"r{i}", False) for i in range(64)]
    plans = [spec.plan(big) for _ in range(6)]
    assert [sum(p.values()) for p in plans] == [2] * 6  # nothing observed yet: every plan explores
    assert len({next(r for r, n in p.items() if n) for p in plans}) == 6  # a different request each
    spec.observe([8, 8], [1, 0])  # now 8 observations at position 0 (rejected): warm
    assert [sum(spec.plan(big).values()) for _ in range(16)] == [0] * 15 + [2]
    assert [sum(spec.plan([("r0", False)]).values()) for _ in range(4)] == [0] * 4  # B = 1: too costly


def test_cold_planner_learns_from_exploration() -> None:
    # At B = 32 drafts pay only once alpha_0 > ~0.6, and the 0.5 prior says off: only exploration
    # can show that they are accepted 90% of the time.
    table = StepTimeTable((1, 32), (0, 1, 2), ((0.07, 0.08, 0.09), (0.30, 0.45, 0.60)))
    # min_gain 0.2: at alpha 0.9 the best budget predicts ~1.3x here, the default threshold's edge.
    spec = AdaptiveSpeculation(table, gamma_max=4, explore_interval=4, min_gain=0.2)
    reqs = [(f"r{i}", False) for i in range(32)]
    assert sum(spec.plan(reqs).values()) == 2  # off by the prior; one request explores
    rng = random.Random(0)
    drafted = 0
    for _ in range(200):
        plan = spec.plan(reqs)
        if not sum(plan.values()):
            continue
        drafted += 1
        proposed, accepted = [0] * 4, [0] * 4
        for n in plan.values():
            ok = True
            for i in range(n):
                proposed[i] += 1
                ok = ok and rng.random() < 0.9  # each token accepted w.p. 0.9 given its prefix was
                accepted[i] += ok
        spec.observe(proposed, accepted)
    assert sum(spec.plan(reqs).values()) >= 32  # learnt: every request drafts
    assert drafted > 100


def test_partial_budget_rotates_within_a_class() -> None:
    # Drafts are cheap up to 1 token per request on average and steep beyond: the best budget (8)
    # gives the 2 probes 2 tokens each and 4 of the 6 others 1. Over successive plans every other
    # request must get its share (a closed batch ends with its slowest request), and the same 4
    # first every time would leave 2 of them without any draft.
    table = StepTimeTable((1, 8), (0, 1, 2, 4), ((0.07, 0.08, 0.085, 0.1), (0.10, 0.11, 0.30, 0.60)))
    spec = AdaptiveSpeculation(table, gamma_max=4, explore_interval=0, min_gain=0.0)
    _observe(spec, 0.7)
    reqs = [(f"p{i}", True) for i in range(2)] + [(f"r{i}", False) for i in range(6)]
    got = Counter[str]()
    for _ in range(6):
        plan = spec.plan(reqs)
        assert sum(plan.values()) == 8 and plan["p0"] == plan["p1"] == 2
        got.update({r: n for r, n in plan.items() if n and r.startswith("r")})
    assert set(got) == {f"r{i}" for i in range(6)}
    assert set(got.values()) == {4}


def test_stats_count_decisions_by_batch_size() -> None:
    spec = AdaptiveSpeculation(_table(0.05, 0.0001), gamma_max=8, explore_interval=0)
    _observe(spec, 0.8)
    for _ in range(3):
        spec.plan([(f"r{i}", False) for i in range(4)])
    spec.table = _table(0.01, 0.002)  # compute-bound from now on: no drafts
    _observe(spec, 0.2)
    spec.plan([(f"r{i}", False) for i in range(64)])
    by = spec.stats()["plans_by_batch"]
    assert by[4] == {"plans": 3, "drafting": 3, "mean_budget": 32.0, "explored": 0}
    assert by[64] == {"plans": 1, "drafting": 0, "mean_budget": 0.0, "explored": 0}
    explorer = AdaptiveSpeculation(_table(0.01, 0.002), gamma_max=8, explore_interval=1, explore_until=0)
    _observe(explorer, 0.1)
    explorer.plan([(f"r{i}", False) for i in range(64)])
    assert explorer.stats()["plans_by_batch"][64] == {"plans": 1, "drafting": 0, "mean_budget": 0.0, "explored": 1}


def test_noisy_table_is_made_monotone() -> None:
    # A profile dip (more drafts measured cheaper) must not make a longer draft look free.
    t = StepTimeTable((1, 4), (0, 2, 4), ((0.060, 0.080, 0.070), (0.050, 0.120, 0.200)))
    assert t.time(1, 4) == pytest.approx(0.080)  # not 0.070
    assert t.time(4, 0) == pytest.approx(0.060)  # a larger batch is not cheaper either
    assert t.time(4, 16) == pytest.approx(0.200)
    assert t.to_dict()["times_s"][0] == [0.060, 0.080, 0.070]  # the measurement itself is kept
    # At B = 1 with alpha 0.3 the dip predicted 1.45 / 1.17 = 1.24x for 4 tokens (above min_gain);
    # the monotone model predicts 1.14x: off.
    spec = AdaptiveSpeculation(t, gamma_max=4, explore_interval=0)
    _observe(spec, 0.3)
    assert spec.plan([("r0", False)]) == {"r0": 0}


def test_cold_exploration_is_bounded_when_explorations_bring_no_drafts() -> None:
    # Exploring requests that have no draft (no match) bring no observations: the planner must not
    # stay cold, exploring on every plan, forever (suite: 12 of 14 plans at B = 11 explored).
    table = StepTimeTable((1, 64), (0, 1, 2), ((0.07, 0.13, 0.14), (0.30, 0.60, 0.90)))
    spec = AdaptiveSpeculation(table, gamma_max=8, explore_interval=16, prior_accept=0.2, explore_until=8)
    big = [(f"r{i}", False) for i in range(64)]
    first = [sum(spec.plan(big).values()) for _ in range(32)]
    assert first == [2] * 32  # cold: every cheap plan explores, 4 x explore_until attempts
    later = [sum(spec.plan(big).values()) for _ in range(64)]
    assert later == ([0] * 15 + [2]) * 4  # then every explore_interval plans only
