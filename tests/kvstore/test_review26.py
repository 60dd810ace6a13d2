"""Regressions of the session-26 kvstore review, on real RocksDB (write stops forced with RocksDB's own
L0 stop trigger) and real gRPC: a RocksDB write stop reaches the client as UNAVAILABLE naming its
cause (a Put creating a namespace was INTERNAL) and, once a write stalled out, later writes fail fast
instead of holding the store's lock for the whole timeout each; the stop, flush failures and pending
SSD records are in GetKvStats; a page delete or owner-record rewrite RocksDB refused is retried until
the disk agrees with the index (a restart brought released pages back under their released owner);
Exists keeps one chain link per page (it kept a chain per Exists: O(n^2) hashes, in no budget)."""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Callable

import grpc
import pytest
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore
from services.worker.kv_client import layout_to_pb
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica

Open = Callable[..., KvStore]
Make = Callable[..., Replica]
NS = "m@v1"


def _h(version: str, i: int) -> bytes:
    return chain_hashes([i] * 4, 4, version)[0]


def _put(store: KvStore, version: str, i: int, owner: str = "r") -> None:
    data = os.urandom(PAGE_BYTES)
    store.put(version, LAYOUT, _h(version, i), data, page_checksum(data), owner)


def _stop_writes(store: KvStore, namespace: str) -> None:
    """RocksDB stops every write of the DB: three L0 files in namespace's column family, with the stop
    trigger at 3 and compaction held off (what a compaction that cannot keep up does at 36)."""
    tier = store.raw_ssd()
    cf = tier.raw_column_family(namespace)
    assert cf is not None
    cf.set_options({"level0_file_num_compaction_trigger": "1000", "level0_slowdown_writes_trigger": "3",
                    "level0_stop_writes_trigger": "3"})
    for i in range(3):
        cf.put(b"x%d" % i, b"y")  # outside the page and record prefixes
        cf.flush(True)
    assert tier._db.property_int_value("rocksdb.is-write-stopped") == 1


def _resume_writes(store: KvStore, namespace: str) -> None:
    tier = store.raw_ssd()
    cf = tier.raw_column_family(namespace)
    assert cf is not None
    cf.set_options({"level0_file_num_compaction_trigger": "4", "level0_slowdown_writes_trigger": "36",
                    "level0_stop_writes_trigger": "36"})
    assert tier._db.property_int_value("rocksdb.is-write-stopped") == 0


def _put_rpc(stub: kvstore_pb2_grpc.KvStoreServiceStub, version: str, i: int) -> None:
    data = os.urandom(PAGE_BYTES)
    req = kvstore_pb2.PutRequest(namespace=version, layout=layout_to_pb(LAYOUT), page_hash=_h(version, i), data=data,
                                 request_id="r", checksum=page_checksum(data))
    stub.Put(iter([req]), timeout=30)


# ---------------------------------------------------------------- items 1 and 3: write stops
def test_write_stop_is_unavailable_naming_its_cause_fails_fast_and_is_reported(replicas: Make) -> None:
    r = replicas("a", dram_bytes=2 * PAGE_BYTES)
    store = r.store
    assert store is not None
    with grpc.insecure_channel(r.address) as channel:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel)
        for i in range(4):
            _put_rpc(stub, NS, i)  # 2 demoted: NS has a column family
        store.raw_ssd().write_stall_timeout_s = 1.0
        _stop_writes(store, NS)
        t0 = time.monotonic()
        _put_rpc(stub, NS, 4)  # lands in DRAM; the page it pushes out cannot be demoted: evicted
        assert time.monotonic() - t0 >= 1.0
        # The tier is stalled now: each later demotion fails after a short try, so the store's lock
        # (every Get and Exists, DRAM hits included) is not held for the timeout per write. Before:
        # 1 s each.
        t0 = time.monotonic()
        for i in range(5, 8):
            _put_rpc(stub, NS, i)
        assert time.monotonic() - t0 < 1.5
        # A Put that must create a namespace (a registry record) was INTERNAL with RocksDB's bare
        # WriteStalled; now UNAVAILABLE naming the field and the cause, like a page write.
        with pytest.raises(grpc.RpcError) as err:
            _put_rpc(stub, "n@v1", 0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "requests[0].namespace" in (err.value.details() or "")
        assert "write stop" in (err.value.details() or "")
        assert store.flush_to_ssd() == 0  # both DRAM pages: not written
        st = stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=10)
        assert st.flush_failures == 2
        assert st.write_stalls >= 5 and st.write_stall_failures >= 5
        assert st.write_stall_seconds >= 1.0
        assert st.evictions == 4 and st.dram_pages == 2
        # Retryable: once RocksDB takes writes again the same Put goes through.
        _resume_writes(store, NS)
        _put_rpc(stub, "n@v1", 0)
        assert not store.raw_ssd().stalled  # a write went through: full waits again
        st = stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=10)
        assert st.namespaces == 2


