"""A Get stream whose client stops reading is cancelled after get_stall_timeout_seconds (before, it
held its stream slot and handler thread until the client's deadline, for ever without one); a Get
whose server side is slow (the store reading pages) is not a stall."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.kvlayout import KVLayout
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore
from services.worker.kv_client import layout_to_pb
from tests.kvstore.kvhelpers import Replica

Make = Callable[..., Replica]

# 256 KiB pages: 16 tokens x 8 layers x K/V x 4 heads x 64 dims x 4 bytes.
BIG = KVLayout(dtype="float32", page_size=16, num_layers=8, num_kv_heads=4, head_dim=64)
NS = "m@v1"


def _fill(store: KvStore, n: int) -> list[bytes]:
    hashes = []
    for i in range(n):
        h = i.to_bytes(4, "big") * 4  # 16-byte page hash
        data = os.urandom(BIG.page_bytes)
        assert store.put(NS, BIG, h, data, page_checksum(data), "owner")
        hashes.append(h)
    return hashes


def _get(address: str, hashes: list[bytes]) -> tuple[grpc.Channel, Iterator[kvstore_pb2.GetResponse]]:
    ch = grpc.insecure_channel(address)
    stub = kvstore_pb2_grpc.KvStoreServiceStub(ch)
    it = stub.Get(kvstore_pb2.GetRequest(namespace=NS, page_hashes=hashes, layout=layout_to_pb(BIG)), timeout=60)
    return ch, it


def _stats(address: str) -> kvstore_pb2.GetKvStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return kvstore_pb2_grpc.KvStoreServiceStub(ch).GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=5)


def test_a_get_whose_client_stopped_reading_is_cancelled(replicas: Make) -> None:
    # One stream slot: the stalled Get holds it, so the next Get shows when it came back.
    r = replicas("a", max_workers=4, max_page_streams=1, get_stall_timeout_seconds=0.5,
                 dram_bytes=256 << 20, ssd_bytes=256 << 20)
    assert r.store is not None
    # 32 MiB: far more than the client's flow-control window, so the server's sends block.
    hashes = _fill(r.store, 128)
    ch, stalled = _get(r.address, hashes)
    try:
        assert next(stalled).page_hash == hashes[0]  # then the client reads nothing more
        deadline = time.monotonic() + 30  # before the client's 60 s deadline (10 s was missed once under load)
        while _stats(r.address).stalled_get_streams_cancelled == 0:
            assert time.monotonic() < deadline, "the stalled Get was never cancelled"
            time.sleep(0.1)
        # The slot comes back: another Get is served in full. The counter moves when the watchdog
        # cancels, a moment before the cancelled handler has unwound and freed the slot, so a Get
        # right then may still be refused (RESOURCE_EXHAUSTED; seen once on a loaded CI-like run):
        # retried within the same deadline.
        while True:
            ch2, it = _get(r.address, hashes[:4])
            try:
                assert [m.page_hash for m in it] == hashes[:4]
                break
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
                assert time.monotonic() < deadline, "the stalled Get's slot never came back"
                time.sleep(0.1)
            finally:
                ch2.close()
        # The stalled client gets what was buffered, then the cancellation: never all 128 pages.
        with pytest.raises(grpc.RpcError) as e:
            for _m in stalled:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED
        st = _stats(r.address)
        assert st.stalled_get_streams_cancelled == 1 and st.idle_put_streams_cancelled == 0
    finally:
        ch.close()


def test_a_slow_store_read_is_not_a_stall(replicas: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    r = replicas("a", max_workers=4, get_stall_timeout_seconds=0.5, dram_bytes=64 << 20, ssd_bytes=64 << 20)
    assert r.store is not None
    hashes = _fill(r.store, 4)
    real = KvStore.get

    def slow(self: KvStore, *a: object, **k: object) -> Iterator[tuple[bytes, object, int]]:
        for page in real(self, *a, **k):  # type: ignore[arg-type]
            time.sleep(0.8)  # the server's own time: longer than the stall timeout
            yield page

    monkeypatch.setattr(KvStore, "get", slow)
    ch, it = _get(r.address, hashes)
    try:
        assert [m.page_hash for m in it] == hashes  # a client reading all along is never cut
    finally:
        ch.close()
    assert _stats(r.address).stalled_get_streams_cancelled == 0
