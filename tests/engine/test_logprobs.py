"""Returned logprobs are what an RL trainer recomputes: log_softmax(logits / T)[token] over the full
vocabulary (before top-k/top-p; T = 1 for greedy), as SGLang returns them, with or without drafts.

The reference is an independent plain forward (Hugging Face transformers, float32, teacher forcing
on prompt + output), so a logprob taken from the processed (truncated, renormalized) distribution,
as the engine did before, fails (top_p 0.5 at T 0.7 was off by ~0.7 nats)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine
from services.worker.engines.reference.sampler import token_logprobs

from .device import DEVICE

N = 8
ATOL = 2e-3  # HF vs our kernels in float32: logits agree to ~1e-5; the old semantics missed by 0.1-1
TRUNCATED = [
    SamplingParams(temperature=0.7, top_p=0.5, seed=11, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, seed=12, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=13, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.5, seed=14, ignore_eos=True),
]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    # Typed as the nn.Module it is used as: transformers' own `to` is typed (functools.wraps) as
    # the unbound torch.nn.Module.to, so mypy took the device for `self`.
    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(DEVICE)
    model.eval()
    return model


def trainer_logprobs(hf: torch.nn.Module, prompt: tuple[int, ...], out: list[int], temperature: float) -> list[float]:
    """What a veRL/OpenRLHF actor computes: log_softmax(logits / T) of each response token, no
    truncation; T = 1 for greedy."""
    with torch.inference_mode():
        logits = hf(torch.tensor([list(prompt) + out], device=DEVICE)).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)] / (temperature or 1.0)
    return torch.log_softmax(rows, -1).gather(1, torch.tensor(out, device=DEVICE)[:, None])[:, 0].tolist()


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= ATOL, f"{what}: logprobs differ from log_softmax(logits / T) by up to {worst:.4f}: {got} vs {want}"


def test_sampling_logprobs_are_full_vocab_tempered(engine: ReferenceEngine, hf: torch.nn.Module,
                                                     prompts: list[tuple[int, ...]]) -> None:
    """(a) top-k / top-p / temperature requests (batched with a greedy one) return
    log_softmax(logits / T)[token], not log p under the truncated distribution; (c) greedy returns
    the raw log_softmax(logits)[token]."""
    p = prompts[2]
    reqs = [GenerateRequest(f"lp-{k}", p, N, sp) for k, sp in enumerate([*TRUNCATED, GREEDY])]
    outs = engine.generate(reqs)
    for k, sp in enumerate([*TRUNCATED, GREEDY]):
        o = outs[f"lp-{k}"]
        assert_close(o.logprobs, trainer_logprobs(hf, p, o.token_ids, sp.temperature), f"{sp}")


def test_speculative_logprobs_equal_plain(engine: ReferenceEngine, hf: torch.nn.Module,
                                          prompts: list[tuple[int, ...]]) -> None:
    """(b) With drafts (accepted chains, a wrong first branch then the right one, a wrong draft),
    on the lazy CPU walk and the batched device-style walk, every emitted token (accepted draft,
    correction, bonus) gets the logprob plain decoding gives it, which is the trainer's value; the
    tokens do not change. Greedy too."""
    p = prompts[3]
    cases = [*TRUNCATED, GREEDY]
    plain = {k: engine.generate([GenerateRequest(f"pl-{k}", p, N, sp)])[f"pl-{k}"] for k, sp in enumerate(cases)}

    def draft_for(k: int, done: int, step: int) -> Draft:
        own = list(plain[k].token_ids[done:])
        wrong = (own[0] + 1) % engine.vocab_size
        if step % 3 == 0:
            return Draft.chain(own[:3])
        if step % 3 == 1 and len(own) > 1:
            return Draft((wrong, own[0], own[1]), (-1, -1, 1))
        return Draft.chain([wrong])

    for batched in (False, True):
        engine.batched_tree_draws = batched
        try:
            rids = {k: f"sp{int(batched)}-{k}" for k in range(len(cases))}
            for k, sp in enumerate(cases):
                engine.add_request(GenerateRequest(rids[k], p, N, replace(sp)))
            got: dict[int, tuple[list[int], list[float]]] = {k: ([], []) for k in rids}
            accepted = 0
            step = 0
            while engine.has_unfinished():
                drafts = {rids[k]: draft_for(k, len(got[k][0]), step) for k in rids if len(got[k][0]) < N - 1}
                for o in engine.step(drafts):
                    k = int(o.request_id.split("-")[1])
                    got[k][0].extend(o.token_ids)
                    got[k][1].extend(o.logprobs)
                    accepted += o.num_accepted
                step += 1
        finally:
            engine.batched_tree_draws = False
        assert accepted > 0, "no draft accepted: the test would not cover accepted draft tokens"
        for k, sp in enumerate(cases):
            toks, lps = got[k]
            assert toks == plain[k].token_ids, f"{sp}: drafts changed the tokens"
            assert_close(lps, plain[k].logprobs, f"spec vs plain, batched={batched}, {sp}")
            assert_close(lps, trainer_logprobs(hf, p, toks, sp.temperature), f"spec vs trainer, {sp}")


def test_token_logprobs_float32_and_full_vocab() -> None:
    """token_logprobs computes in float32 whatever the logits' dtype, over every token of the row,
    and divides only by its own row's temperature."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, generator=g) * 4).to(torch.bfloat16)
    got = token_logprobs(logits, [2, 0, 2], [7, 3, 7], [0.7, 1.0, 1.0])
    x = logits.float()
    want = [torch.log_softmax(x[2] / 0.7, -1)[7].item(), torch.log_softmax(x[0], -1)[3].item(),
            torch.log_softmax(x[2], -1)[7].item()]
    assert got == pytest.approx(want, abs=1e-6)
    assert logits.dtype == torch.bfloat16 and token_logprobs(logits, [], [], []) == []
