"""Engine test fixtures: one real engine on the embedded model shared by the module's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.worker.engines.reference import ReferenceEngine

from .device import DEVICE

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "List five tips for staying productive when working from home.",
    "What are the main differences between Python and C?",
    "Describe the water cycle to a ten year old.",
    "Give me a recipe for pancakes.",
]


def chat(tok: Tokenizer, text: str) -> tuple[int, ...]:
    s = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(tok.encode(s).ids)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def prompts(tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    return [chat(tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> ReferenceEngine:
    """Shared engine; tests must leave it drained (no live requests)."""
    # One thread: on a shared 2-core machine OpenMP spin-waiting with 2 threads is several times slower.
    return ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=2048, max_batch_size=512, num_threads=1)
