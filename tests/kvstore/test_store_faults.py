"""Regressions of the kvstore review: version order, lost claims, poisoned pages without put
verification, failed demotions, repeated hashes in Release, malformed Put input, frame retention."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from seer.v1 import kvstore_pb2

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import WriteStalled
from services.kvstore.store import KvStore
from services.kvstore.wire import decode_put, encode_put
from services.worker.kv_client import KVClient, layout_to_pb
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica, make_pages

Open = Callable[..., KvStore]


def _h(version: str, i: int = 0) -> bytes:
    return chain_hashes([i] * 4, 4, version)[0]


def _put(store: KvStore, version: str, i: int = 0, owner: str = "r") -> bytes:
    data = os.urandom(PAGE_BYTES)
    store.put(version, LAYOUT, _h(version, i), data, page_checksum(data), owner)
    return data


# ---------------------------------------------------------------- 1: versions ordered by number
def test_older_version_created_late_is_refused_and_drops_nothing(open_store: Open) -> None:
    store = open_store()
    _put(store, "m@v3")
    with pytest.raises(FailedPrecondition, match="namespace"):
        _put(store, "m@v2")  # a straggler on old weights, first Put on this replica
    assert store.namespace_layout("m@v2") is None  # not created
    _put(store, "m@v3", 1)  # the newest version still takes Puts
    assert store.exists("m@v3", [_h("m@v3"), _h("m@v3", 1)]) == 2
    _put(store, "m@v10")  # numeric, not lexical: v10 > v3 drops v3
    assert store.namespace_layout("m@v3") is None and store.stats().dropped_namespaces == 1


def test_version_order_survives_a_restart(open_store: Open) -> None:
    store = open_store("db")
    _put(store, "m@v3")
    store.close()
    store = open_store("db")
    with pytest.raises(FailedPrecondition):
        _put(store, "m@v2")
    _put(store, "m@v3", 1)
    assert store.stats().namespaces == 1


def test_keep_versions_keeps_the_highest(open_store: Open) -> None:
    store = open_store(keep_versions=2)
    for v in ("m@v1", "m@v4", "m@v5"):
        _put(store, v)
    assert {n for n in ("m@v1", "m@v4", "m@v5") if store.namespace_layout(n) is not None} == {"m@v4", "m@v5"}
    _put(store, "m@v4", 1)  # an existing older version inside the kept window still takes Puts
    with pytest.raises(FailedPrecondition, match="namespace"):
        _put(store, "m@v2")


# ---------------------------------------------------------------- 2: a claim that finds nothing
def test_lost_claim_is_reported_unstored(tmp_path: Path) -> None:
    rep = Replica(tmp_path / "kv")
    kv = KVClient([rep.address], tune_malloc=False)
    try:
        pages = make_pages(list(range(16)))
        assert kv.put_pages_result(pages, "sibling").stored == 4
        stub: Any = kv._stubs[rep.address]
        real_exists = stub.Exists

        def racy_exists(req: kvstore_pb2.ExistsRequest, timeout: float | None = None) -> Any:
            resp = real_exists(req, timeout=timeout)  # says all 4 are stored ...
            # ... then the sibling finishes and releases them before our claims land.
            stub.Release(kvstore_pb2.ReleaseRequest(namespace=req.namespace, request_id="sibling"))
            return resp

        stub.Exists = racy_exists
        res = kv.put_pages_result(pages, "me")
        stub.Exists = real_exists
        assert res.claimed == 0 and res.first_unstored == 0
    finally:
        kv.close()
        rep.stop()


def test_claim_lost_mid_chain_points_at_that_page(tmp_path: Path) -> None:
    rep = Replica(tmp_path / "kv")
    kv = KVClient([rep.address], tune_malloc=False)
    try:
        pages = make_pages(list(range(16)))
        kv.put_pages_result(pages, "sibling")
        stub: Any = kv._stubs[rep.address]
        real_exists = stub.Exists

        def racy_exists(req: kvstore_pb2.ExistsRequest, timeout: float | None = None) -> Any:
            resp = real_exists(req, timeout=timeout)
            stub.Release(
                kvstore_pb2.ReleaseRequest(
                    namespace=req.namespace, request_id="sibling", page_hashes=[pages.page_hashes[2]]
                )
            )
            return resp

        stub.Exists = racy_exists
        res = kv.put_pages_result(pages, "me")
        stub.Exists = real_exists
        assert res.claimed == 3 and res.first_unstored == 2
    finally:
        kv.close()
        rep.stop()


# ---------------------------------------------------------------- 4: poisoned page, no put verification
def test_unverified_bad_page_is_replaced_by_a_good_put(open_store: Open) -> None:
    store = open_store(verify_put_checksums=False)
    good = os.urandom(PAGE_BYTES)
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    h = _h("m@v1")
    assert store.put("m@v1", LAYOUT, h, bad, page_checksum(good), "a")  # stored unverified
    assert store.put("m@v1", LAYOUT, h, good, page_checksum(good), "b")  # replaces it
    found = store.get_page("m@v1", h)
    assert found is not None and bytes(found[0]) == good and found[1] == page_checksum(good)
    assert store.stats().checksum_failures == 1
    assert store.release("m@v1", "a") == 1 and store.exists("m@v1", [h]) == 1  # a's ownership kept
    # A good stored page is not replaced (nor counted) by another Put of it.
    assert not store.put("m@v1", LAYOUT, h, good, page_checksum(good), "c")
    assert store.stats().checksum_failures == 1


def test_unverified_bad_page_on_ssd_is_replaced(open_store: Open) -> None:
    store = open_store(verify_put_checksums=False, verify_checksums=False, dram_bytes=0)
    good = os.urandom(PAGE_BYTES)
    h = _h("m@v1")
    store.put("m@v1", LAYOUT, h, bytes(PAGE_BYTES), page_checksum(good), "a")
    assert store.put("m@v1", LAYOUT, h, good, page_checksum(good), "b")
    found = store.get_page("m@v1", h)
    assert found is not None and bytes(found[0]) == good


# ---------------------------------------------------------------- 5: failed SSD writes
def test_failed_demotion_leaves_no_ghost(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(dram_bytes=2 * PAGE_BYTES)
    _put(store, "m@v1", 0)
    _put(store, "m@v1", 1)

    def failing_put(*_a: object, **_k: object) -> None:
        raise OSError("IO error: No space left on device")

    monkeypatch.setattr(store.raw_ssd(), "put", failing_put)
    _put(store, "m@v1", 2)  # pushes page 0 out of DRAM; its demotion fails
    st = store.stats()
    assert st.pages == 2 and st.dram_pages == 2 and st.evictions == 1 and st.demotions == 0
    assert store.exists("m@v1", [_h("m@v1", 0)]) == 0
    assert not store.claim("m@v1", _h("m@v1", 0), "other")
    assert store.release("m@v1", "r") == 2


def test_failed_direct_ssd_write_indexes_nothing(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(dram_bytes=0)

    def failing_put(*_a: object, **_k: object) -> None:
        raise OSError("IO error")

    monkeypatch.setattr(store.raw_ssd(), "put", failing_put)
    with pytest.raises(Unavailable):  # typed (test_review14: the status codes)
        _put(store, "m@v1", 0)
    assert store.exists("m@v1", [_h("m@v1", 0)]) == 0 and store.stats().pages == 0


# ---------------------------------------------------------------- 6: Release with a repeated hash
def test_release_with_repeated_hash(open_store: Open) -> None:
    store = open_store()
    a, b = _h("m@v1", 0), _h("m@v1", 1)
    _put(store, "m@v1", 0)
    data = _put(store, "m@v1", 1)
    store.put("m@v1", LAYOUT, b, data, page_checksum(data), "q")
    assert store.release("m@v1", "r", [a, a]) == 1
    assert store.release("m@v1", "r", [b, b]) == 1
    assert store.exists("m@v1", [b]) == 1 and store.stats().released_pages == 2


# ---------------------------------------------------------------- 7/8: bad Put input, frame size
@pytest.mark.parametrize(
    ("namespace", "request_id", "field"),
    [
        ("m\x00x@v1", "r", "namespace"),
        ("m\nx@v1", "r", "namespace"),
        ("n" * 257, "r", "namespace"),
        ("m@v1", "r" * 257, "request_id"),
        ("m@v1", "r\x01", "request_id"),
    ],
)
def test_bad_names_are_invalid_argument(open_store: Open, namespace: str, request_id: str, field: str) -> None:
    store = open_store()
    data = os.urandom(PAGE_BYTES)
    with pytest.raises(InvalidArgument) as err:
        store.put(namespace, LAYOUT, _h("m@v1"), data, page_checksum(data), request_id)
    assert err.value.field == field
    assert store.stats().namespaces == 0


def test_malformed_frames_name_the_message(tmp_path: Path) -> None:
    rep = Replica(tmp_path / "kv")
    ch = grpc.insecure_channel(rep.address)
    put = ch.stream_unary(
        "/seer.v1.KvStoreService/Put", request_serializer=None, response_deserializer=kvstore_pb2.PutResponse.FromString
    )
    data = os.urandom(PAGE_BYTES)
    h = _h("m@v1")
    good = encode_put(h, data, page_checksum(data), namespace="m@v1", layout=layout_to_pb(LAYOUT), request_id="r")
    try:
        for frames, details in [
            ([good[:-10]], "requests[0]: malformed"),
            ([good, b"\x0a\x02\xff\xfe"], "requests[1]: malformed"),  # invalid UTF-8 namespace
            ([encode_put(h, data, page_checksum(data), namespace="m\x00@v1", layout=layout_to_pb(LAYOUT))],
             "requests[0].namespace"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                put(iter(frames), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(details), err.value.details()
    finally:
        ch.close()
        rep.stop()


def test_dram_does_not_pin_large_frames(open_store: Open) -> None:
    store = open_store(dram_bytes=8 * PAGE_BYTES)
    data = os.urandom(PAGE_BYTES)
    h = _h("m@v1")
    # A frame padded with an unknown field: decode_put views it whole.
    padding = b"\xa2\x06\x80\x80\x04" + bytes(1 << 16)  # field 100, 64 KiB
    frame = encode_put(h, data, page_checksum(data), namespace="m@v1", request_id="r") + padding
    msg = decode_put(frame)
    assert isinstance(msg.data, memoryview) and len(msg.data.obj) > 1 << 16  # type: ignore[arg-type]
    store.put(msg.namespace, LAYOUT, msg.page_hash, msg.data, msg.checksum, msg.request_id)
    found = store.get_page("m@v1", h)
    assert found is not None and bytes(found[0]) == data
    held = found[0].obj if isinstance(found[0], memoryview) else found[0]
    assert len(held) <= PAGE_BYTES + 4096  # type: ignore[arg-type]
    # An ordinary frame is still kept as it came (Get echoes it).
    h2 = _h("m@v1", 1)
    msg2 = decode_put(encode_put(h2, data, page_checksum(data), namespace="m@v1", request_id="r"))
    store.put(msg2.namespace, LAYOUT, msg2.page_hash, msg2.data, msg2.checksum, msg2.request_id)
    found2 = store.get_page("m@v1", h2)
    assert found2 is not None and isinstance(found2[0], memoryview)


# ---------------------------------------------------------------- close with failing SSD writes
def test_close_closes_rocksdb_past_failed_page_writes(tmp_path: Path) -> None:
    """A demotion at close that fails (a full disk) costs that page only: the pages after it still
    reach SSD, and RocksDB is closed (its LOCK released: the store opens again in this process)."""
    path = str(tmp_path / "db")
    store = KvStore(path, dram_bytes=64 * PAGE_BYTES, ssd_bytes=1024 * PAGE_BYTES, min_blob_bytes=256)
    data = [_put(store, "m@v1", i) for i in range(4)]
    ssd = store.raw_ssd()
    real_put = ssd.put

    def put_failing_page_1(namespace: str, page_hash: bytes, value: Any, meta: bytes, *, logged: bool = False) -> None:
        if page_hash == _h("m@v1", 1):
            raise OSError("IO error: No space left on device")
        real_put(namespace, page_hash, value, meta, logged=logged)

    ssd.put = put_failing_page_1  # type: ignore[method-assign,assignment]
    store.close()  # raised the OSError, RocksDB left open, before the fix
    assert store.flush_failures == 1
    reopened = KvStore(path, dram_bytes=64 * PAGE_BYTES, ssd_bytes=1024 * PAGE_BYTES, min_blob_bytes=256)
    try:
        assert reopened.exists("m@v1", [_h("m@v1", 0)]) == 1
        assert reopened.exists("m@v1", [_h("m@v1", 1)]) == 0  # its write failed: a miss, not a ghost
        for i in (2, 3):
            got = [bytes(d) if d is not None else None for _, d, _ in reopened.get("m@v1", [_h("m@v1", i)])]
            assert got == [data[i]]
    finally:
        reopened.close()


def test_close_closes_rocksdb_when_a_write_stalls(tmp_path: Path) -> None:
    """A stalled write (RocksDB takes none: WriteStalled) ends the flush at once, and close still
    closes RocksDB."""
    path = str(tmp_path / "db")
    store = KvStore(path, dram_bytes=64 * PAGE_BYTES, ssd_bytes=1024 * PAGE_BYTES, min_blob_bytes=256)
    for i in range(3):
        _put(store, "m@v1", i)
    calls: list[bytes] = []

    def stalled_put(namespace: str, page_hash: bytes, value: Any, meta: bytes, *, logged: bool = False) -> None:
        calls.append(page_hash)
        raise WriteStalled("RocksDB memtables stayed full")

    store.raw_ssd().put = stalled_put  # type: ignore[method-assign,assignment]
    store.close()
    assert len(calls) == 1 and store.flush_failures == 3
    KvStore(path, dram_bytes=64 * PAGE_BYTES, ssd_bytes=1024 * PAGE_BYTES, min_blob_bytes=256).close()
