"""Worker test fixtures: one real reference engine on the embedded model, shared per session.

Tests must leave the engine drained (no live requests) and at policy version 0 (a test that loads
weights builds its own engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from seer.v1 import worker_pb2_grpc
from tokenizers import Tokenizer

from services.common.grpcutil import channel
from services.common.server import RunningServer, ServiceConfig, start_server
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.server import add_servicer
from tests.draft.draft_helpers import DraftServer


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


@pytest.fixture
def served(ref_engine: ReferenceEngine) -> Iterator[tuple[Worker, worker_pb2_grpc.WorkerServiceStub]]:
    """A Worker on the shared reference engine (no speculation), served over real gRPC on loopback."""
    worker = Worker(ref_engine, worker_id="w-grpc", speculation=False).start()
    running: RunningServer = start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
                                          on_stop=worker.close)
    ch = channel(running.address)
    try:
        yield worker, worker_pb2_grpc.WorkerServiceStub(ch)
    finally:
        ch.close()
        running.stop(1.0)


@pytest.fixture
def draft_server() -> Iterator[DraftServer]:
    """A real draft server on a loopback port, for the worker's draft plumbing tests."""
    srv = DraftServer()
    try:
        yield srv
    finally:
        srv.stop()
