"""ChunkStats: what one chunk cost (mirrors seer.v1.ChunkStats). The worker fills it per chunk; the
buffer sums it per response. One definition so the two never drift apart."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1


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
        """Sums other into self; integer sums saturate at INT32_MAX, the width the buffer stores them
        in (a response's counters, not identities: past it every commit of the response failed)."""
        for f in dataclasses.fields(self):
            total = getattr(self, f.name) + getattr(other, f.name)
            setattr(self, f.name, min(total, INT32_MAX) if isinstance(total, int) else total)

    def bad_field(self) -> str | None:
        """The first field that is negative or not finite (none can be), or None. `not v >= 0`, not
        `v < 0`: NaN fails every comparison."""
        return next((f.name for f in dataclasses.fields(self)
                     if not 0 <= getattr(self, f.name) < math.inf), None)

    def to_meta(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def copy(self) -> ChunkStats:
        return ChunkStats(**self.__dict__)

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> ChunkStats:
        return cls(**d)
