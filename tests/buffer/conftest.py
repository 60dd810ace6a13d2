"""Buffer test fixtures: a real buffer (RocksDB in tmp dirs, gRPC on loopback) and a tiny tokenizer."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from buffer_helpers import BufferHandle, start_buffer, write_tiny_model

from services.buffer.config import BufferConfig


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a real (word-level) tokenizer.json and a config.json."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


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
