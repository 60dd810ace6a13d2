"""Builds the C kernels of this package with the system compiler at first use and loads them.

Where no compiler exists (the worker container image), SEER_KERNEL_PREBUILT names a directory of
libraries built on another machine by `prebuild` (docker/build_images.sh), keyed by the source's
hash.

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
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.common.log import get_logger, kv

log = get_logger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c99")
# OpenMP only with GCC: its libgomp is the runtime torch itself loads, so torch.set_num_threads
# governs both; clang would link a second runtime (libomp) whose pool spins against torch's.
OPENMP = ("-fopenmp",)
BUILD_TIMEOUT_S = 120.0


class CacheUnusable(RuntimeError):
    """The cache directory cannot be created or written (read-only home, another user's dir)."""


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


def compiler() -> list[str] | None:
    """The C compiler's argv: $CC split as a shell would ("ccache gcc"), else cc or gcc."""
    env = os.environ.get("CC")
    if env and shlex.split(env):
        return shlex.split(env)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _compiler_version(cc: list[str]) -> str:
    try:
        return subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _flags(version: str) -> tuple[str, ...]:
    return FLAGS + (OPENMP if "Free Software Foundation" in version else ())


def _compile(cc: list[str], flags: tuple[str, ...], source: Path, out_dir: Path, target: Path) -> None:
    """Compiles into a temporary name in out_dir and renames it to target (atomic for readers)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out_dir)
    except OSError as e:
        raise CacheUnusable(f"cannot write the kernel cache {out_dir}: {e}") from e
    os.close(fd)
    try:
        try:
            proc = subprocess.run([*cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"{' '.join(cc)} could not run: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {proc.stderr.strip()[-2000:]}")
        try:
            os.chmod(tmp, 0o755)  # mkstemp makes it 0600: other users sharing the cache could not load it
            os.replace(tmp, target)
        except OSError as e:
            raise CacheUnusable(f"cannot write the kernel cache {out_dir}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: Path, out_dir: Path | None = None) -> Path:
    """Path of the shared library built from `source` into out_dir (default: cache_dir()), built
    now unless cached. Raises RuntimeError with the reason when it cannot be built."""
    if not cpu_has_avx2_fma():
        raise RuntimeError("CPU lacks AVX2/FMA (or is not x86-64)")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = _compiler_version(cc)
    flags = _flags(version)
    # The key covers everything the binary depends on, so a cache shared between machines or
    # compilers never hands one the other's library.
    ident = "\0".join((*cc, *flags, version, platform.machine(), *platform.libc_ver()))
    key = hashlib.sha256(source.read_bytes() + ident.encode()).hexdigest()[:16]
    out_dir = out_dir if out_dir is not None else cache_dir()
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheUnusable(f"cannot create the kernel cache {out_dir}: {e}") from e
    _compile(cc, flags, source, out_dir, target)
    log.info("kernel built", extra=kv(source=source.name, path=str(target)))
    return target


def prebuilt_name(source: Path) -> str:
    """File name of `source`'s library in a prebuilt directory: keyed by the source and this
    module's flags (not the compiler's version: the machine that uses it may have no compiler)."""
    ident = "\0".join((*FLAGS, *OPENMP)).encode()
    return f"{source.stem}-{hashlib.sha256(source.read_bytes() + ident).hexdigest()[:16]}.so"


def prebuild(out_dir: Path) -> list[Path]:
    """Builds every kernel source of this package into out_dir under prebuilt names (container
    images: the worker image has no compiler; docker/build_images.sh runs this on the host)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for source in sorted(Path(__file__).parent.glob("*.c")):
        lib = build(source, out_dir)
        target = out_dir / prebuilt_name(source)
        os.replace(lib, target)
        built.append(target)
    return built


def _prebuilt(source: Path) -> Path | None:
    """SEER_KERNEL_PREBUILT: a directory of libraries built elsewhere for this source, if any."""
    d = os.environ.get("SEER_KERNEL_PREBUILT")
    if not d:
        return None
    p = Path(d) / prebuilt_name(source)
    return p if p.exists() else None


def load(source: Path) -> ctypes.CDLL:
    """The built library, loaded: a prebuilt one (SEER_KERNEL_PREBUILT) when it exists for exactly
    this source, else built here. A cache that cannot be written or whose library cannot be loaded
    (another user's file, a noexec mount, a stale build) does not cost the kernel: it is built
    again into a private temporary directory."""
    pre = _prebuilt(source)
    if pre is not None:
        if not cpu_has_avx2_fma():
            raise RuntimeError("CPU lacks AVX2/FMA (or is not x86-64)")
        try:
            return ctypes.CDLL(str(pre))
        except OSError as e:
            log.warning("prebuilt kernel unusable; building here", extra=kv(path=str(pre), reason=str(e)))
    try:
        return ctypes.CDLL(str(build(source)))
    except (OSError, CacheUnusable) as first:
        log.warning("kernel cache unusable; building privately", extra=kv(source=source.name, reason=str(first)))
        private = Path(tempfile.mkdtemp(prefix="seer-kernels-"))
        try:
            return ctypes.CDLL(str(build(source, private)))  # the mapping outlives the file
        except OSError as e:
            raise RuntimeError(f"built {source.name} but cannot load it: {e}") from e
        finally:
            shutil.rmtree(private, ignore_errors=True)


class LazyKernel:
    """One exported function of a kernel source, built and loaded at first use (thread-safe), or
    None with the reason in `error` when it cannot be (the caller falls back to PyTorch).
    `enabled` (from the environment variable `env`, default on) is the caller's switch; benchmarks
    flip it for a block with `enabled_as`."""

    def __init__(self, source: Path, symbol: str, abi: int, argtypes: list[type], restype: type | None,
                 env: str) -> None:
        self.source, self.symbol, self.abi = source, symbol, abi
        self.argtypes, self.restype = argtypes, restype
        self.enabled = os.environ.get(env, "1").lower() not in ("0", "false", "no", "off")
        self.error: str | None = None
        self._fn: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
        if self._tried:
            return self._fn
        with self._lock:
            if not self._tried:
                try:
                    lib = load(self.source)
                    got = getattr(lib, f"{self.symbol}_abi")()
                    if got != self.abi:
                        raise RuntimeError(f"ABI version mismatch: {self.source.name} has {got}, expected {self.abi}")
                    fn = getattr(lib, self.symbol)
                    fn.argtypes = self.argtypes
                    fn.restype = self.restype
                    self._fn = fn
                except (OSError, RuntimeError, AttributeError) as e:
                    self.error = str(e)
                    log.warning("kernel unavailable; using PyTorch",
                                extra=kv(source=self.source.name, reason=str(e)))
                self._tried = True
        return self._fn


    def available(self) -> bool:
        return self.get() is not None

    def why_unavailable(self) -> str | None:
        """Why the kernel is unavailable (None when it is available)."""
        self.get()
        return self.error

    @contextmanager
    def enabled_as(self, flag: bool) -> Iterator[None]:
        prev, self.enabled = self.enabled, flag
        try:
            yield
        finally:
            self.enabled = prev
