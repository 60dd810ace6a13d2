"""Regressions of the session-33 kvstore mends, on real RocksDB in tmp dirs (faults injected by
patching the SSD tier's own registry writes, the narrowest stand-in for a full disk):

1. A namespace forgotten while empty (_IDLE_NAMESPACES others emptied after it) whose registry delete
   RocksDB refused was forgotten in memory anyway: the running store went on as if it never existed,
   while its record stayed on disk. The next open replayed the family's creations with it, so a
   version the running store had kept (created after it was forgotten, or whose own drop had been
   refused and then found no longer due) was dropped at the start: its pages lost, its workers' Puts
   refused as stragglers. Now the namespace is forgotten only once its record is deleted; until then
   it stays, empty, as the open will see it, and the delete is retried when the next namespace empties.
2. The SSD page budget against the largest page a Put may carry (config): see the tests below.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import pytest

from services.common import config
from services.common.kvlayout import KVLayout
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.config import KvStoreConfig
from services.kvstore.ssd import MIN_WAL_BYTES, SsdTier
from services.kvstore.store import _IDLE_NAMESPACES, KvStore
from tests.kvstore.kvhelpers import LAYOUT

Open = Callable[..., KvStore]
FAMILY = ("m@v1", "m@v2", "m@v3")


def _h(namespace: str, i: int) -> bytes:
    return chain_hashes([i] * 4, 4, namespace)[0]


def _put(store: KvStore, namespace: str, i: int, owner: str = "r", layout: KVLayout = LAYOUT) -> None:
    data = os.urandom(layout.page_bytes)
    store.put(namespace, layout, _h(namespace, i), data, page_checksum(data), owner)


def _live(store: KvStore) -> list[str]:
    return [n for n in FAMILY if store.namespace_layout(n) is not None]


def _empty_others(store: KvStore, n: int, tag: str) -> None:
    """Empties n namespaces of other families after whatever emptied last: the one emptied longest
    ago is then forgotten (_IDLE_NAMESPACES)."""
    for i in range(n):
        name = f"other-{tag}{i}@v1"
        _put(store, name, 0, owner="o")
        assert store.release(name, "o") == 1


@pytest.fixture
def refuse(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bool]]:
    """While a flag is set RocksDB refuses that kind of registry write: 'delete' (a forgotten
    namespace's record, or a covered tombstone's), 'tombstone' (a drop's first write)."""
    flags = {"delete": False, "tombstone": False}
    real_put, real_delete = SsdTier.put_registry, SsdTier.delete_registry

    def put_registry(self: SsdTier, namespace: str, record: bytes) -> None:
        if flags["tombstone"] and b'"dropped"' in record:
            raise RuntimeError("IO error: No space left on device")
        real_put(self, namespace, record)

    def delete_registry(self: SsdTier, namespace: str) -> None:
        if flags["delete"]:
            raise RuntimeError("IO error: No space left on device")
        real_delete(self, namespace)

    monkeypatch.setattr(SsdTier, "put_registry", put_registry)
    monkeypatch.setattr(SsdTier, "delete_registry", delete_registry)
    yield flags


# ---------------------------------------------------------------- item 1: a forgotten namespace's record
def test_a_refused_registry_delete_then_a_restart_drops_no_kept_version(
        open_store: Open, refuse: dict[str, bool]) -> None:
    """keep_versions 2. v1 holds pages; v3 is created, emptied and forgotten, its registry delete
    refused; v2 arrives. Before: the running store, v3 forgotten, kept v1 and v2 (two versions), and
    the open replayed v1, v3 (the record left behind), v2 and dropped v1 with its pages. Now v3 stays
    known while its record does (the running store then drops v1 at v2's creation, as it does when v3
    is not yet forgotten), and the open agrees with the running store."""
    store = open_store(dram_bytes=0, keep_versions=2)
    for i in range(3):
        _put(store, "m@v1", i)
    _put(store, "m@v3", 0, owner="r3")
    assert store.release("m@v3", "r3") == 1
    refuse["delete"] = True
    _empty_others(store, _IDLE_NAMESPACES, "a")  # v3's turn to be forgotten: its delete refused
    _put(store, "m@v2", 0)
    running = _live(store)
    pages = {n: sum(store.get_page(n, _h(n, i)) is not None for i in range(3)) for n in running}
    store.close()
    refuse["delete"] = False
    store = open_store(dram_bytes=0, keep_versions=2)
    assert [n for n in _live(store) if n != "m@v3"] == [n for n in running if n != "m@v3"], running
    assert store.stats().dropped_namespaces == 0  # nothing the running store kept
    for name, n in pages.items():
        assert sum(store.get_page(name, _h(name, i)) is not None for i in range(3)) == n, name


def test_a_refused_drop_then_a_refused_registry_delete_then_a_restart(
        open_store: Open, refuse: dict[str, bool]) -> None:
    """The double failure, keep_versions 1: v2's creation finds v1's drop refused (a full disk), v2
    empties and is forgotten with its registry delete refused too, and the drop's retry then found
    nothing due (v2 gone from memory): v1 was the family's kept version, Puts into it accepted. The
    open replayed v1, v2 (its record) and dropped v1. Now v2 stays known until its record goes, the
    retry drops v1 in the running store, and the open finds nothing more to drop."""
    clock = [1000.0]
    store = open_store(dram_bytes=0, clock=lambda: clock[0])
    for i in range(3):
        _put(store, "m@v1", i)
    refuse["tombstone"] = refuse["delete"] = True
    _put(store, "m@v2", 0, owner="r2")  # v1's drop refused
    assert store.release("m@v2", "r2") == 1
    _empty_others(store, _IDLE_NAMESPACES, "b")  # v2's forget: its delete refused
    refuse["tombstone"] = False
    clock[0] += 60.0  # past the retry backoff
    _put(store, "other-c@v1", 0)  # a Put retries the family's drop
    running = _live(store)
    if "m@v1" in running:  # as before the fix: v1 kept, a straggler's Put goes in
        _put(store, "m@v1", 5)
    store.close()
    refuse["delete"] = False
    store = open_store(dram_bytes=0)
    assert [n for n in _live(store) if n != "m@v2"] == [n for n in running if n != "m@v2"], running
    assert store.stats().dropped_namespaces == 0


def test_a_forget_refused_is_retried_when_the_next_namespace_empties(
        open_store: Open, refuse: dict[str, bool], caplog: pytest.LogCaptureFixture) -> None:
    """The kept record is not kept for good: once RocksDB takes the delete (tried again when another
    namespace empties) the namespace is forgotten, record and all, and stays so across an open."""
    store = open_store(dram_bytes=0)
    _put(store, "m@v3", 0, owner="r3")
    assert store.release("m@v3", "r3") == 1
    refuse["delete"] = True
    with caplog.at_level(logging.WARNING, logger="services.kvstore.store"):
        _empty_others(store, _IDLE_NAMESPACES + 2, "d")
    assert store.namespace_layout("m@v3") is not None  # kept while its record is
    failures = store.stats().meta_write_failures
    assert failures >= 1 and sum("registry record delete failed" in r.getMessage() for r in caplog.records) \
        == failures, [r.getMessage() for r in caplog.records]
    refuse["delete"] = False
    _empty_others(store, 1, "e")
    assert store.namespace_layout("m@v3") is None and store.stats().namespaces == _IDLE_NAMESPACES
    assert b"m@v3" not in b"".join(k.encode() for k in store.raw_ssd().registry())
    store.close()
    store = open_store(dram_bytes=0)
    assert store.namespace_layout("m@v3") is None


# ---------------------------------------------------------------- item 2: the SSD page budget
def _load(**values: object) -> KvStoreConfig:
    env = {f"SEER_KVSTORE_{k.upper()}": str(v) for k, v in values.items()}
    return config.load(KvStoreConfig, "kvstore", argv=[], env=env)


def test_a_page_budget_holding_no_largest_page_with_no_dram_to_hold_it_is_a_config_error() -> None:
    """dram_bytes 0 and --ssd-bytes one byte above the WAL cap: every Put of a page over a byte went
    straight to SSD and was refused (RESOURCE_EXHAUSTED naming data), found only at the first Put.
    Now the start fails, naming ssd_bytes, the budget and what would fit."""
    want = r"ssd_bytes: its page budget \(1 bytes.*max_page_message_bytes \(4194304\)"
    with pytest.raises(config.ConfigError, match=want) as err:
        _load(dram_bytes=0, ssd_bytes=MIN_WAL_BYTES + 1)
    assert err.value.field == "ssd_bytes"
    # A DRAM tier too small for the largest page does not rescue it.
    with pytest.raises(config.ConfigError, match="ssd_bytes: "):
        _load(dram_bytes=1 << 20, ssd_bytes=MIN_WAL_BYTES + (1 << 20))
    # Either tier holding the largest page, or a smaller largest page, is a store that works.
    assert _load(dram_bytes=0, ssd_bytes=MIN_WAL_BYTES + (4 << 20)).ssd_page_bytes() == 4 << 20
    assert _load(dram_bytes=0, ssd_bytes=MIN_WAL_BYTES + (1 << 20),
                 max_page_message_bytes=1 << 20).ssd_page_bytes() == 1 << 20


def test_a_tiny_page_budget_beside_a_dram_tier_is_the_ssd_tier_off_and_said_at_start(
        tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    """The Helm chart's case (tests/deploy: one byte above the WAL cap loads, page budget 1, DRAM 2 GiB):
    a deployment run on DRAM. Valid, and the start says so once (a warning naming the fields): every page
    larger than the budget is evicted when it leaves DRAM, not demoted."""
    from services.kvstore.server import open_store

    cfg = _load(ssd_bytes=MIN_WAL_BYTES + 1, data_dir=f"{tmp_path}/db")
    assert cfg.ssd_page_bytes() == 1 and cfg.dram_bytes >= cfg.max_page_message_bytes
    with caplog.at_level(logging.WARNING, logger="services.kvstore.server"):
        store = open_store(cfg)
    try:
        warned = [r for r in caplog.records if "SSD tier holds no page" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        fields = getattr(warned[0], "fields", {})
        assert fields.get("ssd_page_bytes") == 1 and fields.get("max_page_message_bytes") == 4 << 20, fields
    finally:
        store.close()
    caplog.clear()
    cfg = _load(data_dir=f"{tmp_path}/db2", ssd_bytes=1 << 30)  # a budget that holds pages: no warning
    with caplog.at_level(logging.WARNING, logger="services.kvstore.server"):
        open_store(cfg).close()
    assert not [r for r in caplog.records if "SSD tier holds no page" in r.getMessage()]
