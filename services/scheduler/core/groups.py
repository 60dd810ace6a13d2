"""Group length estimates and probe selection (Seer Algorithm 2, RhymeRL history priors).

A group's estimate is the maximum length among its finished siblings; before any sibling finishes it
is the history prior for the prompt key (previous iteration's lengths, seer_history) if one exists,
else max_tokens. One request per group is its probe: served first so that the estimate is learned
early (Seer section 4.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from services.common.errors import InvalidArgument


@dataclass
class GroupState:
    group_id: str
    prompt_key: str
    group_size: int
    max_tokens: int
    members: list[str] = field(default_factory=list)
    # Its batch's submission (RequestInfo.incarnation): a batch id used again is a new group.
    incarnation: int = 0
    finished_lengths: list[int] = field(default_factory=list)
    probe_id: str | None = None
    prior: int | None = None
    # The previous iteration's lengths for the prompt key, ascending (seer_history).
    prior_lengths: list[int] | None = None
    # How finished siblings refine the prior: "floor" (the prior is a floor they can only raise)
    # or "scaled" (the prior is rescaled by how this iteration's finished lengths compare with
    # the previous iteration's shortest ones).
    history_estimate: str = "floor"
    # Workers that ran a member: each holds the group's prompt prefix in its cache.
    workers: set[str] = field(default_factory=set)
    prompt_len: int = 0
    # Expected KV demand of the whole group from its prior (kv_demand; 0: no prior).
    kv_demand: int = 0
    # history_estimate="posterior": the spread of log lengths within a group (pooled over the
    # history's groups by the core; 0: unknown, then this group's own history's), and the lower
    # bounds of started unfinished members (tokens generated at their last chunk boundary).
    log_sd: float = 0.0
    running: dict[str, int] = field(default_factory=dict)
    # The last posterior estimate and what it was computed from (25-95 us each in pure Python, and
    # a group's members are re-keyed together).
    _posterior: tuple[tuple[object, ...], int] | None = None

    def estimate(self, factor: float | None = None) -> int:
        """Expected length of the group's longest response (tokens).

        `factor` (>= 1, learned by SiblingRatios) corrects the finished maximum for the siblings
        still running, which are the group's longer ones."""
        finished = max(self.finished_lengths) if self.finished_lengths else None
        if finished is not None and factor is not None:
            finished = min(self.max_tokens, round(finished * factor))
        if self.prior is not None:
            if self.history_estimate == "posterior" and self.prior_lengths:
                return self._posterior_estimate()
            if self.history_estimate == "scaled" and self.finished_lengths and self.prior_lengths:
                return min(self.max_tokens, max(self._scaled_prior(), finished or 0))
            # History ranks are stable (RhymeRL: 2-4% change rank much), so the prior is a floor
            # that finished siblings can only raise.
            return min(self.max_tokens, max(self.prior, finished or 0))
        if finished is not None:
            return finished
        return self.max_tokens

    def _posterior_estimate(self) -> int:
        key = (id(self.prior_lengths), self.log_sd, len(self.finished_lengths), tuple(self.running.values()))
        if self._posterior is None or self._posterior[0] != key:
            assert self.prior_lengths
            est = posterior_max(
                self.prior_lengths,
                self.finished_lengths,
                list(self.running.values()),
                self.group_size,
                self.max_tokens,
                self.log_sd,
            )
            self._posterior = (key, est)
        return self._posterior[1]

    def _scaled_prior(self) -> int:
        """The prior times this iteration's drift: the k finished siblings (the group's shortest
        this time) against the k shortest of the previous iteration (RhymeRL: lengths of one
        prompt move together from step to step; a whole-group drift shows in its first finishers)."""
        assert self.prior is not None and self.prior_lengths
        k = min(len(self.finished_lengths), len(self.prior_lengths))
        now = sum(sorted(self.finished_lengths)[:k])
        before = sum(self.prior_lengths[:k])
        if before <= 0:
            return self.prior
        return round(self.prior * now / before)

    def request_estimate(self, generated: int, factor: float | None = None) -> int:
        """Estimated total length of one unfinished member that has generated `generated` tokens.

        A member already longer than the estimate has outgrown every finished sibling: it is the
        group's tail, its length is unknown, so it ranks as if it ran to max_tokens."""
        est = self.estimate(factor)
        return est if generated < est else self.max_tokens


