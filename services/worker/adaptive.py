"""Adaptive speculation (Seer Algorithm 1, marginal-benefit-aware draft budgets), closed loop.

Inputs: an offline-profiled step time T(B, gamma) (`seer profile`, StepTimeTable), online
per-position acceptance rates, and (closed loop) the measured time of every engine step. Each step,
for the current batch of B requests:

1. Every (request, draft position i) is an increment whose expected gain is avail_i x alpha_i:
   alpha_i is the probability that draft position i is accepted (all of 0..i accepted;
   non-increasing in i), avail_i the probability that a planned position i comes back as a draft
   at all (the suffix index may have no match, or a shorter one). Probe requests count their gain
   `probe_factor` (2) times: finishing a probe early sharpens the group's length estimate for
   context-aware scheduling, so the greedy budget goes to them first.
2. Increments are taken greedily by weighted gain. For every prefix of that order the expected
   tokens per step are B + sum(avail x alpha) and the step time is the corrected model below; the
   budget G* that maximises tokens per second wins. G* = 0 turns speculation off, which is what
   happens at large B where a verify step costs more than the accepted tokens pay back.
3. Each request gets the number of its increments inside G* (at most gamma_max = 8). G* > 0 only
   when its predicted tokens/s beats no speculation by a margin: `min_gain` (30%) while the
   batch-size bucket's costs are unmeasured (the open-loop table was measured 15-25% optimistic),
   shrinking to `calibrated_min_gain` as drafting steps of that bucket are timed.

Closing the loop (the worker core reports every decode step through observe_step):

- Cost. The table's time of a plan is T(B, G + pad_cost x (B x gmax - G)): a verify step pads every
  request's query to the longest draft (gmax), and a padded row costs a fraction of a real one
  (attention only; the reference engine: B = 8, one request with 2 draft tokens, +20-24% measured
  vs +7-11% interpolated, i.e. pad_cost ~0.15). Per batch-size bucket (1, 2, 3-4, 5-8, ...) the
  planner keeps decayed sums of measured vs table time: c0 = measured / T(B, 0) over plain steps,
  and rho = measured relative extra cost / the table's relative extra cost over drafting steps
  (t / (c0 T(B, 0)) - 1 vs T(B, G_eff) / T(B, 0) - 1, with G_eff from the draft tokens that
  actually came), kept apart for partial plans (under half of the padded rows real: explorations,
  a budget for a few requests) and full ones, each the other's prior. Plans use
  1 + rho x (T(B, G_eff) / T(B, 0) - 1) in units of a plain step, so the table's clock and machine
  do not matter, only its shape. Samples are clipped (a step descheduled on a shared machine must
  not swing the estimate) and decayed per sample of their kind (drift; evidence that drafting
  costs more does not fade while the planner, convinced, stops drafting). Without step timings
  (a caller that never reports them) the planner is the open-loop model: no padding term, no
  availability, no guard.
- Benefit. avail_i is learned from what was planned vs the draft depth that came back.
- Guard ("never slower than no speculation" by measurement, not by model: for errors no
  correction above can see, e.g. accepted tokens that do not shorten anything). Per bucket, the
  realised speedup of the planner's drafting steps, R = sum(tokens / B) / sum(t / (c0 T(B, 0)))
  over a decayed window of ~4 x `guard_steps` drafting steps, is judged every `guard_steps` of
  them; R + its standard error below `guard_min_speedup` (1.0) turns drafting off in that bucket
  for guard_backoff x 2^k plans (k grows with each failed verdict, shrinks with each passed one),
  so a true loss costs a bounded, shrinking share of the run. One plan in `control_interval`
  that would draft runs plain instead, so c0 stays measured where the planner always drafts.

alpha_i is tracked from what the engine verified: accepted_i / proposed_i with exponential decay (so
the policy follows drift as the model or the data change) and a Beta prior (so a cold start drafts).
While speculation is off no acceptance is observed, so the planner explores: after
`explore_interval` plans off (every plan while it has seen fewer than `explore_until` draft tokens
at position 0: a cold estimate, for at most 4 x explore_until such attempts), one request (in
turn, so a request without a match does not stall learning) gets a short draft (`explore_gamma`
tokens). With step timings, exploration spends a credit that grows by `explore_budget` (2%) of
every step's measured time and is charged each exploring step's measured extra time, so
exploration costs at most that share of the run. Without timings (a caller that never reports
steps) the open-loop rule stays: explore on a step where that costs at most `explore_max_cost`
(10%) more than no draft, or after 4 x explore_interval plans off whatever it costs. Without
exploration a cold planner whose prior says "off" at the current batch size never learns that the
drafts are good (measured in bench.spec and through the suite: a fresh planner at B = 16 and the
0.5 prior drafted nothing in a whole run).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
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
    # Per batch size, the monotone table interpolated along batch: one row over gammas. A plan
    # evaluates ~60 step times at one batch size, and interpolating every batch row for each of
    # them cost ~1.8 ms per plan, a tenth of a GPU decode step.
    _rows: dict[int, tuple[float, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.gammas:
            raise ValueError("batch_sizes, gammas: must not be empty")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.gammas) != sorted(set(self.gammas)):
            raise ValueError("batch_sizes, gammas: must be strictly increasing")
        if len(self.times_s) != len(self.batch_sizes) or any(len(r) != len(self.gammas) for r in self.times_s):
            raise ValueError("times_s: must be a len(batch_sizes) x len(gammas) table")
        # inf passed `> 0` and made every interpolated time inf or NaN (inf - inf): plans on garbage.
        if any(not 0 < t < math.inf for r in self.times_s for t in r):
            raise ValueError("times_s: step times must be finite and > 0")
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
        monotone table; bilinear inside the grid, linear extrapolation outside)."""
        gamma = total_draft / batch if batch else 0.0
        row = self._rows.get(batch)
        if row is None:
            cols = range(len(self.gammas))
            row = tuple(_interp(self.batch_sizes, [r[k] for r in self._model], batch) for k in cols)
            if len(self._rows) < 4096:  # batch sizes are small integers; bounded all the same
                self._rows[batch] = row
        return max(1e-6, _interp(self.gammas, row, gamma))

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "gammas": list(self.gammas),
                "times_s": [list(r) for r in self.times_s], "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepTimeTable:
        if not isinstance(d, Mapping):
            raise ValueError(f"step-time table: must be a JSON object, got {type(d).__name__}")
        try:
            return cls(tuple(int(b) for b in d["batch_sizes"]), tuple(int(g) for g in d["gammas"]),
                       tuple(tuple(float(t) for t in row) for row in d["times_s"]), str(d.get("source", "file")))
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: missing from the step-time table") from None
        except TypeError as e:
            # A value of the wrong shape ("batch_sizes": 5, a null row): a bad table, which
            # load_table's fallback for the default file must see as one (a TypeError crashed the
            # worker at start on a corrupt ~/.cache/seer/step_time.json).
            raise ValueError(f"batch_sizes, gammas, times_s: malformed step-time table ({e})") from None

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


