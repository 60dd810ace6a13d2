"""Other Llama-family checkpoints load and match Hugging Face: tiny random Qwen2 (q/k/v bias),
Mistral and Llama models saved by transformers into a temp dir (no hub access)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine

# A large init scale makes attention sharp, so a wrong rotary base or bias changes the argmax.
TINY: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=0.3)


def save_tiny(kind: str, path: Path) -> Any:
    import transformers

    model: Any
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY)
        model = transformers.Qwen2ForCausalLM(cfg)
        # Random init leaves biases at zero: make them matter.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **TINY, rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    model.eval()
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama"])
def test_tiny_checkpoint_matches_hf(tmp_path: Path, kind: str) -> None:
    model = save_tiny(kind, tmp_path)
    eng = ReferenceEngine.from_dir(tmp_path, num_pages=64, num_threads=1)
    prompts = [tuple(range(3, 3 + n)) for n in (5, 17, 33)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    outs = eng.generate([GenerateRequest(f"r{i}", p, 24, sp) for i, p in enumerate(prompts)])
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            got = outs[f"r{i}"].token_ids
            logits = model(torch.tensor([list(p) + got])).logits[0]
            expect = logits[len(p) - 1 : len(p) - 1 + len(got)].argmax(-1).tolist()
            assert got == expect, f"{kind} prompt {i}"


def test_sliding_window_drafts_match_plain_decoding(tmp_path: Path) -> None:
    """Mistral with a window shorter than the context: draft nodes must see exactly the keys plain
    decoding sees at their own position (all-correct drafts give the plain greedy output)."""
    import transformers

    from services.worker.engine import Draft

    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=6))
    model.eval()
    model.save_pretrained(str(tmp_path))
    prompt = tuple(range(3, 3 + 29))
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    plain = ReferenceEngine.from_dir(tmp_path, num_pages=64, num_threads=1)
    ref = plain.generate([GenerateRequest("plain", prompt, 24, sp)])["plain"].token_ids

    eng = ReferenceEngine.from_dir(tmp_path, num_pages=64, num_threads=1)
    eng.add_request(GenerateRequest("spec", prompt, 24, sp))
    out: list[int] = []
    accepted = 0
    while eng.has_unfinished():
        draft = Draft.chain(ref[len(out) : len(out) + 4]) if out else None
        for o in eng.step({"spec": draft} if draft and draft.tokens else None):
            out.extend(o.token_ids)
            accepted += o.num_accepted
    assert accepted > 0
    assert out == ref


@pytest.mark.parametrize("max_window_layers", [0, 1, 2])
def test_a_qwen2_window_on_some_layers_only_is_refused(tmp_path: Path, max_window_layers: int) -> None:
    """transformers slides only the Qwen2 layers from max_window_layers on; the engine applied the
    window to every layer (a mixed model's full-attention layers silently lost their long context).
    All sliding or none runs and matches Hugging Face; a mix is refused naming the field."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                   max_window_layers=max_window_layers)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path))
    if max_window_layers == 1:  # layer 0 full attention, layer 1 sliding
        with pytest.raises(ValueError, match="max_window_layers"):
            ReferenceEngine.from_dir(tmp_path, num_pages=64, num_threads=1)
        return
    eng = ReferenceEngine.from_dir(tmp_path, num_pages=64, num_threads=1)
    prompt = tuple(range(3, 3 + 29))  # longer than the window
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    got = eng.generate([GenerateRequest("r", prompt, 12, greedy)])["r"].token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + got])).logits[0]
    assert got == logits[len(prompt) - 1 : len(prompt) - 1 + len(got)].argmax(-1).tolist()
