"""Adaptive speculation (Seer Algorithm 1, marginal-benefit-aware draft budgets).

Inputs: an offline-profiled step time T(B, gamma) (`seer profile`, StepTimeTable) and online
per-position acceptance rates. Each step, for the current batch of B requests:

1. Every (request, draft position i) is an increment whose expected gain is alpha_i, the probability
   that draft position i is accepted (all of 0..i accepted; non-increasing in i). Probe requests
   count their gain `probe_factor` (2) times: finishing a probe early sharpens the group's length
   estimate for context-aware scheduling, so the greedy budget goes to them first.
2. Increments are taken greedily by weighted gain. For every prefix of that order (total draft
   budget G) the expected tokens per step are B + sum(alpha) and the step time is T(B, G); the
   budget G* that maximises tokens per second wins. G* = 0 turns speculation off, which is what
   happens at large B where a verify step costs more than the accepted tokens pay back.
3. Each request gets the number of its increments inside G* (at most gamma_max = 8). G* > 0 only
   when its predicted tokens/s beats no speculation by `min_gain` (30%): the model is optimistic
   (measured in bench.spec: predicted ~1.2x where the CPU engine gave 0.9-1.0x; at B = 4, T = 1.0,
   predicted 1.18x, measured 0.92x per CPU second, 0.87x wall: in a closed batch the slowest
   request sets the time, and tokens accepted by the others do not shorten it; a draft for only
   part of the batch costs more than the table's interpolation: B = 8, one request with 2 draft
   tokens, +20-24% measured vs +7-11% modelled, as every query is padded to the longest). 20% let
   it draft at B = 4, T = 1.0 on a predicted 1.205x (alpha_0 0.35) and the suite ran 0.81x.

alpha_i is tracked from what the engine verified: accepted_i / proposed_i with exponential decay (so
the policy follows drift as the model or the data change) and a Beta prior (so a cold start drafts).
While speculation is off no acceptance is observed, so the planner explores: after
`explore_interval` plans off (every plan while it has seen fewer than `explore_until` draft tokens
at position 0: a cold estimate, for at most 4 x explore_until such attempts), one request (in
turn, so a request without a match does not stall learning) gets a short draft (`explore_gamma`
tokens), on a step where that costs at most `explore_max_cost` (10%) more than no draft (a large
batch: a few more rows in a big matmul; on this CPU two more rows at B = 16 cost ~7%), or after
4 x explore_interval plans off whatever it costs. Without this a cold planner whose prior says
"off" at the current batch size never learns that the drafts are good (measured in bench.spec and
through the suite: a fresh planner at B = 16 and the 0.5 prior drafted nothing in a whole run).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.log import get_logger, kv

DEFAULT_TABLE_PATH = Path(os.path.expanduser("~/.cache/seer/step_time.json"))
_LOG_INTERVAL_S = 30.0
_COLD_ATTEMPTS = 4  # cold exploration (every cheap plan) ends after this many x explore_until attempts

log = get_logger(__name__)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = 0
        while xs[i + 1] < x:
            i += 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepTimeTable:
    """T(B, gamma): seconds of one engine step with B requests each verifying gamma draft tokens."""

    batch_sizes: tuple[int, ...]
    gammas: tuple[int, ...]
    times_s: tuple[tuple[float, ...], ...]  # [batch index][gamma index], as measured
    source: str = "builtin"
    _model: tuple[tuple[float, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.gammas:
            raise ValueError("batch_sizes, gammas: must not be empty")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.gammas) != sorted(set(self.gammas)):
            raise ValueError("batch_sizes, gammas: must be strictly increasing")
        if len(self.times_s) != len(self.batch_sizes) or any(len(r) != len(self.gammas) for r in self.times_s):
            raise ValueError("times_s: must be a len(batch_sizes) x len(gammas) table")
        if any(not t > 0 for r in self.times_s for t in r):
            raise ValueError("times_s: step times must be > 0")
        # The model uses the table made monotone (running max along gamma, then along B): a step
        # that verifies more tokens is never cheaper. A profile on a shared machine is noisy
        # (bench.spec measured T(1, 4) = 74 ms < T(1, 2) = 80 ms), and a dip made the planner
        # draft 4 tokens where 2 did not pay.
        rows = [list(itertools.accumulate(r, max)) for r in self.times_s]
        for i in range(1, len(rows)):
            rows[i] = [max(a, b) for a, b in zip(rows[i], rows[i - 1], strict=True)]
        object.__setattr__(self, "_model", tuple(tuple(r) for r in rows))

    def time(self, batch: int, total_draft: float) -> float:
        """Step time for `batch` requests verifying `total_draft` draft tokens in all (from the
        monotone table)."""
        gamma = total_draft / batch if batch else 0.0
        per_batch = [_interp(self.gammas, row, gamma) for row in self._model]
        return max(1e-6, _interp(self.batch_sizes, per_batch, batch))

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "gammas": list(self.gammas),
                "times_s": [list(r) for r in self.times_s], "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepTimeTable:
        try:
            return cls(tuple(int(b) for b in d["batch_sizes"]), tuple(int(g) for g in d["gammas"]),
                       tuple(tuple(float(t) for t in row) for row in d["times_s"]), str(d.get("source", "file")))
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: missing from the step-time table") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StepTimeTable:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, p)

    @classmethod
    def builtin(cls) -> StepTimeTable:
        """A conservative CPU-like model (fixed cost + per-token cost), used when nothing was
        profiled: T = 25 ms + 1.5 ms * B * (1 + gamma)."""
        bs, gs = (1, 256), (0, 8)
        return cls(bs, gs, tuple(tuple(0.025 + 0.0015 * b * (1 + g) for g in gs) for b in bs), "builtin")


def load_table(table: StepTimeTable | Mapping[str, Any] | str | os.PathLike[str] | None) -> StepTimeTable:
    if isinstance(table, StepTimeTable):
        return table
    if isinstance(table, Mapping):
        return StepTimeTable.from_dict(table)
    if table is not None:
        return StepTimeTable.load(table)
    if DEFAULT_TABLE_PATH.exists():
        try:
            return StepTimeTable.load(DEFAULT_TABLE_PATH)
        except (OSError, ValueError):
            pass
    return StepTimeTable.builtin()


class AdaptiveSpeculation:
    def __init__(
        self,
        table: StepTimeTable | Mapping[str, Any] | str | None,
        *,
        gamma_max: int = 8,
        probe_factor: float = 2.0,
        prior_accept: float = 0.5,
        prior_weight: float = 4.0,
        decay: float = 0.998,
        explore_interval: int = 16,
        min_gain: float = 0.3,
        explore_gamma: int = 2,
        explore_max_cost: float = 0.1,
        explore_until: float = 32.0,
    ) -> None:
        if gamma_max < 0:
            raise ValueError("gamma_max: must be >= 0")
        if probe_factor < 1.0:
            raise ValueError("probe_factor: must be >= 1")
        if explore_gamma < 0 or explore_max_cost < 0:
            raise ValueError("explore_gamma, explore_max_cost: must be >= 0")
        self.table = load_table(table)
        self.gamma_max = gamma_max
        self.probe_factor = probe_factor
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.decay = decay
        self.explore_interval = explore_interval
        self.min_gain = min_gain
        self.explore_gamma = explore_gamma
        self.explore_max_cost = explore_max_cost
        self.explore_until = explore_until
        self._explore_turn = 0
        self._turn = 0
        self._proposed = [0.0] * gamma_max
        self._accepted = [0.0] * gamma_max
        self._off_streak = 0
        self.last_budget = 0
        self._cold_explorations = 0
        # Decisions per batch size: [plans, plans that drafted, their draft tokens, explorations]
        # (stats(), and an info log every 30 s: does it draft where a verify costs more than it gains?).
        self._by_batch: dict[int, list[int]] = {}
        self._logged_at = time.monotonic()

    # ---- acceptance -----------------------------------------------------------------------------

    def observe(self, proposed_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> None:
        """Counts of one step (or several): draft position i was proposed / accepted (with all
        positions before it) this many times."""
        d = self.decay
        for i in range(self.gamma_max):
            p = proposed_per_position[i] if i < len(proposed_per_position) else 0
            a = accepted_per_position[i] if i < len(accepted_per_position) else 0
            if p or a:
                self._proposed[i] = self._proposed[i] * d + p
                self._accepted[i] = self._accepted[i] * d + min(a, p)

    def acceptance(self) -> list[float]:
        """alpha_i = P(draft position i accepted), smoothed toward a geometric prior, non-increasing."""
        out: list[float] = []
        prev = 1.0
        for i in range(self.gamma_max):
            prior = self.prior_accept ** (i + 1)
            a = (self._accepted[i] + prior * self.prior_weight) / (self._proposed[i] + self.prior_weight)
            prev = min(prev, a)
            out.append(prev)
        return out

    # ---- planning -------------------------------------------------------------------------------

    def plan(self, requests: Sequence[tuple[str, bool]]) -> dict[str, int]:
        """(request_id, is_probe) -> draft length for this step; 0 = no speculation."""
        n = len(requests)
        plan = {rid: 0 for rid, _ in requests}
        if not n or self.gamma_max == 0:
            self.last_budget = 0
            return plan
        alpha = self.acceptance()
        probes = [rid for rid, is_probe in requests if is_probe]
        others = [rid for rid, is_probe in requests if not is_probe]
        # A budget that ends inside a class goes to a different part of it each plan: the same
        # requests always first would race ahead while their siblings, the batch's makespan, got
        # nothing (bench.spec B = 4: 43 accepted tokens saved 4 of 64 steps instead of ~10).
        self._turn += 1
        if probes:
            k = self._turn % len(probes)
            probes = probes[k:] + probes[:k]
        if others:
            k = self._turn % len(others)
            others = others[k:] + others[:k]
        # Increments in greedy order, grouped: (weighted gain, position, class members).
        chunks: list[tuple[float, int, list[str]]] = []
        for i, a in enumerate(alpha):
            if probes:
                chunks.append((a * self.probe_factor, i, probes))
            if others:
                chunks.append((a, i, others))
        chunks.sort(key=lambda c: (-c[0], c[1]))
        t0 = self.table.time(n, 0)
        best_rate, best_budget = n / t0, 0
        budget, expected = 0, float(n)
        for _w, i, members in chunks:
            a = alpha[i]
            # Evaluate a few points inside a chunk too: E and T are both linear there, but T may
            # bend at table knots.
            step = max(1, len(members) // 4)
            taken = 0
            while taken < len(members):
                inc = min(step, len(members) - taken)
                taken += inc
                budget += inc
                expected += inc * a
                rate = expected / self.table.time(n, budget)
                if rate > best_rate:
                    best_rate, best_budget = rate, budget
        # The step-time model misses costs (batch shrinkage, drafts that come out shorter than
        # planned, verification overheads); speculate only on a clear predicted gain.
        if best_rate < (1.0 + self.min_gain) * n / t0:
            best_budget = 0
        # Hand out the best budget in the same greedy order.
        left = best_budget
        for _w, _i, members in chunks:
            if left <= 0:
                break
            for rid in members[:left]:
                plan[rid] += 1
            left -= min(left, len(members))
        explored = False
        if best_budget == 0:
            self._off_streak += 1
            g = min(self.explore_gamma, self.gamma_max)
            # Cold: few drafts observed yet, explore every cheap plan. Bounded by attempts: an
            # exploring request often has no draft at all (no match; at T = 1.0 in the suite most
            # of them), so the observations may never come, and a planner stuck cold explored on
            # 12 of 14 plans at B = 11 (bench.spec --suite), each such step costing 10-25% more.
            cold = (self._proposed[0] < self.explore_until
                    and self._cold_explorations < _COLD_ATTEMPTS * self.explore_until)
            due = self._off_streak >= (1 if cold else self.explore_interval)
            if (self.explore_interval and g > 0 and due
                    and (self.table.time(n, g) <= (1.0 + self.explore_max_cost) * t0
                         or self._off_streak >= 4 * self.explore_interval)):
                self._off_streak = 0
                self._cold_explorations += cold
                rid = requests[self._explore_turn % n][0]
                self._explore_turn += 1
                plan[rid] = g
                best_budget = g
                explored = True
        else:
            self._off_streak = 0
        self.last_budget = best_budget
        row = self._by_batch.get(n)
        if row is None:
            row = self._by_batch[n] = [0, 0, 0, 0]
        row[0] += 1
        if explored:
            row[3] += 1
        elif best_budget:
            row[1] += 1
            row[2] += best_budget
        now = time.monotonic()
        if now - self._logged_at >= _LOG_INTERVAL_S:
            self._logged_at = now
            log.info("speculation plans", extra=kv(alpha=[round(a, 3) for a in alpha[:4]], **self.stats()))
        return plan

    def stats(self) -> dict[str, Any]:
        """Decisions so far by batch size: plans, plans that drafted by the model, their mean draft
        tokens, and plans that explored (one request, explore_gamma tokens, while the model says off)."""
        return {"plans_by_batch": {b: {"plans": r[0], "drafting": r[1],
                                       "mean_budget": round(r[2] / r[1], 2) if r[1] else 0.0, "explored": r[3]}
                                   for b, r in sorted(self._by_batch.items())}}
