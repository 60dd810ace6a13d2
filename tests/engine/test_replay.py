"""Seeded sampling replays whatever the batch: a request alone, the same requests batched, and
batched in 24-token chunks resumed from their output (as a chunk moved to another worker is) give
the same tokens, at temperature 1.0 and top_p 1.0 (RL's usual setting, where the whole vocabulary
can be drawn).

With the inverse-CDF sampler (before session 28) they did not: the logits differ in their last
bits with the batch's shapes, and in the low-probability tail the CDF's boundaries lie ~1e-7
apart. In this test's run on this model, 1 of the 4 requests (the first) drew a neighbouring token
at output position 86 when resumed in chunks; batched, all 4 matched in that run. Separately, a
reviewer's run of 12 requests diverged in 2, 1 and 1 of 12 batched, chunked and drafted at T 1.0,
and in 2, 4 and 7 of 12 at T 1.3. Gumbel-max draws (sampler.sample_rows) move only on near-ties of
the two best scores."""

from __future__ import annotations

from tokenizers import Tokenizer

from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine

from .conftest import chat

TEXTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "List five tips for staying productive when working from home.",
    "Give me a recipe for pancakes.",
]
N, CHUNK, REQUESTS = 96, 24, 4


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=1.0, seed=seed, ignore_eos=True)


def test_alone_batched_and_chunked_draw_the_same_tokens(engine: ReferenceEngine, tokenizer: Tokenizer) -> None:
    prompts = [chat(tokenizer, t) for t in TEXTS]
    alone = [engine.generate([GenerateRequest(f"alone{i}", prompts[i % 4], N, _params(100 + i))])[f"alone{i}"].token_ids
             for i in range(REQUESTS)]
    batched = engine.generate([GenerateRequest(f"batched{i}", prompts[i % 4], N, _params(100 + i))
                               for i in range(REQUESTS)])
    chunked: list[list[int]] = [[] for _ in range(REQUESTS)]
    for c in range(N // CHUNK):
        got = engine.generate([GenerateRequest(f"chunk{i}.{c}", prompts[i % 4], CHUNK, _params(100 + i),
                                               output_token_ids=tuple(chunked[i])) for i in range(REQUESTS)])
        for i in range(REQUESTS):
            chunked[i] += got[f"chunk{i}.{c}"].token_ids
    for i in range(REQUESTS):
        assert list(batched[f"batched{i}"].token_ids) == list(alone[i]), f"request {i} batched"
        assert chunked[i] == list(alone[i]), f"request {i} chunked"
