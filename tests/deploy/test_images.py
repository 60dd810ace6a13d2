"""The built images (`make images`): non-root, gRPC healthcheck, torch only in the worker, the model
in the worker, and bad config refused at start. Marked `docker`: needs a Docker engine and the images."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from deploy_render import REPO, SERVICES

pytestmark = pytest.mark.docker
TAG = os.environ.get("SEER_IMAGE_TAG", "dev")


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    if shutil.which("docker") is None or _docker("info", timeout=30).returncode != 0:
        pytest.skip("no Docker engine")
    missing = [s for s in SERVICES if _docker("image", "inspect", f"seer-{s}:{TAG}").returncode != 0]
    if missing:
        pytest.skip(f"images not built (make images): {missing}")


def _python(service: str, code: str) -> subprocess.CompletedProcess[str]:
    return _docker("run", "--rm", "--entrypoint", "python", f"seer-{service}:{TAG}", "-c", code, timeout=180)


@pytest.mark.parametrize("service", SERVICES)
def test_image_config(service: str) -> None:
    info = json.loads(_docker("image", "inspect", f"seer-{service}:{TAG}").stdout)[0]["Config"]
    assert info["User"] == "10001:10001", "images run as a non-root user"
    assert info["Healthcheck"]["Test"][-1] == "/opt/seer/healthcheck.py"
    assert info["Entrypoint"] == ["python", "-m", f"services.{service}"]
    assert f"SEER_IMAGE_SERVICE={service}" in info["Env"]


@pytest.mark.parametrize("service", SERVICES)
def test_torch_only_in_the_worker(service: str) -> None:
    proc = _python(service, "import importlib.util as u; print(u.find_spec('torch') is not None)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(service == "worker")


def test_worker_carries_a_readable_model() -> None:
    proc = _python("worker", "import json, os; d = os.environ['SEER_WORKER_MODEL_DIR']; "
                             "c = json.load(open(os.path.join(d, 'config.json'))); "
                             "open(os.path.join(d, 'model.safetensors'), 'rb').read(16); print(c['vocab_size'])")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) > 0


def test_unknown_variable_fails_at_start_naming_it() -> None:
    proc = _docker("run", "--rm", "-e", "SEER_KVSTORE_DRAM_BYTEZ=1", f"seer-kvstore:{TAG}", timeout=120)
    assert proc.returncode != 0
    assert "SEER_KVSTORE_DRAM_BYTEZ" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_compose_smoke() -> None:
    """The full compose smoke test (several minutes)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compose_smoke.py"), "--tag", TAG],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
