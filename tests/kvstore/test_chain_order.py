"""A Get served in several parts (KVClient(streams_per_replica=2) splits a replica's share of a chain
into contiguous runs fetched concurrently) leaves the chain ordered head most recent in both LRUs,
whichever part ends last. Before, each part touched only its own pages: when the later part ended
last, the chain's first pages were the least recently used, so capacity evicted them first and left
the rest of the chain stored but unusable (a fetch stops at the first missing page)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES

Open = Callable[..., KvStore]
NS = "m@v1"


def _chain(tag: int, n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = [tag * 1000 + i for i in range(n * LAYOUT.page_size)]
    return chain_hashes(tokens, LAYOUT.page_size, NS), [os.urandom(PAGE_BYTES) for _ in range(n)]


def _put_chain(store: KvStore, hashes: list[bytes], pages: list[bytes]) -> None:
    for h, p in zip(hashes, pages, strict=True):
        store.put(NS, LAYOUT, h, p, page_checksum(p))


def _fetch_in_parts(store: KvStore, hashes: list[bytes], last: int) -> None:
    """What KVClient.fetch_prefix does against one replica: Exists over the chain, then one Get per
    part; part `last` ends last."""
    assert store.exists(NS, hashes) == len(hashes)
    parts = [hashes[:4], hashes[4:]]
    for part in (parts[1 - last], parts[last]):
        assert all(data is not None for _h, data, _c in store.get(NS, part))


@pytest.mark.parametrize("last", [0, 1])
def test_a_chain_fetched_in_parts_loses_its_tail_first_on_ssd(open_store: Open, last: int) -> None:
    store = open_store(dram_bytes=0, ssd_bytes=12 * PAGE_BYTES)
    ha, pa = _chain(1, 8)
    hb, pb = _chain(2, 8)
    _put_chain(store, ha, pa)
    _fetch_in_parts(store, ha, last)
    _put_chain(store, hb, pb)  # 4 pages of A must go
    assert store.stats().evictions == 4
    # The 4 left are A's first ones: all usable. Before, with the second part ending last: 0.
    assert store.exists(NS, ha) == 4


@pytest.mark.parametrize("last", [0, 1])
def test_a_chain_fetched_in_parts_keeps_its_head_in_dram(open_store: Open, last: int) -> None:
    store = open_store(dram_bytes=12 * PAGE_BYTES, ssd_bytes=64 * PAGE_BYTES)
    ha, pa = _chain(1, 8)
    hb, pb = _chain(2, 8)
    _put_chain(store, ha, pa)
    _fetch_in_parts(store, ha, last)
    _put_chain(store, hb, pb)  # 4 pages of A are demoted to SSD
    assert store.stats().demotions == 4
    in_dram = [(NS, h) in store._dram for h in ha]
    assert in_dram == [True] * 4 + [False] * 4  # the hot head stays in DRAM, the tail goes to SSD


def test_a_part_without_an_exists_touches_only_its_pages(open_store: Open) -> None:
    """No chain known (no Exists before the Get): a part is ordered on its own, as before."""
    store = open_store(dram_bytes=0, ssd_bytes=12 * PAGE_BYTES)
    ha, pa = _chain(1, 8)
    hb, pb = _chain(2, 4)
    _put_chain(store, ha, pa)
    _put_chain(store, hb, pb)
    assert all(data is not None for _h, data, _c in store.get(NS, ha[4:]))
    _put_chain(store, *_chain(3, 4))  # 4 must go: A's first 4, the least recently used
    assert store.exists(NS, ha) == 0
    assert store.exists(NS, ha[4:]) == 4
