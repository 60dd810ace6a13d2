"""Client-side consistent-hash ring over kvstore replicas (DESIGN.md section 2: kvstore shards by
page-key hash over N replicas).

Each replica gets `vnodes` points on a 64-bit ring; a page goes to the first point at or after its
key. Page hashes are already uniform (blake2b), so the key is their first 8 bytes. Adding or
removing one replica moves only about 1/N of the pages.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence


def _point(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: Sequence[str], vnodes: int = 64) -> None:
        if not nodes:
            raise ValueError("nodes: at least one replica address is required")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"nodes: duplicate replica addresses in {list(nodes)}")
        if vnodes < 1:
            raise ValueError(f"vnodes: must be >= 1, got {vnodes}")
        self.nodes = list(nodes)
        points = sorted((_point(f"{node}#{i}"), node) for node in nodes for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def node_for(self, key: bytes) -> str:
        """The replica that owns a page key (a page hash)."""
        k = int.from_bytes(key[:8].rjust(8, b"\x00"), "big")
        i = bisect.bisect_left(self._keys, k)
        return self._owners[i % len(self._owners)]
