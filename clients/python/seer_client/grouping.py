"""Pure helpers for trainers: regroup streamed results (reward-agnostic).

A group index is only meaningful within its batch (group 0 of two batches are two different
prompts), so by_group and score take the results of one batch and refuse a mix; by_batch splits a
mix first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from seer_client.types import RolloutResult, SeerError


def by_batch(results: Iterable[RolloutResult]) -> dict[str, list[RolloutResult]]:
    """Results keyed by batch id (in order of first appearance), each list in the order given."""
    out: dict[str, list[RolloutResult]] = {}
    for r in results:
        out.setdefault(r.batch_id, []).append(r)
    return out


def by_group(results: Iterable[RolloutResult]) -> dict[int, list[RolloutResult]]:
    """Results of one batch keyed by group index, each list ordered by sample index.

    Raises SeerError (INVALID_ARGUMENT) when the results come from more than one batch (their group
    indices would merge different prompts into one group; split them with by_batch first) or when a
    (group, sample) pair appears twice (a result counted twice would skew the group's baseline)."""
    out: dict[int, list[RolloutResult]] = {}
    batch_id: str | None = None
    seen: dict[tuple[int, int], str] = {}
    for k, r in enumerate(results):
        if batch_id is None:
            batch_id = r.batch_id
        elif r.batch_id != batch_id:
            raise SeerError("INVALID_ARGUMENT",
                            f"results[{k}].batch_id: {r.batch_id!r}, but results[0] is of batch {batch_id!r}: "
                            "group indices of different batches are different prompts; group each batch "
                            "on its own (by_batch)")
        pair = (r.group_index, r.sample_index)
        if pair in seen:
            raise SeerError("INVALID_ARGUMENT",
                            f"results[{k}]: group {r.group_index} sample {r.sample_index} ({r.request_id!r}) "
                            f"appears twice (first as {seen[pair]!r})")
        seen[pair] = r.request_id
        out.setdefault(r.group_index, []).append(r)
    return {g: sorted(rs, key=lambda r: r.sample_index) for g, rs in sorted(out.items())}


def group_advantages(rewards: list[float], normalize_std: bool = True) -> list[float]:
    """GRPO group-relative advantages: (r - mean) / std (std of 0 gives 0 advantages).

    Raises SeerError (INVALID_ARGUMENT) naming the index of a nan or infinite reward: it would make
    the mean nan, and the whole group's advantages silently 0."""
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise SeerError("INVALID_ARGUMENT", f"rewards[{i}]: must be finite, got {r}")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = (sum(c * c for c in centered) / len(rewards)) ** 0.5
    return [c / std if std > 1e-8 else 0.0 for c in centered]


def score(results: Iterable[RolloutResult], reward: Callable[[RolloutResult], float]
          ) -> dict[int, list[tuple[RolloutResult, float, float]]]:
    """Per group of one batch (see by_group): (result, reward, advantage), with any reward function
    the caller supplies. A nan or infinite reward raises SeerError naming the result."""
    out = {}
    for g, rs in by_group(results).items():
        rewards = [float(reward(r)) for r in rs]
        for r, x in zip(rs, rewards, strict=True):
            if not math.isfinite(x):
                raise SeerError("INVALID_ARGUMENT", f"reward of {r.request_id!r}: must be finite, got {x}")
        out[g] = list(zip(rs, rewards, group_advantages(rewards), strict=True))
    return out
