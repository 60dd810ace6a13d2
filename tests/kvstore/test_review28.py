"""Regressions of the session-28 kvstore mends (review of the session-27 pending SSD records journal), on
real RocksDB with write stops forced by its own L0 stop trigger (helpers of test_review27):

1. A pending delete or owner rewrite was resolved (its journal line dropped) as soon as RocksDB took the
   retried write, but deletes and owner records skipped the WAL: the write sat in an unflushed memtable,
   and a SIGKILL lost it with its journal line, so released pages came back owned by the releasing
   request. Now deletes and owner records go through the WAL. A logged owner record may then outlive
   its page's WAL-less put at a crash: such a record without its page is a miss, not an error.
2. Every owner change of a page with a pending rewrite appended its whole owner list to the journal,
   which was only compacted when a record resolved: a long stop grew it without bound.
3. A journal line that was a JSON object failed the store's open (KeyError); a "+" whose meta was not
   a string (or did not decode) was taken for a delete, removing a live page.
4. A pending delete whose column family was then dropped kept its bytes in ssd_bytes, pending_ssd_bytes
   and against the capacity.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from services.kvstore.pending import FILE_NAME
from services.kvstore.store import KvStore
from tests.kvstore.kvhelpers import PAGE_BYTES
from tests.kvstore.test_review27 import NS, _crash, _h, _put, _resume, _stall_out, _stop

Open = Callable[..., KvStore]
ROOT = Path(__file__).resolve().parents[2]


def _run_killed(script: str) -> None:
    """Runs script in a child process that ends by SIGKILL (no close, no flush: a crash)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                          timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()


def _owners(store: KvStore, i: int) -> list[str] | None:
    entry = store._namespaces[NS].entries.get(_h(i))
    return None if entry is None else sorted(entry.owners)


