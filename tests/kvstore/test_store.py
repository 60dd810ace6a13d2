"""The pure store core over a real RocksDB: tiers, capacity, ownership, versions, checksums."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.kvlayout import KVLayout
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES

Open = Callable[..., KvStore]


def _put_chain(store: KvStore, n: int, version: str = "m@v1", owner: str = "r1") -> list[tuple[bytes, bytes]]:
    hashes = chain_hashes(list(range(n * LAYOUT.page_size)), LAYOUT.page_size, version)
    pages = [(h, os.urandom(PAGE_BYTES)) for h in hashes]
    for h, data in pages:
        store.put(version, LAYOUT, h, data, page_checksum(data), owner)
    return pages


def test_put_get_exists_roundtrip(open_store: Open) -> None:
    store = open_store()
    pages = _put_chain(store, 5)
    hashes = [h for h, _ in pages]
    got = list(store.get("m@v1", hashes))
    assert [d for _, d, _ in got] == [d for _, d in pages]
    assert all(c == page_checksum(d) for _, d, c in got if d is not None)
    assert store.exists("m@v1", hashes) == 5
    # A hole in the chain bounds the prefix.
    assert store.exists("m@v1", [*hashes[:2], os.urandom(16), *hashes[3:]]) == 2
    assert store.exists("other@v1", hashes) == 0
    s = store.stats()
    assert s.pages == 5 and s.hits == 5 and s.namespaces == 1 and s.dram_bytes == 5 * PAGE_BYTES


def test_bad_input_names_the_field(open_store: Open) -> None:
    store = open_store()
    _put_chain(store, 1)
    h = os.urandom(16)
    data = os.urandom(PAGE_BYTES)
    other = KVLayout("float32", 4, 2, 2, 8)
    with pytest.raises(InvalidArgument, match=r"layout\.num_kv_heads"):
        store.put("m@v1", other, h, os.urandom(other.page_bytes), 0, "r")
    with pytest.raises(InvalidArgument, match=r"layout\.dtype"):
        store.put("m@v1", KVLayout("bfloat16", 4, 2, 1, 8), h, data, page_checksum(data), "r")
    with pytest.raises(InvalidArgument, match=r"^data:"):
        store.put("m@v1", LAYOUT, h, data[:-1], page_checksum(data[:-1]), "r")
    with pytest.raises(InvalidArgument, match=r"^checksum:"):
        store.put("m@v1", LAYOUT, h, data, page_checksum(data) ^ 1, "r")
    with pytest.raises(InvalidArgument, match=r"^page_hash:"):
        store.put("m@v1", LAYOUT, b"short", data, page_checksum(data), "r")
    with pytest.raises(InvalidArgument, match=r"^namespace:"):
        store.put("", LAYOUT, h, data, page_checksum(data), "r")
    with pytest.raises(InvalidArgument, match=r"layout\.dtype"):
        store.put("new@v1", KVLayout("float13", 4, 2, 1, 8), h, data, page_checksum(data), "r")
    with pytest.raises(InvalidArgument, match=r"layout\.page_size"):
        list(store.get("m@v1", [h], KVLayout("float32", 8, 2, 1, 8)))
    # Nothing bad was stored (not even the namespace of a rejected first Put); the good page is served.
    with pytest.raises(InvalidArgument, match=r"^data:"):
        store.put("fresh@v1", LAYOUT, h, data[:-1], page_checksum(data[:-1]), "r")
    assert store.stats().pages == 1 and store.stats().namespaces == 1
    assert store.namespace_layout("fresh@v1") is None


def test_dram_evicts_to_ssd_and_ssd_evicts_lru(open_store: Open) -> None:
    store = open_store(dram_bytes=3 * PAGE_BYTES, ssd_bytes=6 * PAGE_BYTES)
    pages = _put_chain(store, 8)
    s = store.stats()
    assert s.dram_pages == 3 and s.dram_bytes == 3 * PAGE_BYTES
    assert s.demotions == 5 and s.ssd_bytes == 5 * PAGE_BYTES and s.evictions == 0
    # An SSD hit is verified, served and promoted to DRAM.
    ((_h, data, _c),) = store.get("m@v1", [pages[0][0]])
    assert data == pages[0][1]
    assert store.stats().promotions == 1
    # DRAM [5 6 7] -> [6 7 0]; SSD LRU order [1 2 3 4 0 5] = full. Two new pages demote 6 and 7
    # and push out the SSD tier's least recently used pages 1 and 2 for good.
    for h, d in zip(
        chain_hashes(list(range(100, 108)), 4, "m@v1"), (os.urandom(PAGE_BYTES) for _ in range(2)), strict=False
    ):
        store.put("m@v1", LAYOUT, h, d, page_checksum(d), "r2")
    s = store.stats()
    assert s.ssd_bytes == 6 * PAGE_BYTES and s.evictions == 2 and s.pages == 8
    hashes = [h for h, _ in pages]
    assert [store.exists("m@v1", [h]) for h in hashes] == [1, 0, 0, 1, 1, 1, 1, 1]


def test_release_keeps_pages_other_owners_share(open_store: Open) -> None:
    store = open_store()
    shared = _put_chain(store, 2, owner="a")
    for h, data in shared:  # a sibling offloads the same prompt pages
        assert store.put("m@v1", LAYOUT, h, data, page_checksum(data), "b") is False
    assert store.release("m@v1", "a") == 2
    assert store.exists("m@v1", [h for h, _ in shared]) == 2
    assert store.release("m@v1", "b") == 2
    assert store.exists("m@v1", [h for h, _ in shared]) == 0
    assert store.release("m@v1", "b") == 0
    with pytest.raises(InvalidArgument, match="request_id"):
        store.release("m@v1", "")


def test_restart_keeps_ssd_tier_and_ownership(open_store: Open) -> None:
    store = open_store("db", dram_bytes=2 * PAGE_BYTES)
    pages = _put_chain(store, 5, owner="r1")
    store.close()  # graceful: DRAM-only pages are flushed too
    again = open_store("db", dram_bytes=2 * PAGE_BYTES)
    hashes = [h for h, _ in pages]
    assert again.exists("m@v1", hashes) == 5
    assert [d for _, d, _ in again.get("m@v1", hashes)] == [d for _, d in pages]
    assert again.stats().ssd_bytes == 5 * PAGE_BYTES
    assert again.release("m@v1", "r1") == 5
    assert again.stats().pages == 0


def test_restart_drops_pages_checksummed_by_another_algorithm(open_store: Open) -> None:
    """A page whose metadata was written by an earlier release (a CRC-32 in the old 4-field
    record) cannot be verified with XXH3: recovery drops it instead of failing every read of it;
    so are pages whose metadata does not parse, rather than stopping the store's start."""
    store = open_store("db", dram_bytes=0)
    pages = _put_chain(store, 3, owner="r1")
    old_hash, old_data = pages[1]
    store.raw_ssd().put_meta("m@v1", old_hash, json.dumps([zlib.crc32(old_data), PAGE_BYTES, 2, ["r1"]]).encode())
    for broken in (b"null", b"{}", b"[1, 2", json.dumps(["xxh3_64", "x", 1, 2, []]).encode()):
        h = os.urandom(16)
        store.raw_ssd().put("m@v1", h, os.urandom(PAGE_BYTES), broken)  # unreadable metadata: dropped too
    store.close()
    again = open_store("db", dram_bytes=0)
    hashes = [h for h, _ in pages]
    assert again.exists("m@v1", hashes) == 1  # page 0 only: page 1 is gone, so the chain stops there
    assert again.exists("m@v1", hashes[2:]) == 1
    assert again.get_page("m@v1", old_hash) is None
    assert again.raw_ssd().get("m@v1", old_hash) is None  # deleted from RocksDB, not just hidden
    assert again.stats().pages == 2 and again.stats().checksum_failures == 0


