"""bench.spec's held-out prompt set and the drafter analysis tools, on synthetic rollouts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from bench.spec import PROMPTS, acceptance, generate_rollouts, replay
from bench.spec_analysis import analyse
from bench.spec_variants import replay_variant


def _rollouts(seed: int) -> dict[str, Any]:
    """Two iterations x 2 prompts x 4 responses: noisy copies of one text per prompt, so that
    siblings and history share most n-grams but fork often."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50, 60) for _ in range(6)] for _ in range(2)]
    iters = []
    for _it in range(2):
        groups = []
        for p in range(2):
            base = [random.Random(p).randrange(12) for _ in range(60)]
            groups.append([[t if rng.random() < 0.8 else rng.randrange(12) for t in base] for _ in range(4)])
        iters.append(groups)
    return {"prompts": prompts, "iterations": iters, "temperature": 0.7, "top_p": 1.0}


def test_prompt_offset_out_of_range_is_rejected_before_any_work() -> None:
    with pytest.raises(ValueError, match="out of range"):
        generate_rollouts(Path("/nonexistent"), 4, 16, 8, 0.7, prompt_offset=len(PROMPTS) - 2)


def test_analysis_splits_the_gap_consistently() -> None:
    data = _rollouts(1)
    res = analyse(data, 4, history=True)
    assert res["online_per_step"] >= 1.0
    # Requiring a longer backward match can only shrink the oracle's candidate set.
    by_m = [res[f"ideal_min_match_{m}_per_step"] for m in (2, 3, 4, 5, 7, 10)]
    assert by_m == sorted(by_m, reverse=True)
    assert res["ideal_same_state_per_step"] == by_m[0]
    assert res["lost_tokens"] > 0 and sum(res["by_source"].values()) == pytest.approx(1.0, abs=0.01)


def test_variant_harness_reproduces_the_index_and_the_bench_replay() -> None:
    data = _rollouts(2)
    prompts, (it1, it2) = data["prompts"], data["iterations"]
    tok = st = 0
    for p, prompt in enumerate(prompts):
        t, s = replay(list(prompt), [list(x) for x in it2[p]], [list(x) for x in it1[p]], siblings=True)
        tok += t
        st += s
    assert replay_variant(data, 4, True, {"index": 1}) == pytest.approx(tok / st)
    acc = acceptance(data, 4, ideal_min1=True)
    assert acc["grouped_history"] == pytest.approx(tok / st)
    # The oracle over 1-token matches sees a superset of the >= 2-token oracle's candidates.
    assert acc["grouped_history_ideal_min1"] >= acc["grouped_history_ideal"]
    # A variant picks among >= 2-token matches differently, but stays a valid replay.
    assert replay_variant(data, 4, True, {"alpha": 1.0, "own": 3.0, "history": 0.5}) >= 1.0
