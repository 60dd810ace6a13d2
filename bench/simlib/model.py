"""Step-time, prefill and speculative-acceptance models of one simulated inference instance.

Decode step time (seconds) of a batch of B requests with total context S tokens and gamma draft
tokens per request: T = a + b * B * (1 + gamma) + c * S. a is the memory-bound floor (weights read
once per step), b the per-token compute, c the per-context-token attention (KV read). The default
constants are a plausible H800-class instance (not measured here; there is no GPU on these
machines); each workload overrides the KV capacity.

Grouped speculative decoding: mean accepted tokens per step (incl. the bonus token) as a function
of how many siblings have finished, from Seer Table 2 (linear drafts): self only 1.70, 1 sibling
2.04, 5 siblings 2.32, 15 siblings 2.53 (interpolated in log(1 + n)). Speculation is adaptive
(Seer Algorithm 1, simplified): an instance speculates in a step only when it lowers time per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SIBLINGS = np.log1p(np.array([0.0, 1.0, 5.0, 15.0]))
_ACCEPT = np.array([1.70, 2.04, 2.32, 2.53])


def accepted_per_step(finished_siblings: int) -> float:
    return float(np.interp(np.log1p(finished_siblings), _SIBLINGS, _ACCEPT))


@dataclass(frozen=True)
class InstanceModel:
    a: float = 0.020  # s: per-step floor
    b: float = 0.00012  # s per batched token (compute)
    c: float = 3.0e-9  # s per context token (attention KV reads)
    prefill_tps: float = 40_000.0  # tokens/s of (re)prefill
    fetch_tps: float = 400_000.0  # tokens/s of pulling KV from the global pool
    kv_tokens: int = 1_000_000  # KV capacity
    max_batch: int = 256
    gamma: int = 4  # draft tokens per request when speculating

    def step_time(self, batch: int, ctx_sum: float, gamma: int = 0) -> float:
        return self.a + self.b * batch * (1 + gamma) + self.c * ctx_sum

    def speculate(self, batch: int, ctx_sum: float, mean_accept: float) -> bool:
        """Marginal-benefit test: speculate iff it lowers the time per generated token."""
        return self.step_time(batch, ctx_sum, self.gamma) / mean_accept < self.step_time(batch, ctx_sum)


# Per-workload instance models (assumptions, not measurements: plausible H800-class instances for
# each model size; KV capacities are set so that KV, not batch slots, binds during the long phase,
# as it did for veRL in the paper: 13,686 preemptions in one Qwen2-VL-72B iteration).
INSTANCE_MODELS: dict[str, InstanceModel] = {
    "moonlight": InstanceModel(a=0.015, b=0.00008, c=1.5e-9, kv_tokens=1_200_000, max_batch=256),
    "qwen2-vl-72b": InstanceModel(a=0.020, b=0.00012, c=3.0e-9, kv_tokens=1_000_000, max_batch=256),
    "kimi-k2": InstanceModel(a=0.030, b=0.00006, c=1.0e-9, kv_tokens=4_000_000, max_batch=512),
}
