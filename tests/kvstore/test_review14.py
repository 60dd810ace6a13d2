"""Regressions of the session-14 kvstore review: late offloads after Release, idle Put streams
holding server threads, a failed open leaving RocksDB locked, SSD write failures' status codes,
pages fetched but never claimed by the fetching request, and SSD disk use under churn."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import SsdTier
from services.kvstore.store import KvStore
from services.kvstore.wire import encode_put
from services.worker.engine import KVPages
from services.worker.kv_client import KVClient, layout_to_pb
from tests.kvstore.kvhelpers import KV_LAYOUT, LAYOUT, PAGE_BYTES, Replica, make_pages

Open = Callable[..., KvStore]
Make = Callable[..., Replica]


def _h(version: str, i: int = 0) -> bytes:
    return chain_hashes([i] * 4, 4, version)[0]


def _put(store: KvStore, version: str, i: int = 0, owner: str = "r") -> bool:
    data = os.urandom(PAGE_BYTES)
    return store.put(version, LAYOUT, _h(version, i), data, page_checksum(data), owner)


# ---------------------------------------------------------------- 1: a late offload after Release
def test_late_put_after_release_does_not_recreate_pages(open_store: Open) -> None:
    store = open_store()
    _put(store, "m@v1", 0, "r")
    assert store.release("m@v1", "r") == 1 and store.stats().pages == 0
    # The request's offload that was still queued on its old worker lands now.
    with pytest.raises(FailedPrecondition) as err:
        _put(store, "m@v1", 1, "r")
    assert err.value.field == "request_id"
    with pytest.raises(FailedPrecondition):
        store.claim("m@v1", _h("m@v1", 0), "r")
    assert store.stats().pages == 0 and store.release("m@v1", "r") == 0


def test_release_tombstone_keeps_other_requests_and_expires(open_store: Open) -> None:
    now = [1000.0]
    store = open_store(release_tombstone_s=60.0, clock=lambda: now[0])
    _put(store, "m@v1", 0, "a")
    store.release("m@v1", "a")
    # Another request (a sibling with the same prefix) still stores and owns the same page.
    assert _put(store, "m@v1", 0, "b")
    # A Release naming pages ends no request: no tombstone.
    _put(store, "m@v1", 1, "c")
    store.release("m@v1", "c", [_h("m@v1", 1)])
    assert _put(store, "m@v1", 2, "c")
    # The same request id in another namespace (a new weight version) is another request.
    assert _put(store, "m@v2", 0, "a")
    # A Release that found nothing on this replica tombstones too (the late Put may come here).
    store.release("m@v2", "z")
    with pytest.raises(FailedPrecondition):
        _put(store, "m@v2", 1, "z")
    now[0] += 61.0
    assert _put(store, "m@v2", 3, "z")  # the tombstone expired


def test_release_tombstones_are_bounded(open_store: Open) -> None:
    store = open_store(max_release_tombstones=3)
    for k in range(5):
        store.release("m@v1", f"r{k}")
    with pytest.raises(FailedPrecondition):
        _put(store, "m@v1", 0, "r4")
    assert _put(store, "m@v1", 1, "r0")  # the oldest tombstone went first


def test_late_offload_over_grpc_is_refused_and_counted(replicas: Make) -> None:
    r = replicas("a")
    pages = make_pages(list(range(16)))
    with KVClient([r.address], tune_malloc=False) as kv:
        assert kv.put_pages(pages, "r1") == 4
        assert kv.release("m@v1", "r1") == 4
        res = kv.put_pages_result(pages, "r1")  # late: a refused Put is a failed offload, not an error
        assert res.stored == 0 and res.first_unstored == 0
        assert r.store is not None and r.store.stats().pages == 0
    ch = grpc.insecure_channel(r.address)
    st = kvstore_pb2_grpc.KvStoreServiceStub(ch).GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=5)
    ch.close()
    assert st.late_puts >= 1 and st.released_pages == 4  # an operator sees what was refused


# ---------------------------------------------------------------- 2: idle Put streams
def _idle_put(address: str, hold: threading.Event) -> grpc.Future:
    """A Put stream that sends one page, then nothing until `hold` is set."""
    data = os.urandom(PAGE_BYTES)
    first = encode_put(
        _h("m@v1", 99), data, page_checksum(data), namespace="m@v1", layout=layout_to_pb(LAYOUT), request_id="idle"
    )

    def frames() -> Iterator[bytes]:
        yield first
        hold.wait(30)

    ch = grpc.insecure_channel(address)
    put = ch.stream_unary(
        "/seer.v1.KvStoreService/Put", request_serializer=None, response_deserializer=kvstore_pb2.PutResponse.FromString
    )
    return put.future(frames(), timeout=60)


def _stream_error(fut: grpc.Future, timeout: float) -> grpc.RpcError | None:
    """The RPC error a stream's future ended with (None: it succeeded), waiting up to `timeout` s
    (grpc.FutureTimeoutError past it). Not Future.exception(timeout=...): grpc's stubs type that
    without the timeout and as a plain Exception, though a failed RPC's future raises grpc.RpcError."""
    try:
        fut.result(timeout=timeout)
    except grpc.RpcError as err:
        return err
    return None


