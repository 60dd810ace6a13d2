"""The DRAM tier: a byte-bounded LRU of page buffers.

Keys are opaque (the store uses (namespace, page hash)). `put` returns what it pushed out so the
store can demote those pages to the SSD tier instead of losing them (DESIGN.md section 2: DRAM over
SSD, Mooncake-style).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

# A page buffer: bytes, or a read-only view into a received message (services.kvstore.wire decodes
# Put pages without copying them).
Buffer = bytes | memoryview


class DramLru:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[Hashable, Buffer] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def fits(self, size: int) -> bool:
        return size <= self.capacity_bytes

    def get(self, key: Hashable) -> Buffer | None:
        """The value, marked most recently used; None when absent."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Buffer) -> list[tuple[Hashable, Buffer]]:
        """Inserts (or refreshes) key; returns the least recently used entries evicted to make room.

        A value larger than the whole capacity is not cached: it comes straight back as evicted.
        """
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old)
        if len(value) > self.capacity_bytes:
            return [(key, value)]
        evicted: list[tuple[Hashable, Buffer]] = []
        while self.bytes + len(value) > self.capacity_bytes and self._items:
            k, v = self._items.popitem(last=False)
            self.bytes -= len(v)
            evicted.append((k, v))
        self._items[key] = value
        self.bytes += len(value)
        return evicted

    def victims(self, size: int) -> Iterator[Hashable]:
        """The keys put(key, value of `size` bytes) would evict, least recently used first (for a key
        not held; lazily, so a caller can stop at the first it cannot spare)."""
        need = self.bytes + size - self.capacity_bytes
        for k, v in self._items.items():
            if need <= 0:
                return
            need -= len(v)
            yield k

    def pop(self, key: Hashable) -> Buffer | None:
        value = self._items.pop(key, None)
        if value is not None:
            self.bytes -= len(value)
        return value

    def items(self) -> Iterator[tuple[Hashable, Buffer]]:
        """Entries from least to most recently used (a snapshot, safe to mutate the LRU meanwhile)."""
        return iter(list(self._items.items()))
