"""Pure helpers for trainers: regroup streamed results (reward-agnostic)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from seer_client.types import RolloutResult


def by_group(results: Iterable[RolloutResult]) -> dict[int, list[RolloutResult]]:
    """Results keyed by group index, each list ordered by sample index."""
    out: dict[int, list[RolloutResult]] = {}
    for r in results:
        out.setdefault(r.group_index, []).append(r)
    return {g: sorted(rs, key=lambda r: r.sample_index) for g, rs in sorted(out.items())}


def group_advantages(rewards: list[float], normalize_std: bool = True) -> list[float]:
    """GRPO group-relative advantages: (r - mean) / std (std of 0 gives 0 advantages)."""
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
    """Per group: (result, reward, advantage), with any reward function the caller supplies."""
    out = {}
    for g, rs in by_group(results).items():
        rewards = [float(reward(r)) for r in rs]
        out[g] = list(zip(rs, rewards, group_advantages(rewards), strict=True))
    return out