def test_new_version_drops_old_namespace(open_store: Open) -> None:
    store = open_store()
    v1 = _put_chain(store, 3, version="m@v1")
    other = _put_chain(store, 1, version="other@v1")
    v2 = _put_chain(store, 3, version="m@v2")
    # The same tokens hash differently under v2, and v1's namespace is gone.
    assert {h for h, _ in v1}.isdisjoint({h for h, _ in v2})
    assert store.exists("m@v2", [h for h, _ in v1]) == 0
    assert next(iter(store.get("m@v2", [h for h, _ in v1])))[1] is None
    assert store.exists("m@v1", [h for h, _ in v1]) == 0
    assert store.exists("other@v1", [h for h, _ in other]) == 1
    s = store.stats()
    assert s.namespaces == 2 and s.pages == 4 and s.dropped_namespaces == 1
    # A straggler on the old weights cannot recreate the dropped namespace.
    h, data = v1[0]
    with pytest.raises(FailedPrecondition, match="namespace"):
        store.put("m@v1", LAYOUT, h, data, page_checksum(data), "late")


def test_keep_versions_two(open_store: Open) -> None:
    store = open_store(keep_versions=2)
    _put_chain(store, 1, version="m@v1")
    _put_chain(store, 1, version="m@v2")
    assert store.stats().namespaces == 2
    _put_chain(store, 1, version="m@v3")
    assert store.stats().namespaces == 2
    assert store.drop_namespace("m@v2") == 1
    assert store.stats().namespaces == 1


