"""Reference engine configuration (sizes of the paged KV cache and of a batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_KV_MEMORY_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None: derived from kv_memory_bytes
    kv_memory_bytes: int = DEFAULT_KV_MEMORY_BYTES
    max_batch_size: int = 256  # running requests
    max_prefill_tokens: int = 4096  # tokens computed by one prefill step (at least one request)
    max_draft_tokens: int = 64  # per request per step; longer drafts are trimmed (drafts are optional)
    model_version: str = "v0"
    num_threads: int | None = None  # torch.set_num_threads when set
    # Tune glibc malloc for the process at start (services/common/memtune.py): untuned, the
    # [rows, vocab] tensors of every step are page-faulted in fresh. Process-wide and applied once.
    tune_malloc: bool = True

    def validate(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages: must be positive, got {self.num_pages}")
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size: must be positive, got {self.max_batch_size}")
        if not self.model_version:
            raise ValueError("model_version: must not be empty")
