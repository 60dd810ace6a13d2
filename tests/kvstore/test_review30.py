"""Regressions of the session-30 kvstore mends, on real RocksDB with write stops forced by its own L0
stop trigger (helpers of test_review27/28), the crashes real SIGKILLs of a child process:

1. The pending-records journal wrote a delete ("+", meta null) for every pending delete, also for one
   that only freed the SSD copy of a page still indexed (hot in DRAM: capacity dropped its copy; or
   released, then stored again by another request into DRAM). Recovery took it for "the page is
   gone" and removed the page, its copy on disk and its owners with it, though the page was still
   owned: a miss its owners never asked for. Now the journal holds what recovery should make of
   the copy on disk: the page's owner record while the page is indexed, a delete once it is not.
2. An owner record that outlived its WAL-less page at a kill was dropped at its first Get and counted
   as a checksum failure. It is counted as an orphan owner record now (stats, GetKvStats, metrics).
3. The WAL (capped at max(32 MiB, write buffer / 2)) was outside --ssd-bytes. The service now reserves
   the cap out of it (the store's page budget is the rest) and refuses an ssd_bytes not above it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve
from services.kvstore.ssd import MIN_WAL_BYTES
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import PAGE_BYTES, Replica
from tests.kvstore.test_review27 import NS, _h, _put
from tests.kvstore.test_review28 import _owners, _run_killed

Open = Callable[..., KvStore]

# The child's part common to the item 1 tests: pages 0-5 owned by r with room for 4 in DRAM, so 0 and
# 1 are demoted to SSD; 2-5 released (DRAM only: no SSD write). Then writes stop, pages 0 and 1 are
# read (promoted into DRAM, staying on SSD) and the SSD budget shrinks to one page: capacity drops the
# SSD copy of page 1 (the least recently used), hot in DRAM, and RocksDB refuses the delete (pending).
_HOT_PAGE_WITH_A_PENDING_COPY_DELETE = """
    import os, signal
    from services.kvstore.store import KvStore
    from tests.kvstore.kvhelpers import PAGE_BYTES
    from tests.kvstore.test_review27 import NS, _h, _put, _stop
    store = KvStore({db!r}, dram_bytes=4 * PAGE_BYTES, ssd_bytes=1 << 20, min_blob_bytes=256)
    for i in range(6):
        _put(store, i)
    assert store.release(NS, "r", [_h(i) for i in range(2, 6)]) == 4
    assert store.stats().ssd_pages == 2
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)  # flushes the column family: pages 0 and 1 with their records (owner r) are durable
    assert store.get_page(NS, _h(1)) is not None and store.get_page(NS, _h(0)) is not None
    store.ssd_capacity_bytes = PAGE_BYTES
    _put(store, 7)  # into DRAM; then the capacity check
    s = store.stats()
    assert s.ssd_pages == 1 and s.pending_ssd_records == 1 and s.pending_ssd_bytes == PAGE_BYTES, s
