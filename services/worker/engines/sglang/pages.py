"""Mapping SGLang HiCache L3 pages onto the Seer KV store (pure: no sglang, no grpc).

HiCache names a page by a string key: a hash chained over the page's tokens and every page before
it, salted with the request's extra key. Seer runs every request with the policy version as that
extra key, so pages of old weights get different keys and are never reused. In the KV store a page
lives under (namespace, 16-byte page hash):

    namespace = "sglang-<family>-tp<rank>of<size>@v<N>"
    page hash = blake2b-128(HiCache key)

The "@v<N>" suffix makes the store drop a family's older versions once a newer one is written; the
"sglang-" prefix and the TP coordinate keep these pages apart from the reference engine's (another
layout) and from other tensor-parallel ranks (each rank holds a slice of the heads).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from services.worker.engine import KVLayout

PAGE_HASH_BYTES = 16


def page_hash(key: str) -> bytes:
    """The KV store page hash of one HiCache key."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=PAGE_HASH_BYTES).digest()


def namespace(family: str, policy_version: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    if not family or "@" in family:
        raise ValueError(f"family: {family!r} must be non-empty and contain no '@'")
    if policy_version < 0:
        raise ValueError(f"policy_version: must be >= 0, got {policy_version}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is not in [0, {tp_size})")
    return f"sglang-{family}-tp{tp_rank}of{tp_size}@v{policy_version}"


def extra_key(family: str, policy_version: int) -> str:
    """The per-request extra key (HiCache salts page keys with it): the weight version."""
    return f"{family}@v{policy_version}"


def page_layout(
    dtype: str, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, mem_layout: str,
    tp_rank: int = 0, tp_size: int = 1,
) -> KVLayout:
    """The KV store layout of an MHA host pool page (K and V of every layer, this rank's heads)."""
    return KVLayout(dtype=dtype, page_size=page_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, layout=f"sglang:{mem_layout}:tp{tp_rank}of{tp_size}")


@dataclass(frozen=True)
class VersionFile:
    """The current policy version, shared between the worker (writer) and the HiCache backend in
    SGLang's scheduler process (reader). One small file read per batch call; atomic replace."""

    path: str

    def write(self, version: int) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(int(version)))
        os.replace(tmp, self.path)

    def read(self, default: int = 0) -> int:
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read().strip()
        except FileNotFoundError:
            return default
        return int(text) if text else default
