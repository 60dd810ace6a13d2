"""The chained KV page hash shared by the engine's prefix cache, the KV store and the scheduler.

hash(page i) = H(hash(page i-1), model version, token ids of page i). A page's hash therefore
identifies the whole prefix up to and including that page under one set of weights, so pages of an
old policy version are never reused after a weight update (they live in another namespace too).
Only full pages are hashed: a partial last page is never shared or stored.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
ROOT = b"\x00" * HASH_BYTES


def page_hash(parent: bytes | None, tokens: Sequence[int], model_version: str) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else ROOT)
    h.update(model_version.encode("utf-8"))
    h.update(b"\xff")  # separates the version string from the token bytes
    # Little-endian int32 per token. struct, not numpy: the kvstore server imports this module, and
    # importing numpy starts OpenBLAS threads that took ~1.4% of its CPU while idle.
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def chain_hashes(tokens: Sequence[int], page_size: int, model_version: str, parent: bytes | None = None) -> list[bytes]:
    """Hashes of every full page of `tokens` (a partial tail page is not hashed)."""
    if page_size <= 0:
        raise ValueError("page_size: must be positive")
    out: list[bytes] = []
    prev = parent
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = page_hash(prev, tokens[start : start + page_size], model_version)
        out.append(prev)
    return out
