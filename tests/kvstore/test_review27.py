"""Regressions of the session-27 kvstore mends, on real RocksDB (write stops forced with RocksDB's own L0
stop trigger):

1. A stalled tier (a write stalled out: later writes fail fast) stayed stalled until a write of ours
   went through, however long ago RocksDB had lifted the stop: a later short stop (one slow flush or
   compaction, longer than STALLED_TRY_S) then failed every write meeting it, and deletes and owner
   rewrites were left pending without a try until the next probe (a second). Now the tier is stalled
   only while RocksDB reports that stop on.
2. Pending SSD records (deletes / owner rewrites RocksDB refused) lived in memory only: a crash left the
   released pages on disk, and a restart brought them back owned by the requests that had released
   them. Now each is journaled beside the DB and applied at open.
3. A pending delete's page stays on disk until it goes through, but its bytes had left `ssd_bytes`:
   usage reported too low, and the capacity check let the disk go past its budget. Now counted
   (`ssd_bytes`, and `pending_ssd_bytes` on its own), and the capacity check includes them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rocksdict import WriteOptions

from services.common.errors import Unavailable
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import SsdTier, WriteStalled
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES

Open = Callable[..., KvStore]
NS = "m@v1"


def _h(i: int, version: str = NS) -> bytes:
    return chain_hashes([i] * 4, 4, version)[0]


def _put(store: KvStore, i: int, owner: str = "r", version: str = NS) -> None:
    data = os.urandom(PAGE_BYTES)
    store.put(version, LAYOUT, _h(i, version), data, page_checksum(data), owner)


def _stop(tier: SsdTier, namespace: str = NS) -> None:
    """RocksDB stops every write of the DB: L0 holds 3 files of namespace's column family (made here if
    fewer), the stop trigger is 3 and compaction is held off (a compaction that cannot keep up at 36)."""
    cf = tier.raw_column_family(namespace)
    assert cf is not None
    cf.set_options({"level0_file_num_compaction_trigger": "1000"})
    i = 0
    while (cf.property_int_value("rocksdb.num-files-at-level0") or 0) < 3:
        cf.put(b"x%d" % i, b"y")  # outside the page and record prefixes
        cf.flush(True)
        i += 1
    cf.set_options({"level0_slowdown_writes_trigger": "3", "level0_stop_writes_trigger": "3"})
    assert tier._db.property_int_value("rocksdb.is-write-stopped") == 1


def _resume(tier: SsdTier, namespace: str = NS) -> None:
    """Lifts the stop; the L0 files stay (compaction still held off), so _stop can stop writes again."""
    cf = tier.raw_column_family(namespace)
    assert cf is not None
    cf.set_options({"level0_slowdown_writes_trigger": "36", "level0_stop_writes_trigger": "36"})
    assert tier._db.property_int_value("rocksdb.is-write-stopped") == 0


def _stall_out(store: KvStore) -> None:
    """A real stall: writes stop, an SSD-only Put waits out the (shortened) timeout and fails."""
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.5
    _stop(tier)
    with pytest.raises(Unavailable):
        _put(store, 99)
    assert tier.stalled


# ---------------------------------------------------------------- item 1: a lifted stall
def test_a_lifted_stall_ends_at_once_and_a_later_short_stop_is_waited_out(open_store: Open) -> None:
    store = open_store(dram_bytes=0)  # SSD only: every Put is an SSD write
    for i in range(4):
        _put(store, i)
    _stall_out(store)
    tier = store.raw_ssd()
    assert store.release(NS, "r", [_h(0)]) == 1  # the stalled tier's probe: tried once, still refused
    assert store.stats().pending_ssd_records == 1
    _resume(tier)  # RocksDB takes writes again (the compaction caught up)
    # Before: the tier counted as stalled until a write of ours went through, and the next probe was a
    # second away: this delete and the earlier one were left pending without a try.
    assert store.release(NS, "r", [_h(1)]) == 1
    assert store.stats().pending_ssd_records == 0
    assert not tier.stalled
    # A short stop (one slow compaction, 0.3 s): a Put meeting it waits it out, as on a healthy tier.
    # Before: refused after STALLED_TRY_S (UNAVAILABLE), the tier still stalled from the old stop.
    _stop(tier)
    lift = threading.Timer(0.3, _resume, (tier,))
    lift.start()
    try:
        t0 = time.monotonic()
        _put(store, 10)
        assert time.monotonic() - t0 >= 0.2
    finally:
        lift.join()
    assert not tier.stalled
    assert store.stats().pages == 3 and store.stats().pending_ssd_records == 0


def test_a_new_stop_met_while_failing_fast_is_waited_out(tmp_path: Path) -> None:
    """The glue of SsdTier._write: the stop that stalled the tier lifts while a write fails fast, and a
    new one (injected at the write's boundary: RocksDB's refusal of a no_slowdown write) refuses it
    for 0.3 s: that write waits the new stop out. Before: it failed after STALLED_TRY_S."""
    tier = SsdTier(str(tmp_path / "db"), min_blob_bytes=256, write_buffer_bytes=4 << 20)
    try:
        tier.put(NS, _h(0), b"p" * 512, b"{}")
        tier.write_stall_timeout_s = 0.5
        _stop(tier)
        with pytest.raises(WriteStalled):
            tier.put(NS, _h(1), b"p" * 512, b"{}")
        assert tier.stalled
        tries = 0
        t0 = time.monotonic()

        def write(opts: WriteOptions) -> None:
            nonlocal tries
            tries += 1
            if tries == 1:
                _resume(tier)  # the old stop lifts during the write's first try
            if time.monotonic() - t0 < 0.3:  # ... and a new one refuses it until 0.3 s
                raise Exception("Incomplete: Write stall")
            tier._db.put(b"k", b"v", opts)

        tier._write(write, WriteOptions())
        assert time.monotonic() - t0 >= 0.3
        assert not tier.stalled and tier._db.get(b"k") == b"v"
    finally:
        tier.close()


# ---------------------------------------------------------------- item 2: pending records survive a crash
def _crash(store: KvStore) -> None:
    """Drops a store as a crash would: RocksDB closed without the store's close (no flush of DRAM, no
    retry of pending records); the fixture's close is then a no-op."""
    store._closed = True
    store.raw_ssd().close()
    journal = getattr(store, "_journal", None)
    if journal is not None:
        journal.close()  # the descriptor, as the process's exit would


