"""Prometheus view of a KvStore: gauges and counters read from KvStore.stats() at scrape time, so the
core keeps plain integers and needs no metrics calls on its hot path."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from services.kvstore.store import KvStore

_GAUGES = {
    "dram_bytes": "bytes of pages in the DRAM tier",
    "dram_capacity_bytes": "DRAM tier capacity",
    "ssd_bytes": "bytes of pages in the SSD tier",
    "ssd_capacity_bytes": "SSD tier capacity",
    "namespaces": "live namespaces (model versions)",
    "pages": "stored pages",
    "dram_pages": "pages in the DRAM tier",
    "ssd_pages": "pages in the SSD tier",
    "column_families": "RocksDB column families open (namespaces with SSD pages, and a few idle ones)",
    "memtable_bytes": "bytes in RocksDB memtables, all column families (rocksdb.cur-size-all-mem-tables)",
}
_COUNTERS = {
    "hits": "pages served",
    "misses": "pages asked for and not stored",
    "evictions": "pages evicted for capacity",
    "demotions": "pages demoted from DRAM to SSD",
    "promotions": "pages promoted from SSD to DRAM",
    "checksum_failures": "pages that failed their checksum on read (deleted)",
    "released_pages": "page ownerships released",
    "dropped_namespaces": "namespaces dropped on a version change",
    "late_puts": "Puts and claims refused: their request had been released whole just before",
    "meta_write_failures": "SSD owner-record writes that failed (logged; a stale record costs a cache miss)",
}


class KvStoreCollector(Collector):
    def __init__(self, store: KvStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = asdict(self.store.stats())
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"seer_kvstore_{name}", doc, value=stats[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"seer_kvstore_{name}", doc, value=stats[name])


def register(store: KvStore, registry: CollectorRegistry = REGISTRY) -> KvStoreCollector:
    """Registers the collector (once per process: __main__ serves one store)."""
    collector = KvStoreCollector(store)
    registry.register(collector)
    return collector
