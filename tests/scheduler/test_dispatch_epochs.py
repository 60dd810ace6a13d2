"""Dispatch epochs never go back for a request (RunChunkRequest.dispatch_epoch, the draft service's
AppendRequest.epoch): the draft service refuses every append older than the newest epoch it has seen
for the request, and a worker ignores an Abort older than the attempt it runs.

Before session 25 the epoch was max(the request's last + 1, wall clock in microseconds): a wall
clock gone back (an NTP step, a restored VM, a restart on a host whose clock is behind) gave a
request tracked anew - a batch id submitted again, or any request after a scheduler restart - epochs
below its earlier attempts', so the newer attempt's appends were all refused as stale."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.scheduler.epochs import EpochClock

from .test_dispatcher_faults import item, wait_for

HOUR_NS = 3600 * 10**9


def _clock_back(monkeypatch: pytest.MonkeyPatch, ns: int) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - ns)


def test_a_request_tracked_anew_after_the_clock_went_back_gets_larger_epochs(
        make_rig: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch id "b" submitted again (a new submit_seq, the same request and group ids: the draft
    service may still hold the old group and its epochs) after the wall clock stepped back."""
    t = make_rig(policy="divided")
    t.register("w0")
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: "a" not in t.d._requests)
    old = max(req.dispatch_epoch for _wid, req in t.workers.requests)
    _clock_back(monkeypatch, HOUR_NS)
    again = item("a")
    again.submit_seq = 2
    t.d._add_items([again])
    wait_for(lambda: len(t.workers.requests) >= 3)
    new = t.workers.requests[2][1].dispatch_epoch
    assert new > old, f"epoch {new} of the new attempt is below {old}, the earlier attempt's"


def test_a_restarted_scheduler_keeps_epochs_above_the_old_ones_with_epoch_file(
        make_rig: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = str(tmp_path / "epochs")
    first = make_rig(policy="divided", epoch_file=path)
    first.register("w0")
    first.run()
    first.d._add_items([item("a", max_tokens=24)])  # chunks of 8 tokens: it is still running...
    wait_for(lambda: len(first.workers.requests) >= 2)
    first.close()  # ...when the scheduler stops
    old = max(req.dispatch_epoch for _wid, req in first.workers.requests)
    _clock_back(monkeypatch, HOUR_NS)  # and the new process's wall clock is an hour behind
    second = make_rig(policy="divided", epoch_file=path)
    second.register("w0")
    second.run()
    second.d._add_items([item("a", max_tokens=24, output=[7] * 8, next_seq=1)])
    wait_for(lambda: len(second.workers.requests) >= 1)
    assert second.workers.requests[0][1].dispatch_epoch > old


def test_epochs_increase_over_requests_and_follow_the_monotonic_clock() -> None:
    mono = [0]
    c = EpochClock(wall_ns=lambda: 5_000_000_000, monotonic_ns=lambda: mono[0])
    assert c.next() == 5_000_000
    assert c.next() == 5_000_001  # no clock tick: still larger
    mono[0] = 2_000_000_000  # 2 s later
    assert c.next() == 5_000_000 + 2_000_000
    assert c.next(after=10**12) == 10**12 + 1  # above the request's own last epoch
    assert c.next() == 10**12 + 2  # and every later epoch above it too


def test_the_epoch_file_is_written_once_per_reserve_and_read_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "epochs"
    writes: list[int] = []
    import services.scheduler.epochs as epochs

    real_write = epochs._write_floor

    def counted_write(p: str, v: int) -> None:
        writes.append(v)
        real_write(p, v)

    monkeypatch.setattr(epochs, "_write_floor", counted_write)
    mono = [0]
    c = EpochClock(str(path), wall_ns=lambda: 10**12 * 1000, monotonic_ns=lambda: mono[0], reserve_us=1000)
    first = c.next()
    for _ in range(10):
        c.next()
    assert writes == [first + 1000] and int(path.read_text()) == first + 1000
    mono[0] = 5_000_000  # 5 ms: past the reserved epochs
    e = c.next()
    assert writes[-1] == e + 1000
    restarted = EpochClock(str(path), wall_ns=lambda: 0, monotonic_ns=lambda: 0)  # a wall clock at 1970
    assert restarted.next() > e


def test_a_bad_epoch_file_is_refused_naming_the_option(tmp_path: Path) -> None:
    path = tmp_path / "epochs"
    path.write_text("not a number\n")
    with pytest.raises(ValueError, match="epoch_file"):
        EpochClock(str(path))


def test_an_empty_epoch_file_is_a_fresh_start(tmp_path: Path) -> None:
    """A file created empty beforehand (touched by a deployment) holds no floor yet: the clock
    starts from the wall clock and writes its first reservation there (it refused to start)."""
    path = tmp_path / "epochs"
    path.write_text("")
    c = EpochClock(str(path), wall_ns=lambda: 7_000_000_000, monotonic_ns=lambda: 0)
    e = c.next()
    assert e == 7_000_000
    assert int(path.read_text()) > e


def test_an_unwritable_epoch_file_logs_and_dispatch_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    c = EpochClock(str(tmp_path / "missing-dir" / "epochs"))
    with caplog.at_level(logging.ERROR):
        a, b = c.next(), c.next()
    assert a < b
    assert sum("dispatch epoch floor" in r.getMessage() for r in caplog.records) == 1  # once per reserve


def test_the_chunk_request_carries_the_batch_submit_seq(make_rig: Callable[..., Any]) -> None:
    """RunChunkRequest.submit_seq is the item's (the buffer's submission of the batch): the worker
    registers the draft group with it, which tells a resubmitted batch id's new run from a retry of
    the old run where dispatch epochs cannot (a clock gone back, a lost commit's retry)."""
    t = make_rig(policy="divided")
    t.register("w0")
    t.run()
    it = item("a")
    it.submit_seq = 77
    t.d._add_items([it])
    wait_for(lambda: len(t.workers.requests) >= 1)
    assert all(req.submit_seq == 77 for _wid, req in t.workers.requests)
