"""The small-M GEMM kernel against F.linear, its dispatch, and its build fallbacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.engines.reference.kernels import build
from services.worker.engines.reference.kernels import linear as lin
from services.worker.engines.reference.kernels.linear import (
    small_gemm,
    small_gemm_available,
    small_gemm_enabled,
    small_gemm_error,
)

from .device import needs_kernel


@needs_kernel
def test_kernel_builds_where_it_can() -> None:
    build.load(lin.SOURCE)  # raises with the compiler's stderr
    assert small_gemm_available(), small_gemm_error()


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_matches_f_linear_on_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(8):
        M = int(torch.randint(1, 70, (1,), generator=g))
        N = int(torch.randint(1, 300, (1,), generator=g))
        K = int(torch.randint(1, 200, (1,), generator=g))  # mostly not multiples of 8: masked tails
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g) if seed % 2 else None
        torch.testing.assert_close(small_gemm(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (3072, 576)])
def test_model_shapes_all_small_m(N: int, K: int) -> None:
    w = torch.randn(N, K) / K**0.5
    for M in range(1, 17):
        x = torch.randn(M, K)
        torch.testing.assert_close(small_gemm(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("M,N,K", [(0, 8, 64), (3, 0, 64), (3, 8, 0), (0, 0, 0)])
def test_empty_operands(M: int, N: int, K: int) -> None:
    # The prefetch is shared over ceil(M / 4) passes of K / 8 steps: M = 0 or K = 0 once divided
    # by zero (SIGFPE, the whole process gone) in the first version of that change.
    x, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    torch.testing.assert_close(small_gemm(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(small_gemm(x, w), F.linear(x, w))


@needs_kernel
def test_strided_rows_and_threads() -> None:
    big = torch.randn(5, 300)
    x = big[:, 17:150]  # row stride 300, unit column stride: passed without a copy
    w = torch.randn(77, 133)
    want = F.linear(x, w)
    prev = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            torch.testing.assert_close(small_gemm(x, w), want, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(prev)
    xt = torch.randn(133, 5).t()  # column stride != 1: copied
    torch.testing.assert_close(small_gemm(xt, w), F.linear(xt, w), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_bad_operands_are_errors() -> None:
    with pytest.raises(ValueError, match="shapes"):
        small_gemm(torch.randn(3, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="bias shape"):
        small_gemm(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5))
    with pytest.raises(ValueError, match="2-D"):
        small_gemm(torch.randn(2, 3, 8), torch.randn(4, 8))
    with pytest.raises(TypeError, match="w must be float32"):
        small_gemm(torch.randn(3, 8), torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be float32"):
        small_gemm(torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8))


def test_dispatch_uses_f_linear_outside_its_range(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = lin.small_gemm

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(lin, "small_gemm", spy)
    monkeypatch.setattr(lin._KERNEL, "enabled", True)  # whatever SEER_SMALL_GEMM says in this environment
    w = torch.randn(16, 24)
    for M in (1, lin.MIN_ROWS, lin.MAX_ROWS, lin.MAX_ROWS + 1):
        x = torch.randn(M, 24)
        torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    lin.linear(torch.randn(4, 24, dtype=torch.float64), w.double())  # not float32: F.linear
    with small_gemm_enabled(False):
        lin.linear(torch.randn(4, 24), w)
    expected = [lin.MIN_ROWS, lin.MAX_ROWS] if small_gemm_available() else []
    assert calls == expected
    calls.clear()
    wide = torch.randn(lin.WIDE_WEIGHTS // 256, 256)  # an lm_head-sized weight: more rows allowed
    for M in (lin.MAX_ROWS + 1, lin.MAX_ROWS_WIDE + 1):
        x = torch.randn(M, 256)
        torch.testing.assert_close(lin.linear(x, wide), F.linear(x, wide), rtol=1e-4, atol=1e-4)
    assert calls == ([lin.MAX_ROWS + 1] if small_gemm_available() else [])


def test_build_reports_a_missing_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(build, "cpu_has_avx2_fma", lambda: True)
    with pytest.raises(RuntimeError, match="could not run"):
        build.build(lin.SOURCE)
    assert not list(tmp_path.glob("*.so"))


def test_build_reports_a_compile_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("SEER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "cpu_has_avx2_fma", lambda: True)
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        build.build(bad)
    assert not list((tmp_path / "cache").glob("*.so"))


@needs_kernel
def test_build_is_cached_by_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEER_KERNEL_CACHE", str(tmp_path))
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    first = build.build(src)
    assert build.build(src) == first  # cached: same file, not rebuilt
    src.write_text("int f(void) { return 2; }\n")
    assert build.build(src) != first  # the key follows the source


@needs_kernel
def test_unusable_cache_falls_back_to_a_private_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SEER_KERNEL_CACHE", str(blocker / "cache"))  # cannot be created
    lib = build.load(lin.SOURCE)
    assert lib.seer_small_gemm_abi() == 1


def test_cc_with_arguments_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "ccache  gcc -m64")
    assert build.compiler() == ["ccache", "gcc", "-m64"]


@needs_kernel
def test_prebuilt_kernels_load_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker image has no compiler: libraries prebuilt on the host (SEER_KERNEL_PREBUILT) load
    there, and only for exactly the source they were built from."""
    pre = tmp_path / "pre"
    built = build.prebuild(pre)
    assert {p.name for p in built} == {build.prebuilt_name(s) for s in Path(build.__file__).parent.glob("*.c")}
    monkeypatch.setenv("SEER_KERNEL_PREBUILT", str(pre))
    monkeypatch.setenv("SEER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    lib = build.load(lin.SOURCE)
    assert lib.seer_small_gemm_abi() == 1
    assert not (tmp_path / "cache").exists()  # nothing was compiled
    other = tmp_path / "k.c"
    other.write_text("int f(void) { return 1; }\n")  # no prebuilt library for this source
    with pytest.raises(RuntimeError, match="could not run"):
        build.load(other)


def test_kernel_sources_ship_in_the_wheel() -> None:
    """An installed wheel (the container images) compiles or looks up kernels by their .c source:
    without it the engine silently runs the PyTorch fallbacks, as the images did until session 10."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["services.worker.engines.reference.kernels"]
    sources = [p.name for p in Path(build.__file__).parent.glob("*.c")]
    assert sources and all(any(fnmatch.fnmatch(s, pat) for pat in patterns) for s in sources)