def _expected_max_z(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def log_spread(lengths: Sequence[int]) -> tuple[float, int]:
    """Sum of squared deviations of log lengths from their mean, and its degrees of freedom."""
    xs = [math.log(max(1, n)) for n in lengths]
    if len(xs) < 2:
        return 0.0, 0
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs), len(xs) - 1


def posterior_max(
    prior_lengths: Sequence[int],
    finished: Sequence[int],
    running: Sequence[int],
    group_size: int,
    max_tokens: int,
    log_sd: float = 0.0,
) -> int:
    """Expected longest response of a group (history_estimate="posterior").

    Model: log lengths of one group are theta + N(0, s^2). The previous iteration's lengths give
    theta a normal prior (their mean log, variance 2 s^2 / n: the history counts as half its size,
    for the drift between iterations). This iteration's finished siblings are exact samples and the
    started unfinished ones are right-censored at what they generated; theta's posterior mean comes
    from a few EM steps (the censored ones contribute E[x | x > bound]). Previous lengths at
    max_tokens count as max_tokens (treating them as censored too: Moonlight seed 1 0.949 -> 0.940
    of the oracle). The expected maximum over the unfinished members is then exp(theta + s' z(n)),
    z(n) the expected maximum of n standard normals (s' adds theta's posterior variance), and
    at least the finished maximum and every bound."""
    s = log_sd
    if s <= 0:
        ss, dof = log_spread(prior_lengths)
        s = math.sqrt(ss / dof) if dof else 0.25
    s = max(s, 1e-3)
    norm = NormalDist()
    logs = [math.log(max(1, n)) for n in prior_lengths]
    mu0 = sum(logs) / len(logs)
    prec0 = len(logs) / (2 * s * s)
    xs = [math.log(max(1, n)) for n in finished]
    cs = [math.log(max(1, n)) for n in running if n > 0]
    theta = mu0
    for _ in range(4 if cs else 1):
        total = prec0 * mu0 + sum(xs) / (s * s)
        for c in cs:
            a = (c - theta) / s
            tail = max(1e-12, 1 - norm.cdf(a))
            total += (theta + s * norm.pdf(a) / tail) / (s * s)
        theta = total / (prec0 + (len(xs) + len(cs)) / (s * s))
    post_var = 1 / (prec0 + (len(xs) + len(cs)) / (s * s))
    unfinished = max(0, group_size - len(finished))
    est = math.exp(theta + math.sqrt(s * s + post_var) * _expected_max_z(unfinished)) if unfinished else 0.0
    est = max(est, max(finished, default=0), max(running, default=0))
    return min(max_tokens, round(est))


def history_prior(lengths: Sequence[int], max_tokens: int | None = None) -> int | None:
    """The prior for a group from the previous iteration's lengths for its prompt key."""
    for i, n in enumerate(lengths):
        if n < 0:
            raise InvalidArgument(f"must be >= 0, got {n}", field=f"lengths[{i}]")
    if not lengths:
        return None
    prior = max(lengths)
    return prior if max_tokens is None else min(prior, max_tokens)


def kv_demand(lengths: Sequence[int], group_size: int, prompt_len: int, max_tokens: int) -> int:
    """Expected KV occupancy of a group, in token-steps x 2 (an integer, so that sums of many
    groups add and subtract exactly), from the previous iteration's lengths for its prompt key.

    A response of n tokens holds its prompt plus what it has generated at each of its n decode
    steps: n * (prompt + n / 2) token-steps. Scaled to `group_size` members when the history has
    a different count."""
    if not lengths:
        return 0
    total = sum(n * (2 * prompt_len + n) for n in (min(x, max_tokens) for x in lengths))
    return round(total * group_size / len(lengths))