def test_corrupt_page_on_disk_is_never_served(open_store: Open) -> None:
    store = open_store("db", dram_bytes=0)  # SSD only: every read comes from RocksDB
    pages = _put_chain(store, 3)
    cf = store.raw_ssd().raw_column_family("m@v1")
    assert cf is not None
    h = pages[1][0]
    raw = bytearray(cf[b"d" + h] or b"")
    raw[17] ^= 0x40
    cf[b"d" + h] = bytes(raw)
    del cf
    got = list(store.get("m@v1", [h for h, _ in pages]))
    assert got[0][1] == pages[0][1]
    assert got[1][1] is None  # failed its checksum: dropped, reported missing
    assert got[2][1] == pages[2][1]
    s = store.stats()
    assert s.checksum_failures == 1
    assert store.exists("m@v1", [h for h, _ in pages]) == 1


def test_prometheus_collector_reads_stats(open_store: Open) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from services.kvstore.metrics import register

    store = open_store()
    _put_chain(store, 3)
    list(store.get("m@v1", [os.urandom(16)]))
    registry = CollectorRegistry()
    register(store, registry)
    text = generate_latest(registry).decode()
    assert f"seer_kvstore_dram_bytes {float(3 * PAGE_BYTES)}" in text
    assert "seer_kvstore_pages 3.0" in text
    assert "seer_kvstore_misses_total 1.0" in text


def test_claim_adds_an_owner_without_bytes(open_store: Open) -> None:
    store = open_store()
    pages = _put_chain(store, 2, owner="a")
    assert store.claim("m@v1", pages[0][0], "b") is True
    assert store.claim("m@v1", os.urandom(16), "b") is False
    assert store.claim("nope@v1", pages[0][0], "b") is False
    assert store.release("m@v1", "a") == 2
    assert store.exists("m@v1", [h for h, _ in pages]) == 1  # page 0 is still b's
    with pytest.raises(InvalidArgument, match="page_hash"):
        store.claim("m@v1", b"x", "b")


@pytest.mark.parametrize("store_verifies", [True, False])
def test_bit_flip_in_a_blob_file_is_never_served(open_store: Open, tmp_path: object, store_verifies: bool) -> None:
    """A byte flipped on disk inside a page's blob record: with the store's own checksum check on,
    RocksDB's (slower) check is off and the store catches it; with it off, RocksDB's catches it."""
    store = open_store("db", dram_bytes=0, verify_checksums=store_verifies)
    pages = _put_chain(store, 3)
    store.flush_to_ssd()  # memtable -> blob files
    _h, victim = pages[1]
    hits = []
    for root, _dirs, files in os.walk(store.raw_ssd().path):
        for name in files:
            if name.endswith(".blob"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    content = f.read()
                if victim in content:
                    hits.append((path, content.index(victim)))
    assert len(hits) == 1, hits
    path, offset = hits[0]
    with open(path, "r+b") as f:
        f.seek(offset + 17)
        byte = f.read(1)
        f.seek(offset + 17)
        f.write(bytes([byte[0] ^ 0x40]))
    got = list(store.get("m@v1", [h for h, _ in pages]))
    assert got[0][1] == pages[0][1] and got[2][1] == pages[2][1]
    assert got[1][1] is None  # never the flipped bytes
    assert store.stats().checksum_failures == 1
    assert store.exists("m@v1", [h for h, _ in pages]) == 1
