"""GetBatch with include_requests reads the batch's request records outside the core lock (every
record of a 65,536-request batch took 0.2-0.26 s under it: a stall of every commit), from the
RocksDB view its scan took when it was created under the lock, and close() waits for such a read
instead of closing RocksDB under it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

from services.buffer.core import BatchStatus, BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, RequestState, Sampling
from services.buffer.store import Scan, Store


def _core(tmp_path: Path) -> BufferCore:
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    spec = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=4, max_tokens=4,
                     sampling=Sampling(temperature=1.0))
    core.submit_batch("b", [spec, spec])
    return core


class _PausingScan(Scan):
    """The real Scan Store.scan made, waiting for `release` before its step number `at` (0: before
    its first step, the seek included). It wraps that scan rather than being one: the RocksDB
    iterator (and view) is the real scan's, created by Store.scan's call as the core's is, and its
    first step is Store.scan's own: a scan whose iterator came at its first step would make that
    step after the pause, and show the writes made during it."""

    def __init__(self, inner: Scan, at: int, started: threading.Event, release: threading.Event) -> None:
        # Scan.__init__ is not called: every step and the close go to `inner`, none to own state.
        self._inner = inner
        self._at = at
        self._step = 0
        self._started = started
        self._release = release

    def __next__(self) -> tuple[bytes, bytes]:
        if self._step == self._at:
            self._started.set()
            self._release.wait(10)
        self._step += 1
        return next(self._inner)

    def close(self) -> None:
        self._inner.close()


class _ScanFn(Protocol):
    """Store.scan's signature (its `start` has a default)."""

    def __call__(self, prefix: bytes, start: bytes | None = None) -> Scan: ...


def _pausing_scan(core: BufferCore, at: int, started: threading.Event, release: threading.Event) -> _ScanFn:
    """Store.scan whose scans are _PausingScan(real scan, at, started, release)."""
    real = core._store.scan

    def scan(prefix: bytes, start: bytes | None = None) -> Scan:
        return _PausingScan(real(prefix, start), at, started, release)

    return scan


def test_a_commit_during_a_request_read_neither_waits_for_it_nor_changes_it(tmp_path: Path) -> None:
    """The read pauses at its very first step: a commit then goes through at once (the first step
    under the lock made every commit wait for it), and the page is the store as of the GetBatch's
    batch record (the scan's view is taken under the lock), not with the commit's changes."""
    core = _core(tmp_path)
    try:
        started, release = threading.Event(), threading.Event()
        core._store.scan = _pausing_scan(core, 0, started, release)  # type: ignore[method-assign]
        got: list[BatchStatus] = []
        reader = threading.Thread(target=lambda: got.append(core.get_batch("b", include_requests=True)))
        reader.start()
        try:
            assert started.wait(5)
            t0 = time.monotonic()
            for rid in ("b/0/0", "b/1/3"):  # the first record in key order and the last
                core.commit_chunk(Commit(rid, 0, [5, 6], [-0.5, -0.5], FinishReason.STOP, 0))
            assert time.monotonic() - t0 < 3, "the commits waited for the read"
            assert reader.is_alive(), "the read ended before the commits: they did not run during it"
        finally:
            release.set()
            reader.join(10)
        [status] = got
        assert status.num_finished == 0 and status.generated_tokens == 0
        assert [(r.request_id, r.state, r.generated_tokens, r.num_chunks) for r in status.requests] == [
            (f"b/{g}/{s}", RequestState.PENDING, 0, 0) for g in range(2) for s in range(4)]
        after = {r.request_id: r for r in core.get_batch("b", include_requests=True).requests}
        assert after["b/0/0"].state == after["b/1/3"].state == RequestState.FINISHED  # the commits happened
    finally:
        core.close()


def test_close_waits_for_a_read_in_progress(tmp_path: Path) -> None:
    core = _core(tmp_path)
    started, release = threading.Event(), threading.Event()
    core._store.scan = _pausing_scan(core, 2, started, release)  # type: ignore[method-assign]
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(len(core.get_batch("b", include_requests=True).requests)))
    closer = threading.Thread(target=core.close)
    try:
        reader.start()
        assert started.wait(5)
        closer.start()
        time.sleep(0.2)
        assert closer.is_alive(), "close() did not wait for the read in progress"
        assert core._store_reads == 1  # the read is still counted: what close() waits for
    finally:
        # However an assert above ends, the read goes on and the store closes: no thread and no
        # open RocksDB (its LOCK) are left to the tests after this one.
        release.set()
        reader.join(5)
        if closer.ident is None:  # the assert failed before close() was called
            core.close()
        else:
            closer.join(5)
    assert got == [8] and not closer.is_alive()
