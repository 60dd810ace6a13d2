"""ChunkStats: what one chunk cost (mirrors seer.v1.ChunkStats). The worker fills it per chunk; the
buffer sums it per response. One definition so the two never drift apart."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ChunkStats:
    prefill_tokens: int = 0
    cached_tokens: int = 0
    kv_loaded_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    kv_recomputed_pages: int = 0

    def add(self, other: ChunkStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_meta(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def copy(self) -> ChunkStats:
        return ChunkStats(**self.__dict__)

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> ChunkStats:
        return cls(**d)
