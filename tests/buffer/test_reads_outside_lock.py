"""read_results (StreamResults' pages) and history() (GetHistory, the scheduler's priors) read and
decode stored values outside the core lock: a page is up to results_page_bytes of results (a single
result up to a gRPC message) and a prompt key's history with tokens is MBs, and decoding them under
the lock stalled every CommitChunk and SubmitBatch as long. The page comes from a view of the store
taken under the lock (a retention delete meanwhile does not show), and close() waits for a read in
progress instead of closing RocksDB under it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import services.buffer.core as core_mod
from services.buffer import store as keys
from services.buffer.core import BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, RolloutResult, Sampling
from services.buffer.store import Store

WAIT = 10.0  # seconds a step may take on a loaded machine; passing runs never wait this long


def _core(path: Path, retain_batches: int = 0) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None),
                      retain_batches=retain_batches)


def _submit(core: BufferCore, batch_id: str, prompt_key: str = "pk", group_size: int = 2) -> None:
    core.submit_batch(batch_id, [GroupSpec(prompt_key=prompt_key, prompt_token_ids=(1, 2), group_size=group_size,
                                           max_tokens=64, sampling=Sampling(seed=1))])


def _finish(core: BufferCore, request_id: str, n: int = 8) -> None:
    out = core.commit_chunk(Commit(request_id, 0, [5] * n, [-0.5] * n, FinishReason.STOP, 0))
    assert out.request_finished


def _commit_elsewhere(core: BufferCore) -> threading.Event:
    """Commits an unfinished chunk of batch "other" in a thread; the event is set once it returned."""
    done = threading.Event()

    def run() -> None:
        core.commit_chunk(Commit("other/0/0", 0, [3, 4], [-0.1, -0.2], FinishReason.CHUNK, 0))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


class _Gate:
    """Holds the first call of a patched function at its start until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.lock_held: list[bool] = []

    def wrap(self, core: BufferCore, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*a: Any, **kw: Any) -> Any:
            self.lock_held.append(core._lock._is_owned())  # type: ignore[attr-defined]
            if not self.entered.is_set():
                self.entered.set()
                self.release.wait(WAIT)
            return fn(*a, **kw)
        return gated


def _reader(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    t.start()
    return t, got


def _commit_while_held(core: BufferCore, gate: _Gate, read: Callable[[], Any], what: str) -> Any:
    """Runs read in a thread, and while the gate holds it commits elsewhere: the commit must not wait
    for the read. Returns what read returned."""
    reader, got = _reader(read)
    try:
        assert gate.entered.wait(WAIT)
        assert _commit_elsewhere(core).wait(WAIT), f"a commit waited for {what}"
    finally:
        gate.release.set()
    reader.join(WAIT)
    return got[0]


@pytest.fixture
def core(tmp_path: Path) -> Iterator[BufferCore]:
    c = _core(tmp_path / "db")
    _submit(c, "a")
    _finish(c, "a/0/0")
    _finish(c, "a/0/1")  # completes "a": history of "pk"
    _submit(c, "other")
    yield c
    c.close()


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "stored-before-sizes"])
def test_a_commit_goes_on_while_a_results_page_decodes(core: BufferCore, monkeypatch: pytest.MonkeyPatch,
                                                       sized: bool) -> None:
    if not sized:  # a store written before result sizes were kept: the page is sized as it is read
        wb = core._store.new_batch()
        wb.delete_range(b"z/a/", b"z/a0")
        core._store.write(wb)
    gate = _Gate()
    monkeypatch.setattr(RolloutResult, "decode", staticmethod(gate.wrap(core, RolloutResult.decode)))
    # Before: read_results decoded under the lock, and the commit waited for the whole page.
    page, done = _commit_while_held(core, gate, lambda: core.read_results("a", 0), "a results page to decode")
    assert [r.request_id for _i, r in page] == ["a/0/0", "a/0/1"] and done
    assert gate.lock_held and not any(gate.lock_held)


def test_a_commit_goes_on_while_a_history_is_read(core: BufferCore) -> None:
    gate = _Gate()
    real_get = core._store.get
    gated_get = gate.wrap(core, real_get)
    core._store.get = lambda key: gated_get(key) if key.startswith(b"h/") else real_get(key)  # type: ignore[method-assign]
    # Before: history() read the value under the lock.
    reply = _commit_while_held(core, gate, lambda: core.newest_history(["pk"], with_tokens=True), "a history read")
    assert [(k, it.lengths) for k, it in reply.histories] == [("pk", [8, 8])]
    assert not any(gate.lock_held)


def test_a_page_is_read_from_its_view_whatever_retention_deletes_meanwhile(tmp_path: Path) -> None:
    """The page's values come from a snapshot taken with the batch record, under the lock: retention
    deleting the batch (its first reader called read_results directly, so nothing held it) between
    the lock's release and the read must not turn the page into DataLoss or a short page."""
    c = _core(tmp_path / "db", retain_batches=1)
    try:
        _submit(c, "a")
        _finish(c, "a/0/0")
        _finish(c, "a/0/1")
        _submit(c, "other", prompt_key="other", group_size=1)
        gate = _Gate()
        real_view = c._store.view

        def view() -> Any:
            v = real_view()
            v.get_many = gate.wrap(c, v.get_many)  # type: ignore[method-assign]
            return v

        c._store.view = view  # type: ignore[method-assign]
        reader, got = _reader(lambda: c.read_results("a", 0))
        try:
            assert gate.entered.wait(WAIT)
            _finish(c, "other/0/0")  # completes "other": retention (1 batch) deletes "a"
            assert c._store.get(keys.result_key("a", 0)) is None
        finally:
            gate.release.set()
        reader.join(WAIT)
        page, done = got[0]
        assert [r.request_id for _i, r in page] == ["a/0/0", "a/0/1"] and done
    finally:
        c.close()


def test_close_waits_for_a_page_being_decoded(core: BufferCore, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate()
    monkeypatch.setattr(core_mod.RolloutResult, "decode", staticmethod(gate.wrap(core, RolloutResult.decode)))
    reader, got = _reader(lambda: core.read_results("a", 0))
    assert gate.entered.wait(WAIT)
    closer = threading.Thread(target=core.close, daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() did not wait for the read in progress"
    gate.release.set()
    reader.join(WAIT)
    closer.join(WAIT)
    assert not closer.is_alive() and len(got[0][0]) == 2


def test_a_decoding_error_leaves_no_iterator_open_past_close(tmp_path, monkeypatch):
    """GetBatch with its requests: a record that fails to decode ends the read with the scan's
    generator alive in the exception's traceback; its RocksDB iterator held the DB's LOCK after
    close(), and the store could not be opened again while the traceback lived (review, session 27)."""
    from services.buffer.records import GroupSpec, Sampling
    from services.buffer.store import Store

    core = BufferCore(Store(tmp_path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    core.submit_batch("a", [GroupSpec(prompt_key="pk", prompt_token_ids=(1, 2), group_size=3, max_tokens=64,
                                      sampling=Sampling(seed=1))])

    def broken(_v: bytes, *, key: bytes) -> None:
        raise ValueError(f"corrupt record {key!r}")

    monkeypatch.setattr(core_mod.RequestRecord, "decode", staticmethod(broken))
    with pytest.raises(ValueError) as kept:  # `kept` holds the traceback, and with it the generator
        core.get_batch("a", include_requests=True)
    core.close()
    Store(tmp_path).close()  # the LOCK is free
    assert kept.value is not None
