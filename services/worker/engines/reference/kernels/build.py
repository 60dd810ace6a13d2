"""Builds the C kernels of this package with the system compiler at first use and loads them.

Not torch.utils.cpp_extension: that needs ninja and the Python headers and takes a minute; one
`cc -O3 -shared` of a plain C file takes about a second. The shared library is cached in
~/.cache/seer/kernels (SEER_KERNEL_CACHE overrides) under a hash of the source, the flags and the
compiler's version, written to a temporary name and renamed, so concurrent first uses (test
workers, several engines) never load a half-written file. Any failure (no compiler, no AVX2/FMA,
build error) is logged once and the caller falls back to PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from services.common.log import get_logger, kv

log = get_logger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c99")
BUILD_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    env = os.environ.get("SEER_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "seer" / "kernels"


def cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {"avx2", "fma"} <= flags
    return False


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path) -> Path:
    """Path of the shared library built from `source` (built now unless cached). Raises
    RuntimeError with the reason when it cannot be built."""
    if not cpu_has_avx2_fma():
        raise RuntimeError("CPU lacks AVX2/FMA (or is not x86-64)")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes()
    key = hashlib.sha256(src + "\0".join((cc, *FLAGS, _compiler_version(cc))).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc} could not run: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("kernel built", extra=kv(source=source.name, path=str(target)))
    return target


def load(source: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source)))
