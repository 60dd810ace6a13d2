"""clients/python is a package of its own: `pip install ./clients/python` gives a trainer's
environment seer_client and the generated seer.v1 it imports, depending on gRPC and protobuf only
(before, the client came only with `pip install -e .` of the whole repo, torch included). The wheel
is built offline from a copy of clients/python and protos/ in their repo layout (the build maps
seer.v1 in from ../../protos), unpacked, and imported from there by a fresh interpreter that then
submits a batch to a real buffer on loopback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from client_helpers import Buffer

REPO = Path(__file__).resolve().parents[2]


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "repo"
    # A copy, so the in-place build's build/ and *.egg-info stay out of the checkout.
    shutil.copytree(REPO / "clients" / "python", src / "clients" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copytree(REPO / "protos", src / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src / "clients" / "python")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("seer_client-*.whl")
    return wheel


def test_the_client_wheel_installs_the_client_and_its_protos_only(tmp_path: Path, buffer: Buffer) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip() for line in z.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
        z.extractall(tmp_path / "site")
    code = {n for n in names if n.endswith(".py")}
    client = {f"seer_client/{p.name}" for p in (REPO / "clients/python/seer_client").glob("*.py")}
    protos = {f"seer/v1/{p.name}" for p in (REPO / "protos/seer/v1").glob("*_pb2*.py")}
    assert client <= code and {"seer_client/client.py", "seer/v1/rollout_pb2_grpc.py"} <= code
    assert code == client | protos | {"seer/__init__.py", "seer/v1/__init__.py"}, code
    assert not any(n.startswith(("services/", "bench/", "tests/")) for n in names)
    # gRPC and protobuf only (grpcio-health-checking: wait_ready), no torch.
    assert sorted(re.split(r"[<>=!~ ;\[]", r)[0] for r in requires) == [
        "grpcio", "grpcio-health-checking", "protobuf"], requires

    site = tmp_path / "site"
    probe = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(site)!r})
        import seer_client, seer.v1.rollout_pb2 as rollout_pb2
        from seer_client import PromptGroup, SeerClient
        with SeerClient({buffer.address!r}) as c:
            c.wait_ready(10)
            sub = c.submit_batch("wheel", [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)])
        print(json.dumps({{"client": seer_client.__file__, "protos": rollout_pb2.__file__,
                          "torch": "torch" in sys.modules, "services": "services" in sys.modules,
                          "num_requests": sub.num_requests}}))
    """)
    # -I: no PYTHONPATH, no current directory (the checkout) on sys.path.
    proc = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(seen["client"]).is_relative_to(site) and Path(seen["protos"]).is_relative_to(site), seen
    assert (seen["torch"], seen["services"], seen["num_requests"]) == (False, False, 2), seen
