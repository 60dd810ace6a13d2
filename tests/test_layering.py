"""Each service's core is pure: importing it (and the simulator, which runs the scheduler core)
pulls in no gRPC. The services' servers are the only gRPC edge (DESIGN.md section 2).

Until session 24 the buffer core did import grpc: its model module reads the buffer's config,
whose base ServiceConfig lived in services/common/server.py. Each import runs in a fresh
interpreter, so modules other tests loaded do not hide a leak."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]

PURE = [
    "services.buffer.core",
    "services.draft.store",
    "services.draft.index",
    "services.kvstore.store",
    "services.scheduler.core",
    "services.worker.core",
    "services.worker.engines.reference",
    "bench.simlib.cluster",
]


@pytest.mark.parametrize("module", PURE)
def test_core_imports_no_grpc(module: str) -> None:
    probe = (f"import sys, {module}\n"
             "leaked = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'grpc_')))\n"
             "print(','.join(leaked))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()}"


def test_the_probe_sees_a_grpc_import() -> None:
    """The control: the same probe on a server module reports grpc."""
    done = subprocess.run([sys.executable, "-c", "import sys, services.common.server; print('grpc' in sys.modules)"],
                          cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
