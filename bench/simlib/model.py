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


# Per-workload instance models. Assumptions derived from the model shapes and H800 numbers (990
# TFLOP/s bf16 at ~40-50% efficiency, 3.35 TB/s HBM per GPU), not measured (no GPU here):
# a = weights (active experts at large batch) read once per step + launch overhead; b = 2 x active
# params FLOP per token; c = KV bytes per context token / aggregate HBM bandwidth; kv_tokens = HBM
# left after weights / KV bytes per token; fetch = KV bytes per token over a Mooncake-class RDMA pool.
INSTANCE_MODELS: dict[str, InstanceModel] = {
    # Moonlight-16B-A3B (MLA, ~31 KB KV/token), one H800 per instance (~28 GB left for KV).
    "moonlight": InstanceModel(
        a=0.010, b=0.000015, c=9.0e-9, prefill_tps=80_000, fetch_tps=800_000, kv_tokens=900_000, max_batch=256
    ),
    # Qwen2-VL-72B (GQA, ~320 KB KV/token), TP8 over 8 H800.
    "qwen2-vl-72b": InstanceModel(
        a=0.010, b=0.00005, c=1.2e-8, prefill_tps=25_000, fetch_tps=150_000, kv_tokens=1_200_000, max_batch=256
    ),
    # Kimi-K2 (1T MoE, 32B active, MLA ~70 KB KV/token), 32 H800 per instance.
    "kimi-k2": InstanceModel(
        a=0.025, b=0.00002, c=2.0e-9, prefill_tps=200_000, fetch_tps=1_400_000, kv_tokens=8_000_000, max_batch=512
    ),
}
