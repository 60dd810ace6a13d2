"""The committed generated code must match the .proto files, and buf lint must pass."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"


def test_generated_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    out.mkdir()
    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "seer" / "v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={out}", f"--pyi_out={out}",
         f"--grpc_python_out={out}", *protos],
        cwd=PROTOS, check=True,
    )
    generated = sorted(p.name for p in (out / "seer" / "v1").iterdir())
    assert generated, "protoc produced nothing"
    committed = PROTOS / "seer" / "v1"
    stale = [n for n in generated if not filecmp.cmp(out / "seer" / "v1" / n, committed / n, shallow=False)]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"


def test_buf_lint() -> None:
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        pytest.skip("buf (buf-bin) not installed")
    res = subprocess.run([buf, "lint"], cwd=PROTOS, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_any_or_pickles() -> None:
    for proto in (PROTOS / "seer" / "v1").glob("*.proto"):
        text = proto.read_text()
        assert "google/protobuf/any.proto" not in text, proto.name
        assert "pickle" not in text.lower(), proto.name


def test_enums_have_unspecified_zero() -> None:
    from seer.v1 import common_pb2, rollout_pb2

    for enum in (common_pb2.FinishReason, rollout_pb2.BatchState, rollout_pb2.RequestState):
        zero = enum.Name(0)
        assert zero.endswith("_UNSPECIFIED"), zero
