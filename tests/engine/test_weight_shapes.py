"""Checkpoint tensors are checked against config.json (audit): a checkpoint whose config matches
but whose tensors do not is refused naming the tensor, and the refused LoadWeights leaves the
running weights serving. Before, only some shapes were compared (with the running model's), so a
norm of the wrong size loaded and broadcast silently in rms_norm."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine
from services.worker.model.loader import load_state_dict

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def real_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_state_dict(model_dir)


@pytest.mark.parametrize(("name", "mangle"), [
    # [1] broadcasts against [hidden]: before the check this loaded and ran with wrong outputs.
    ("model.layers.3.post_attention_layernorm.weight", lambda t: t[:1]),
    ("model.layers.0.input_layernorm.weight", lambda t: t[:-1]),
    ("model.norm.weight", lambda t: t[:1]),
    ("model.layers.5.self_attn.o_proj.weight", lambda t: t[:, :-64]),
    ("model.layers.2.self_attn.k_proj.weight", lambda t: t[:-64]),
    ("model.embed_tokens.weight", lambda t: t[:-1]),
])
def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(
        engine: ReferenceEngine, real_state: dict[str, torch.Tensor], name: str,
        mangle: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model = engine.model
    before = (model.layers[0].qkv, model.layers[3].post_norm, model.embed, model.norm, model.lm_head)
    state = dict(real_state)
    state[name] = mangle(state[name]).clone()
    with pytest.raises(ValueError) as ei:
        model.load(state)
    assert f"{name} has shape {list(state[name].shape)}, expected {list(real_state[name].shape)}" in str(ei.value)
    after = (model.layers[0].qkv, model.layers[3].post_norm, model.embed, model.norm, model.lm_head)
    assert all(a is b for a, b in zip(after, before, strict=True))


def test_an_untied_lm_head_and_dtypes_are_checked(engine: ReferenceEngine,
                                                   real_state: dict[str, torch.Tensor]) -> None:
    # The served config ties the embeddings; an untied one reads lm_head.weight, which is checked.
    model = engine.model
    state = dict(real_state)
    state["lm_head.weight"] = state["model.embed_tokens.weight"][:, :-1].clone()
    tied = model.cfg
    try:
        model.cfg = type(tied)(**{**tied.__dict__, "tie_word_embeddings": False})
        with pytest.raises(ValueError, match=r"lm_head\.weight has shape \[49152, 575\], expected \[49152, 576\]"):
            model.load(state)
    finally:
        model.cfg = tied
    state = dict(real_state)
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype torch\.int32, expected a floating point"):
        model.load(state)


def test_a_refused_load_weights_leaves_the_old_weights_serving(
        engine: ReferenceEngine, model_dir: Path, real_state: dict[str, torch.Tensor],
        tmp_path: Path) -> None:
    """A real LoadWeights of a mangled copy of the checkpoint on disk (config.json unchanged)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, bad / f)
    state = dict(real_state)
    state["model.layers.7.post_attention_layernorm.weight"] = state[
        "model.layers.7.post_attention_layernorm.weight"][:1].clone()
    save_file(state, str(bad / "model.safetensors"))
    prompt = tuple(range(200, 216))
    ref = engine.generate([GenerateRequest("before", prompt, 6, GREEDY)])["before"].token_ids
    version = engine.model_version
    with pytest.raises(ValueError, match=r"model\.layers\.7\.post_attention_layernorm\.weight has shape \[1\]"):
        engine.load_weights(str(bad), version + "-bad")
    assert engine.model_version == version and engine.model_dir == model_dir
    again = engine.generate([GenerateRequest("after", prompt, 6, GREEDY)])["after"].token_ids
    assert again == ref
