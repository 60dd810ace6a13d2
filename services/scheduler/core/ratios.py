"""Online-learned correction of the group estimate (Seer's "online context learning", section 4.2).

Seer's estimate of a group's length is the maximum among its finished siblings. With k of G
finished that is a lower bound of the group's longest response, and a biased one: the siblings
that finish first are the short ones. A sibling that turns out much longer than the first finished
ones is then ranked low, paused behind other groups, and becomes the rollout's tail (bench.sim
shows this is most of seer's gap to the oracle: with the true group maximum as its estimate the
same policy reaches 0.98-0.99 of the oracle).

The correction is learned from this rollout's own completed groups, with no length model: for every
completed group and every k < G, the ratio (group maximum) / (maximum of its first k finished
siblings, in finish order). The estimate of a running group with k finished is then its finished
maximum times a quantile of those ratios for (G, k). Until enough groups of that shape completed,
no correction applies (the paper's plain maximum).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Ratios kept per (group size, k): the most recent ones (the workload drifts over a rollout).
_WINDOW = 4096


@dataclass
class _Samples:
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    sorted_: list[float] = field(default_factory=list)
    cached: float | None = None
    dirty: int = 0


@dataclass
class SiblingRatios:
    """Quantiles of (group max / max of the first k finished) over completed groups."""

    quantile: float
    min_samples: int
    _by_shape: dict[tuple[int, int], _Samples] = field(default_factory=dict)

    def observe(self, finished_in_order: Sequence[int], group_size: int) -> None:
        """Record a completed group: its lengths in the order its members finished."""
        if len(finished_in_order) < 2 or self.quantile <= 0:
            return
        top = max(finished_in_order)
        if top <= 0:
            return
        running = 0
        for k, n in enumerate(finished_in_order[:-1], start=1):
            running = max(running, n)
            s = self._by_shape.setdefault((group_size, k), _Samples())
            ratio = top / max(1, running)
            if len(s.recent) == s.recent.maxlen:
                old = s.recent[0]
                del s.sorted_[bisect.bisect_left(s.sorted_, old)]
            s.recent.append(ratio)
            bisect.insort(s.sorted_, ratio)
            s.dirty += 1

    def factor(self, group_size: int, k: int) -> float | None:
        """The multiplier for a group of `group_size` with `k` finished; None = no correction."""
        if k <= 0 or k >= group_size or self.quantile <= 0:
            return None
        s = self._by_shape.get((group_size, k))
        if s is None or len(s.sorted_) < self.min_samples:
            return None
        # The quantile is refreshed every few new samples: estimates only need to be approximate,
        # and a stable value keeps queued keys consistent.
        if s.cached is None or s.dirty >= max(8, len(s.sorted_) // 16):
            i = min(len(s.sorted_) - 1, int(self.quantile * len(s.sorted_)))
            s.cached, s.dirty = s.sorted_[i], 0
        return s.cached

    def samples(self, group_size: int, k: int) -> int:
        s = self._by_shape.get((group_size, k))
        return 0 if s is None else len(s.sorted_)