def _stream_status(fut: grpc.Future, timeout: float) -> tuple[grpc.StatusCode, str] | None:
    """(code, details) of a stream's failed RPC; None when it succeeded."""
    err = _stream_error(fut, timeout)
    return None if err is None else (err.code(), err.details() or "")


def test_idle_put_streams_do_not_starve_other_rpcs(replicas: Make) -> None:
    r = replicas("a", max_workers=4, put_idle_timeout_seconds=60.0)
    hold = threading.Event()
    futures = [_idle_put(r.address, hold) for _ in range(6)]
    try:
        time.sleep(0.5)
        ch = grpc.insecure_channel(r.address)
        stub = kvstore_pb2_grpc.KvStoreServiceStub(ch)
        # Unary RPCs still find a handler thread while every stream slot is taken ...
        for _ in range(3):
            stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=2)
        stub.Exists(kvstore_pb2.ExistsRequest(namespace="m@v1", page_hashes=[_h("m@v1")]), timeout=2)
        # ... and the streams over the cap were refused at once, not queued.
        refused = [f for f in futures if f.done()]
        statuses = [_stream_status(f, 0) for f in refused]
        assert refused and all(st is not None and st[0] == grpc.StatusCode.RESOURCE_EXHAUSTED for st in statuses)
        assert statuses[0] is not None and "max_page_streams" in statuses[0][1], statuses
        st = stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=2)
        assert st.refused_streams == len(refused)
        ch.close()
    finally:
        hold.set()
        for f in futures:
            _stream_error(f, 10)


def test_idle_put_stream_is_cut_after_the_idle_timeout(replicas: Make) -> None:
    r = replicas("a", max_workers=4, put_idle_timeout_seconds=0.5)
    hold = threading.Event()
    try:
        fut = _idle_put(r.address, hold)
        err = _stream_error(fut, 5)  # well before the client's own 60 s deadline
        assert err is not None and err.code() == grpc.StatusCode.CANCELLED
        # The slot came back: a full Put works. Within a few seconds, not at once: the client sees
        # CANCELLED before the server's handler has let its stream slot go (a Put made at once
        # failed once on a CI machine, then degraded to recompute).
        deadline = time.monotonic() + 5
        with KVClient([r.address], tune_malloc=False) as kv:
            while (stored := kv.put_pages(make_pages(list(range(8))), "r1")) != 2 and time.monotonic() < deadline:
                time.sleep(0.2)
        assert stored == 2
        ch = grpc.insecure_channel(r.address)
        st = kvstore_pb2_grpc.KvStoreServiceStub(ch).GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=5)
        ch.close()
        assert st.idle_put_streams_cancelled == 1
    finally:
        hold.set()


