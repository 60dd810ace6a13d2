"""Anonymous pages (Put without a request id) are evicted by capacity only, whoever claims them.

Before: a page put anonymously got an empty owner set; a later claim (or Put) by request R made R
its only owner, and R's Release then deleted it as "left without owners", out from under the
anonymous writer that expected it kept until the LRU evicts it. Now the page remembers that it was
put anonymously (in memory and in its SSD metadata record, so across a restart too) and goes back
to being anonymous when its named owners are all released. Pages only ever put by named requests
are still deleted by the release of their last owner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from services.kvstore.checksum import ALGORITHM, page_checksum
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES

Open = Callable[..., KvStore]
NS = "m@v1"
# DRAM tier (the page is in memory only until close flushes it) and SSD only (every owner change
# rewrites the page's metadata record in RocksDB).
TIERS = pytest.mark.parametrize("dram_pages", [64, 0], ids=["dram", "ssd"])


def _page(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "big"), os.urandom(PAGE_BYTES)


def _put(store: KvStore, page: tuple[bytes, bytes], request_id: str = "") -> bool:
    h, data = page
    return store.put(NS, LAYOUT, h, data, page_checksum(data), request_id)


def _served(store: KvStore, page: tuple[bytes, bytes]) -> bool:
    h, data = page
    return store.exists(NS, [h]) == 1 and store.get_page(NS, h) == (data, page_checksum(data))


@TIERS
@pytest.mark.parametrize("how", ["claim", "put"])
def test_a_claimed_anonymous_page_outlives_its_claimers_release(open_store: Open, dram_pages: int, how: str) -> None:
    store = open_store(dram_bytes=dram_pages * PAGE_BYTES)
    page = _page(1)
    assert _put(store, page)  # anonymous
    if how == "claim":
        assert store.claim(NS, page[0], "r")
    else:
        assert not _put(store, page, "r")  # already stored: r only becomes an owner
    assert store.release(NS, "r") == 1
    assert _served(store, page)  # before: deleted here, as a page left without owners
    assert store.stats().pages == 1
    assert store.release(NS, "r") == 0  # r owns nothing any more


@TIERS
def test_the_anonymous_mark_survives_a_restart(open_store: Open, dram_pages: int) -> None:
    store = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    kept, released_before = _page(1), _page(2)
    for page in (kept, released_before):
        assert _put(store, page)
        assert store.claim(NS, page[0], "r" if page is kept else "q")
    assert store.release(NS, "q") == 1  # released before the restart: its record says anonymous
    store.close()
    again = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    assert _served(again, kept) and _served(again, released_before)
    assert again.release(NS, "r") == 1  # claimed before the restart, released after it
    assert _served(again, kept)
    again.close()
    third = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    assert _served(third, kept) and _served(third, released_before)
    assert third.stats().pages == 2


@TIERS
def test_pages_put_only_by_named_requests_are_still_deleted(open_store: Open, dram_pages: int) -> None:
    store = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    shared, alone = _page(1), _page(2)
    assert _put(store, shared, "a")
    assert store.claim(NS, shared[0], "b")
    assert _put(store, alone, "a")
    store.close()  # and across a restart: the record says named-only
    again = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    assert again.release(NS, "a") == 2
    assert _served(again, shared) and again.exists(NS, [alone[0]]) == 0  # b still owns shared
    assert again.release(NS, "b") == 1
    assert again.exists(NS, [shared[0]]) == 0 and again.stats().pages == 0


@TIERS
@pytest.mark.parametrize("how", ["put", "claim"])
def test_an_anonymous_put_of_an_owned_page_makes_it_anonymous(open_store: Open, dram_pages: int, how: str) -> None:
    store = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    page = _page(1)
    assert _put(store, page, "r")
    if how == "put":
        assert not _put(store, page)  # stored already: nothing new, but now also put anonymously
    else:
        assert store.claim(NS, page[0], "")  # the client claims what Exists reported stored
    store.close()
    again = open_store("db", dram_bytes=dram_pages * PAGE_BYTES)
    assert again.release(NS, "r") == 1
    assert _served(again, page)


def test_released_anonymous_pages_are_still_evicted_by_capacity(open_store: Open) -> None:
    store = open_store(dram_bytes=PAGE_BYTES, ssd_bytes=2 * PAGE_BYTES)
    page = _page(1)
    assert _put(store, page)
    assert store.claim(NS, page[0], "r") and store.release(NS, "r") == 1
    for i in range(2, 5):  # three newer pages: DRAM holds one, SSD two; the oldest page goes
        assert _put(store, _page(i), "s")
    assert store.exists(NS, [page[0]]) == 0 and store.stats().evictions == 1


def test_records_written_before_the_anonymous_mark_are_read(open_store: Open) -> None:
    """[algorithm, checksum, size, seq, owners], as written up to session 23: an empty owner list
    was an anonymous page (kept when a claimer releases it); a named one keeps the old contract."""
    store = open_store("db", dram_bytes=0)
    anon, named = _page(1), _page(2)
    for page, owners in ((anon, []), (named, ["a"])):
        h, data = page
        old = json.dumps([ALGORITHM, page_checksum(data), PAGE_BYTES, 1, owners]).encode()
        store.raw_ssd().put(NS, h, data, old)
    assert _put(store, _page(3), "keeps-the-namespace")  # registers the namespace (its layout)
    store.close()
    again = open_store("db", dram_bytes=0)
    assert _served(again, anon) and _served(again, named)
    assert again.claim(NS, anon[0], "r") and again.release(NS, "r") == 1
    assert again.release(NS, "a") == 1
    assert _served(again, anon) and again.exists(NS, [named[0]]) == 0
