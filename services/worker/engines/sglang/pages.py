"""Mapping SGLang HiCache L3 pages onto the Seer KV store (pure: no sglang, no grpc).

HiCache names a page by a string key: a hash chained over the page's tokens and every page before
it, seeded with the request's extra key (SGLang 0.5.23: storage_namespace_seed,
mem_cache/utils.py:125-150; the extra key reaches the scheduler's Req, managers/scheduler.py:3025;
0.5.4 dropped it). Seer runs every request with the weights' family (model + weights id) and policy
version as that extra key, so pages of other weights get different keys and are never reused
(the namespace below separates them too, on any version). In the KV store a page
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
    """The current weights, shared between the worker (writer) and the HiCache backend in SGLang's
    scheduler process (reader): the policy version, and the family (model + weights id) whose
    namespace the pages live in. A LoadWeights from another source changes the family too: with
    the version alone, weights reloaded as the same version from another checkpoint (or a new run
    on the same KV store volume) would be served the old weights' pages. One small file read per
    batch call; atomic replace. Format: "<version>" or "<version>\n<family>"."""

    path: str

    def write(self, version: int, family: str = "") -> None:
        if "\n" in family:
            raise ValueError(f"family: {family!r} must be one line")
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(int(version)) + (f"\n{family}" if family else ""))
        os.replace(tmp, self.path)

    def read(self, default: int = 0) -> int:
        return self.read_both(default, "")[0]

    def read_both(self, default_version: int, default_family: str) -> tuple[int, str]:
        """(version, family); the defaults for what the file does not say."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.read().strip().split("\n")
        except FileNotFoundError:
            return default_version, default_family
        version = int(lines[0]) if lines[0].strip() else default_version
        family = lines[1].strip() if len(lines) > 1 and lines[1].strip() else default_family
        return version, family