def test_a_busy_put_stream_is_not_idle(replicas: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's own time storing a message (a RocksDB stall, the store lock) is not the client's
    # idle time: a store slower than the timeout used to cancel a client sending continuously.
    r = replicas("a", max_workers=4, put_idle_timeout_seconds=0.5)
    real = KvStore.put

    def slow(self: KvStore, *a: object, **k: object) -> bool:
        time.sleep(1.2)
        return real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(KvStore, "put", slow)
    with KVClient([r.address], tune_malloc=False) as kv:
        res = kv.put_pages_result(make_pages(list(range(8))), "r1")
    assert res.first_unstored is None and res.stored == 2


# ---------------------------------------------------------------- 3: a failed open
def test_failed_open_releases_the_rocksdb_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "db")
    store = KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    _put(store, "m@v1")
    store.close()

    def unreadable(self: object) -> dict[str, bytes]:
        raise OSError("IO error: registry unreadable")

    monkeypatch.setattr(SsdTier, "registry", unreadable)
    errors: list[BaseException] = []  # kept alive, as a caller logging and retrying would
    for _ in range(2):
        try:
            KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        except Exception as exc:
            errors.append(exc)
    assert len(errors) == 2
    assert "lock" not in str(errors[1]).lower(), errors[1]
    assert type(errors[1]) is type(errors[0])


def test_a_registry_record_that_does_not_parse_is_dropped_not_fatal(tmp_path: Path) -> None:
    # Before: json.loads raised in recovery and the store could never open again on that disk.
    path = str(tmp_path / "db")
    store = KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    _put(store, "m@v1")
    _put(store, "x@v1")
    store.raw_ssd().put_registry("x@v1", b"{not json")
    store.close()
    store = KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    try:
        assert store.stats().pages == 1  # m@v1's page; x@v1 went with its record
        assert "x@v1" not in store.raw_ssd().registry() and "x@v1" not in store.raw_ssd().namespaces()
        _put(store, "x@v1")  # the namespace can be used again
        assert store.stats().pages == 2
    finally:
        store.close()


