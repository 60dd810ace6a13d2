from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
from services.common import telemetry
with telemetry.tracer("seer.scheduler").start_as_current_span("scheduler.dispatch", context=None) as span:
    span.set_attribute("seer.request_id", "r1")
print(sorted(m for m in sys.modules if m.startswith("opentelemetry"))[:1])
"""


@pytest.mark.parametrize(("mode", "imported"), [("", False), ("none", False), ("console", True)])
def test_tracing_off_does_not_load_opentelemetry(mode: str, imported: bool) -> None:
    env = dict(os.environ, SEER_TRACING=mode, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert (out.strip() != "[]") is imported, out
