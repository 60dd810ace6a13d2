"""Namespace records stay bounded over an RL run (one namespace per policy version), in memory and in
the RocksDB registry, across restarts of the real store.

Before: every namespace ever created kept its record (layout, creation order) after its pages had
all gone, and every superseded version kept a tombstone record: the metadata grew by one record per
iteration for good. Now an empty namespace is forgotten once _IDLE_NAMESPACES others were emptied
after it, and a family keeps only its highest tombstone (which refuses every lower version anyway).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from services.common.errors import FailedPrecondition
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import SsdTier
from services.kvstore.store import _IDLE_NAMESPACES, KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES

Open = Callable[..., KvStore]


def _h(ns: int, page: int) -> bytes:
    return ns.to_bytes(8, "big") + page.to_bytes(8, "big")


def _put(store: KvStore, namespace: str, hashes: list[bytes], owner: str = "r") -> None:
    for h in hashes:
        data = os.urandom(PAGE_BYTES)
        store.put(namespace, LAYOUT, h, data, page_checksum(data), owner)


def _checkpoint(i: int) -> str:
    return f"smollm2@{i:012x}@v{i}"  # as the worker names a loaded checkpoint: its own family


def test_records_of_emptied_versions_are_forgotten_and_stay_so_after_a_restart(open_store: Open) -> None:
    store = open_store("db", dram_bytes=2 * PAGE_BYTES)
    for i in range(60):
        _put(store, _checkpoint(i), [_h(i, p) for p in range(3)], owner=f"req{i}")  # DRAM and SSD
        assert store.release(_checkpoint(i), f"req{i}") == 3
    live = _checkpoint(60)
    _put(store, live, [_h(60, p) for p in range(3)], owner="live")
    # Before: 61 namespaces and 61 registry records.
    assert store.stats().namespaces == _IDLE_NAMESPACES + 1
    assert len(store.raw_ssd().registry()) == _IDLE_NAMESPACES + 1
    store.close()

    again = open_store("db", dram_bytes=2 * PAGE_BYTES)
    assert again.stats().namespaces == _IDLE_NAMESPACES + 1
    assert set(again.raw_ssd().registry()) == {live} | {_checkpoint(i) for i in range(60 - _IDLE_NAMESPACES, 60)}
    assert again.exists(live, [_h(60, p) for p in range(3)]) == 3
    # A forgotten version is a new namespace to a late Put (its family knows no other version).
    _put(again, _checkpoint(5), [_h(5, 0)])
    assert again.exists(_checkpoint(5), [_h(5, 0)]) == 1


def test_a_family_keeps_one_tombstone_and_still_refuses_every_older_version(open_store: Open) -> None:
    store = open_store("db", dram_bytes=0)
    for i in range(40):
        _put(store, f"fam@v{i}", [_h(i, 0)])  # each version supersedes (drops) the one before
    assert store.stats().dropped_namespaces == 39
    # The live version and one tombstone (v38); before: 40 records.
    assert sorted(store.raw_ssd().registry()) == ["fam@v38", "fam@v39"]
    store.close()

    again = open_store("db", dram_bytes=0)
    assert sorted(again.raw_ssd().registry()) == ["fam@v38", "fam@v39"]
    for old in ("fam@v38", "fam@v20", "fam@v0"):  # tombstoned, or older than the newest: refused
        with pytest.raises(FailedPrecondition, match="namespace"):
            _put(again, old, [_h(1000, 0)])
    assert again.exists("fam@v39", [_h(39, 0)]) == 1
    _put(again, "fam@v40", [_h(40, 0)])
    assert sorted(again.raw_ssd().registry()) == ["fam@v39", "fam@v40"]


def test_a_forgotten_newest_version_leaves_its_tombstones_refusing(open_store: Open) -> None:
    store = open_store("db", dram_bytes=0)
    _put(store, "fam@v1", [_h(1, 0)])
    _put(store, "fam@v2", [_h(2, 0)], owner="a")  # drops v1
    assert store.release("fam@v2", "a") == 1
    for i in range(_IDLE_NAMESPACES):  # v2 becomes the namespace emptied longest ago: forgotten
        _put(store, _checkpoint(i), [_h(10 + i, 0)], owner="b")
        store.release(_checkpoint(i), "b")
    assert "fam@v2" not in store.raw_ssd().registry()
    with pytest.raises(FailedPrecondition, match="namespace"):
        _put(store, "fam@v1", [_h(1, 1)])
    with pytest.raises(FailedPrecondition, match="older than the family's newest"):
        _put(store, "fam@v0", [_h(0, 1)])
    _put(store, "fam@v2", [_h(2, 1)])  # the live version's next Put re-creates it
    assert store.exists("fam@v2", [_h(2, 1)]) == 1


def test_a_kept_older_version_forgotten_while_empty_is_created_again(open_store: Open) -> None:
    """keep_versions = 2 keeps the version before the newest (a version change has both live). Once
    that one emptied and _IDLE_NAMESPACES others emptied after it, it was forgotten, and its next
    Put was then refused as a straggler, though it would be kept were it still held (review,
    session 25). A version the family would not keep is still refused."""
    store = open_store("db", dram_bytes=0, keep_versions=2)
    _put(store, "m@w@v1", [_h(1, 0)], owner="a")
    _put(store, "m@w@v2", [_h(2, 0)], owner="b")  # both kept
    assert store.release("m@w@v1", "a") == 1
    for i in range(_IDLE_NAMESPACES):  # v1 becomes the namespace emptied longest ago: forgotten
        _put(store, _checkpoint(i), [_h(10 + i, 0)], owner="c")
        store.release(_checkpoint(i), "c")
    assert "m@w@v1" not in store.raw_ssd().registry()
    _put(store, "m@w@v1", [_h(1, 1)], owner="d")  # still one of the two kept versions
    assert store.exists("m@w@v1", [_h(1, 1)]) == 1
    assert store.exists("m@w@v2", [_h(2, 0)]) == 1  # and it drops nothing newer
    with pytest.raises(FailedPrecondition, match="older than the family's newest"):
        _put(store, "m@w@v0", [_h(0, 1)])  # two versions below the newest: not kept
    _put(store, "m@w@v3", [_h(3, 0)])  # drops v1 (tombstoned) and keeps v2, v3
    with pytest.raises(FailedPrecondition, match="namespace"):
        _put(store, "m@w@v1", [_h(1, 2)])
    assert store.exists("m@w@v2", [_h(2, 0)]) == 1


def test_recovery_compacts_the_records_an_older_store_left(open_store: Open, tmp_path: object) -> None:
    """A store from before kept a record per namespace ever seen and a tombstone per dropped one."""
    store = open_store("db", dram_bytes=0)
    _put(store, "fam@v30", [_h(30, 0)])
    path = store.raw_ssd().path
    store.close()
    ssd = SsdTier(path, min_blob_bytes=256)
    for i in range(30):
        ssd.put_registry(f"fam@v{i}", json.dumps({"seq": 1000 + i, "dropped": True}).encode())
        ssd.put_registry(_checkpoint(i), json.dumps({"layout": LAYOUT.to_json(), "seq": 2000 + i}).encode())
    ssd.close()

    again = open_store("db", dram_bytes=0)
    records = set(again.raw_ssd().registry())
    assert records == {"fam@v30", "fam@v29"} | {_checkpoint(i) for i in range(30 - _IDLE_NAMESPACES, 30)}
    with pytest.raises(FailedPrecondition, match="namespace"):
        _put(again, "fam@v3", [_h(3, 0)])
    assert again.exists("fam@v30", [_h(30, 0)]) == 1
