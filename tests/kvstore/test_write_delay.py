"""RocksDB's write delay (L0 past its slowdown trigger: writes throttled to a rate) against its write
stop (writes refused until a flush or compaction frees room), on a real SsdTier. A no_slowdown write
gets "Write stall" for both; only a stop may fail it (WriteStalled, never a hang): a delayed write
goes through RocksDB's throttle and succeeds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from services.kvstore.ssd import SsdTier, WriteStalled

NS = "m@v1"
PAGE = 720 * 1024  # a SmolLM2 page in float32


def _tier(path: Path, *, stop_at_l0: int) -> SsdTier:
    """A tier whose namespace column family is delayed from 2 L0 files on and stopped at
    `stop_at_l0`; L0 is never compacted (the trigger is out of reach), so the condition holds."""
    t = SsdTier(str(path), min_blob_bytes=64 * 1024, write_buffer_bytes=4 << 20)
    t.ensure_namespace(NS)
    cf = t.raw_column_family(NS)
    assert cf is not None
    cf.set_options({"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "2",
                    "level0_stop_writes_trigger": str(stop_at_l0)})
    for _ in range(2):  # two L0 files: the delay starts
        t.put(NS, os.urandom(32), os.urandom(4096), b"{}")
        cf.flush(True)
    return t


def test_a_burst_under_a_write_delay_is_throttled_not_failed(tmp_path: Path) -> None:
    t = _tier(tmp_path / "db", stop_at_l0=1000)
    t.write_stall_timeout_s = 1.0
    try:
        assert t._db.property_int_value("rocksdb.actual-delayed-write-rate")  # delayed...
        assert t._db.property_int_value("rocksdb.is-write-stopped") == 0  # ...not stopped
        page = os.urandom(PAGE)
        t0 = time.monotonic()
        stalled = 0
        for _ in range(40):
            try:
                t.put(NS, os.urandom(32), page, b"{}")
            except WriteStalled:
                stalled += 1
            if time.monotonic() - t0 > 30:
                break
        wall = time.monotonic() - t0
        # Retried with no_slowdown, each refused try booked its delay again: 30 of 31 puts failed
        # WriteStalled in 30 s (1 s timeout). The throttle (16 MiB/s) takes 40 pages in ~2 s.
        assert stalled == 0 and wall < 15, f"{stalled} puts stalled, {wall:.1f} s"
    finally:
        t.close()


def test_a_write_stop_still_fails_instead_of_hanging(tmp_path: Path) -> None:
    t = _tier(tmp_path / "db", stop_at_l0=3)
    t.write_stall_timeout_s = 0.5
    try:
        cf = t.raw_column_family(NS)
        assert cf is not None
        t.put(NS, os.urandom(32), os.urandom(4096), b"{}")
        cf.flush(True)  # the third L0 file: writes stop
        assert t._db.property_int_value("rocksdb.is-write-stopped") == 1
        t0 = time.monotonic()
        with pytest.raises(WriteStalled):
            t.put(NS, os.urandom(32), os.urandom(PAGE), b"{}")
        assert time.monotonic() - t0 < 3
    finally:
        t.close()
