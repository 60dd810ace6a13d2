"""Store.scan on a real RocksDB: its items are the store as of the call (the core takes a scan
under its lock and steps it after releasing the lock), a read error fails the scan instead of ending
it early (rocksdict's items() stopped at a corrupted block without error, halfway through a batch),
and GetBatch turns that error into DATA_LOSS naming the batch, not a partial answer."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, group, submit
from seer.v1 import rollout_pb2

from services.buffer.store import Store, request_key
from services.common.errors import DataLoss


def _put(store: Store, items: dict[bytes, bytes]) -> None:
    wb = store.new_batch()
    for k, v in items.items():
        wb.put(k, v)
    store.write(wb)


def test_a_scan_reads_the_store_as_of_its_creation_not_its_first_step(tmp_path: Path) -> None:
    """Writes, deletes and a flush between the call and the first step do not show: the core
    relies on it to read GetBatch's request records outside its lock, consistent with the batch
    record it copied under the lock. A scan whose iterator were made at its first step (a lazy
    generator) would read the new values here."""
    store = Store(tmp_path / "db")
    try:
        old = {request_key("b", 0, s): f"old-{s}".encode() for s in range(4)}
        _put(store, old)
        scan = store.scan(b"r/b/")  # not stepped yet
        _put(store, {request_key("b", 0, 0): b"new-first", request_key("b", 0, 3): b"new-last",
                     request_key("b", 0, 9): b"inserted", b"r/b/": b"inserted-before-the-first"})
        wb = store.new_batch()
        wb.delete(request_key("b", 0, 2))
        store.write(wb)
        store._db.flush(True)  # the new values in an SST file, the memtable the scan saw gone
        assert list(scan) == sorted(old.items())
        assert [v for _k, v in store.scan(b"r/b/")] == [b"inserted-before-the-first", b"new-first", b"old-1",
                                                       b"new-last", b"inserted"]
    finally:
        store.close()


def test_close_drops_the_iterator_before_the_first_step(tmp_path: Path) -> None:
    """close() of a scan never stepped (GetBatch's exit when decoding never began) ends it, and the
    store then closes and reopens (an iterator left alive would keep the DB's LOCK)."""
    store = Store(tmp_path / "db")
    _put(store, {request_key("b", 0, 0): b"v"})
    scan = store.scan(b"r/b/")
    scan.close()
    scan.close()  # idempotent
    assert list(scan) == []
    store.close()
    again = Store(tmp_path / "db")
    assert [v for _k, v in again.scan(b"r/b/")] == [b"v"]
    again.close()


N = 8192  # 64-byte random values: ~100 data blocks of 4 KiB, so one corrupted block is in the middle


def _data_size(store: Store) -> int:
    """The bytes of data blocks in the store's (one) SST file: they come first in the file, before
    the range deletions, the index and the footer, which are read when the store opens."""
    props = store._db.property_value("rocksdb.aggregated-table-properties") or ""
    m = re.search(r"data block size=(\d+)", props)
    assert m, props
    return int(m.group(1))


def _corrupt(db: Path, offset: int) -> None:
    """Overwrites 64 bytes of the one SST file at offset: that data block's checksum fails."""
    [sst] = [p for p in db.iterdir() if p.suffix == ".sst"]
    with sst.open("r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 64)


def test_a_read_error_fails_the_scan_instead_of_ending_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    _put(store, {request_key("b", i // 1024, i % 1024): os.urandom(64) for i in range(N)})
    store._db.flush(True)
    data_size = _data_size(store)
    store.close()
    _corrupt(tmp_path / "db", data_size // 2)
    store = Store(tmp_path / "db")
    try:
        read = 0
        with pytest.raises(DataLoss, match=r"r/b/.*Corruption") as info:
            for _item in store.scan(b"r/b/"):
                read += 1
        assert 0 < read < N, read  # the records before the bad block came, then the error
        assert f"after {read} items" in str(info.value)
    finally:
        store.close()


def test_get_batch_of_a_corrupted_store_is_data_loss_naming_the_batch(
        make_buffer: Callable[..., BufferHandle]) -> None:
    """The batch is cancelled (terminal), so recovery at start does not read its request records;
    GetBatch with include_requests does, and fails instead of answering with the first half."""
    buf = make_buffer()
    submit(buf.rollout, "big", [group(prompt_key=f"p{g}", group_size=1024, max_tokens=8) for g in range(N // 1024)])
    buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="big"), timeout=10)
    buf.core._store._db.flush(True)
    # The request records are the last keys and most of the data (b/, g/, m/ come first).
    offset = _data_size(buf.core._store) * 3 // 4
    buf.stop()  # closes the core and its store
    _corrupt(Path(buf.cfg.data_dir), offset)
    buf = make_buffer()
    status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="big"), timeout=10)  # the b/ record reads
    assert status.state == rollout_pb2.BATCH_STATE_CANCELLED and status.num_requests == N
    details = expect_error(lambda: buf.rollout.GetBatch(
        rollout_pb2.GetBatchRequest(batch_id="big", include_requests=True), timeout=10), grpc.StatusCode.DATA_LOSS)
    assert "batch 'big'" in details and "Corruption" in details, details
    # A later read still answers (the failed read ended and released its iterator).
    assert buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="big"), timeout=10).num_requests == N
