"""Client test fixtures: a restartable real buffer."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_helpers import Buffer


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[Buffer]:
    b = Buffer(tmp_path / "db")
    b.start()
    yield b
    b.stop()