def _released_during_a_stop(store: KvStore) -> None:
    """Pages 0-2 owned by r, page 3 by r and q; RocksDB stops writes and r releases all four: three
    deletes and one owner rewrite are refused (pending)."""
    for i in range(4):
        _put(store, i)
    assert store.claim(NS, _h(3), "q")
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)
    assert store.release(NS, "r") == 4
    assert store.stats().pending_ssd_records == 4


def _only_q_left(store: KvStore) -> None:
    assert store.stats().pages == 1 and store.stats().pending_ssd_records == 0
    records = store.raw_ssd().iter_meta(NS)
    assert [h for h, _m in records] == [_h(3)] and '["q"]' in records[0][1].decode()
    assert store.release(NS, "r") == 0
    assert store.release(NS, "q") == 1 and store.stats().pages == 0


def test_pending_records_are_applied_after_a_crash(open_store: Open, tmp_path: Path) -> None:
    store = open_store(dram_bytes=0)  # SSD only: every page has a record on disk
    _released_during_a_stop(store)
    _crash(store)
    # Before: the 3 released pages came back owned by r (nobody releases them again: a leak until
    # LRU), and page 3 owned by r again.
    again = open_store()
    _only_q_left(again)
    again.close()
    assert not os.path.exists(tmp_path / "db" / "seer-pending-ssd.jsonl")  # nothing pending: no journal left


def test_pending_records_are_applied_after_a_killed_process(open_store: Open, tmp_path: Path) -> None:
    """The same with a real crash: a child process leaves the records pending and is killed (SIGKILL)."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal
        from services.kvstore.store import KvStore
        from tests.kvstore.test_review27 import _released_during_a_stop
        store = KvStore({str(tmp_path / "db")!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        _released_during_a_stop(store)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    _only_q_left(open_store(dram_bytes=0))


# ---------------------------------------------------------------- item 3: pending bytes
def test_pending_delete_bytes_count_in_ssd_bytes_and_against_the_capacity(open_store: Open) -> None:
    store = open_store(dram_bytes=0, ssd_bytes=4 * PAGE_BYTES)
    for i in range(4):
        _put(store, i)
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)
    assert store.release(NS, "r", [_h(0), _h(1)]) == 2  # both deletes refused: the pages stay on disk
    st = store.stats()
    assert st.ssd_pages == 2 and st.pending_ssd_records == 2
    # Before: ssd_bytes 2 pages, as if the disk held only the indexed ones.
    assert st.ssd_bytes == 4 * PAGE_BYTES and st.pending_ssd_bytes == 2 * PAGE_BYTES
    _resume(tier)
    for i in (4, 5):
        _put(store, i)
    # The disk holds at most the budget: the pending deletes were made (the capacity check counted
    # them). Before: 6 pages on disk for a budget of 4, 4 reported.
    assert len(tier.iter_meta(NS)) == 4
    st = store.stats()
    assert st.ssd_bytes == 4 * PAGE_BYTES and st.pending_ssd_bytes == 0 and st.evictions == 0


def test_a_stalled_tier_over_its_budget_does_not_evict_in_vain(open_store: Open) -> None:
    """While RocksDB refuses writes, an eviction's delete is refused too: it frees nothing on disk, so
    the store does not evict the SSD tier's pages one after another into pending deletes."""
    store = open_store(dram_bytes=2 * PAGE_BYTES, ssd_bytes=4 * PAGE_BYTES)
    for i in range(6):
        _put(store, i)  # 4 on SSD, 2 in DRAM
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)
    assert store.release(NS, "r", [_h(0)]) == 1  # refused: pending
    for i in range(6, 9):
        _put(store, i)  # each pushes a DRAM page out; its demotion fails (evicted)
    st = store.stats()
    assert st.ssd_pages == 3 and st.pending_ssd_records == 1, st
    assert st.ssd_bytes == 4 * PAGE_BYTES
