"""An SSD hit during a write stall must not push DRAM-only pages out of the store (audit, session 32).

Promoting an SSD hit into a full DRAM tier evicts its least recently used pages, which are demoted
to SSD. While RocksDB refuses writes (the tier stalled) that demotion fails and the DRAM-only page is
evicted for good, so every read of an SSD page lost a page no tier held otherwise (and cost
STALLED_TRY_S under the store's lock per victim), for a copy of a page the SSD tier still serves."""

from __future__ import annotations

import os
from collections.abc import Callable

from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES
from tests.kvstore.test_review26 import _h, _resume_writes, _stop_writes

Open = Callable[..., KvStore]
NS = "m@v1"


def _put(store: KvStore, i: int) -> bytes:
    data = os.urandom(PAGE_BYTES)
    assert store.put(NS, LAYOUT, _h(NS, i), data, page_checksum(data), "r")
    return data


def test_ssd_hits_during_a_stall_keep_dram_only_pages(open_store: Open) -> None:
    store = open_store(dram_bytes=2 * PAGE_BYTES)
    pages = {i: _put(store, i) for i in range(4)}  # 0, 1 demoted to SSD; 2, 3 only in DRAM
    store.raw_ssd().write_stall_timeout_s = 0.2
    _stop_writes(store, NS)
    pages[4] = _put(store, 4)  # its demotion of page 2 stalls out: page 2 is lost (nothing to do)
    assert store.raw_ssd().stalled
    assert store.exists(NS, [_h(NS, 2)]) == 0
    before = store.stats()
    for i in (0, 1):  # SSD hits, served from SSD
        got = store.get_page(NS, _h(NS, i))
        assert got is not None and bytes(got[0]) == pages[i]
    after = store.stats()
    assert after.evictions == before.evictions, "an SSD hit evicted a DRAM-only page"
    for i in (3, 4):  # the DRAM-only pages are all still served
        got = store.get_page(NS, _h(NS, i))
        assert got is not None and bytes(got[0]) == pages[i], i
    assert after.promotions == before.promotions
    # Once RocksDB takes writes again, SSD hits are promoted as before.
    _resume_writes(store, NS)
    got = store.get_page(NS, _h(NS, 0))
    assert got is not None and bytes(got[0]) == pages[0]
    assert store.stats().promotions == after.promotions + 1
    assert store.exists(NS, [_h(NS, 3)]) + store.exists(NS, [_h(NS, 4)]) == 2  # demoted, not lost


def test_a_promotion_whose_victims_are_on_ssd_still_happens_during_a_stall(open_store: Open) -> None:
    """The guard is no broader than the loss: a victim the SSD tier holds costs no write."""
    store = open_store(dram_bytes=3 * PAGE_BYTES)
    pages = {i: _put(store, i) for i in range(4)}  # 0 on SSD; 1, 2, 3 in DRAM only
    for i in (1, 2, 3):
        store.claim(NS, _h(NS, i), "q")
    got = store.get_page(NS, _h(NS, 0))  # promoted: evicts 1 (demoted), DRAM 2, 3, 0
    assert got is not None
    store.raw_ssd().write_stall_timeout_s = 0.2
    _stop_writes(store, NS)
    pages[4] = _put(store, 4)  # evicts page 2 (its demotion stalls out: lost), DRAM 3, 0, 4
    assert store.raw_ssd().stalled
    store.get_page(NS, _h(NS, 3))
    store.get_page(NS, _h(NS, 4))  # LRU now 0 (also on SSD), 3, 4
    before = store.stats()
    got = store.get_page(NS, _h(NS, 1))  # the victim would be page 0, which SSD holds: promoted
    assert got is not None and bytes(got[0]) == pages[1]
    after = store.stats()
    assert after.promotions == before.promotions + 1 and after.evictions == before.evictions
    assert store.exists(NS, [_h(NS, 0)]) == 1
