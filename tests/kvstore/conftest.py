"""Fixtures of the kvstore tests: real RocksDB in tmp dirs, real gRPC servers on loopback port 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import PAGE_BYTES, Replica


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., KvStore]]:
    opened: list[KvStore] = []

    def _open(name: str = "db", **kw: object) -> KvStore:
        params: dict[str, object] = {
            "dram_bytes": 64 * PAGE_BYTES,
            "ssd_bytes": 1024 * PAGE_BYTES,
            "min_blob_bytes": 256,
        }
        params.update(kw)
        store = KvStore(str(tmp_path / name), **params)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def _make(name: str, **cfg: object) -> Replica:
        r = Replica(tmp_path / name, **cfg)
        made.append(r)
        return r

    yield _make
    for r in made:
        r.stop()
