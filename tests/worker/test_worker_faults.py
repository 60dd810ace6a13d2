"""Worker and reference engine fault paths found by a review (session 13): a LoadWeights of a bad
checkpoint leaves the running weights whole, a temperature too small for float32 is refused naming
the field, and a chunk's cached_tokens is what the engine can actually reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.core import ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference import ReferenceEngine
from services.worker.model.loader import load_state_dict


def test_a_checkpoint_missing_a_tensor_changes_nothing(ref_engine: ReferenceEngine, model_dir: Path) -> None:
    model = ref_engine.model
    before = (model.layers[0].qkv, model.embed, model.norm, model.lm_head)
    state = load_state_dict(model_dir)
    state = {k: v + 1.0 for k, v in state.items() if k != "model.norm.weight"}  # other weights, one missing
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        model.load(state)
    after = (model.layers[0].qkv, model.embed, model.norm, model.lm_head)
    assert all(a is b for a, b in zip(after, before, strict=True))  # the same tensors, untouched


@pytest.mark.parametrize("t", [1e-40, 1e-300, 5e-6])
def test_a_temperature_too_small_for_float32_is_refused(t: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t).validate()
    SamplingParams(temperature=1e-5).validate()
    SamplingParams(temperature=0.0).validate()


def test_cached_tokens_counts_what_the_engine_reuses(ref_engine: ReferenceEngine) -> None:
    page = ref_engine.kv_layout.page_size
    prompt = tuple(range(1000, 1000 + 2 * page))  # whole pages: the last one is recomputed anyway
    w = Worker(ref_engine, speculation=False).start()
    try:
        job = ChunkJob(request_id="a", prompt_token_ids=prompt, max_new_tokens=1, max_tokens=1,
                       sampling=SamplingParams(temperature=0.0), policy_version=0)
        w.run(job)
        _toks, _reason, done = w.run(ChunkJob(**{**job.__dict__, "request_id": "b"}))
        assert done.stats.cached_tokens == page and done.stats.prefill_tokens == page
    finally:
        w.close()