def _shape(batch: int, draft_tokens: float, gmax: float) -> int:
    """0: a partial plan (under half of the padded [B, gmax] verify rows are real drafts), 1: full."""
    return int(draft_tokens >= 0.5 * batch * gmax)


def _bucket(batch: int) -> int:
    """Batch-size bucket: 1, 2, 3-4, 5-8, 9-16, ... (step costs change smoothly in log B)."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Cell:
    """What the planner measured in one batch-size bucket. Sums of plain and of drafting steps decay
    per new sample of their own kind: evidence that drafting costs more must not fade while the
    planner, convinced by it, stops drafting."""

    plain_meas: float = 0.0  # seconds of plain steps (no draft token verified)
    plain_pred: float = 0.0  # their table time T(B, 0)
    plain_steps: float = 0.0
    # Drafting steps, by shape (_shape: 0 = partial, most requests without a draft; 1 = full): the
    # measured relative extra cost t / (c0 T(B, 0)) - 1, the table's T(B, G_eff) / T(B, 0) - 1, and
    # the (decayed) count of such steps, the evidence behind rho. The shapes are kept apart: a
    # padded one-request exploration says little about every request drafting one token.
    extra_meas: list[float] = field(default_factory=lambda: [0.0, 0.0])
    extra_pred: list[float] = field(default_factory=lambda: [0.0, 0.0])
    drafted: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # Guard: the planner's own drafting steps (explorations excluded), per step u = tokens / B and
    # v = t / (c0 T(B, 0)) (plain steps' worth of time); decayed sums of u, v, u^2, uv, v^2 and
    # the step count, reset by a failed verdict; `pending` counts steps since the last verdict.
    gain: list[float] = field(default_factory=lambda: [0.0] * 6)
    pending: int = 0
    level: int = 0  # failed verdicts not yet made up by passed ones
    off_until: int = 0  # plan number until which drafting is off here
    drafting_plans: int = 0  # plans that would draft (every control_interval-th runs plain)
    verdicts: list[int] = field(default_factory=lambda: [0, 0])  # [passed, failed]



@dataclass
class _Pending:
    """The plan of the step in flight, completed by observe() and observe_step()."""

    batch: int
    kind: str  # plain | draft | explore | beside (draft + an exploration) | guarded (the guard said off) | control
    planned: list[int]  # requests planned to reach draft position i
    proposed: list[int]  # requests whose draft reached position i (observe)


@dataclass
class _Request:
    """One request's verified drafts, as conditional acceptance counts per draft position: trials[i]
    counts steps whose draft reached position i with positions 0..i-1 accepted, hits[i] those that
    accepted position i too; both decay by request_decay per observed step of the request."""

    trials: list[float]
    hits: list[float]
    # alpha_r for the global alpha it was computed from (recomputed when either changes).
    alpha: list[float] | None = None
    alpha_of: Sequence[float] | None = None


_MIN_GAIN = 0.01  # a per-request class's increments below this expected gain are not planned
_FEW_CLASSES = 4  # plan(): up to this many classes, a chunk's cost is evaluated inside it too
_PRIOR_STEPS = 3.0  # pseudo-steps of the priors c0 = global c0 and rho = 1
_PRIOR_EXTRA = 0.1  # the relative extra cost one prior pseudo-step of rho stands for
_MAX_LEVEL = 6  # guard: off periods grow to guard_backoff x 2^6 plans at most


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
        calibrated_min_gain: float = 0.05,
        calibration_steps: float = 8.0,
        pad_cost: float = 0.15,
        cost_decay: float = 0.97,
        explore_budget: float = 0.02,
        guard_steps: int = 16,
        guard_min_speedup: float = 1.0,
        guard_backoff: int = 64,
        control_interval: int = 32,
        request_weight: float = 2.0,
        request_decay: float = 0.9,
        request_bins: int = 8,
        max_requests: int = 4096,
    ) -> None:
        if gamma_max < 0:
            raise ValueError("gamma_max: must be >= 0")
        if probe_factor < 1.0:
            raise ValueError("probe_factor: must be >= 1")
        if explore_gamma < 0 or explore_max_cost < 0:
            raise ValueError("explore_gamma, explore_max_cost: must be >= 0")
        if min_gain < 0 or calibrated_min_gain < 0:
            raise ValueError("min_gain, calibrated_min_gain: must be >= 0")
        if pad_cost < 0:
            raise ValueError("pad_cost: must be >= 0")
        if not 0.0 < cost_decay <= 1.0:
            raise ValueError("cost_decay: must be in (0, 1]")
        if not 0.0 <= explore_budget < 1.0:
            raise ValueError("explore_budget: must be in [0, 1)")
        if guard_steps < 1 or guard_backoff < 1 or control_interval < 0 or calibration_steps < 0:
            raise ValueError("guard_steps, guard_backoff: must be >= 1; control_interval, calibration_steps: >= 0")
        if request_weight <= 0 or not 0.0 < request_decay <= 1.0:
            raise ValueError("request_weight: must be > 0; request_decay: must be in (0, 1]")
        if request_bins < 1 or max_requests < 1:
            raise ValueError("request_bins, max_requests: must be >= 1")
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
        self.calibrated_min_gain = calibrated_min_gain
        self.calibration_steps = calibration_steps
        self.pad_cost = pad_cost
        self.cost_decay = cost_decay
        self.explore_budget = explore_budget
        self.guard_steps = guard_steps
        self.guard_min_speedup = guard_min_speedup
        self.guard_backoff = guard_backoff
        self.control_interval = control_interval
        self.request_weight = request_weight
        self.request_decay = request_decay
        self.request_bins = request_bins
        self.max_requests = max_requests
        # Per-request acceptance (observe_request), least recently observed first: bounded by
        # max_requests whether or not the caller reports the requests' ends (forget_request).
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._alpha: list[float] | None = None  # acceptance() until the next observe()
        self._per_request = False  # set by the first observe_request
        self._beside_streak = 0  # drafting plans since the last exploration beside them
        self._prior_of: Sequence[float] | None = None  # _request_alpha: the global alpha of _prior_wc
        self._prior_wc: list[float] = []
        self._worth_memo: tuple[tuple[object, ...], bool] | None = None  # plan(): worth(), by its inputs
        self._explore_turn = 0
        self._turn = 0
        self._proposed = [0.0] * gamma_max
        self._accepted = [0.0] * gamma_max
        self._planned = [0.0] * gamma_max  # availability: positions planned / proposed (decayed)
        self._came = [0.0] * gamma_max
        self._off_streak = 0
        self.last_budget = 0
        self._cold_explorations = 0
        # Closed loop: set by the first observe_step (a caller that never reports steps keeps the
        # open-loop behaviour).
        self._timed = False
        self._cells: dict[int, _Cell] = {}
        self._c0_meas = 0.0  # all buckets' plain steps: the prior of a bucket without its own
        self._c0_pred = 0.0
        self._c0_steps = 0.0
        self._credit = 0.0  # exploration credit, seconds
        self._plan_no = 0
        self._pending: _Pending | None = None
        # Decisions per batch size: [plans, plans that drafted, their draft tokens, explorations,
        # guard-off plans, control plans] (stats(), and an info log every 30 s).
        self._by_batch: dict[int, list[int]] = {}
        self._logged_at = time.monotonic()

    # ---- acceptance and availability ------------------------------------------------------------

    def observe(self, proposed_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> None:
        """Counts of one step (or several): draft position i was proposed / accepted (with all
        positions before it) this many times."""
        d = self.decay
        pend = self._pending
        for i in range(self.gamma_max):
            p = proposed_per_position[i] if i < len(proposed_per_position) else 0
            a = accepted_per_position[i] if i < len(accepted_per_position) else 0
            if p or a:
                self._proposed[i] = self._proposed[i] * d + p
                self._accepted[i] = self._accepted[i] * d + min(a, p)
            if pend is not None and p:
                pend.proposed[i] += p
        self._alpha = None

    def acceptance(self) -> list[float]:
        """alpha_i = P(draft position i accepted), smoothed toward a geometric prior, non-increasing."""
        return list(self._acceptance())

    def _acceptance(self) -> list[float]:
        """acceptance(), kept until the next observe(): the per-request alphas computed from it
        are kept with it (plan() runs every step, up to B = 256 requests)."""
        if self._alpha is not None:
            return self._alpha
        out: list[float] = []
        prev = 1.0
        for i in range(self.gamma_max):
            prior = self.prior_accept ** (i + 1)
            a = (self._accepted[i] + prior * self.prior_weight) / (self._proposed[i] + self.prior_weight)
            prev = min(prev, a)
            out.append(prev)
        # Kept (observe() clears it): the per-request alphas are cached against this very list
        # (identity), so a fresh list every call recomputed all of them every plan (51,456 in 200
        # plans at B = 256).
        self._alpha = out
        return out

    def observe_request(self, request_id: str, proposed_depth: int, accepted: int) -> None:
        """One request's verified draft of one step: it reached `proposed_depth` positions (a draft
        tree: its deepest path), of which the first `accepted` were accepted. The aggregate counts
        still come through observe(); this only sharpens the request's own estimate."""
        depth = min(int(proposed_depth), self.gamma_max)
        if depth <= 0:
            return
        acc = min(max(int(accepted), 0), depth)
        self._per_request = True
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = _Request([0.0] * self.gamma_max, [0.0] * self.gamma_max)
            if len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)  # the least recently observed one
        else:
            self._requests.move_to_end(request_id)
        d = self.request_decay
        for i in range(self.gamma_max):
            st.trials[i] *= d
            st.hits[i] *= d
        # Position i was a trial if the draft reached it and 0..i-1 were accepted.
        for i in range(min(acc + 1, depth)):
            st.trials[i] += 1.0
            if i < acc:
                st.hits[i] += 1.0
        st.alpha = None

    def forget_request(self, request_id: str) -> None:
        """The request ended here (its chunk finished or was aborted): its estimate goes."""
        self._requests.pop(request_id, None)

    def request_acceptance(self, request_id: str, alpha: Sequence[float] | None = None) -> list[float]:
        """alpha_r,i for one request: the global alpha_i (`alpha`, default acceptance()) shrunk
        toward the request's own evidence. Shrinkage is per conditional step c_i = P(i accepted |
        0..i-1 accepted): c_r,i = (hits_i + w g_i) / (trials_i + w), g_i = alpha_i / alpha_{i-1},
        alpha_r,i = c_r,0 ... c_r,i (non-increasing by construction). Per position unconditional
        counts would leave every position past the deepest draft the request was given at the
        global alpha: a request that accepted every 2-token exploration would never be planned a
        third token while the global alpha (weak siblings) said no. Without evidence of its own a
        request's alpha is the global one exactly."""
        # The cached global alpha itself (not a copy): a copy would replace the request's cached
        # alpha_r with one for the copy, and the next plan would recompute it.
        g = list(alpha) if alpha is not None else self._acceptance()
        st = self._requests.get(request_id)
        if st is None:
            return list(g)
        return list(self._request_alpha(st, g))

    def _request_alpha(self, st: _Request, g: Sequence[float]) -> list[float]:
        if st.alpha is not None and st.alpha_of is g:
            return st.alpha
        w = self.request_weight
        # The global conditional steps w g_i, once per global alpha (every request's alpha_r is
        # recomputed after each observe(): 256 of them per plan at B = 256 while drafting).
        if self._prior_of is not g:
            wc: list[float] = []
            prev_g = 1.0
            for gi in g:
                wc.append(w * (gi / prev_g if prev_g > 0 else 0.0))
                prev_g = gi
            self._prior_of, self._prior_wc = g, wc
        out: list[float] = []
        a = 1.0
        for h, t, c in zip(st.hits, st.trials, self._prior_wc, strict=False):
            a *= (h + c) / (t + w)
            out.append(a)
        st.alpha, st.alpha_of = out, g
        return out

    def availability(self) -> list[float]:
        """avail_i = P(a planned draft position i comes back as a draft token), prior 1 (weight 2),
        non-increasing."""
        out: list[float] = []
        prev = 1.0
        for i in range(self.gamma_max):
            prev = min(prev, (self._came[i] + 2.0) / (self._planned[i] + 2.0))
            out.append(prev)
        return out

    # ---- step timings (closed loop) -------------------------------------------------------------

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """One decode step (no prefill in it) of `batch` requests finished: it emitted `tokens`
        tokens in `seconds` (the draft positions it verified came through observe() before)."""
        pend, self._pending = self._pending, None
        # Not finite: no measurement (an inf step made the exploration credit inf: unbounded
        # exploration for the rest of the run).
        if pend is None or batch < 1 or not 0 < seconds < math.inf:
            return
        self._timed = True
        self._settle(pend)
        cell = self._cells.setdefault(_bucket(batch), _Cell())
        d = self.cost_decay
        t0 = self.table.time(batch, 0)
        real = sum(pend.proposed)
        c0 = self._c0(cell)
        if real == 0:  # nothing verified (planned off, or no draft came): a plain step
            r = min(max(seconds / t0, 0.5 * c0), 2.0 * c0)
            cell.plain_meas = cell.plain_meas * d + r * t0
            cell.plain_pred = cell.plain_pred * d + t0
            cell.plain_steps = cell.plain_steps * d + 1.0
            self._c0_meas = self._c0_meas * d + r * t0
            self._c0_pred = self._c0_pred * d + t0
            self._c0_steps = self._c0_steps * d + 1.0
        else:
            gmax = max(i + 1 for i, p in enumerate(pend.proposed) if p)
            x_pred = max(self._table_time(batch, real, gmax) / t0 - 1.0, 0.0)
            x_meas = min(max(seconds / (c0 * t0), 0.5), 3.0) - 1.0
            sh = _shape(batch, real, gmax)
            cell.extra_meas[sh] = cell.extra_meas[sh] * d + x_meas
            cell.extra_pred[sh] = cell.extra_pred[sh] * d + x_pred
            cell.drafted[sh] = cell.drafted[sh] * d + 1.0
        base = c0 * t0  # seconds of a plain step here
        if pend.kind == "explore":
            self._credit -= max(seconds - base, 0.0)
        self._credit = min(self._credit + self.explore_budget * seconds, max(base, seconds))
        if pend.kind == "draft":
            u, v = tokens / batch, min(seconds / base, 3.0)
            g, k = cell.gain, 1.0 - 1.0 / (4 * self.guard_steps)  # memory ~4 verdicts' steps
            for j, x in enumerate((u, v, u * u, u * v, v * v, 1.0)):
                g[j] = g[j] * k + x
            cell.pending += 1
            if cell.pending >= self.guard_steps:
                self._verdict(cell, batch)

    def _settle(self, pend: _Pending) -> None:
        """Availability from a finished plan: planned positions vs the draft depths that came."""
        d = self.decay
        for i, n in enumerate(pend.planned):
            if n:
                self._planned[i] = self._planned[i] * d + n
                self._came[i] = self._came[i] * d + min(pend.proposed[i], n)

    def _verdict(self, cell: _Cell, batch: int) -> None:
        """Drafting off in this bucket when its realised speedup R = sum(u) / sum(v) is below
        guard_min_speedup by more than one standard error. Tokens per step vary a lot with the
        acceptance of the moment (1 to 9 at B = 1): a plain window mean turned drafting off at
        B = 1, T = 0.7 (1.33x overall) on stretches without matches; the standard error keeps a
        true 1.17x (T = 1.0) drafting (a false verdict ~0.3%) and still stops a 0.85x in 16 steps."""
        su, sv, suu, suv, svv, n = cell.gain
        cell.pending = 0
        if sv <= 0 or n < 2:
            return
        r = su / sv
        resid = max(suu - 2 * r * suv + r * r * svv, 0.0)  # sum of (u - r v)^2
        se = math.sqrt(resid * n / (n - 1)) / sv
        if r + se < self.guard_min_speedup:
            cell.off_until = self._plan_no + self.guard_backoff * (1 << cell.level)
            cell.level = min(cell.level + 1, _MAX_LEVEL)
            cell.verdicts[1] += 1
            cell.gain = [0.0] * 6
            log.info("speculation guard: drafting measured slower than plain steps; off",
                     extra=kv(batch=batch, speedup=round(r, 3), se=round(se, 3),
                              off_plans=cell.off_until - self._plan_no))
        else:
            cell.level = max(cell.level - 1, 0)
            cell.verdicts[0] += 1

    def _c0(self, cell: _Cell | None) -> float:
        """Measured / table time of a plain step in this bucket. Prior: _PRIOR_STEPS pseudo-steps
        of the all-buckets ratio (itself with a prior of 1), in the bucket's own units."""
        g = 1.0
        if self._c0_steps:
            w = _PRIOR_STEPS * self._c0_pred / self._c0_steps
            g = (self._c0_meas + w) / (self._c0_pred + w)
        if cell is None or not cell.plain_steps:
            return g
        w = _PRIOR_STEPS * cell.plain_pred / cell.plain_steps
        return (cell.plain_meas + g * w) / (cell.plain_pred + w)

    def _rho(self, cell: _Cell | None, shape: int) -> float:
        """Measured / table relative extra cost of drafting in this bucket and plan shape. Prior:
        the other shape's ratio where that was measured, else 1."""
        if cell is None:
            return 1.0
        w = _PRIOR_STEPS * _PRIOR_EXTRA
        other = 1 - shape
        # Only pessimism carries over: a partial plan's rho < 1 (its padding over-modelled) made
        # full plans at B = 8 look 34% cheaper than they were, and the planner drafted at a loss.
        prior = max((cell.extra_meas[other] + w) / (cell.extra_pred[other] + w), 1.0) if cell.drafted[other] else 1.0
        return min(max((cell.extra_meas[shape] + prior * w) / (cell.extra_pred[shape] + w), 0.25), 8.0)

    def _table_time(self, batch: int, draft_tokens: float, gmax: float) -> float:
        """The table's step time with every query padded to the longest draft (gmax tokens).
        Padding is part of the closed-loop model only: without step timings the planner is the
        open-loop model of session 3 (pinned by tests/draft/test_adaptive.py)."""
        pad = max(batch * gmax - draft_tokens, 0.0) if self._timed else 0.0
        return self.table.time(batch, draft_tokens + self.pad_cost * pad)

    # ---- planning -------------------------------------------------------------------------------

    def plan(self, requests: Sequence[tuple[str, bool]]) -> dict[str, int]:
        """(request_id, is_probe) -> draft length for this step; 0 = no speculation."""
        n = len(requests)
        plan = {rid: 0 for rid, _ in requests}
        if self._pending is not None:
            # The last step was not timed (a prefill step): keep its availability. A caller that
            # never times steps may not report every step's drafts either: no availability then.
            if self._timed:
                self._settle(self._pending)
            self._pending = None
        if not n or self.gamma_max == 0:
            self.last_budget = 0
            return plan
        self._plan_no += 1
        alpha = self._acceptance()
        avail = self.availability()
        cell = self._cells.get(_bucket(n)) if self._timed else None
        rho = (self._rho(cell, 0), self._rho(cell, 1))
        classes, class_trials = self._classes(requests, alpha)
        # A budget that ends inside a class goes to a different part of it each plan: the same
        # requests always first would race ahead while their siblings, the batch's makespan, got
        # nothing (bench.spec B = 4: 43 accepted tokens saved 4 of 64 steps instead of ~10).
        self._turn += 1
        for _f, _a, members in classes:
            k = self._turn % len(members)
            members[:] = members[k:] + members[:k]
        # Increments in greedy order, grouped: (weighted gain, position, class, class members).
        # A class of requests with evidence of their own (class_trials not None) is one of up to
        # 2 x request_bins: its increments under _MIN_GAIN of a token go (they cannot pay, and B = 64
        # in 16 classes made ~500 cost evaluations a plan), and a small one is evaluated at its end
        # only (steps: per chunk, how many members between cost evaluations). With more than
        # _FEW_CLASSES classes every chunk is evaluated at its end only: the chunks are then small
        # slices of the batch already, and 4 points in each made ~640 cost evaluations a plan at
        # B = 256 (1.0-1.5 ms, against ~0.2 ms for the global planner's 2 classes).
        chunks: list[tuple[float, int, int, list[str]]] = []
        steps: list[int] = []
        many = len(classes) > _FEW_CLASSES
        for c, (_f, _a, members) in enumerate(classes):
            k = len(members)
            steps.append(k if many or (class_trials[c] is not None and k < 8) else max(1, k // 4))
        for i, av_i in enumerate(avail):
            for c, (factor, a, members) in enumerate(classes):
                w = a[i] * av_i * factor
                if class_trials[c] is None or w >= _MIN_GAIN:
                    chunks.append((w, i, c, members))
        chunks.sort(key=lambda ch: (-ch[0], ch[1]))
        class_alpha = [a for _f, a, _m in classes]
        t0 = self.table.time(n, 0)

        def cost(real: float, gmax: int) -> float:  # in plain steps (c0 T(B, 0))
            return 1.0 + rho[_shape(n, real, gmax)] * max(self._table_time(n, real, gmax) / t0 - 1.0, 0.0)

        def best(alphas: Sequence[Sequence[float]], avail: Sequence[float],
                 enough: float = math.inf) -> tuple[float, int]:
            """(tokens per plain step's time, draft budget) of the best prefix of the greedy order,
            with alphas[class][i] and avail[i]; stops at the first prefix whose rate reaches
            `enough` (a yes / no question needs no more)."""
            best_rate, best_budget = float(n), 0
            budget, expected, real, gmax = 0, float(n), 0.0, 0
            for _w, i, c, members in chunks:
                a, av = alphas[c][i], avail[i]
                gmax = max(gmax, i + 1)
                # Evaluate a few points inside a chunk too: E and T are both linear there, but T
                # may bend at table knots.
                step = steps[c]
                taken = 0
                while taken < len(members):
                    inc = min(step, len(members) - taken)
                    taken += inc
                    budget += inc
                    real += inc * av
                    expected += inc * av * a
                    rate = expected / cost(real, gmax)
                    if rate > best_rate:
                        best_rate, best_budget = rate, budget
                        if rate >= enough:
                            return best_rate, best_budget
            return best_rate, best_budget

        best_rate, best_budget = best(class_alpha, avail)
        # The step-time model misses costs until measured (batch shrinkage, drafts that come out
        # shorter than planned, verification overheads); speculate only on a clear predicted gain,
        # a margin that shrinks as this bucket's drafting steps are timed.
        # Evidence: this bucket's timed drafting steps of either shape (an unmeasured shape's rho
        # starts from the measured one's).
        seen = sum(cell.drafted) if cell else 0.0
        evidence = seen / (seen + self.calibration_steps) if seen else 0.0
        margin = self.min_gain + (self.calibrated_min_gain - self.min_gain) * evidence
        if best_rate < (1.0 + margin) * n:
            best_budget = 0
        kind = "draft" if best_budget else "plain"
        if best_budget and cell is not None:
            if self._plan_no < cell.off_until:  # the guard measured drafting slower here
                best_budget, kind = 0, "guarded"
            else:
                cell.drafting_plans += 1
                if self.control_interval and cell.drafting_plans % self.control_interval == 0:
                    best_budget, kind = 0, "control"
        # Hand out the best budget in the same greedy order.
        left = best_budget
        for _w, _i, _c, members in chunks:
            if left <= 0:
                break
            for rid in members[:left]:
                plan[rid] += 1
            left -= min(left, len(members))
        if best_budget == 0 and kind != "control":
            self._off_streak += 1
            # Exploring is worth its cost only if what it may learn can change the decision: with
            # acceptance and availability at their upper confidence bounds the model would draft
            # here once its costs are measured (the calibrated margin: exploring measures them);
            # a warm planner that saw alpha_0 0.2 at B = 8 stops paying for explorations. Every
            # 8 x explore_interval plans off it explores anyway (drift).
            # Asked lazily (a second pass over the greedy order): only on a plan where the answer
            # decides, i.e. an exploration is due and affordable.
            enough = (1.0 + self.calibrated_min_gain) * n

            def worth() -> bool:
                # Kept while its inputs stay (off, nothing explored: they do, plan after plan, and
                # the "no" answer runs the whole greedy order: ~100 cost evaluations at B = 256).
                key = (n, self._per_request, rho, tuple(avail), tuple(self._proposed), tuple(self._planned),
                       tuple(len(m) for _f, _a, m in classes), tuple(tuple(a) for a in class_alpha),
                       tuple(None if t is None else tuple(t) for t in class_trials))
                if self._worth_memo is not None and self._worth_memo[0] == key:
                    return self._worth_memo[1]
                ok = best(*self._optimistic(class_alpha, class_trials, avail), enough)[0] >= enough
                self._worth_memo = (key, ok)
                return ok

            explored = self._explore(requests, plan, t0, cell, worth)
            if explored:
                best_budget, kind = explored, "explore"
        elif best_budget:
            self._off_streak = 0
            if self._per_request and kind == "draft":
                # Its tokens count (last_budget, stats), and the step is kept out of the guard's
                # window (kind "beside"): the guard judges the model's drafting, not the cost of a
                # probably-bad request's exploration.
                beside = self._explore_beside(requests, plan, t0, cell)
                if beside:
                    best_budget, kind = best_budget + beside, "beside"
        self.last_budget = best_budget
        planned = [0] * self.gamma_max
        for v in plan.values():
            for i in range(min(v, self.gamma_max)):
                planned[i] += 1
        self._pending = _Pending(n, kind, planned, [0] * self.gamma_max)
        self._count(n, kind, best_budget, alpha)
        return plan

    def _optimistic(self, alphas: Sequence[Sequence[float]], evidence: Sequence[Sequence[float] | None],
                    avail: Sequence[float]) -> tuple[list[list[float]], list[float]]:
        """Every class's alpha_i and avail_i at two standard errors above their estimates. The
        counts behind a class's alpha: the global ones, or, once the caller reports per-request
        outcomes, its members' own (mean trials + request_weight): an unmeasured request may be
        one that accepts everything (history-backed) however poor the batch-wide alpha, and that
        is what exploring it finds out."""

        def up(p: float, n: float) -> float:
            return min(1.0, p + 2.0 * math.sqrt(p * (1.0 - p) / n)) if n > 0 else 1.0

        out: list[list[float]] = []
        for alpha, ev in zip(alphas, evidence, strict=True):
            if not self._per_request:
                out.append([up(a, self._proposed[i] + self.prior_weight)
                            for i, a in enumerate(alpha)])
            else:
                out.append([up(a, (ev[i] if ev is not None else 0.0) + self.request_weight)
                            for i, a in enumerate(alpha)])
        return out, [up(a, self._planned[i] + 2.0) for i, a in enumerate(avail)]

    def _classes(self, requests: Sequence[tuple[str, bool]], alpha: list[float]
                 ) -> tuple[list[tuple[float, list[float], list[str]]], list[list[float] | None]]:
        """The batch in classes of like requests: (gain factor, the class's alpha, members in batch
        order), and each class's mean trials per position (None: no evidence of its own). Probes
        and others apart (probe_factor); requests with evidence of their own in request_bins bins
        of alpha_r,0, a class planned with its members' mean alpha (the greedy order and its cost
        stay per class and position, not per request: B up to 256 every step).
        Requests without evidence of their own form one class with the global alpha itself, so a
        caller that never reports per-request outcomes gets the global planner exactly."""
        # Per class: members, their alpha_r lists and trial lists (summed per position at the end
        # with sum(zip(...)): summing in the per-request loop was most of a plan's time at B = 256).
        groups: dict[tuple[bool, int], tuple[list[str], list[list[float]], list[list[float]]]] = {}
        unmeasured: dict[bool, list[str]] = {}
        known = self._requests
        bins = self.request_bins
        for rid, is_probe in requests:
            st = known.get(rid)
            if st is None:
                unmeasured.setdefault(is_probe, []).append(rid)
                continue
            a = self._request_alpha(st, alpha)
            key = (is_probe, min(int(a[0] * bins), bins - 1))
            group = groups.get(key)
            if group is None:
                groups[key] = ([rid], [a], [st.trials])
            else:
                group[0].append(rid)
                group[1].append(a)
                group[2].append(st.trials)
        for is_probe, members in unmeasured.items():
            groups[(is_probe, -1)] = (members, [], [])
        out: list[tuple[float, list[float], list[str]]] = []
        evidence: list[list[float] | None] = []
        # Probes first, then others (the order of equal gains in the greedy sort), each from the
        # highest acceptance down, the requests without evidence last.
        for key in sorted(groups, key=lambda k: (not k[0], -k[1])):
            members, alphas, trials = groups[key]
            factor = self.probe_factor if key[0] else 1.0
            if key[1] < 0:
                out.append((factor, alpha, members))
                evidence.append(None)
            else:
                k = len(members)
                out.append((factor, [sum(col) / k for col in zip(*alphas, strict=True)], members))
                evidence.append([sum(col) / k for col in zip(*trials, strict=True)])
        return out, evidence

    def _explore(self, requests: Sequence[tuple[str, bool]], plan: dict[str, int], t0: float,
                 cell: _Cell | None, worth: Callable[[], bool]) -> int:
        """Give one request (in turn) a short draft while speculation is off, if due, affordable and
        (timed, before 8 x explore_interval plans off) `worth()` it; returns its length (0: no
        exploration)."""
        n = len(requests)
        g = min(self.explore_gamma, self.gamma_max)
        if not self.explore_interval or g <= 0:
            return 0
        # Cold: few drafts observed yet, explore every plan it may. Bounded by attempts: an
        # exploring request often has no draft at all (no match; at T = 1.0 in the suite most
        # of them), so the observations may never come, and a planner stuck cold explored on
        # 12 of 14 plans at B = 11 (bench.spec --suite), each such step costing 10-25% more.
        cold = (self._proposed[0] < self.explore_until
                and self._cold_explorations < _COLD_ATTEMPTS * self.explore_until)
        # A batch with requests never measured (per-request mode) explores twice as often: each of
        # them may be one that accepts everything, and a response lasts a few dozen plans. Not
        # more often: where requests are alike (acceptance low for all, T = 1.0) every exploration
        # is a cost (simulated, B = 4-16: 0.5-1.2% of the run at half the interval, 1-1.5% at a
        # quarter; the real engine, B = 4 with history: 53-56 steps for 104 tokens at half, 43-53
        # at a quarter, 54-67 at the full interval).
        fresh = self._per_request and any(r[0] not in self._requests for r in requests)
        interval = max(1, self.explore_interval // 2) if fresh else self.explore_interval
        if self._off_streak < (1 if cold else interval):
            return 0
        if self._timed:
            # Affordable: the credit (explore_budget of all timed steps) covers its predicted extra.
            if self._credit < self._explore_extra(n, g, t0, cell):
                return 0
            if self._off_streak < 8 * max(self.explore_interval, 1) and not worth():
                return 0
        elif not (self.table.time(n, g) <= (1.0 + self.explore_max_cost) * t0
                  or self._off_streak >= 4 * self.explore_interval):
            return 0
        self._off_streak = 0
        self._cold_explorations += cold
        rid = self._explore_pick(requests)
        plan[rid] = g
        return g

    def _explore_extra(self, n: int, g: int, t0: float, cell: _Cell | None) -> float:
        """Seconds one request's g-token exploration adds to a plain step of B = n (the corrected
        model: what the exploration credit must cover)."""
        rho = self._rho(cell, _shape(n, g, g))
        return rho * max(self._table_time(n, g, g) / t0 - 1.0, 0.0) * self._c0(cell) * t0

    def _explore_beside(self, requests: Sequence[tuple[str, bool]], plan: dict[str, int], t0: float,
                        cell: _Cell | None) -> int:
        """Per request (only once per-request outcomes come): while the model drafts for some
        requests the others were never measured (exploration ran only with speculation off), so
        a batch where one history-backed request drafted kept its history-backed siblings at the
        global alpha. Every explore_interval such plans (half of it while one of them is
        unmeasured) one request the plan left without a draft gets explore_gamma tokens, the
        predicted extra paid from the exploration credit. Returns its length (0: none)."""
        n = len(requests)
        g = min(self.explore_gamma, self.gamma_max)
        idle = [r for r in requests if not plan[r[0]]]
        if not idle or not self.explore_interval or g <= 0:
            return 0
        self._beside_streak += 1
        fresh = any(r[0] not in self._requests for r in idle)
        if self._beside_streak < (max(1, self.explore_interval // 2) if fresh else self.explore_interval):
            return 0
        if self._timed:
            extra = self._explore_extra(n, g, t0, cell)
            if self._credit < extra:
                return 0
            self._credit -= extra
        elif self.table.time(n, g) > (1.0 + self.explore_max_cost) * t0:
            return 0
        self._beside_streak = 0
        rid = self._explore_pick(idle)
        plan[rid] = g
        return g

    def _explore_pick(self, requests: Sequence[tuple[str, bool]]) -> str:
        """The request to explore, in turn among the best candidates."""
        # Per request: the request whose alpha_r,0 is highest at its upper confidence bound (from
        # its own trials), ties in turn. An unmeasured request's bound is high, so each gets
        # measured; one whose exploration was accepted is higher still and is measured again until
        # the model drafts for it (round robin took 77 plans at B = 4 to start drafting for the 2
        # history-backed requests of 4, see tests/worker/test_planner_per_request.py); one that
        # rejected its drafts goes last. Without per-request outcomes all tie: plain turns.
        pick = requests
        if self._per_request:
            alpha = self._acceptance()
            score: dict[str, float] = {}
            for rid, _ in requests:
                st = self._requests.get(rid)
                a, t = (alpha[0], 0.0) if st is None else (self._request_alpha(st, alpha)[0], st.trials[0])
                score[rid] = min(1.0, a + 2.0 * math.sqrt(a * (1.0 - a) / (t + self.request_weight)))
            top = max(score.values())
            pick = [r for r in requests if score[r[0]] >= top - 1e-9]
        rid = pick[self._explore_turn % len(pick)][0]
        self._explore_turn += 1
        return rid

    def _count(self, n: int, kind: str, budget: int, alpha: Sequence[float]) -> None:
        row = self._by_batch.get(n)
        if row is None:
            row = self._by_batch[n] = [0, 0, 0, 0, 0, 0]
        row[0] += 1
        if kind == "explore":
            row[3] += 1
        elif kind in ("draft", "beside"):
            row[1] += 1
            row[2] += budget
            row[3] += kind == "beside"
        elif kind == "guarded":
            row[4] += 1
        elif kind == "control":
            row[5] += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_INTERVAL_S:
            self._logged_at = now
            log.info("speculation plans", extra=kv(alpha=[round(a, 3) for a in alpha[:4]], **self.stats()))

    def stats(self) -> dict[str, Any]:
        """Decisions so far by batch size: plans, plans that drafted by the model, their mean draft
        tokens (exploration beside them included), plans that explored (one request, explore_gamma
        tokens, while the model says off or beside a drafting plan),
        and (with step timings) plans the guard kept plain and control plans; and per batch-size
        bucket the measured cost corrections and guard verdicts."""
        out: dict[str, Any] = {"plans_by_batch": {
            b: {"plans": r[0], "drafting": r[1], "mean_budget": round(r[2] / r[1], 2) if r[1] else 0.0,
                "explored": r[3], **({"guarded": r[4], "control": r[5]} if self._timed else {})}
            for b, r in sorted(self._by_batch.items())}}
        if self._timed:
            out["cost_by_bucket"] = {
                f"{(1 << k) // 2 + 1}-{1 << k}" if k > 1 else str(1 << k): {
                    "c0": round(self._c0(c), 3), "rho_partial": round(self._rho(c, 0), 3),
                    "rho_full": round(self._rho(c, 1), 3), "drafted": [round(x, 1) for x in c.drafted],
                    "guard_passed": c.verdicts[0], "guard_failed": c.verdicts[1], "guard_level": c.level}
                for k, c in sorted(self._cells.items())}
            out["explore_credit_s"] = round(self._credit, 4)
        out["requests_tracked"] = len(self._requests)
        return out