"""


# The child's start of a test where r releases page 0 during a stop (pages 0 and 1 on SSD, owned by r;
# page 0's delete refused: pending). Its `store` goes on into the test's part (of the same indent).
PAGE_0_RELEASED_DURING_A_STOP = """
    import os, signal
    from services.kvstore.store import KvStore
    from tests.kvstore.kvhelpers import PAGE_BYTES
    from tests.kvstore.test_review27 import NS, _h, _put, _resume, _stop
    store = KvStore({db!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
    _put(store, 0)
    _put(store, 1)
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)  # flushes the column family: pages 0 and 1 with their records (owner r) are durable
    assert store.release(NS, "r", [_h(0)]) == 1
    assert store.stats().pending_ssd_records == 1
"""


def kill_leaving_an_orphan_record_of_page_0(db: str) -> None:
    """Pages 0 and 1 put (WAL-less), page 0 claimed by q (its record rewritten through the WAL), then a
    SIGKILL before the memtable flush: page 0's record (owners q, r) comes back without its page."""
    _run_killed(f"""
        import os, signal
        from services.kvstore.store import KvStore
        from tests.kvstore.test_review27 import NS, _h, _put
        store = KvStore({db!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        _put(store, 0)
        _put(store, 1)
        assert store.claim(NS, _h(0), "q")
        os.kill(os.getpid(), signal.SIGKILL)
    """)


def test_a_hot_page_whose_ssd_copy_delete_was_pending_survives_a_kill(open_store: Open, tmp_path: Path) -> None:
    """Page 1's SSD copy is dropped for capacity while it is hot in DRAM, the delete refused, and the
    process is killed: its DRAM copy is lost, the copy on disk is the page's only one and r still owns
    it. Before: recovery replayed the journaled delete and removed page 1 (a miss r never asked for)."""
    db = str(tmp_path / "db")
    _run_killed(_HOT_PAGE_WITH_A_PENDING_COPY_DELETE.format(db=db) + """
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert _owners(store, 1) == ["r"]
    assert store.get_page(NS, _h(1)) is not None
    assert store.stats().pending_ssd_records == 0
    assert store.release(NS, "r", [_h(1)]) == 1
    assert _owners(store, 1) is None


def test_a_pending_copy_delete_of_a_page_released_after_it_still_deletes(open_store: Open, tmp_path: Path) -> None:
    """As above, then r releases page 1 (DRAM only now: nothing written) before the kill: the page is
    gone, so recovery deletes the copy on disk (the journal line follows the index, not the first
    refusal)."""
    db = str(tmp_path / "db")
    _run_killed(_HOT_PAGE_WITH_A_PENDING_COPY_DELETE.format(db=db) + """
    assert store.release(NS, "r", [_h(1)]) == 1
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert _owners(store, 1) is None and _owners(store, 0) == ["r"]
    assert store.raw_ssd().get(NS, _h(1)) is None


def test_a_page_stored_again_into_dram_over_its_pending_delete_survives_a_kill(open_store: Open,
                                                                             tmp_path: Path) -> None:
    """r releases SSD page 0 during a stop (its delete refused: pending), q stores page 0 again (into
    DRAM: nothing written to SSD) and the process is killed. Before: the journal still held r's delete,
    and recovery removed the copy on disk that q's page could come back from. Now it comes back owned
    by q alone (r released it)."""
    db = str(tmp_path / "db")
    _run_killed(PAGE_0_RELEASED_DURING_A_STOP.format(db=db) + """
    store._dram.capacity_bytes = 4 * PAGE_BYTES  # q's Put lands in DRAM
    _put(store, 0, owner="q")
    assert store.stats().dram_pages == 1 and store.stats().pending_ssd_records == 1
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert _owners(store, 0) == ["q"]
    assert store.get_page(NS, _h(0)) is not None
    assert store.release(NS, "r", [_h(0)]) == 0


def test_an_orphan_owner_record_is_counted_as_such_not_as_a_checksum_failure(open_store: Open,
                                                                           tmp_path: Path) -> None:
    """A page's put skips the WAL, its owner record's rewrite does not: killed before the memtable
    flush, the record comes back without its page. Before: counted in checksum_failures."""
    kill_leaving_an_orphan_record_of_page_0(str(tmp_path / "db"))
    store = open_store(dram_bytes=0)
    assert [(h, d) for h, d, _c in store.get(NS, [_h(0)])] == [(_h(0), None)]
    s = store.stats()
    assert s.checksum_failures == 0 and s.orphan_owner_records == 1, s
    assert s.pages == 0 and s.ssd_bytes == 0
    _put(store, 0)
    assert store.get_page(NS, _h(0)) is not None and store.stats().orphan_owner_records == 1


# ---------------------------------------------------------------- item 3: the WAL inside --ssd-bytes
def test_the_wal_cap_is_reserved_out_of_ssd_bytes(replicas: Callable[..., Replica], tmp_path: Path) -> None:
    """The page budget is ssd_bytes less the WAL cap (32 MiB, or half a larger write buffer); a config
    leaving nothing for pages is refused naming ssd_bytes, by validate and by serve (a config built
    directly). Before: the budget was all of ssd_bytes, the WAL on disk beside it."""
    r = replicas("a", ssd_bytes=MIN_WAL_BYTES + 64 * PAGE_BYTES)
    assert r.store is not None and r.store.stats().ssd_capacity_bytes == 64 * PAGE_BYTES
    big = KvStoreConfig(data_dir=str(tmp_path / "b"), ssd_bytes=1 << 30, ssd_write_buffer_bytes=256 << 20)
    assert big.ssd_page_bytes() == (1 << 30) - (128 << 20)
    for cfg in (KvStoreConfig(data_dir=str(tmp_path / "c"), ssd_bytes=MIN_WAL_BYTES),
                big.replace(ssd_bytes=128 << 20)):
        with pytest.raises(ValueError, match=r"^ssd_bytes: must be > \d+, the WAL cap"):
            cfg.validate()
        with pytest.raises(ValueError, match=r"^ssd_bytes: "):
            serve(cfg)  # type: ignore[arg-type]
