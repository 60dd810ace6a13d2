"""GetBatch with include_requests reads the batch's request records outside the core lock (every
record of a 65,536-request batch took 0.2-0.26 s under it: a stall of every commit), and close()
waits for such a read instead of closing RocksDB under it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import services.buffer.core as core_mod
from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store


def _core(tmp_path: Path) -> BufferCore:
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    spec = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=4, max_tokens=4,
                     sampling=Sampling(temperature=1.0))
    core.submit_batch("b", [spec, spec])
    return core


def test_the_request_scan_starts_under_the_lock_and_reads_outside_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's view is taken under the lock (its iterator, created by its first step, then
    matches the batch record copied there: a retention delete or the id submitted again before the
    scan started showed one submission's status with another's requests, or with none); the
    records are decoded after the lock is released."""
    core = _core(tmp_path)
    try:
        real = core._store.scan
        at_start: list[bool] = []
        decoded: list[bool] = []

        def scan(*a: Any, **kw: Any) -> Iterator[Any]:
            for i, kv in enumerate(real(*a, **kw)):
                if i == 0:
                    at_start.append(core._lock._is_owned())  # type: ignore[attr-defined]
                yield kv

        real_decode = core_mod.RequestRecord.decode

        def decode(raw: bytes) -> Any:
            decoded.append(core._lock._is_owned())  # type: ignore[attr-defined]
            return real_decode(raw)

        core._store.scan = scan  # type: ignore[method-assign]
        monkeypatch.setattr(core_mod.RequestRecord, "decode", staticmethod(decode))
        status = core.get_batch("b", include_requests=True)
        assert len(status.requests) == 8
        assert at_start == [True]
        assert decoded and not any(decoded)
    finally:
        core.close()


def test_close_waits_for_a_read_in_progress(tmp_path: Path) -> None:
    core = _core(tmp_path)
    real = core._store.scan
    started, release = threading.Event(), threading.Event()

    def slow_scan(*a: Any, **kw: Any) -> Iterator[Any]:
        for i, kv in enumerate(real(*a, **kw)):
            if i == 2:
                started.set()
                release.wait(5)
            yield kv

    core._store.scan = slow_scan  # type: ignore[method-assign]
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(len(core.get_batch("b", include_requests=True).requests)))
    reader.start()
    assert started.wait(5)
    closer = threading.Thread(target=core.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive(), "close() did not wait for the read in progress"
    release.set()
    reader.join(5)
    closer.join(5)
    assert got == [8] and not closer.is_alive()
