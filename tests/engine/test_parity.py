"""Greedy output equals Hugging Face transformers' greedy output token for token (float32)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine

NEW_TOKENS = 64


def hf_greedy(model_dir: Path, prompts: list[tuple[int, ...]], n: int) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            res = model(ids, use_cache=True)
            past = res.past_key_values
            toks: list[int] = []
            for _ in range(n):
                nxt = int(res.logits[0, -1].argmax())
                toks.append(nxt)
                res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
            outs.append(toks)
    return outs


def test_greedy_matches_hf(model_dir: Path, engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    ps = prompts[:5]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"parity-{i}", p, NEW_TOKENS, greedy) for i, p in enumerate(ps)]
    ours = engine.generate(reqs)
    expected = hf_greedy(model_dir, ps, NEW_TOKENS)
    for i, exp in enumerate(expected):
        got = ours[f"parity-{i}"].token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, exp, strict=True)) if a != b), None)
        assert got == exp, f"prompt {i}: first mismatch at token {first}"
        lps = ours[f"parity-{i}"].logprobs
        assert len(lps) == NEW_TOKENS and all(lp <= 0.0 for lp in lps)