# ---------------------------------------------------------------- item 1: resolved records survive a kill
def test_records_resolved_after_a_stop_survive_a_killed_process(open_store: Open, tmp_path: Path) -> None:
    """Pages 0-3 owned by r, page 2 also by q. During a stop r releases pages 0 and 2 (a delete and an
    owner rewrite, both refused: pending); the stop lifts and r releases page 1, which retries both
    (accepted: journal emptied) and deletes page 1; then the process is killed. Before: the three
    writes were in a WAL-less memtable and were lost, the journal already gone: pages 0 and 1 came
    back owned by r, page 2 owned by r and q."""
    db = str(tmp_path / "db")
    _run_killed(f"""
        import os, signal
        from services.kvstore.store import KvStore
        from tests.kvstore.test_review27 import NS, _h, _put, _resume, _stop
        store = KvStore({db!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        for i in range(4):
            _put(store, i)
        assert store.claim(NS, _h(2), "q")
        tier = store.raw_ssd()
        tier.write_stall_timeout_s = 0.2
        _stop(tier)  # flushes the column family: pages 0-3 and their records are durable
        assert store.release(NS, "r", [_h(0), _h(2)]) == 2
        assert store.stats().pending_ssd_records == 2
        _resume(tier)
        assert store.release(NS, "r", [_h(1)]) == 1
        assert store.stats().pending_ssd_records == 0 and not os.path.exists({db!r} + "/{FILE_NAME}")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    assert [_owners(store, i) for i in range(4)] == [None, None, ["q"], ["r"]]
    assert store.stats().pages == 2 and store.stats().pending_ssd_records == 0


def test_an_owner_record_outliving_its_page_at_a_kill_is_a_miss(open_store: Open, tmp_path: Path) -> None:
    """A page's put skips the WAL, the owner record rewritten after it does not: killed before the
    memtable flush, RocksDB replays the record without its page. The store opens, and the page is a
    miss (dropped from the index at its first Get), stored again by the next Put."""
    db = str(tmp_path / "db")
    _run_killed(f"""
        import os, signal
        from services.kvstore.store import KvStore
        from tests.kvstore.test_review27 import NS, _h, _put
        store = KvStore({db!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        _put(store, 0)
        assert store.claim(NS, _h(0), "q")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    store = open_store(dram_bytes=0)
    records = store.raw_ssd().iter_meta(NS)
    assert [h for h, _m in records] == [_h(0)] and store.raw_ssd().get(NS, _h(0)) is None  # the orphan record
    assert [(h, d) for h, d, _c in store.get(NS, [_h(0)])] == [(_h(0), None)]
    assert store.stats().pages == 0 and store.stats().ssd_bytes == 0
    assert store.release(NS, "q") == 0
    _put(store, 0)
    assert store.get_page(NS, _h(0)) is not None


# ---------------------------------------------------------------- item 2: a bounded journal
def test_the_journal_stays_bounded_while_owners_change_during_a_stop(open_store: Open, tmp_path: Path) -> None:
    """300 claims of one SSD page during a stop, each journaling its owner list (long request ids).
    Before: every line appended, 11 MB, compacted only when a record resolved; now rewritten once it
    holds far more bytes than at its last rewrite. The journal still brings every owner back."""
    store = open_store(dram_bytes=0)
    _put(store, 0)
    _stall_out(store)
    path = tmp_path / "db" / FILE_NAME
    owners = {f"{k:04d}" + "x" * 200 for k in range(300)}
    largest = 0
    for owner in sorted(owners):
        assert store.claim(NS, _h(0), owner)
        largest = max(largest, path.stat().st_size)
    assert store.stats().pending_ssd_records == 1
    assert largest < 2 << 20, largest
    _crash(store)
    again = open_store(dram_bytes=0)
    assert set(_owners(again, 0) or []) == owners | {"r"}


# ---------------------------------------------------------------- item 3: malformed journal lines
def test_malformed_journal_lines_are_skipped(open_store: Open, tmp_path: Path) -> None:
    store = open_store(dram_bytes=0)
    for i in range(3):
        _put(store, i)
    store.close()
    lines = [
        '{"op": "+"}',  # before: KeyError, the store did not open
        json.dumps(["+", NS, _h(0).hex(), 5]),  # before: read as "5", a delete of live page 0
        json.dumps(["+", NS, _h(0).hex(), ["r"]]),  # likewise
        json.dumps(["+", NS, _h(1).hex(), "not a record"]),  # before: taken for a delete of page 1
        json.dumps(["+", NS, "zz", None]),
        json.dumps(["-", 7, _h(0).hex()]),
        '["+", "' + NS,  # cut short by a crash
        json.dumps(["+", NS, _h(2).hex(), None]),  # well formed: page 2's delete still applies
    ]
    (tmp_path / "db" / FILE_NAME).write_text("\n".join(lines) + "\n")
    again = open_store(dram_bytes=0)
    assert [_owners(again, i) for i in range(3)] == [["r"], ["r"], None]
    assert [h for h, _m in again.raw_ssd().iter_meta(NS)] == sorted([_h(0), _h(1)])
    assert again.stats().pending_ssd_records == 0


# ---------------------------------------------------------------- item 4: pending deletes of a dropped column family
def test_a_pending_delete_goes_with_an_idle_column_familys_drop(open_store: Open) -> None:
    """Namespace a's page is released during a stop (its delete pending); a has no SSD page left and
    two other namespaces were written since, so its column family is dropped, page and all. Before:
    the page's bytes kept counting in ssd_bytes and pending_ssd_bytes."""
    store = open_store(dram_bytes=0)
    _put(store, 0, version="a")
    _put(store, 0, version="b")
    _put(store, 0, version="c")  # a is no longer one of the two recent namespaces
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier, "b")
    assert store.release("a", "r") == 1
    assert tier.raw_column_family("a") is None  # dropped with the page (a drop is not a write)
    st = store.stats()
    assert st.pending_ssd_records == 0 and st.pending_ssd_bytes == 0, st
    assert st.ssd_bytes == 2 * PAGE_BYTES


def test_a_pending_delete_goes_with_a_dropped_namespace(open_store: Open) -> None:
    store = open_store(dram_bytes=0)
    for i in range(2):
        _put(store, i)
    tier = store.raw_ssd()
    tier.write_stall_timeout_s = 0.2
    _stop(tier)
    assert store.release(NS, "r", [_h(0)]) == 1  # its delete refused: pending
    _resume(tier)
    assert store.drop_namespace(NS) == 1
    st = store.stats()
    # Before: only the pages still indexed were unpended; page 0's delete stayed, 1 page counted.
    assert st.pending_ssd_records == 0 and st.pending_ssd_bytes == 0 and st.ssd_bytes == 0, st
