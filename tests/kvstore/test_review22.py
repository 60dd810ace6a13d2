"""Regressions of the session-22 kvstore review (helper 67): eviction takes a prefix chain's tail
before its head (after a Get and after a Put stream, both of which go head first), and a page delete
the disk refuses leaves the index whole (the Put that evicted goes through, the owner's Release
works)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import DEFAULT_WRITE_BUFFER_BYTES, wal_bytes_cap
from services.kvstore.store import KvStore
from services.worker.kv_client import KVClient
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica, make_pages

Open = Callable[..., KvStore]


def _chain(tag: int, n: int, version: str = "m@v1") -> tuple[list[bytes], list[bytes]]:
    tokens = [tag * 1000 + i for i in range(n * LAYOUT.page_size)]
    return chain_hashes(tokens, LAYOUT.page_size, version), [os.urandom(PAGE_BYTES) for _ in range(n)]


def _put_chain(store: KvStore, hashes: list[bytes], pages: list[bytes], owner: str = "") -> None:
    for h, p in zip(hashes, pages, strict=True):
        store.put("m@v1", LAYOUT, h, p, page_checksum(p), owner)


def test_after_a_get_a_chain_loses_its_tail_first(open_store: Open) -> None:
    store = open_store(dram_bytes=0, ssd_bytes=12 * PAGE_BYTES)
    ha, pa = _chain(1, 8)
    hb, pb = _chain(2, 8)
    _put_chain(store, ha, pa)
    assert all(data is not None for _h, data, _c in store.get("m@v1", ha))  # read head first
    _put_chain(store, hb, pb)  # 4 pages of A must go
    assert store.stats().evictions == 4
    # Its first 4 pages are left, all of them usable (head first, they were 0 of 4).
    assert store.exists("m@v1", ha) == 4


def test_after_a_put_stream_a_chain_loses_its_tail_first(replicas: Callable[..., Replica]) -> None:
    r = replicas("a", dram_bytes=0, ssd_bytes=wal_bytes_cap(DEFAULT_WRITE_BUFFER_BYTES) + 12 * PAGE_BYTES)
    a = make_pages(list(range(1000, 1032)))  # 8 pages
    b = make_pages(list(range(2000, 2032)))
    with KVClient([r.address]) as kv:
        assert kv.put_pages(a, "ra") == 8
        assert kv.put_pages(b, "rb") == 8  # evicts 4 pages of a
        assert kv.prefix_pages(a.page_hashes, "m@v1") == 4


class _RefusingDeletes:
    """The SSD tier of a full disk: RocksDB refuses every write, deletes included."""

    def __init__(self, ssd: object) -> None:
        self._ssd = ssd
        self.refuse = True

    def delete(self, namespace: str, page_hash: bytes) -> None:
        if self.refuse:
            raise OSError("IO error: No space left on device")
        self._ssd.delete(namespace, page_hash)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._ssd, name)


def test_a_refused_page_delete_leaves_the_index_whole(open_store: Open, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(dram_bytes=0, ssd_bytes=4 * PAGE_BYTES)
    ha, pa = _chain(1, 4)
    _put_chain(store, ha, pa, owner="r1")
    disk = _RefusingDeletes(store._ssd)
    monkeypatch.setattr(store, "_ssd", disk)
    hb, pb = _chain(2, 2)
    _put_chain(store, hb, pb, owner="r2")  # evicts 2 pages of r1: their deletes fail; the Puts do not
    assert store.exists("m@v1", hb) == 2
    assert store.stats().meta_write_failures == 2
    assert store.release("m@v1", "r1") == 2  # what it still owns (was INTERNAL: a KeyError)
    disk.refuse = False
    assert store.release("m@v1", "r2") == 2
    assert store.stats().pages == 0
