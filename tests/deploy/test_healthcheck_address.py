"""docker/healthcheck.py dials the address the service binds: a service given one interface's
address (SEER_<SERVICE>_HOST) does not answer on 127.0.0.1, where the check always asked."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seer_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("host", "want"), [
    (None, "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("[::]", "127.0.0.1"),
    ("::0", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("::1", "[::1]"), ("[fd00::5]", "[fd00::5]"),
    ("localhost", "localhost"),
])
def test_the_default_address_follows_the_bind_host(monkeypatch: pytest.MonkeyPatch, host: str | None,
                                                   want: str) -> None:
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "buffer")
    monkeypatch.setenv("SEER_BUFFER_PORT", "50051")
    if host is None:
        monkeypatch.delenv("SEER_BUFFER_HOST", raising=False)
    else:
        monkeypatch.setenv("SEER_BUFFER_HOST", host)
    assert _healthcheck().default_address() == f"{want}:50051"
