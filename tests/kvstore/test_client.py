"""The worker's KVClient against two real kvstore replicas (consistent-hash ring) on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from services.common.errors import InvalidArgument
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ring import HashRing
from services.worker.engine import KVLayout, KVPages
from services.worker.kv_client import KVClient
from tests.kvstore.kvhelpers import KV_LAYOUT, LAYOUT, Replica, make_pages

Make = Callable[..., Replica]

TOKENS = list(range(1000, 1000 + 4 * 24 + 3))  # 24 full pages and a partial tail


def test_ring_spreads_pages_and_is_stable() -> None:
    ring = HashRing(["a:1", "b:1"], vnodes=64)
    hashes = chain_hashes(list(range(4 * 400)), 4, "m@v1")
    owners = [ring.node_for(h) for h in hashes]
    share = owners.count("a:1") / len(owners)
    assert 0.3 < share < 0.7
    # Adding a replica moves only the pages the new one takes over.
    ring3 = HashRing(["a:1", "b:1", "c:1"], vnodes=64)
    moved = [(o, ring3.node_for(h)) for o, h in zip(owners, hashes, strict=True) if ring3.node_for(h) != o]
    assert all(new == "c:1" for _, new in moved)
    assert 0.15 < len(moved) / len(hashes) < 0.5
    with pytest.raises(ValueError, match="nodes"):
        HashRing([])


def test_put_then_fetch_over_two_replicas(replicas: Make) -> None:
    a, b = replicas("a"), replicas("b")
    pages = make_pages(TOKENS)
    with KVClient([a.address, b.address]) as kv:
        assert kv.offload_async(pages, "r1").result(timeout=30).stored == 24
        assert a.store is not None and b.store is not None
        na, nb = a.store.stats().pages, b.store.stats().pages
        assert na + nb == 24 and na > 0 and nb > 0  # sharded over both
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        assert got is not None
        assert got.pages == pages.pages and got.page_hashes == pages.page_hashes
        assert got.token_ids == tuple(TOKENS[: 24 * 4])
        # A longer context fetches the stored prefix; min_tokens skips what is cached locally.
        longer = kv.fetch_prefix([*TOKENS[:96], 7, 7, 7, 7], "m@v1", KV_LAYOUT)
        assert longer is not None and len(longer.pages) == 24
        assert kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT, min_tokens=96) is None
        # Only the pages past what is cached locally are transferred (a continuation from page 10).
        sent_before = kv.stats().fetched_pages
        tail = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT, min_tokens=42)
        assert tail is not None and tail.first_page == 10 and tail.end_page == 24
        assert tail.pages == pages.pages[10:] and tail.page_hashes == pages.page_hashes[10:]
        assert tail.token_ids == tuple(TOKENS[: 24 * 4])
        assert kv.stats().fetched_pages - sent_before == 14
        with pytest.raises(InvalidArgument, match="min_tokens"):
            kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT, min_tokens=-1)
        # Version v pages are never served for v+1.
        assert kv.fetch_prefix(TOKENS, "m@v2", KV_LAYOUT) is None
        per_replica = kv.store_stats()
        assert sum(r["pages"] for r in per_replica.values() if r is not None) == 24
        assert kv.release("m@v1", "r1") == 24
        assert kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT) is None
        s = kv.stats()
        assert s.stored_pages == 24 and s.fetched_pages == 62 and s.fetch_calls == 6 and s.fetch_hits == 3
        assert s.missing_pages == 0 and s.replica_errors == 0


def test_replica_down_degrades_to_recompute(replicas: Make) -> None:
    a, b = replicas("a"), replicas("b")
    pages = make_pages(TOKENS)
    with KVClient([a.address, b.address], rpc_timeout_s=5, exists_timeout_s=2) as kv:
        kv.put_pages(pages, "r1")
        ring = kv.ring
        first_b = next(i for i, h in enumerate(pages.page_hashes) if ring.node_for(h) == b.address)
        b.stop()
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        if first_b == 0:
            assert got is None
        else:
            assert got is not None and len(got.pages) == first_b
            assert got.pages == pages.pages[:first_b]
        # Offload to a down replica loses only that share, counted; no exception. The result names
        # the first page not stored (the down replica's first), so a worker resends from there.
        res = kv.put_pages_result(make_pages(TOKENS, "m@v1"), "r2")
        assert res.first_unstored == first_b and not res.dropped
        s = kv.stats()
        assert s.replica_errors >= 2 and s.put_failures > 0
        assert kv.store_stats()[b.address] is None
        assert kv.release("m@v1", "r1") > 0  # a's share
        b.start()
        got = _fetch_when_back(kv)
        assert got is not None and len(got.pages) == 24


def _fetch_when_back(kv: KVClient) -> KVPages | None:
    """A restarted replica is used again once the client reconnects (sub-second backoff)."""
    deadline = time.time() + 10
    while True:
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        if (got is not None and len(got.pages) == 24) or time.time() > deadline:
            return got
        time.sleep(0.2)


def _corrupt_first_page_on(replica: Replica, pages: KVPages) -> int:
    """Stops the replica, flips a byte of one of its pages directly in RocksDB, restarts it."""
    assert replica.store is not None
    replica.stop()  # graceful: flushes DRAM to RocksDB and closes it
    from services.kvstore.ssd import SsdTier

    ssd = SsdTier(replica.cfg.data_dir, min_blob_bytes=256)
    idx = next(i for i, h in enumerate(pages.page_hashes) if ssd.get("m@v1", h) is not None)
    cf = ssd.raw_column_family("m@v1")
    assert cf is not None
    raw = bytearray(cf[b"d" + pages.page_hashes[idx]] or b"")
    raw[100] ^= 0x01
    cf[b"d" + pages.page_hashes[idx]] = bytes(raw)
    del cf
    ssd.close()
    replica.start()
    return idx


@pytest.mark.parametrize("server_verifies", [True, False])
def test_corrupt_page_stops_the_prefix_and_is_counted(replicas: Make, server_verifies: bool) -> None:
    r = replicas("a", verify_checksums=server_verifies)
    pages = make_pages(TOKENS)
    with KVClient([r.address]) as kv:
        kv.put_pages(pages, "r1")
        idx = _corrupt_first_page_on(r, pages)
        idx = min(idx, 23)
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        if idx == 0:
            assert got is None
        else:
            assert got is not None and got.pages == pages.pages[:idx]  # never wrong KV
        s = kv.stats()
        if server_verifies:
            assert s.missing_pages == 1 and s.checksum_failures == 0
            assert r.store is not None and r.store.stats().checksum_failures == 1
        else:
            assert s.checksum_failures == 1 and s.missing_pages == 0


def test_restart_keeps_the_ssd_tier(replicas: Make) -> None:
    r = replicas("a", dram_bytes=0)
    pages = make_pages(TOKENS)
    with KVClient([r.address]) as kv:
        kv.put_pages(pages, "r1")
        r.stop()
        assert kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT) is None  # down: recompute, no error
        r.start()
        got = _fetch_when_back(kv)
        assert got is not None and got.pages == pages.pages


def test_layout_disagreement_is_rejected(replicas: Make) -> None:
    r = replicas("a")
    with KVClient([r.address]) as kv:
        kv.put_pages(make_pages(TOKENS), "r1")
        other = KVLayout(dtype="float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=4)
        bad = make_pages(TOKENS)
        bad = KVPages(bad.model_version, other, bad.token_ids, bad.page_hashes, bad.pages)
        with pytest.raises(InvalidArgument, match="num_kv_heads"):
            kv.put_pages(bad, "r2")
        assert kv.fetch_prefix(TOKENS, "m@v1", other) is None  # rejected Get: counted, recompute
        assert kv.stats().replica_errors == 1


def test_reoffload_sends_only_new_pages_and_claims_the_rest(replicas: Make) -> None:
    a, b = replicas("a"), replicas("b")
    full = make_pages(TOKENS)
    first = KVPages(full.model_version, full.layout, full.token_ids[:40], full.page_hashes[:10], full.pages[:10])
    with KVClient([a.address, b.address]) as kv:
        assert kv.put_pages(first, "r1") == 10
        sent = kv.stats().put_bytes
        # The next chunk's offload covers the whole longer context; another request shares it.
        assert kv.put_pages(full, "r2") == 14
        s = kv.stats()
        assert s.put_bytes - sent == 14 * len(full.pages[0])
        assert s.claimed_pages == 10
        # r2 owns the claimed pages too: releasing r1 keeps them, releasing r2 frees everything.
        assert kv.release("m@v1", "r1") == 10
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        assert got is not None and got.pages == full.pages
        assert kv.release("m@v1", "r2") == 24
        assert kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT) is None


def test_unverified_put_of_bad_bytes_is_caught_by_the_reader(replicas: Make) -> None:
    """With put verification off the store keeps the writer's checksum; bytes that do not match it
    (corrupted in transit) are refused by the fetching client, never imported."""
    r = replicas("a", verify_put_checksums=False)
    pages = make_pages(TOKENS)
    with KVClient([r.address]) as kv:
        kv.put_pages(pages, "r1")
        # A writer whose bytes changed after the checksum was taken: page 5 goes in with a bad checksum.
        assert r.store is not None
        bad = bytes(b ^ 0xFF for b in pages.pages[5])
        assert r.store.release("m@v1", "r1") == 24
        for i, (h, d) in enumerate(zip(pages.page_hashes, pages.pages, strict=True)):
            data = bad if i == 5 else d
            r.store.put("m@v1", LAYOUT, h, data, page_checksum(d), "r2")  # r1 is released: refused
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        assert got is not None and got.pages == pages.pages[:5]
        assert kv.stats().checksum_failures == 1


def test_offload_queue_is_bounded(replicas: Make) -> None:
    r = replicas("a")
    with KVClient([r.address], max_pending_offloads=1) as kv:
        gate = threading.Event()
        blocker = kv._offload.submit(gate.wait)  # the offload thread is busy
        first = kv.offload_async(make_pages(TOKENS), "r1")  # queued behind it
        dropped = kv.offload_async(make_pages(TOKENS), "r2")  # over the bound: dropped at once
        assert dropped.done() and dropped.result().dropped and dropped.result().first_unstored == 0
        assert kv.stats().offloads_dropped == 1
        gate.set()
        blocker.result(timeout=10)
        assert first.result(timeout=30).stored == 24 and first.result().first_unstored is None
        again = kv.offload_async(make_pages(TOKENS), "r3").result(timeout=30)  # dedup: claimed only
        assert again.stored == 0 and again.claimed == 24 and again.first_unstored is None
        assert kv.stats().claimed_pages == 24
    with pytest.raises(InvalidArgument, match="max_pending_offloads"):
        KVClient([r.address], max_pending_offloads=0)
