"""RocksDB write delays and stops on a real SsdTier.

A delayed write (L0 past its slowdown trigger: writes throttled to a rate) sleeps inside RocksDB with
the GIL held (rocksdict keeps it through the call) and the store's lock taken, so the process starves
for the delay, and a delay that turns into a stop meanwhile hangs it. A no_slowdown write is refused
under a delay too, and retried it crawls (each refused try books its delay again). So the tier never
delays writes, it only stops them, and a stopped write is retried sleeping in Python, then fails
(WriteStalled), never a hang, while the rest of the process keeps running (review, session 25).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from services.kvstore.ssd import SsdTier, WriteStalled

NS = "m@v1"
PAGE = 720 * 1024  # a SmolLM2 page in float32


def _l0_files(t: SsdTier, n: int) -> None:
    """n more L0 files in NS (compaction held off: its trigger is out of reach)."""
    cf = t.raw_column_family(NS)
    assert cf is not None
    for _ in range(n):
        t.put(NS, os.urandom(32), os.urandom(4096), b"{}")
        cf.flush(True)


def _held_off(path: Path, **options: str) -> SsdTier:
    t = SsdTier(str(path), min_blob_bytes=64 * 1024, write_buffer_bytes=4 << 20)
    t.ensure_namespace(NS)
    cf = t.raw_column_family(NS)
    assert cf is not None
    cf.set_options({"level0_file_num_compaction_trigger": "1000", **options})
    return t


def test_the_tier_never_delays_writes(tmp_path: Path) -> None:
    """Past RocksDB's default slowdown trigger (20 L0 files) and short of the stop (36), writes are
    neither delayed nor stopped. Before: delayed from 20 files on (the throttle, GIL held)."""
    t = _held_off(tmp_path / "db")
    try:
        _l0_files(t, 24)
        assert t._db.property_int_value("rocksdb.actual-delayed-write-rate") == 0
        assert t._db.property_int_value("rocksdb.is-write-stopped") == 0
        t0 = time.monotonic()
        for _ in range(8):
            t.put(NS, os.urandom(32), os.urandom(PAGE), b"{}")
        assert time.monotonic() - t0 < 5
    finally:
        t.close()


def test_a_write_stop_fails_without_hanging_and_the_process_runs_meanwhile(tmp_path: Path) -> None:
    t = _held_off(tmp_path / "db", level0_slowdown_writes_trigger="3", level0_stop_writes_trigger="3")
    t.write_stall_timeout_s = 1.0
    ticks = [0]
    done = threading.Event()

    def spin() -> None:  # another Python thread: a gRPC handler, the health servicer
        while not done.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    th = threading.Thread(target=spin, daemon=True)
    try:
        _l0_files(t, 3)  # the third L0 file: writes stop
        assert t._db.property_int_value("rocksdb.is-write-stopped") == 1
        th.start()
        t0 = time.monotonic()
        with pytest.raises(WriteStalled):
            t.put(NS, os.urandom(32), os.urandom(PAGE), b"{}")
        wall = time.monotonic() - t0
        assert wall < 3
        # The retries sleep in Python: the other thread ran all along (a write blocked inside
        # RocksDB holds the GIL, and it would have run a handful of times at most).
        assert ticks[0] > 20 * wall, (ticks[0], wall)
    finally:
        done.set()
        t.close()

