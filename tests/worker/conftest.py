"""Worker test fixtures: one real reference engine on the embedded model, shared per session.

Tests must leave the engine drained (no live requests) and at policy version 0 (a test that loads
weights builds its own engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.worker.engines.reference.engine import ReferenceEngine


def chat_prompt(tok: Tokenizer, text: str) -> tuple[int, ...]:
    s = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(tok.encode(s).ids)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def prompts(tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    texts = [
        "What is 12 plus 30? Answer with a number.",
        "Name three colors of the rainbow.",
        "Write one sentence about the sea.",
        "What is the capital of France?",
    ]
    return [chat_prompt(tokenizer, t) for t in texts]


@pytest.fixture(scope="session")
def ref_engine(model_dir: Path) -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine.from_dir(model_dir, num_pages=512, max_batch_size=16, page_size=16)
    yield engine
    assert not engine.has_unfinished(), "a test left live requests in the shared engine"