# ---------------------------------------------------------------- item 2: refused deletes
def test_refused_deletes_are_retried_and_a_restart_brings_nothing_back(
        open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.kvstore import ssd

    monkeypatch.setattr(ssd, "STALLED_PROBE_S", 0.05)  # a stalled tier is probed this often
    store = open_store(dram_bytes=0)  # SSD only: every page has a record on disk
    for i in range(3):
        _put(store, NS, i, "r")
    _put(store, NS, 3, "r")
    assert store.claim(NS, _h(NS, 3), "q")  # page 3 is kept by q
    store.raw_ssd().write_stall_timeout_s = 0.2
    _stop_writes(store, NS)
    assert store.release(NS, "r") == 4
    st = store.stats()
    # The index is right at once: q's page only. The disk lags: 3 deletes and 1 record rewrite.
    assert st.pages == 1 and st.ssd_pages == 1 and st.pending_ssd_records == 4
    assert store.release(NS, "r") == 0 and store.stats().pending_ssd_records == 4  # still refused
    _resume_writes(store, NS)
    time.sleep(0.06)  # the next probe of the stalled tier is due
    assert store.release(NS, "r") == 0  # a retried Release (any Release) makes the disk agree
    assert store.stats().pending_ssd_records == 0
    records = store.raw_ssd().iter_meta(NS)
    assert [h for h, _m in records] == [_h(NS, 3)]
    assert '["q"]' in records[0][1].decode()
    store.close()
    # Before: the 3 released pages came back owned by r, and page 3 owned by r again.
    again = open_store()
    assert again.stats().pages == 1
    assert again.release(NS, "r") == 0
    assert again.release(NS, "q") == 1 and again.stats().pages == 0


def test_close_writes_pending_records(open_store: Open) -> None:
    store = open_store(dram_bytes=0)
    _put(store, NS, 0, "r")
    store.raw_ssd().write_stall_timeout_s = 0.2
    _stop_writes(store, NS)
    store.release(NS, "r")
    _resume_writes(store, NS)
    store.close()  # no Release came: close retries them
    assert open_store().stats().pages == 0


# ---------------------------------------------------------------- item 4: chain records
def test_exists_keeps_one_chain_link_per_page(open_store: Open) -> None:
    n = 300
    store = open_store(dram_bytes=(n + 1) * PAGE_BYTES)
    hashes = chain_hashes(list(range(4 * n)), 4, NS)
    for h in hashes:
        data = os.urandom(PAGE_BYTES)
        store.put(NS, LAYOUT, h, data, page_checksum(data), "r")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # Each Exists a shorter prefix, with its own hash objects (as decoded from a request): each
        # used to leave its chain on the one page it did not reach again.
        for k in range(n, 1, -1):
            assert store.exists(NS, [bytes(bytearray(h)) for h in hashes[:k]]) == k
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # One link per page (~60 B each). Before: ~45,000 hashes held, 2.5 MB.
    assert grown < 200_000, grown
    assert store.stats().chain_links == n - 1
    # Links naming hashes in another order (a cycle) do not hang the walk of a Get.
    a, b = hashes[0], hashes[1]
    assert store.exists(NS, [b, a]) == 2
    assert [d is not None for _h, d, _c in store.get(NS, [a])] == [True]
    assert store.release(NS, "r") == n and store.stats().chain_links == 0


def test_a_stalled_tier_whose_only_writes_are_deferrable_learns_it_recovered(
        open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of session 26: while the tier counted as stalled, owner rewrites and deletes went
    straight to pending without a try; when those were the only writes (claims, Gets, no DRAM
    tier), nothing ever found out RocksDB took writes again: the flag stayed, the records on disk
    kept lacking the new owner. Now a deferrable write is tried once per STALLED_PROBE_S."""
    from services.kvstore import ssd

    monkeypatch.setattr(ssd, "STALLED_PROBE_S", 0.05)
    ns = "m@v1"
    store = open_store(dram_bytes=0)
    for i in range(4):
        _put(store, ns, i, "r")
    store.raw_ssd().write_stall_timeout_s = 0.2
    _stop_writes(store, ns)
    data = os.urandom(PAGE_BYTES)
    with pytest.raises(Exception):  # noqa: B017 - the stalled write's error, whichever type
        store.put(ns, LAYOUT, _h(ns, 9), data, page_checksum(data), "r")
    assert store.raw_ssd().stalled
    _resume_writes(store, ns)
    for i in range(4):
        time.sleep(0.06)
        store.claim(ns, _h(ns, i), "q")
    assert not store.raw_ssd().stalled
    owners = {h: m.decode() for h, m in store.raw_ssd().iter_meta(ns)}
    assert all('"q"' in m for m in owners.values()), owners
    assert store.stats().pending_ssd_records == 0
