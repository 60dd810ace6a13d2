"""Attention of decode and draft-verification queries over the paged KV cache: the C kernel
paged_attn.c on float32 CPU, PyTorch's gather + SDPA otherwise (model.LlamaModel._attend).

Why a kernel: the PyTorch path copies every request's keys and values out of the pages into a
padded [B, KV, Km, D] tensor per layer and pads every request's queries to the longest draft tree
of the step; SDPA's CPU kernel is built for long query blocks. One attention layer, 1 thread,
SmolLM2-135M shapes (H 9, KV 3, D 64), pages of 16 (`python docs/research/paged_attn/attn_rate.py`):

    batch x keys per request, queries per request   gather + SDPA   kernel      (two runs)
    8 x 300-349, 1 (decode)                          1.9-3.2 ms      0.8-1.0 ms
    8 x 300-349, 3 for one request, 1 for the rest   1.3-3.6 ms      0.6-0.9 ms
    8 x 300-349, 9 (8-token drafts for all)          2.8-3.2 ms      2.3-2.6 ms
    32 x 100-317, 1                                  17.9-18.4 ms    2.2-2.4 ms
    4 x 1000-1021, 5                                 2.9-3.8 ms      3.0-3.2 ms

Many queries over long contexts is where SDPA's blocked kernel catches up; a request's queries
share every key load here, but each (row, key) score still ends in a horizontal sum.
Prefill (more than model_runner.SHORT_QUERY queries per request) stays on SDPA, whose blocked
kernel does the O(n^2) work better. SEER_PAGED_ATTN=0 turns the kernel off; `paged_attention_enabled(False)`
does it for a block (benchmarks compare both in one run).
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engines.reference.kernels.build import LazyKernel

SOURCE = Path(__file__).with_name("paged_attn.c")
MAX_TREE = 64  # draft nodes per request a query's visibility mask can describe (one uint64)

_c_long, _c_ptr = ctypes.c_long, ctypes.c_void_p
# (q, k_cache, v_cache, out, slots, koff, qoff, lo, hi, xmask, B, H, KV, D, scale, max_rows, max_keys, threads)
_KERNEL = LazyKernel(SOURCE, "seer_paged_attn", 2,
                     [_c_ptr] * 10 + [_c_long] * 4 + [ctypes.c_float, _c_long, _c_long, ctypes.c_int], ctypes.c_int,
                     "SEER_PAGED_ATTN")


@dataclass(frozen=True)
class PagedQueries:
    """Which keys each query of a step's short-query group sees (built once per step, read by every
    layer). Request b's keys are numbered by position and lie at cache slots
    slots[koff[b] : koff[b] + its key count]; its queries are rows qoff[b] .. qoff[b + 1] of the group.
    Query t sees keys lo[t] <= j < hi[t] and hi[t] + i for every bit i of xmask[t]."""

    slots: torch.Tensor  # [sum of key counts] int64
    koff: torch.Tensor  # [B] int64
    qoff: torch.Tensor  # [B + 1] int64
    lo: torch.Tensor  # [Tg] int64
    hi: torch.Tensor  # [Tg] int64
    xmask: torch.Tensor  # [Tg] int64 holding uint64 bit patterns
    max_rows: int  # most query rows of one request (queries x heads per kv head)
    max_keys: int  # widest key span of one request

    def __post_init__(self) -> None:
        # Checked once per step here, not in every layer's call: the C side reads these raw.
        for name in ("slots", "koff", "qoff", "lo", "hi", "xmask"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
                raise TypeError(f"PagedQueries: {name} must be a contiguous 1-D int64 CPU tensor")
        n = self.lo.shape[0]
        if not (self.hi.shape[0] == self.xmask.shape[0] == n):
            raise ValueError("PagedQueries: lo, hi and xmask must have one entry per query")
        if self.qoff.shape[0] != self.koff.shape[0] + 1 or int(self.qoff[-1]) != n:
            raise ValueError("PagedQueries: qoff must hold len(koff) + 1 offsets ending at the query count")


def paged_attention_available() -> bool:
    return _KERNEL.available()


def paged_attention_error() -> str | None:
    """Why the kernel is unavailable (None when it is available)."""
    return _KERNEL.why_unavailable()


def paged_attention_enabled(flag: bool) -> AbstractContextManager[None]:
    """Turns the kernel on or off for a block (benchmarks compare both in one run)."""
    return _KERNEL.enabled_as(flag)


def use_paged_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step on this cache should take the kernel path (decided per step)."""
    return (_KERNEL.enabled and device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
            and _KERNEL.get() is not None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pq: PagedQueries) -> torch.Tensor:
    """q [Tg, H, D], k_cache / v_cache [slots, KV, D] (one layer) -> [Tg, H * D], float32 CPU.
    Raises RuntimeError when the kernel is unavailable or rejects the call."""
    fn = _KERNEL.get()
    if fn is None:
        raise RuntimeError(f"paged attention kernel unavailable: {_KERNEL.error}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            raise TypeError(f"paged_attention: {name} must be a 3-D float32 CPU tensor, got "
                            f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the cache layers must be contiguous")
    T, H, D = q.shape
    KV = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != D or H % KV:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if pq.lo.shape[0] != T:
        raise ValueError(f"paged_attention: {T} queries but visibility for {pq.lo.shape[0]}")
    q = q.contiguous()
    out = torch.empty((T, H, D), dtype=torch.float32)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), pq.slots.data_ptr(),
            pq.koff.data_ptr(), pq.qoff.data_ptr(), pq.lo.data_ptr(), pq.hi.data_ptr(), pq.xmask.data_ptr(),
            pq.koff.shape[0], H, KV, D, D**-0.5, pq.max_rows, pq.max_keys, torch.get_num_threads())
    if rc != 0:
        why = {-1: "out of memory for its scratch", -2: "unsupported head shape",
               -3: "a request exceeds max_rows / max_keys"}.get(rc, f"code {rc}")
        raise RuntimeError(f"paged attention kernel failed: {why}")
    return out.view(T, H * D)
