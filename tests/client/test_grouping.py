"""by_group / score / group_advantages on real results (a real buffer, a thread playing the
scheduler): a group index is only meaningful within its batch, so results of two batches are never
merged into one group, and a reward that is not finite is refused rather than zeroing the group."""

from __future__ import annotations

import math
import threading

import pytest
from client_helpers import Buffer, play_scheduler
from seer_client import (
    PromptGroup,
    RolloutResult,
    SeerClient,
    SeerError,
    by_batch,
    by_group,
    group_advantages,
    score,
)


def _two_batches(buffer: Buffer) -> tuple[list[RolloutResult], list[RolloutResult]]:
    threading.Thread(target=play_scheduler, args=(buffer.address,), daemon=True).start()
    with SeerClient(buffer.address) as c:
        # Two batches of one group each: both have a group 0, of different prompts.
        a = c.run_batch("step-a", [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4, prompt_key="qa")])
        b = c.run_batch("step-b", [PromptGroup(prompt=[3, 4], group_size=2, max_tokens=4, prompt_key="qb")])
    return a, b


def test_results_of_two_batches_are_not_merged_into_one_group(buffer: Buffer) -> None:
    a, b = _two_batches(buffer)
    # Before: one "group 0" of four results (two sample 0s) across prompts qa and qb, and GRPO
    # advantages computed across different prompts, silently.
    with pytest.raises(SeerError) as e:
        by_group(a + b)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith("results[2].batch_id:")
    with pytest.raises(SeerError):
        score(a + b, lambda r: 1.0)
    # The way to group a mix: per batch.
    split = by_batch(b + a)
    assert list(split) == ["step-b", "step-a"]
    for batch_id, rs in split.items():
        groups = by_group(rs)
        assert list(groups) == [0] and [r.sample_index for r in groups[0]] == [0, 1]
        assert {r.batch_id for r in groups[0]} == {batch_id}
    scored = score(a, lambda r: float(r.sample_index))
    assert [adv for _r, _rw, adv in scored[0]] == [-1.0, 1.0]


def test_a_result_counted_twice_is_refused(buffer: Buffer) -> None:
    a, _b = _two_batches(buffer)
    with pytest.raises(SeerError) as e:
        by_group(a + a[:1])
    assert e.value.message.startswith("results[2]: group 0 sample ") and "twice" in e.value.message


def test_a_reward_that_is_not_finite_is_refused(buffer: Buffer) -> None:
    a, _b = _two_batches(buffer)
    for bad in (math.nan, math.inf, -math.inf):
        # Before: the mean was nan and the whole group's advantages silently 0.
        with pytest.raises(SeerError) as e:
            group_advantages([1.0, bad, 0.0])
        assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith("rewards[1]:")
        with pytest.raises(SeerError) as e:
            score(a, lambda r, bad=bad: bad if r.sample_index == 1 else 0.0)  # type: ignore[misc]
        assert a[0].batch_id in e.value.message and "/0/1" in e.value.message
    assert group_advantages([1.0, 0.0]) == [1.0, -1.0]
