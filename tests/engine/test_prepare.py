"""Model preparation: the cached conversion of the embedded GGUF and the `seer model` command."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from services.worker.model.config import ModelConfig
from services.worker.model.prepare import _unpermute, ensure_model, is_complete


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permute of Q/K rows (the transform prepare undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    assert np.array_equal(_unpermute(llama_cpp_permute(w, n_head), n_head), w)


def test_converted_model_matches_the_gguf_metadata(model_dir: Path) -> None:
    assert is_complete(model_dir)
    t = time.perf_counter()
    assert ensure_model(model_dir) == model_dir
    assert time.perf_counter() - t < 1.0  # cached: no conversion
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.head_dim == 64 and cfg.rope_theta == 100000.0
    assert 2 in cfg.eos_token_ids


def test_cli_model_info(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.model import main

    assert main(["info", "--model-dir", str(model_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_dir"] == str(model_dir) and info["num_layers"] == 30 and info["weights_bytes"] > 10**8
    assert main(["prepare", "--model-dir", str(model_dir)]) == 0  # already prepared: a no-op
    assert capsys.readouterr().out.strip() == str(model_dir)
