"""Shared fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The services' own configuration variables (SEER_<SERVICE>_<FIELD>, services/common/config.py): a
# developer's shell (SEER_SCHEDULER_POLICY=baseline, say) or a CI machine's would reach every
# service a test starts, in process or as a child, and change what it tests; an unknown one is even
# refused at start. Tests that need one set it themselves. Test controls (SEER_TEST_DEVICE,
# SEER_SGLANG_WHEEL, SEER_IMAGE_TAG, ...) are not service configuration and stay.
_SERVICE_VAR_PREFIXES = tuple(f"SEER_{s}_" for s in ("BUFFER", "SCHEDULER", "DRAFT", "KVSTORE", "WORKER"))


def pytest_configure(config: pytest.Config) -> None:
    for name in [n for n in os.environ if n.startswith(_SERVICE_VAR_PREFIXES)]:
        del os.environ[name]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2-135M converted to safetensors (converted once, then cached)."""
    from services.worker.model.prepare import ensure_model

    return ensure_model()


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that runs a service's main() in process (setup_logging) leaves the root logger at
    INFO with its own handler: every later test's info lines were then made and kept, which a
    memory measurement of the draft store counted as the store's."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[Any]:
    """A real buffer (in process: real gRPC and RocksDB) on a fixed port that tests may stop and
    start again (tests.client.client_helpers.Buffer); used by the client and CLI tests."""
    from tests.client.client_helpers import Buffer

    b = Buffer(tmp_path / "db")
    b.start()
    yield b
    b.stop()
