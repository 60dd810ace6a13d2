"""y = x @ w^T (+ b): the small-M C kernel (small_gemm.c) where it beats PyTorch, F.linear elsewhere.

Where it wins (`python -m bench.engine --threads 1 --only gemm`: 1 thread, AVX2 Zen3, weights
streamed from memory as in the model), F.linear time / kernel time, median of repeats (session 11,
with the next weight block's prefetch spread over every pass: at M = 8-16 the kernel now streams
the weights at the memory bus's rate, 12-14 GB/s here, where it reached 7-10 before):
    M        2     3     4     6     8    12    16    24    32    48    64    96
    qkv    1.6   1.9   1.8   2.0   1.9   2.2   1.9   1.5   1.3   1.2   1.2   1.1   [960, 576]
    o      1.4   1.8   1.7   1.8   1.9   1.9   1.6   1.3   1.2   1.2   1.2   1.0   [576, 576]
    gu     2.3   2.6   2.1   2.3   2.6   2.1   1.9   1.5   1.3   1.3   1.1   1.0   [3072, 576]
    down   1.3   1.8   1.6   1.7   1.6   1.5   1.5   1.2   1.2   1.0   0.9   0.8   [576, 1536]
    lm     2.8   3.9   2.7   3.1   2.9   2.8   2.4   2.1   1.8   1.5   1.5   1.2   [49152, 576]
At M = 1 MKL's gemv is bandwidth-bound and the kernel only matches it (0.9-1.3x), so M = 1 stays
on F.linear (plain decode bit-identical to before). Around 64-96 rows MKL's blocked gemm catches up
on the layer shapes (down first: its x rows [M, 1536] outgrow L1); the lm_head (113 MB of weights,
memory-bound) still gains up to 128 rows.

Set SEER_SMALL_GEMM=0 to disable the kernel; `small_gemm_enabled(False)` does it for a block
(benchmarks compare both in one run).
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.nn.functional as F

from services.worker.engines.reference.kernels.build import LazyKernel

SOURCE = Path(__file__).with_name("small_gemm.c")
MIN_ROWS = 2  # M = 1: MKL gemv is as fast and keeps greedy decoding bit-identical
MAX_ROWS = 64  # crossover vs MKL sgemm on the layer shapes (table above)
WIDE_WEIGHTS = 8 << 20  # elements: a weight this large (the lm_head) is memory-bound up to ...
MAX_ROWS_WIDE = 128  # ... this many rows

_c_long, _c_ptr = ctypes.c_long, ctypes.c_void_p
# (x, ldx, w, bias, y, ldy, M, N, K, threads)
_KERNEL = LazyKernel(SOURCE, "seer_small_gemm", 1,
                     [_c_ptr, _c_long, _c_ptr, _c_ptr, _c_ptr, _c_long, _c_long, _c_long, _c_long, ctypes.c_int], None,
                     "SEER_SMALL_GEMM")


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _KERNEL.get()


def small_gemm_available() -> bool:
    return _KERNEL.available()


def small_gemm_error() -> str | None:
    """Why the kernel is unavailable (None when it is available)."""
    return _KERNEL.why_unavailable()


def small_gemm_enabled(flag: bool) -> AbstractContextManager[None]:
    """Turns the kernel on or off for a block (benchmarks compare both in one run)."""
    return _KERNEL.enabled_as(flag)


def small_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel itself: x [M, K], w [N, K] (contiguous), bias [N] -> [M, N], float32 CPU.
    Raises RuntimeError when the kernel is unavailable."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"small-M GEMM kernel unavailable: {_KERNEL.error}")
    # The C side reads raw float32 memory: anything else would be garbage or an out-of-bounds read.
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise TypeError(f"small_gemm: {name} must be float32 on CPU, got {t.dtype} on {t.device}")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"small_gemm: x and w must be 2-D, got x {tuple(x.shape)}, w {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"small_gemm: shapes x {tuple(x.shape)}, w {tuple(w.shape)} do not match")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"small_gemm: bias shape {tuple(bias.shape)} != ({N},)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), N,
       M, N, K, torch.get_num_threads())
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K]; the kernel for float32 CPU tensors with MIN_ROWS <= M <= MAX_ROWS
    (MAX_ROWS_WIDE for weights of at least WIDE_WEIGHTS elements)."""
    m = x.shape[0]
    if (_KERNEL.enabled and m >= MIN_ROWS and (m <= MAX_ROWS or (m <= MAX_ROWS_WIDE and w.numel() >= WIDE_WEIGHTS))
            and x.dim() == 2 and x.dtype == torch.float32
            and w.dtype == torch.float32 and x.device.type == "cpu" and w.device.type == "cpu"
            and (bias is None or bias.dtype == torch.float32) and _kernel() is not None):
        return small_gemm(x, w, bias)
    return F.linear(x, w, bias)
