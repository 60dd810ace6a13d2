"""The journal line of a page stored again over its old SSD copy (whose delete is pending) describes
that copy, on real RocksDB with a write stop forced by its own L0 stop trigger and a real SIGKILL
(helpers of test_review27/28/30).

r releases SSD page 0 during a stop (its delete refused: pending), q stores page 0 again into DRAM
with other bytes (KV computed in another batch need not match bit for bit), and the process is
killed: the copy on disk is the page's only one, and the journal says what recovery makes of it.
Before, that line carried the checksum of q's bytes in DRAM for the copy holding r's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from services.kvstore.checksum import page_checksum
from services.kvstore.pending import FILE_NAME
from services.kvstore.store import KvStore, _decode_meta
from tests.kvstore.test_review27 import NS, _h
from tests.kvstore.test_review28 import _owners, _run_killed
from tests.kvstore.test_review30 import PAGE_0_RELEASED_DURING_A_STOP

Open = Callable[..., KvStore]


def test_a_page_stored_again_over_its_pending_copy_journals_the_copys_checksum(open_store: Open,
                                                                             tmp_path: Path) -> None:
    db = str(tmp_path / "db")
    _run_killed(PAGE_0_RELEASED_DURING_A_STOP.format(db=db) + """
    store._dram.capacity_bytes = 4 * PAGE_BYTES  # q's Put lands in DRAM
    _put(store, 0, owner="q")  # fresh random bytes: not the copy on disk
    from services.kvstore.checksum import page_checksum
    on_disk = store.raw_ssd().get(NS, _h(0))  # r's copy, its delete pending
    assert on_disk is not None and page_checksum(on_disk) != store.get_page(NS, _h(0))[1]
    os.kill(os.getpid(), signal.SIGKILL)
    """)
    # The journal as the killed process left it (the next open rewrites it).
    lines = [json.loads(line) for line in Path(db, FILE_NAME).read_text().splitlines()]
    page_0 = [rec for rec in lines if rec[2] == _h(0).hex()]
    assert page_0 and page_0[-1][0] == "+" and page_0[-1][3] is not None, page_0
    journaled = _decode_meta(page_0[-1][3].encode("utf-8"))
    assert journaled is not None and journaled.owners == {"q"}

    store = open_store(dram_bytes=0)
    copy = store.raw_ssd().get(NS, _h(0))
    assert copy is not None
    # What the line says is what the disk holds: r's bytes, under q's ownership.
    assert (journaled.checksum, journaled.size) == (page_checksum(copy), len(copy))
    assert _owners(store, 0) == ["q"]
    found = store.get_page(NS, _h(0))
    assert found is not None and found[1] == page_checksum(copy)
    s = store.stats()
    assert s.checksum_failures == 0 and s.misses == 0, s
