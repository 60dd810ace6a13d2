"""Client test fixtures: a restartable real buffer with the tokenizer, and the Node.js client (the
plain `buffer` fixture is in tests/conftest.py, shared with the CLI tests)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_helpers import Buffer, play_scheduler

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture
def one_at_a_time(buffer: Buffer) -> Iterator[None]:
    """A scheduler that finishes the first request only (the others wait on its gate), so a batch
    is still running after its first result."""
    stop, gate = threading.Event(), threading.Semaphore(1)
    t = threading.Thread(target=play_scheduler, args=(buffer.address,), kwargs={"stop": stop, "gate": gate},
                         daemon=True)
    t.start()
    yield
    stop.set()
    gate.release(100)
    t.join(10)


@pytest.fixture
def tok_buffer(tmp_path: Path, model_dir: Path) -> Iterator[Buffer]:
    """A restartable buffer that tokenizes prompt_text with the embedded model's tokenizer (the
    Node client sends text prompts)."""
    b = Buffer(tmp_path / "db")
    b.cfg = dataclasses.replace(b.cfg, model_dir=str(model_dir))
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def node_client() -> Path:
    """clients/node/rollout.js, its dependencies installed (skipped where node/npm are not)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        proc = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            pytest.skip(f"npm ci failed (no npm registry?): {proc.stderr[-500:]}")
    return NODE_DIR / "rollout.js"
