"""Shared fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2-135M converted to safetensors (converted once, then cached)."""
    from services.worker.model.prepare import ensure_model

    return ensure_model()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
