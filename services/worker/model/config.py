"""Llama-family model configuration read from a Hugging Face style config.json.

Covers Llama, SmolLM (Llama architecture), Mistral (Llama + optional sliding window) and Qwen2
(Llama + bias on the q/k/v projections).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = str(d.get("model_type", "llama"))
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not a supported Llama-family type {SUPPORTED_TYPES}")
        # transformers 5 writes rope settings under rope_parameters; older configs at the top level.
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or rope
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling: {scaling!r} is not supported by the reference engine")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sw = _sliding_window(d, model_type, int(d["num_hidden_layers"]))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            sliding_window=None if sw is None else int(sw),
        )

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (not a Hugging Face model directory)")
        # Whatever is wrong with the files is a ValueError naming them: LoadWeights reports it as
        # a bad source (INVALID_ARGUMENT), which the scheduler takes as a refusal of the weights,
        # not as an engine fault (INTERNAL, "outcome unknown").
        try:
            cfg = cls.from_dict(_json_object(path))
            # generation_config.json may list extra EOS ids (chat models end turns with them).
            gen = Path(model_dir) / "generation_config.json"
            if gen.exists():
                g = _json_object(gen).get("eos_token_id")
                extra = g if isinstance(g, list) else ([] if g is None else [g])
                ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(x) for x in extra)]))
                cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": ids})
        except KeyError as e:
            raise ValueError(f"{path}: {e.args[0]} is missing") from e
        except (TypeError, AttributeError, ZeroDivisionError, OverflowError) as e:
            raise ValueError(f"{path}: malformed ({type(e).__name__}: {e})") from e
        return cfg


def _json_object(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(d).__name__}")
    return d


def _sliding_window(d: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The window every layer uses, or None; the reference engine has one window for all layers.

    transformers slides only some layers: those listed as "sliding_attention" in layer_types
    (transformers 5), or for Qwen2 with use_sliding_window those from max_window_layers on. Applied
    to every layer, a mixed model's full-attention layers would silently lose their long context."""
    if not d.get("use_sliding_window", model_type == "mistral") or d.get("sliding_window") is None:
        return None
    window = int(d["sliding_window"])
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type == "qwen2":
        first = int(d.get("max_window_layers", num_layers))
        sliding = [i >= first for i in range(num_layers)]
    else:
        return window
    if all(sliding):
        return window
    if not any(sliding):
        return None
    raise ValueError(f"max_window_layers: {sum(sliding)} of {num_layers} layers use a sliding window and the "
                     "others full attention; the reference engine runs one attention kind for all layers")
