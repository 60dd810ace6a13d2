"""rms_norm: on a GPU (float32) one fused kernel, elsewhere Hugging Face's formula written out; both
compute the same normalization (SEER_TEST_DEVICE=cuda runs the fused path; the parity tests with
HF's model check it end to end there)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engines.reference.model import rms_norm

from .device import DEVICE


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.skipif(DEVICE == "cpu", reason="off CUDA rms_norm is this very formula; the fused path runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_formula(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(device=DEVICE, dtype=dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(device=DEVICE, dtype=dtype)
    got, want = rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_fused_rms_norm_is_the_same_normalization() -> None:
    """The fused op the GPU path calls, run here on this machine's device against the formula."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 576, generator=g).to(DEVICE)
    w = (torch.rand(576, generator=g) + 0.5).to(DEVICE)
    fused = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(fused, hf_rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
