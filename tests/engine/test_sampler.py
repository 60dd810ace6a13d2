"""The top-p fast path (topk head, full sort only for wide nuclei) selects exactly what a full sort does."""

from __future__ import annotations

import torch

from services.worker.engine import SamplingParams
from services.worker.engines.reference.sampler import sample_rows, target_probs, uniform


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if p.top_k:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, -float("inf"))
    probs = torch.softmax(x, -1)
    sp, si = probs.sort(descending=True)
    keep = (sp.cumsum(-1) - sp) < p.top_p
    out = torch.zeros_like(probs).scatter_(-1, si, sp * keep)
    return out / out.sum()


def test_target_probs_matches_full_sort() -> None:
    g = torch.Generator().manual_seed(0)
    # Peaked rows (small nucleus) and flat rows (nucleus of thousands of tokens: the fallback).
    logits = torch.cat([torch.randn(6, 5000, generator=g) * 8, torch.randn(6, 5000, generator=g) * 0.5])
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k)
              for t, tp, k in [(1.0, 0.9, 0), (0.7, 0.9, 0), (1.0, 0.5, 0), (1.3, 0.95, 40), (1.0, 1.0, 0),
                               (0.5, 0.99, 0)] * 2]
    got = target_probs(logits, params)
    for i, p in enumerate(params):
        exp = reference_probs(logits[i], p)
        assert torch.equal(got[i] > 0, exp > 0), f"row {i}: different nucleus"
        assert torch.allclose(got[i], exp, atol=1e-6)
    assert (got[6:9] > 0).sum(-1).min() > 256  # the flat rows did take the full-sort path


def test_inverse_cdf_sampling_is_keyed_by_seed_and_position() -> None:
    probs = torch.softmax(torch.randn(1, 100), -1).repeat(2, 1)
    a = sample_rows(probs, [uniform(5, 10), uniform(5, 10)])
    assert a[0] == a[1]
    draws = [sample_rows(probs[:1], [uniform(5, t)])[0] for t in range(200)]
    assert len(set(draws)) > 10  # different positions draw differently
    assert 0.0 <= min(uniform(s, t, k) for s in range(20) for t in range(20) for k in range(3)) < 0.05
