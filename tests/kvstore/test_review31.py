"""Regressions of the session-31 kvstore mends, on real RocksDB (write stops forced by its own L0 stop
trigger, helpers of test_review27/28/30), the crashes real SIGKILLs of a child process:

1. A Put over an orphan owner record (its WAL-less page lost at a kill) added its owner to the record
   and returned False: with put verification the page was never stored (only a Get dropped the
   record), without it the Put went through the "stored page failed its checksum" path and counted a
   checksum failure. Now the Put drops the orphan record (counted in orphan_owner_records) and stores
   the page.
2. Journal paths the session-30 tests left open: an owner change of a hot page whose SSD copy's
   delete is pending re-journals the page's owner record (_owners_changed), and a compaction of the
   journal writes what is journaled (_journaled_meta), not the page's current intent.
3. A demotion refused while a page's old SSD copy waits for its pending delete evicted the page, its
   bytes still on disk: the copy is kept (the pending delete cancelled) instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from services.kvstore.pending import FILE_NAME
from services.kvstore.store import KvStore
from tests.kvstore.test_review27 import NS, _h, _put
from tests.kvstore.test_review28 import _owners, _run_killed
from tests.kvstore.test_review30 import (
    _HOT_PAGE_WITH_A_PENDING_COPY_DELETE,
    PAGE_0_RELEASED_DURING_A_STOP,
    kill_leaving_an_orphan_record_of_page_0,
)

Open = Callable[..., KvStore]


# ---------------------------------------------------------------- item 1: a Put over an orphan record
@pytest.mark.parametrize("verify", [True, False])
def test_a_put_over_an_orphan_owner_record_stores_the_page(open_store: Open, tmp_path: Path, verify: bool) -> None:
    """Page 0 is put (WAL-less), claimed by q (the record through the WAL) and the process killed: its
    record comes back without its page. A Put of page 0 by z, no Get before it. Before: with put
    verification z was added to the orphan record and the page stayed missing; without, the Put stored
    it but counted a checksum failure."""
    kill_leaving_an_orphan_record_of_page_0(str(tmp_path / "db"))
    store = open_store(dram_bytes=0, verify_put_checksums=verify)
    assert _owners(store, 0) == ["q", "r"] and store.raw_ssd().get(NS, _h(0)) is None
    _put(store, 0, owner="z")
    s = store.stats()
    assert s.orphan_owner_records == 1 and s.checksum_failures == 0, s
    assert _owners(store, 0) == ["z"]  # the orphan record's owners went with it, as at a Get
    assert store.get_page(NS, _h(0)) is not None
    assert store.release(NS, "z", [_h(0)]) == 1 and _owners(store, 0) is None


# ---------------------------------------------------------------- item 2: journal paths
def test_an_owner_change_of_a_hot_page_with_a_pending_copy_delete_is_journaled(open_store: Open,
                                                                             tmp_path: Path) -> None:
    """Hot page 1's SSD copy delete is pending (journaled: r's owner record); q claims it and r releases
    it (DRAM only: no SSD write), then the kill. Recovery must keep the copy owned by q alone. Without
    the re-journal on an owner change the journal still held r's record: page 1 came back owned by r,
    who had released it."""
    db = str(tmp_path / "db")
    _run_killed(_HOT_PAGE_WITH_A_PENDING_COPY_DELETE.format(db=db) + """
    assert store.claim(NS, _h(1), "q")
    assert store.release(NS, "r", [_h(1)]) == 1
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert _owners(store, 1) == ["q"]
    assert store.get_page(NS, _h(1)) is not None
    assert store.release(NS, "r", [_h(1)]) == 0


def test_a_compacted_journal_keeps_a_hot_pages_owner_record(open_store: Open, tmp_path: Path) -> None:
    """Hot page 1's SSD copy delete is pending (journaled: r's owner record); 3000 owner changes of page 0
    during the same stop make the journal compact (rewritten whole), then the kill. The rewrite must
    keep page 1's owner record: written as a delete (its copy is no longer the page's intended SSD
    state), recovery removed page 1, which r still owned."""
    db = str(tmp_path / "db")
    _run_killed(_HOT_PAGE_WITH_A_PENDING_COPY_DELETE.format(db=db) + """
    for k in range(3000):
        assert store.claim(NS, _h(0), "owner-%04d" % k)
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    journal = Path(db, FILE_NAME).read_text().splitlines()
    assert len(journal) < 3000  # compacted
    page_1 = [json.loads(line) for line in journal if _h(1).hex() in line]
    assert page_1 and page_1[-1][0] == "+" and page_1[-1][3] is not None, page_1  # its record, not a delete
    store = open_store(dram_bytes=0)
    assert _owners(store, 1) == ["r"]
    assert store.get_page(NS, _h(1)) is not None


# ---------------------------------------------------------------- item 3: a refused demotion keeps the copy
def test_a_refused_demotion_keeps_the_pages_copy_whose_delete_is_pending(open_store: Open, tmp_path: Path) -> None:
    """r releases SSD page 0 during a stop (its delete refused: pending), q stores page 0 again into
    DRAM, and page 5 pushes it out of DRAM while writes are still stopped: its demotion is refused.
    Before: page 0 was evicted (a miss for q) though its bytes were still on disk. Now the pending
    delete is cancelled and the copy indexed, owned by q (its record's rewrite pending), across a
    kill too."""
    db = str(tmp_path / "db")
    _run_killed(PAGE_0_RELEASED_DURING_A_STOP.format(db=db) + """
    store._dram.capacity_bytes = PAGE_BYTES
    _put(store, 0, owner="q")
    _put(store, 5, owner="q")  # pushes page 0 out of DRAM: its demotion is refused
    s = store.stats()
    assert s.evictions == 0 and s.ssd_pages == 2 and s.pending_ssd_bytes == 0 and s.pending_ssd_records == 1, s
    assert s.ssd_bytes == 2 * PAGE_BYTES, s
    assert store.get_page(NS, _h(0)) is not None
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert _owners(store, 0) == ["q"]
    assert store.get_page(NS, _h(0)) is not None
    assert store.release(NS, "r", [_h(0)]) == 0
    assert store.release(NS, "q", [_h(0)]) == 1 and store.raw_ssd().get(NS, _h(0)) is None
