"""GetKvStats reports the RocksDB column families open and their memtable bytes, over real gRPC.

Since session 23 a namespace keeps a column family only while it has SSD pages (or is one of the
_IDLE_COLUMN_FAMILIES namespaces most recently written to SSD); bench.store_scaling counted them
by reaching into the store. Now the count and the memtable bytes are part of the stats, the
response and the Prometheus gauges.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.kvstore.store import _IDLE_COLUMN_FAMILIES
from services.worker.kv_client import KVClient
from tests.kvstore.kvhelpers import PAGE_BYTES, Replica, make_pages

Make = Callable[..., Replica]
TOKENS = list(range(100, 100 + 4 * 3))  # 3 full pages


def _stats(address: str) -> kvstore_pb2.GetKvStatsResponse:
    with grpc.insecure_channel(address) as channel:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel)
        res: kvstore_pb2.GetKvStatsResponse = stub.GetKvStats(kvstore_pb2.GetKvStatsRequest(), timeout=10)
        return res


def test_column_families_follow_ssd_pages_over_grpc(replicas: Make) -> None:
    # SSD only: every Put is a RocksDB write into its namespace's column family.
    r = replicas("a", dram_bytes=0)
    versions = [f"fam{i}@v1" for i in range(_IDLE_COLUMN_FAMILIES + 2)]  # other families: none supersedes another
    assert _stats(r.address).column_families == 0
    with KVClient([r.address]) as kv:
        assert kv.offload_async(make_pages(TOKENS, versions[0]), "r0").result(timeout=30).stored == 3
        first = _stats(r.address)
        assert first.column_families == 1 and first.ssd_pages == 3
        # The pages sit in the memtable until a flush (blob files are written at flush).
        assert first.memtable_bytes >= 3 * PAGE_BYTES
        for i, version in enumerate(versions[1:], start=1):
            assert kv.offload_async(make_pages(TOKENS, version), f"r{i}").result(timeout=30).stored == 3
        assert _stats(r.address).column_families == len(versions)  # every one holds SSD pages
        # The oldest namespace is not among the recently written ones: its column family goes
        # with its last SSD page.
        assert kv.release(versions[0], "r0") == 3
        assert _stats(r.address).column_families == len(versions) - 1
        for i, version in enumerate(versions[1:], start=1):
            assert kv.release(version, f"r{i}") == 3
        # The namespaces written last keep theirs while empty (no drop and re-create per swing).
        released = _stats(r.address)
        assert released.column_families == _IDLE_COLUMN_FAMILIES and released.ssd_pages == 0
        # The worker's view of the same RPC carries the new fields too.
        via_client = kv.store_stats()[r.address]
        assert via_client is not None and via_client["column_families"] == _IDLE_COLUMN_FAMILIES
        assert via_client["memtable_bytes"] > 0
    # A restart drops the column families of namespaces without pages: none is recent yet.
    r.stop()
    r.start()
    assert _stats(r.address).column_families == 0


def test_column_families_and_memtables_are_gauges(replicas: Make) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from services.kvstore.metrics import register

    r = replicas("a", dram_bytes=0)
    assert r.store is not None
    registry = CollectorRegistry()
    register(r.store, registry)
    with KVClient([r.address]) as kv:
        assert kv.offload_async(make_pages(TOKENS, "fam@v1"), "r").result(timeout=30).stored == 3
    text = generate_latest(registry).decode()
    assert "seer_kvstore_column_families 1.0" in text
    memtable = next(line for line in text.splitlines() if line.startswith("seer_kvstore_memtable_bytes "))
    assert float(memtable.split()[1]) >= 3 * PAGE_BYTES


def test_every_store_figure_is_exported() -> None:
    """Each KvStats field and each other GetKvStatsResponse field (the page-stream counters, kept by
    the server) is a gauge or a counter: late_puts and meta_write_failures, and later the stream
    counters, were reported by GetKvStats only, so no dashboard or alert saw them."""
    from dataclasses import fields

    from services.kvstore import metrics
    from services.kvstore.store import KvStats

    exported = set(metrics._GAUGES) | set(metrics._COUNTERS)
    assert not set(metrics._GAUGES) & set(metrics._COUNTERS)
    assert [f.name for f in fields(KvStats) if f.name not in exported] == []
    streams = set(metrics._STREAM_COUNTERS)
    assert not streams & exported
    response = [f.name for f in kvstore_pb2.GetKvStatsResponse.DESCRIPTOR.fields]
    assert [name for name in response if name not in exported | streams] == []


def test_stream_counters_are_prometheus_counters(tmp_path: Path) -> None:
    """The server's page-stream counters reach the registry serve() is given, with GetKvStats' values
    (a Put stream idle past its timeout is cancelled: idle_put_streams_cancelled 1)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from services.kvstore.config import KvStoreConfig
    from services.kvstore.server import serve
    from tests.kvstore.test_review14 import _idle_put, _stream_error

    registry = CollectorRegistry()
    cfg = KvStoreConfig(
        data_dir=str(tmp_path / "db"), grace_seconds=0.0, max_workers=4, min_blob_bytes=256,
        put_idle_timeout_seconds=0.3,
    )
    running, _store = serve(cfg, registry=registry)
    hold = threading.Event()
    try:
        err = _stream_error(_idle_put(f"127.0.0.1:{running.port}", hold), 10)
        assert err is not None and err.code() == grpc.StatusCode.CANCELLED
        st = _stats(f"127.0.0.1:{running.port}")
        text = generate_latest(registry).decode()
        values = {
            line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
        }
        assert st.idle_put_streams_cancelled == 1
        assert values["seer_kvstore_idle_put_streams_cancelled_total"] == 1.0
        assert values["seer_kvstore_refused_streams_total"] == st.refused_streams == 0
        assert values["seer_kvstore_stalled_get_streams_cancelled_total"] == 0.0
    finally:
        hold.set()
        running.stop(0)
