"""One hung KV replica must cost each concurrent fetch at most one Exists deadline (real gRPC on
loopback: a real store and one that takes RPCs and never answers). The replica calls shared a pool
of 2n threads: calls to the hung replica held every thread for their whole deadline, and
concurrent admissions queued behind them (16 fetches: up to 8 s with a 2 s deadline)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hung_kv import hung_kv_nodes
from worker_fake_engine import FakeEngine

from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve
from services.worker.kv_client import KVClient


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[str]]:
    """[a real store, a hung one]."""
    running, _store = serve(KvStoreConfig(port=0, data_dir=str(tmp_path / "kv"), dram_bytes=16 << 20,
                                          ssd_bytes=64 << 20, grace_seconds=1.0))
    try:
        with hung_kv_nodes(("Exists",)) as hung:
            yield [running.address, *hung]
    finally:
        running.stop(0.5)


def test_concurrent_fetches_wait_one_deadline_with_a_replica_hung(nodes: list[str]) -> None:
    eng = FakeEngine()
    kc = KVClient(nodes, exists_timeout_s=0.5, tune_malloc=False)
    try:
        took: list[float] = []
        lock = threading.Lock()

        def fetch(i: int) -> None:
            t0 = time.monotonic()
            # 10 pages: both replicas hold a share of the chain, so each fetch asks both.
            assert kc.fetch_prefix(tuple(range(i, i + 40)), eng.model_version, eng.kv_layout) is None
            with lock:
                took.append(time.monotonic() - t0)

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(took) == 16
        # Was up to 16 / 4 threads x 0.5 s = 2 s; now one deadline plus scheduling slack.
        assert max(took) < 1.2, took
    finally:
        kc.close()
