"""Buffer test fixtures: a real buffer (RocksDB in tmp dirs, gRPC on loopback) and a tiny tokenizer."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from buffer_helpers import BufferHandle, start_buffer

from services.buffer.config import BufferConfig

WORDS = ["[UNK]", "<eos>", "question", ":", "what", "is", "two", "plus", "three", "answer", "five", "?", "the",
         "cat", "sat", "on", "mat", "."]
TINY_VOCAB = 64  # config.json vocab_size (larger than the tokenizer's word list, as with real models)
TINY_CONTEXT = 48


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a real (word-level) tokenizer.json and a config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB, "max_position_embeddings": TINY_CONTEXT}))
    return d


@pytest.fixture
def make_buffer(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., BufferHandle]]:
    handles: list[BufferHandle] = []

    def make(**overrides: Any) -> BufferHandle:
        values: dict[str, Any] = {"port": 0, "data_dir": str(tmp_path / "db"), "model_dir": str(tiny_model_dir),
                                  "grace_seconds": 0.0}
        values.update(overrides)
        h = start_buffer(BufferConfig(**values))
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.stop()


@pytest.fixture
def buf(make_buffer: Callable[..., BufferHandle]) -> BufferHandle:
    return make_buffer()
