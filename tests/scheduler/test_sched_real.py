"""bench.sched_real: the policies over the real suite (slow: starts the whole suite)."""

from __future__ import annotations

import json
import os

import pytest

from bench import sched_real


def test_spread_is_median_and_range() -> None:
    assert sched_real.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_long_groups_never_stop_short_groups_stop() -> None:
    wl = sched_real.RealWorkload(groups=8, group_size=2, max_tokens=16, long_every=4)
    groups = wl.prompt_groups(seed=5)
    long = [i for i, g in enumerate(groups) if g.sampling.ignore_eos]
    assert long == [3, 7]
    assert all(g.sampling.stop_token_ids for i, g in enumerate(groups) if i not in long)
    assert len({g.prompt_key for g in groups}) == 8  # stable keys: history priors apply


def test_submission_order_stratifies_the_baselines_placement_luck() -> None:
    wl = sched_real.RealWorkload(groups=10, group_size=4, max_tokens=16, long_every=4)
    for rep in range(8):
        order = wl.submission_order(rep, workers=2)
        assert sorted(order) == list(range(10))
        longs = [p for p, i in enumerate(order) if wl.is_long(i)]
        assert len(longs) == 2
        # Even repetitions: both long groups on one round-robin worker; odd: one on each.
        assert ((longs[0] - longs[1]) % 2 == 0) == (rep % 2 == 0) == wl.collides(order, 2)
    assert wl.submission_order(3, 2) == wl.submission_order(3, 2)  # seeded
    assert len({tuple(wl.submission_order(r, 2)) for r in range(8)}) == 8  # shuffled per repetition
    # Long-ness follows the prompt key through the shuffle (the warm-up's history stays valid).
    groups = wl.prompt_groups(seed=1, order=wl.submission_order(0, 2))
    assert all(g.sampling.ignore_eos == wl.is_long(int(g.prompt_key.split("-")[1])) for g in groups)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin 2 workers")
def test_quick_run_reports_ratios_for_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert sched_real.main(["--quick", "--policies", "baseline,seer", "--reps", "2"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT ") :])
    assert res["pinned_cpus"][0] != res["pinned_cpus"][1]
    assert len(res["runs"]["baseline"]) == 2 and len(res["runs"]["seer"]) == 2
    for r in res["runs"]["seer"]:
        assert r["requests"] == 16 and r["max_len"] == 24  # the long group ran to max_tokens
    assert set(res["seer_throughput_vs_baseline"]) == {"median", "min", "max"}
