"""RocksDB column families and memtable memory over many namespaces (one per policy version).

Before: the SSD tier created a column family per namespace and dropped one only when a newer
version of the same family superseded it. A worker names each loaded checkpoint its own family
(services.worker.core.version_name), so an RL run (a new version per iteration) kept one column
family per iteration, each with its own memtables (64 MiB x 2 budget, holding the released pages'
bytes until a flush that an old version's column family never got): RocksDB memory grew without
bound. Now an empty namespace's column family is dropped (but for the two most recently written
to SSD), at runtime and at recovery, and one db-wide write buffer caps all memtables together.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from services.common import config
from services.common.errors import InvalidArgument
from services.common.kvlayout import KVLayout
from services.kvstore.checksum import page_checksum
from services.kvstore.config import KvStoreConfig
from services.kvstore.ssd import SsdTier
from services.kvstore.store import _IDLE_NAMESPACES, KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica

Open = Callable[..., KvStore]
MiB = 1024 * 1024
# 64 KiB pages: 4 tokens x 64 layers x K/V x 4 heads x 8 dims x 4 bytes (blob-sized, few Puts).
BIG = KVLayout(dtype="float32", page_size=4, num_layers=64, num_kv_heads=4, head_dim=8)


def _version(i: int) -> str:
    # As the worker names them after a LoadWeights: every checkpoint is its own family, so no
    # version supersedes (and drops) another.
    return f"smollm2@{i:012x}@v{i}"


def _page_hash(ns: int, page: int) -> bytes:
    return ns.to_bytes(8, "big") + page.to_bytes(8, "big")


def _put(store: KvStore, namespace: str, hashes: list[bytes], owner: str = "r", layout: KVLayout = LAYOUT) -> None:
    for h in hashes:
        data = os.urandom(layout.page_bytes)
        store.put(namespace, layout, h, data, page_checksum(data), owner)


def _cfs_on_disk(path: str) -> list[str]:
    """The column families RocksDB would open next time (read from the MANIFEST; 'default' included)."""
    return Rdict.list_cf(path, Options(raw_mode=True))


def _options_value(path: str, key: str) -> str:
    """A value from the newest OPTIONS file RocksDB wrote: the options the DB actually runs with."""
    newest = max((f for f in os.listdir(path) if f.startswith("OPTIONS-")), key=lambda f: int(f.split("-")[1]))
    with open(os.path.join(path, newest), encoding="utf-8") as fh:
        for line in fh:
            name, _, value = line.strip().partition("=")
            if name == key:
                return value
    raise AssertionError(f"{key} not in {newest}")


@pytest.mark.parametrize("how", ["released", "evicted"])
def test_column_families_stay_bounded_over_many_versions(open_store: Open, how: str) -> None:
    # SSD only, so every page is written to RocksDB. "evicted": the SSD budget holds one version's
    # pages, so each version's Puts evict the previous one's instead of a Release.
    store = open_store("db", dram_bytes=0, ssd_bytes=4 * PAGE_BYTES)
    path = store.raw_ssd().path
    for i in range(50):
        _put(store, _version(i), [_page_hash(i, p) for p in range(4)], owner=f"req{i}")
        if how == "released":
            assert store.release(_version(i), f"req{i}") == 4
    stats = store.stats()
    assert stats.pages == (0 if how == "released" else 4)
    # Only the namespaces emptied last are still known (test_version_records.py); before: all 50.
    assert stats.namespaces == _IDLE_NAMESPACES + (0 if how == "released" else 1)
    # The two namespaces written last keep theirs (a live version is not made to drop and
    # re-create its column family each time its pages momentarily all leave SSD). Before: 50.
    assert len(store.raw_ssd().namespaces()) <= 2
    assert len(_cfs_on_disk(path)) <= 3  # + "default"
    assert set(store.raw_ssd().namespaces()) <= {_version(48), _version(49)}


def test_a_namespace_whose_column_family_was_dropped_works_again(open_store: Open) -> None:
    store = open_store("db", dram_bytes=0)
    ns = _version(1)
    _put(store, ns, [_page_hash(1, 0)], owner="a")
    assert store.release(ns, "a") == 1
    # Empty, but the namespace last written to SSD: kept (dropping and re-creating a column family
    # costs MANIFEST writes under the store lock, and the live version's next page would pay it).
    assert ns in store.raw_ssd().namespaces()
    _put(store, _version(2), [_page_hash(2, 0)], owner="b")
    _put(store, _version(3), [_page_hash(3, 0)], owner="c")  # ns is no longer among the recent two
    assert ns not in store.raw_ssd().namespaces()
    assert "ns:" + ns not in _cfs_on_disk(store.raw_ssd().path)
    # A Put into it re-creates its column family; the namespace itself was never forgotten: its
    # layout is still enforced.
    hashes = [_page_hash(1, p) for p in range(3)]
    data = [os.urandom(PAGE_BYTES) for _ in hashes]
    for h, d in zip(hashes, data, strict=True):
        assert store.put(ns, LAYOUT, h, d, page_checksum(d), "d")
    assert ns in store.raw_ssd().namespaces()
    assert [got for _, got, _ in store.get(ns, hashes)] == data
    assert store.exists(ns, hashes) == 3
    other = KVLayout("float32", 4, 2, 2, 8)
    with pytest.raises(InvalidArgument, match=r"layout\.num_kv_heads"):
        store.put(ns, other, _page_hash(1, 9), os.urandom(other.page_bytes), 0, "d")
    # And it survives a restart like any other.
    store.close()
    again = open_store("db", dram_bytes=0)
    assert [got for _, got, _ in again.get(ns, hashes)] == data
    assert again.release(ns, "d") == 3


class _DropFails:
    """Stands in for the SSD tier's RocksDB handle: drop_column_family fails (a full disk refuses
    the MANIFEST write), everything else goes to the real one."""

    def __init__(self, db: Rdict) -> None:
        self.db = db

    def drop_column_family(self, name: str) -> None:
        raise Exception("IO error: No space left on device")

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def test_a_failed_column_family_drop_leaves_the_namespace_usable(open_store: Open) -> None:
    store = open_store("db", dram_bytes=0)
    ssd = store.raw_ssd()
    ns = _version(1)
    _put(store, ns, [_page_hash(1, 0)], owner="a")
    _put(store, _version(2), [_page_hash(2, 0)], owner="b")
    _put(store, _version(3), [_page_hash(3, 0)], owner="c")
    real = ssd._db
    ssd._db = _DropFails(real)  # type: ignore[assignment]
    try:
        assert store.release(ns, "a") == 1  # the drop fails: logged, not raised
        assert ns in ssd.namespaces()
        _put(store, ns, [_page_hash(1, 1)], owner="a2")  # the column family is still there to write to
        assert store.exists(ns, [_page_hash(1, 1)]) == 1
    finally:
        ssd._db = real
    assert store.release(ns, "a2") == 1  # empty again (and recent: kept for now)
    _put(store, _version(4), [_page_hash(4, 0)], owner="d")
    _put(store, _version(5), [_page_hash(5, 0)], owner="e")  # no longer recent: now the drop goes through
    assert ns not in ssd.namespaces()
    assert "ns:" + ns not in _cfs_on_disk(ssd.path)


def test_recovery_drops_the_column_families_of_empty_namespaces(open_store: Open, tmp_path: Path) -> None:
    # The state a store from before this change leaves: a column family per namespace it ever saw,
    # most of them empty (their pages released). Made here by deleting pages behind the store's back.
    store = open_store("db", dram_bytes=0)
    for i in range(10):
        _put(store, _version(i), [_page_hash(i, 0)], owner=f"req{i}")
    kept = [_page_hash(99, p) for p in range(2)]
    _put(store, "keep@v1", kept, owner="k")
    store.close()
    path = str(tmp_path / "db")
    ssd = SsdTier(path, min_blob_bytes=256)
    for i in range(10):
        ssd.ensure_namespace(_version(i))
        ssd.delete(_version(i), _page_hash(i, 0))
    ssd.close()
    assert len(_cfs_on_disk(path)) == 12

    again = open_store("db", dram_bytes=0)
    assert again.raw_ssd().namespaces() == ["keep@v1"]
    assert sorted(_cfs_on_disk(path)) == ["default", "ns:keep@v1"]
    s = again.stats()
    # keep@v1 and the empty namespaces created last (the oldest two are forgotten at recovery).
    assert (s.namespaces, s.pages) == (_IDLE_NAMESPACES + 1, 2)
    assert again.exists("keep@v1", kept) == 2
    _put(again, _version(3), [_page_hash(3, 1)], owner="new")  # an emptied namespace takes Puts again
    assert again.exists(_version(3), [_page_hash(3, 1)]) == 1


def test_a_hot_page_keeps_working_when_its_ssd_copy_and_column_family_go(open_store: Open) -> None:
    """SSD capacity frees the SSD copy of a page still hot in DRAM (promoted): when that was its
    namespace's last SSD page, the column family goes too, and the page's later demotion makes a
    new one."""
    a, b, c, d = (_version(i) for i in range(4))
    # DRAM: two small pages. SSD: a's page and two BIG ones (BIG pages do not fit DRAM: straight to SSD).
    store = open_store("db", dram_bytes=2 * PAGE_BYTES, ssd_bytes=PAGE_BYTES + 2 * BIG.page_bytes + 100)
    a0 = _page_hash(0, 0)
    page = os.urandom(PAGE_BYTES)
    assert store.put(a, LAYOUT, a0, page, page_checksum(page), "o")
    _put(store, a, [_page_hash(0, 1), _page_hash(0, 2)], owner="x")  # demotes a0 to SSD
    assert store.release(a, "x") == 2
    assert store.get_page(a, a0) is not None  # promoted: in DRAM and on SSD
    _put(store, b, [_page_hash(1, 0)], layout=BIG)
    _put(store, c, [_page_hash(2, 0)], layout=BIG)  # a is no longer recent; its SSD page keeps its column family
    assert a in store.raw_ssd().namespaces()
    _put(store, d, [_page_hash(3, 0)], layout=BIG)  # over the SSD budget: a0's SSD copy is freed first
    assert a not in store.raw_ssd().namespaces()
    got = store.get_page(a, a0)
    assert got is not None and bytes(got[0]) == page  # from DRAM
    _put(store, _version(4), [_page_hash(4, 0), _page_hash(4, 1)])  # demotes a0 again
    assert a in store.raw_ssd().namespaces()
    assert store.raw_ssd().get(a, a0) == page
    got = store.get_page(a, a0)
    assert got is not None and bytes(got[0]) == page


def test_tiers_and_column_families_agree_under_churn(open_store: Open) -> None:
    """Random Puts, Gets, Releases and capacity evictions over a few namespaces with both tiers
    small, so pages are demoted, promoted, have their SSD copy freed while hot in DRAM and are
    evicted: every stored page stays readable with its bytes, every namespace with pages on SSD
    has its column family, and no other column family is open but the two most recently written."""
    store = open_store("db", dram_bytes=3 * PAGE_BYTES, ssd_bytes=6 * PAGE_BYTES, release_tombstone_s=0)
    rng = random.Random(7)
    names = [_version(i) for i in range(5)]
    stored: dict[tuple[str, bytes], bytes] = {}
    for step in range(600):
        ns = rng.choice(names)
        h = _page_hash(names.index(ns), rng.randrange(6))
        op = rng.random()
        if op < 0.5:
            data = os.urandom(PAGE_BYTES)
            if store.put(ns, LAYOUT, h, data, page_checksum(data), f"o{rng.randrange(2)}"):
                stored[(ns, h)] = data
        elif op < 0.8:
            got = store.get_page(ns, h)
            if got is not None:
                assert bytes(got[0]) == stored[(ns, h)], step
        else:
            store.release(ns, f"o{rng.randrange(2)}", [h] if rng.random() < 0.5 else [])
        on_ssd = {key[0] for key in store._ssd_lru}
        open_cfs = set(store.raw_ssd().namespaces())
        assert on_ssd <= open_cfs, step
        assert open_cfs - on_ssd <= set(store._ssd_recent), step
        assert len(store._ssd_recent) <= 2
        assert sum(n.ssd_pages for n in store._namespaces.values()) == len(store._ssd_lru) == store.stats().ssd_pages
    for key, data in stored.items():
        got = store.get_page(*key)
        assert got is None or bytes(got[0]) == data
    assert store.stats().checksum_failures == 0  # no page was ever looked for in a dropped column family


def _memtable_bytes(store: KvStore) -> int:
    ssd = store.raw_ssd()
    total = 0
    for ns in ssd.namespaces():
        cf = ssd.raw_column_family(ns)
        assert cf is not None
        total += cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        del cf  # a live handle would keep RocksDB's LOCK at close
    return total


def test_one_write_buffer_caps_the_memtables_of_all_namespaces(open_store: Open) -> None:
    # 6 namespaces x 1.5 MiB of pages kept (not released), nothing flushed by hand: with a budget
    # per column family only, all 9 MiB (12 MiB of arena blocks) stay in memtables for good.
    cap = 2 * MiB
    store = open_store("db", dram_bytes=0, ssd_bytes=64 * MiB, ssd_write_buffer_bytes=cap)
    assert _options_value(store.raw_ssd().path, "db_write_buffer_size") == str(cap)
    for i in range(6):
        _put(store, _version(i), [_page_hash(i, p) for p in range(24)], owner="r", layout=BIG)
    # Past 7/8 of the cap a write makes RocksDB flush the oldest memtable whose column family has no
    # flush under way, in the background: the last bulk writes can leave more than the cap behind
    # (their flushes were still running), and the writes that follow bring it down. Without a
    # db-wide cap no write ever does (each column family's memtable is far below its own 64 MiB).
    extra = 0
    while (used := _memtable_bytes(store)) > 2 * cap:
        assert extra < 100, f"{used} bytes in memtables after {extra} more pages, cap {cap}"
        _put(store, _version(6), [_page_hash(6, extra)], owner="r", layout=BIG)
        extra += 1
        time.sleep(0.02)
    assert store.stats().pages == 6 * 24 + extra
    assert store.exists(_version(0), [_page_hash(0, p) for p in range(24)]) == 24


def test_the_default_write_buffer_is_db_wide(open_store: Open) -> None:
    store = open_store("db")
    assert _options_value(store.raw_ssd().path, "db_write_buffer_size") == str(64 * MiB)
    with pytest.raises(InvalidArgument, match="ssd_write_buffer_bytes"):
        open_store("other", ssd_write_buffer_bytes=0)


def test_the_write_buffer_flag_reaches_rocksdb(tmp_path: Path) -> None:
    assert KvStoreConfig().ssd_write_buffer_bytes == 64 * MiB
    cfg = config.load(KvStoreConfig, "kvstore", ["--ssd-write-buffer-bytes", str(8 * MiB)], {})
    assert cfg.ssd_write_buffer_bytes == 8 * MiB
    env = config.load(KvStoreConfig, "kvstore", [], {"SEER_KVSTORE_SSD_WRITE_BUFFER_BYTES": str(4 * MiB)})
    assert env.ssd_write_buffer_bytes == 4 * MiB
    with pytest.raises(ValueError, match="ssd_write_buffer_bytes"):
        KvStoreConfig(ssd_write_buffer_bytes=0).validate()
    r = Replica(tmp_path / "r", ssd_write_buffer_bytes=8 * MiB)
    try:
        assert _options_value(r.cfg.data_dir, "db_write_buffer_size") == str(8 * MiB)
    finally:
        r.stop()


def test_a_burst_of_puts_stays_within_the_memtable_budget(open_store: Open) -> None:
    """The db-wide budget alone is soft: past 7/8 of it the mutable memtable is switched for a flush,
    but the next one fills up to RocksDB's per column family default (64 MiB, x2) while the flush
    runs. Measured with 720 KiB pages: a burst peaked at 2x a 64 MiB budget and 8x a 16 MiB one.
    Now a column family holds at most 2 memtables of a quarter of the budget: writes wait beyond."""
    cap = 4 * MiB
    store = open_store("db", dram_bytes=0, ssd_bytes=1 << 30, ssd_write_buffer_bytes=cap)
    peak = 0
    for p in range(160):  # 10 MiB of pages in one burst, into one namespace
        _put(store, _version(1), [_page_hash(1, p)], owner="r", layout=BIG)
        peak = max(peak, store.stats().memtable_bytes)
    # Half the budget (+ the default column family's registry writes and arena rounding).
    assert peak <= cap * 5 // 8, f"{peak} bytes in memtables, budget {cap}"
    assert store.exists(_version(1), [_page_hash(1, p) for p in range(160)]) == 160
    assert _options_value(store.raw_ssd().path, "write_buffer_size") == str(cap // 4)
    assert _options_value(store.raw_ssd().path, "max_write_buffer_number") == "2"


class _Stalling:
    """A RocksDB write that keeps reporting a write stall (memtables full, the flush not finishing)
    for `times` tries, as a no_slowdown write does."""

    def __init__(self, times: int) -> None:
        self.left = times

    def __call__(self, _opts: object = None) -> None:
        if self.left > 0:
            self.left -= 1
            raise Exception("Operation incomplete: Write stall")


def test_a_stalled_write_is_retried_then_fails_instead_of_hanging(open_store: Open) -> None:
    from services.common.errors import Unavailable
    from services.kvstore.ssd import WriteStalled

    store = open_store("db", dram_bytes=0)
    ssd = store.raw_ssd()
    stall = _Stalling(3)
    ssd._write(stall, ssd._page_write)  # retried until RocksDB takes it
    assert stall.left == 0
    ssd.write_stall_timeout_s = 0.2
    t0 = time.monotonic()
    with pytest.raises(WriteStalled):
        ssd._write(_Stalling(10**9), ssd._page_write)
    assert time.monotonic() - t0 < 2
    # Through the store: a Put whose page cannot be written is UNAVAILABLE naming data, not a hang.
    real = ssd._db
    ssd.ensure_namespace(_version(1))

    class _Full:
        def write(self, *_a: object) -> None:
            raise Exception("Operation incomplete: Write stall")

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    ssd._db = _Full()  # type: ignore[assignment]
    try:
        with pytest.raises(Unavailable, match="data"):
            _put(store, _version(1), [_page_hash(1, 0)])
    finally:
        ssd._db = real
    assert store.exists(_version(1), [_page_hash(1, 0)]) == 0
