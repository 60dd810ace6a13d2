"""Rollout workloads with group-correlated long-tail lengths and iteration-to-iteration correlation,
calibrated to the three workloads of the Seer paper (Table 1).

Length model: a group's latent log-length mu_g ~ N(m, s_group); a sample's length is
exp(mu_g + eps), eps ~ N(0, s_sample), clipped to [min_len, max_tokens] (clipped = truncated
responses). m is solved so that the clipped mean matches the published mean. The previous
iteration's lengths (history priors) share mu_g up to a small drift, so group length ranks are
stable across iterations, as RhymeRL reports (only 2-4% of responses change rank much).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompts: int
    group_size: int
    max_tokens: int
    mean_len: int  # published mean response length (tokens)
    instances: int
    prompt_mean: int = 1024
    s_group: float = 0.9  # spread of group means (log space)
    s_sample: float = 0.25  # spread within a group (log space)
    drift: float = 0.1  # iteration-to-iteration drift of a group's mean (log space)
    min_len: int = 16

    def scaled(self, factor: float) -> WorkloadSpec:
        """The same workload with prompts and instances scaled (quick mode)."""
        return replace(
            self,
            prompts=max(8, round(self.prompts * factor)),
            instances=max(1, round(self.instances * factor)),
        )


# Seer Table 1 (prompts x G, max response, mean response, instances).
WORKLOADS: dict[str, WorkloadSpec] = {
    "moonlight": WorkloadSpec("Moonlight", 400, 8, 65_536, 22_386, 32, prompt_mean=1024),
    "qwen2-vl-72b": WorkloadSpec("Qwen2-VL-72B", 600, 16, 40_960, 7_615, 16, prompt_mean=2048),
    "kimi-k2": WorkloadSpec("Kimi-K2", 800, 8, 98_304, 38_959, 8, prompt_mean=1024),
}


@dataclass
class Workload:
    spec: WorkloadSpec
    prompt_len: np.ndarray  # [prompts] tokens
    lengths: np.ndarray  # [prompts, G] this iteration's response lengths
    prev_lengths: np.ndarray  # [prompts, G] previous iteration's lengths (history priors)

    @property
    def num_requests(self) -> int:
        return int(self.lengths.size)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())


def _clipped(spec: WorkloadSpec, m: float, z: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(np.exp(m + z)), spec.min_len, spec.max_tokens).astype(np.int64)


def _solve_location(spec: WorkloadSpec, z: np.ndarray) -> float:
    """m such that the clipped mean of exp(m + z) matches spec.mean_len (bisection on this draw,
    so every sample, however small, has the published mean)."""
    lo, hi = 0.0, float(np.log(spec.max_tokens)) + 3.0
    for _ in range(50):
        mid = (lo + hi) / 2
        mean = np.clip(np.exp(mid + z), spec.min_len, spec.max_tokens).mean()
        lo, hi = (mid, hi) if mean < spec.mean_len else (lo, mid)
    return (lo + hi) / 2


def make_workload(spec: WorkloadSpec, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    shape = (spec.prompts, spec.group_size)
    mu_g = rng.normal(0.0, spec.s_group, size=spec.prompts)  # [prompts] group latent
    z = mu_g[:, None] + rng.normal(0.0, spec.s_sample, size=shape)  # [prompts, G]
    m = _solve_location(spec, z)
    lengths = _clipped(spec, m, z)
    mu_prev = mu_g + rng.normal(0.0, spec.drift, size=spec.prompts)
    prev = _clipped(spec, m, mu_prev[:, None] + rng.normal(0.0, spec.s_sample, size=shape))
    prompt_len = np.clip(rng.lognormal(np.log(spec.prompt_mean), 0.5, size=spec.prompts), 32, 8 * spec.prompt_mean)
    return Workload(spec, np.rint(prompt_len).astype(np.int64), lengths, prev)


def describe(spec: WorkloadSpec) -> str:
    """How the lengths and their iteration-to-iteration correlation are modelled (fixed parameters,
    never tuned per policy)."""
    return (
        f"lengths: exp(m + mu_g + eps), group latent mu_g ~ N(0, {spec.s_group}), per sample eps ~ "
        f"N(0, {spec.s_sample}), clipped to [{spec.min_len}, {spec.max_tokens}], m solved for mean "
        f"{spec.mean_len}; previous iteration: mu_g + N(0, {spec.drift}) drift, fresh eps (history priors); "
        f"prompts lognormal around {spec.prompt_mean} tokens"
    )


def rank_change_fraction(w: Workload, threshold: float = 0.25) -> float:
    """Fraction of groups whose max-length rank moves by more than `threshold` of the range
    between the previous and this iteration (RhymeRL's stability measure, at group level)."""
    n = w.lengths.shape[0]
    r_now = np.argsort(np.argsort(w.lengths.max(axis=1)))
    r_prev = np.argsort(np.argsort(w.prev_lengths.max(axis=1)))
    return float(np.mean(np.abs(r_now - r_prev) > threshold * n))
