"""The kvstore service over real gRPC on loopback: messages, limits, statuses naming fields."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.grpcutil import channel
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.worker.kv_client import layout_to_pb
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica

Make = Callable[..., Replica]


def _stub(r: Replica) -> kvstore_pb2_grpc.KvStoreServiceStub:
    return kvstore_pb2_grpc.KvStoreServiceStub(channel(r.address))


def _requests(pages: list[tuple[bytes, bytes]], ns: str = "m@v1", rid: str = "r1") -> Iterator[kvstore_pb2.PutRequest]:
    for h, d in pages:
        yield kvstore_pb2.PutRequest(
            namespace=ns, layout=layout_to_pb(LAYOUT), page_hash=h, data=d, checksum=page_checksum(d), request_id=rid
        )


def _pages(n: int, ns: str = "m@v1") -> list[tuple[bytes, bytes]]:
    return [(h, os.urandom(PAGE_BYTES)) for h in chain_hashes(list(range(4 * n)), 4, ns)]


def test_put_get_exists_release_stats(replicas: Make) -> None:
    r = replicas("a")
    stub = _stub(r)
    pages = _pages(4)
    resp = stub.Put(_requests(pages), timeout=10)
    assert resp.stored_pages == 4 and resp.stored_bytes == 4 * PAGE_BYTES
    assert stub.Put(_requests(pages), timeout=10).stored_pages == 0  # dedup
    hashes = [h for h, _ in pages]
    missing = os.urandom(16)
    got = list(stub.Get(kvstore_pb2.GetRequest(namespace="m@v1", page_hashes=[*hashes, missing]), timeout=10))
    assert [g.page_hash for g in got] == [*hashes, missing]
    assert [g.data for g in got[:4]] == [d for _, d in pages] and not any(g.missing for g in got[:4])
    assert got[4].missing
    assert stub.Exists(kvstore_pb2.ExistsRequest(namespace="m@v1", page_hashes=hashes), timeout=5).prefix_pages == 4
    st = stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=5)
    assert (st.pages, st.hits, st.misses, st.namespaces) == (4, 4, 1, 1)
    rel = stub.Release(kvstore_pb2.ReleaseRequest(namespace="m@v1", request_id="r1"), timeout=5)
    assert rel.released_pages == 4
    assert stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=5).pages == 0


def test_release_names_are_checked_like_puts(replicas: Make) -> None:
    """A whole Release keeps a tombstone keyed by namespace and request id; both went unchecked,
    so 1 MiB ids were each held for minutes (300 of them: 300 MiB; found by review, session 18)."""
    r = replicas("a")
    stub = _stub(r)
    big = "r" * 4096
    for ns, rid, field in (("m@v1", big, "request_id"), ("n" * 4096, "r1", "namespace"),
                           ("m@v1", "bad\x00id", "request_id"), ("", "r1", "namespace"), ("m@v1", "", "request_id")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Release(kvstore_pb2.ReleaseRequest(namespace=ns, request_id=rid), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert (e.value.details() or "").startswith(f"{field}: "), e.value.details()
    assert r.store is not None and not r.store._released_requests
    assert stub.Release(kvstore_pb2.ReleaseRequest(namespace="m@v1", request_id="r1"), timeout=5).released_pages == 0


def test_bad_layout_is_invalid_argument_naming_the_field(replicas: Make) -> None:
    r = replicas("a")
    stub = _stub(r)
    (h0, d0), (h1, d1) = _pages(2)
    bad = kvstore_pb2.PageLayout(dtype="float32", page_size=4, num_layers=2, num_kv_heads=3, head_dim=8)
    msgs = [
        next(_requests([(h0, d0)])),
        kvstore_pb2.PutRequest(namespace="m@v1", layout=bad, page_hash=h1, data=d1, checksum=page_checksum(d1)),
    ]
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(msgs), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[1].layout.num_kv_heads" in str(err.value.details())
    # The page accepted before the bad one is kept, and the service keeps serving.
    assert stub.Exists(kvstore_pb2.ExistsRequest(namespace="m@v1", page_hashes=[h0, h1]), timeout=5).prefix_pages == 1
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Get(kvstore_pb2.GetRequest(namespace="m@v1", page_hashes=[h0], layout=bad), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layout.num_kv_heads" in str(err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(
            iter([kvstore_pb2.PutRequest(namespace="m@v1", page_hash=h1, data=d1, checksum=page_checksum(d1))]),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[0].layout" in str(err.value.details())


def test_oversized_page_is_resource_exhausted(replicas: Make) -> None:
    r = replicas("a", max_page_message_bytes=PAGE_BYTES)
    stub = _stub(r)
    h = os.urandom(16)
    big = os.urandom(PAGE_BYTES + 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(
            iter(
                [
                    kvstore_pb2.PutRequest(
                        namespace="m@v1",
                        layout=layout_to_pb(LAYOUT),
                        page_hash=h,
                        data=big,
                        checksum=page_checksum(big),
                    )
                ]
            ),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests[0].data" in str(err.value.details())


def test_stale_version_put_is_failed_precondition(replicas: Make) -> None:
    r = replicas("a")
    stub = _stub(r)
    stub.Put(_requests(_pages(1, "m@v1"), "m@v1"), timeout=5)
    stub.Put(_requests(_pages(1, "m@v2"), "m@v2"), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(_requests(_pages(1, "m@v1"), "m@v1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "namespace" in str(err.value.details())


def test_process_sigterm_flushes_and_restart_keeps_pages(tmp_path: Path) -> None:
    """`python -m services.kvstore` as a process: SIGTERM exits 0, the restart serves the pages."""
    data_dir, port_file = tmp_path / "db", tmp_path / "port"
    pages = _pages(3)

    def start() -> tuple[subprocess.Popen[bytes], str]:
        if port_file.exists():
            port_file.unlink()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.kvstore",
                "--port",
                "0",
                "--data-dir",
                str(data_dir),
                "--port-file",
                str(port_file),
                "--min-blob-bytes",
                "256",
                "--grace-seconds",
                "0",
            ],
            stderr=subprocess.PIPE,
        )
        deadline = time.time() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.time() < deadline
            time.sleep(0.05)
        return proc, f"127.0.0.1:{port_file.read_text()}"

    proc, addr = start()
    try:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel(addr))
        assert stub.Put(_requests(pages), timeout=10).stored_pages == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    proc, addr = start()
    try:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel(addr))
        got = list(stub.Get(kvstore_pb2.GetRequest(namespace="m@v1", page_hashes=[h for h, _ in pages]), timeout=10))
        assert [g.data for g in got] == [d for _, d in pages]
        more = _pages(6)[3:]
        assert stub.Put(_requests(more), timeout=10).stored_pages == 3
    finally:
        proc.kill()  # a crash: pages not yet flushed may be lost, but nothing may come back wrong
        proc.wait(30)
    proc, addr = start()
    try:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel(addr))
        asked = pages + more
        got = list(stub.Get(kvstore_pb2.GetRequest(namespace="m@v1", page_hashes=[h for h, _ in asked]), timeout=10))
        assert [g.data for g in got[:3]] == [d for _, d in pages]  # flushed by the graceful stop
        for g, (_h, d) in zip(got[3:], more, strict=True):
            assert g.missing or (g.data == d and g.checksum == page_checksum(d))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
