"""Prometheus view of a KvStore: gauges and counters read from KvStore.stats() at scrape time, so the
core keeps plain integers and needs no metrics calls on its hot path. The server's page-stream
counters (streams refused at the cap, idle Put and stalled Get streams cancelled) live outside the
store (server.PageStreams) and are read the same way when the collector is given them: every field
of GetKvStatsResponse is a metric."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from services.kvstore.store import KvStore

_GAUGES = {
    "dram_bytes": "bytes of pages in the DRAM tier",
    "dram_capacity_bytes": "DRAM tier capacity",
    "ssd_bytes": "bytes of pages in the SSD tier, pending deletes' pages included (still on disk)",
    "ssd_capacity_bytes": "SSD page budget: --ssd-bytes less the RocksDB WAL cap reserved out of it",
    "namespaces": "live namespaces (model versions)",
    "pages": "stored pages",
    "dram_pages": "pages in the DRAM tier",
    "ssd_pages": "pages in the SSD tier",
    "column_families": "RocksDB column families open (namespaces with SSD pages, and a few idle ones)",
    "memtable_bytes": "bytes in RocksDB memtables, all column families (rocksdb.cur-size-all-mem-tables)",
    "pending_ssd_records": "SSD page records RocksDB refused to delete or rewrite, retried on later Releases",
    "pending_ssd_bytes": "bytes of pages whose SSD delete RocksDB refused: still on disk, counted in ssd_bytes",
    "chain_links": "pages linked to their predecessor in a chain by an Exists (at most one per page)",
}
_COUNTERS = {
    "hits": "pages served",
    "misses": "pages asked for and not stored",
    "evictions": "pages evicted for capacity",
    "demotions": "pages demoted from DRAM to SSD",
    "promotions": "pages promoted from SSD to DRAM",
    "checksum_failures": "pages that failed their checksum on read (deleted)",
    "orphan_owner_records": "SSD owner records found without their page at a read (lost at a kill; dropped)",
    "released_pages": "page ownerships released",
    "dropped_namespaces": "namespaces dropped on a version change",
    "late_puts": "Puts and claims refused: their request had been released whole just before",
    "meta_write_failures": "SSD owner-record writes that failed (logged; a stale record costs a cache miss)",
    "flush_failures": "DRAM pages a flush to SSD (graceful stop) could not write",
    "write_stalls": "RocksDB writes that met a write stop and waited",
    "write_stall_failures": "RocksDB writes that failed on a write stop (Put UNAVAILABLE, demotion evicted)",
    "write_stall_seconds": "seconds RocksDB writes waited on write stops",
}

# GetKvStatsResponse field -> (attribute of the server's PageStreams, help).
_STREAM_COUNTERS = {
    "refused_streams": ("refused", "Put / Get streams refused at max_page_streams"),
    "idle_put_streams_cancelled": ("idle_cancelled", "Put streams cancelled after put_idle_timeout_seconds"),
    "stalled_get_streams_cancelled": (
        "stalled_cancelled",
        "Get streams cancelled after get_stall_timeout_seconds (the client took no message)",
    ),
}


class StreamCounters(Protocol):
    """What the collector reads of server.PageStreams (no gRPC import here)."""

    @property
    def refused(self) -> int: ...

    idle_cancelled: int
    stalled_cancelled: int


class KvStoreCollector(Collector):
    def __init__(self, store: KvStore, streams: StreamCounters | None = None) -> None:
        self.store = store
        self.streams = streams

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = asdict(self.store.stats())
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"seer_kvstore_{name}", doc, value=stats[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"seer_kvstore_{name}", doc, value=stats[name])
        if self.streams is not None:
            for name, (attr, doc) in _STREAM_COUNTERS.items():
                yield CounterMetricFamily(f"seer_kvstore_{name}", doc, value=getattr(self.streams, attr))


def register(
    store: KvStore, registry: CollectorRegistry = REGISTRY, streams: StreamCounters | None = None
) -> KvStoreCollector:
    """Registers the collector (once per process: __main__ serves one store); `streams` (the
    servicer's PageStreams) adds the page-stream counters."""
    collector = KvStoreCollector(store, streams)
    registry.register(collector)
    return collector