def test_failed_recovery_midway_releases_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "db")
    store = KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    for i in range(3):
        _put(store, "m@v1", i)
    store.close()
    calls = [0]
    real = KvStore._enforce_ssd_capacity

    def crash(self: KvStore) -> None:
        calls[0] += 1
        raise OSError("IO error: crash while opening")

    monkeypatch.setattr(KvStore, "_enforce_ssd_capacity", crash)
    with pytest.raises(OSError) as first:
        KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    monkeypatch.setattr(KvStore, "_enforce_ssd_capacity", real)
    again = KvStore(path, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    try:
        assert first.value is not None and again.stats().pages == 3
    finally:
        again.close()


# ---------------------------------------------------------------- 4: SSD write failures
@pytest.mark.parametrize(
    ("message", "error", "code"),
    [
        ("IO error: No space left on device", ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            "IO error: While appending to file: 000012.blob: Input/output error",
            Unavailable,
            grpc.StatusCode.UNAVAILABLE,
        ),
    ],
)
def test_failed_direct_ssd_put_maps_to_a_status(
    replicas: Make, monkeypatch: pytest.MonkeyPatch, message: str, error: type[Exception], code: grpc.StatusCode
) -> None:
    r = replicas("a", dram_bytes=0)
    assert r.store is not None

    def failing_put(*_a: object, **_k: object) -> None:
        raise Exception(message)  # what rocksdict raises for a RocksDB status

    monkeypatch.setattr(r.store.raw_ssd(), "put", failing_put)
    with pytest.raises(error) as core_err:
        _put(r.store, "m@v1", 0)
    assert getattr(core_err.value, "field", None) == "data" and message in str(core_err.value)
    stub = kvstore_pb2_grpc.KvStoreServiceStub(grpc.insecure_channel(r.address))
    data = os.urandom(PAGE_BYTES)
    req = kvstore_pb2.PutRequest(
        namespace="m@v1",
        layout=layout_to_pb(LAYOUT),
        page_hash=_h("m@v1", 1),
        data=data,
        checksum=page_checksum(data),
        request_id="r",
    )
    with pytest.raises(grpc.RpcError) as rpc_err:
        stub.Put(iter([req]), timeout=5)
    assert rpc_err.value.code() == code
    assert (rpc_err.value.details() or "").startswith("requests[0].data: "), rpc_err.value.details()
    # The client degrades it to a failed offload (a miss), not a rejected layout.
    with KVClient([r.address], tune_malloc=False) as kv:
        res = kv.put_pages_result(make_pages(list(range(8))), "r2")
        assert res.stored == 0 and res.first_unstored == 0 and kv.stats().put_failures == 2


# ---------------------------------------------------------------- 5: fetched pages never claimed
def _continue(pages: KVPages, end: int) -> KVPages:
    return KVPages(
        pages.model_version, pages.layout, pages.token_ids[: end * 4], pages.page_hashes[:end], pages.pages[:end]
    )


def test_fetched_sibling_pages_must_be_claimed_to_survive_its_release(replicas: Make) -> None:
    """Item 5 (worker watermark): a resumed request whose own first offload did not land fetches
    its sibling's prompt pages; core.py then marks them offloaded, so its next offload starts after
    them and it never owns them: the sibling's Release drops them. Offloading the fetched pages
    themselves (claims only, no bytes) makes the request an owner."""
    r = replicas("a")
    tokens = list(range(40))  # 10 pages: 4 of prompt, then the request's own output
    full = make_pages(tokens)
    with KVClient([r.address], tune_malloc=False) as kv:
        assert kv.put_pages(_continue(full, 4), "sibling") == 4  # the shared prompt
        # The request's chunk-1 offload was dropped; chunk 2 runs elsewhere and fetches.
        fetched = kv.fetch_prefix(tokens, "m@v1", KV_LAYOUT)
        assert fetched is not None and fetched.end_page == 4
        # What core.py does today: the watermark jumps to end_page; the next offload sends the rest.
        rest = KVPages(
            full.model_version, full.layout, full.token_ids, full.page_hashes[4:], full.pages[4:], first_page=4
        )
        assert kv.put_pages(rest, "me") == 6
        kv.release("m@v1", "sibling")
        assert kv.prefix_pages(full.page_hashes, "m@v1") == 0  # the prefix is gone for "me" too
        # The remedy: claim what was fetched (offload it as it is); no page bytes are sent.
        assert kv.put_pages(_continue(full, 4), "sibling2") == 4
        sent = kv.stats().put_bytes
        res = kv.offload_async(kv.fetch_prefix(tokens, "m@v1", KV_LAYOUT), "me2").result()  # type: ignore[arg-type]
        assert res.claimed == 10 and res.stored == 0 and kv.stats().put_bytes == sent
        kv.release("m@v1", "sibling2")
        assert kv.prefix_pages(full.page_hashes, "m@v1") == 10


def test_a_failed_owner_record_write_does_not_fail_claims_or_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a claim or Release whose SSD owner record write failed raised half done (INTERNAL),
    # leaving the rest of a Release unprocessed.
    store = KvStore(str(tmp_path / "db"), dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    try:
        for i in range(3):
            _put(store, "m@v1", i, "a")
            _put(store, "m@v1", i, "b")  # a second owner: release writes its record, not a delete

        def broken(self: object, namespace: str, page_hash: bytes, meta: bytes) -> None:
            raise OSError("IO error: disk gone")

        monkeypatch.setattr(SsdTier, "put_meta", broken)
        assert store.claim("m@v1", _h("m@v1", 0), "c")
        assert store.release("m@v1", "a") == 3  # every page, not just up to the first failure
        assert store.release("m@v1", "b") == 3
        assert store.stats().pages == 1  # page 0: still c's
        assert store.release("m@v1", "c") == 1 and store.stats().pages == 0
        assert store.stats().meta_write_failures >= 4  # c's claim, then a's three records
    finally:
        store.close()
