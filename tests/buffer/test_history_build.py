"""The commit that completes a batch builds the batch's history outside the core lock (review,
session 18: built under it, 4,096 responses x 4,096 tokens held every other batch's commits for
791 ms). The build is held up here at a gate (reading the batch's results log, which it does
whether inside the lock or not), so the tests do not depend on timing: another batch's commit either
completes while the build waits or it cannot."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.buffer.core import BufferCore, Commit, CommitOutcome, SubmitOutcome
from services.buffer.model import ModelInfo
from services.buffer.records import BatchState, FinishReason, GroupSpec
from services.buffer.store import Scan, Store

STOP, CHUNK = FinishReason.STOP, FinishReason.CHUNK
WAIT = 5.0  # seconds; only ever waited out when the behaviour under test is broken


class GatedStore(Store):
    """A store whose scans of one prefix wait for `release` (after setting `entered`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate: bytes | None = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def scan(self, prefix: bytes, start: bytes | None = None) -> Scan:
        if prefix == self.gate:
            self.entered.set()
            self.release.wait(WAIT * 2)
        return super().scan(prefix, start)


class Background:
    """A call on its own thread; result() waits at most WAIT seconds for it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn())
            except BaseException as e:  # pragma: no cover - re-raised by result()
                self._err.append(e)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self, timeout: float = WAIT) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        assert self.done(), "still running"
        if self._err:
            raise self._err[0]
        return self._out[0]


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[BufferCore, GatedStore]]:
    store = GatedStore(tmp_path / "db")
    core = BufferCore(store, ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None), retain_batches=1)
    yield core, store
    store.release.set()
    core.close()


def _submit(core: BufferCore, batch_id: str, key: str, size: int) -> SubmitOutcome:
    return core.submit_batch(batch_id, [GroupSpec(prompt_key=key, prompt_token_ids=(1, 2), group_size=size,
                                                  max_tokens=8)])


def _stop(rid: str, tokens: list[int]) -> Commit:
    return Commit(rid, 0, tokens, [-0.5] * len(tokens), STOP, 0)


def _hold_completion(core: BufferCore, store: GatedStore, commit: Commit) -> Background:
    """Starts the commit that completes its batch and returns once its history build is at the gate."""
    store.gate = f"l/{commit.request_id.split('/')[0]}/".encode()
    completing = Background(lambda: core.commit_chunk(commit))
    assert store.entered.wait(WAIT), "the completing commit never read its batch's results"
    return completing


def test_other_batches_commit_while_a_completing_commit_builds_history(
        gated: tuple[BufferCore, GatedStore]) -> None:
    core, store = gated
    _submit(core, "a", "p", 2)
    _submit(core, "b", "q", 1)
    core.commit_chunk(_stop("a/0/0", [5, 6]))
    completing = _hold_completion(core, store, _stop("a/0/1", [7]))
    # Batch b commits meanwhile, and readers see a whole history or none: not batch a's yet.
    other = Background(lambda: core.commit_chunk(Commit("b/0/0", 0, [9], [-0.5], CHUNK, 0)))
    assert other.done(), "another batch's commit waited for the history build"
    assert other.result().next_seq == 1
    assert core.newest_history(["p"]).histories == []
    assert core.get_batch("a").state == BatchState.RUNNING
    store.release.set()
    out: CommitOutcome = completing.result()
    assert (out.request_finished, out.duplicate) == (True, False)
    # The completion and the history were one write.
    assert core.get_batch("a").state == BatchState.COMPLETED
    (it,) = core.history("p")
    assert (it.batch_id, it.lengths, [list(t) for t in it.token_ids]) == ("a", [2, 1], [[5, 6], [7]])


def test_a_retry_of_the_completing_commit_during_the_build_is_a_duplicate(
        gated: tuple[BufferCore, GatedStore]) -> None:
    core, store = gated
    _submit(core, "a", "p", 1)
    completing = _hold_completion(core, store, _stop("a/0/0", [5, 6]))
    retry = Background(lambda: core.commit_chunk(_stop("a/0/0", [5, 6])))  # a lost ack, sent again
    assert not retry.done(0.2)  # it completes the batch too: it waits for the history being built
    store.release.set()
    outcomes = sorted((completing.result(), retry.result()), key=lambda o: o.duplicate)
    assert [(o.request_finished, o.duplicate) for o in outcomes] == [(True, False), (True, True)]
    assert [it.batch_id for it in core.history("p")] == ["a"]  # one iteration, not two


def test_a_batch_cancelled_and_its_id_reused_during_the_build(gated: tuple[BufferCore, GatedStore]) -> None:
    """The completing commit checks, under the lock, that the batch is still the one its history was
    built from: cancelled meanwhile, it is not accepted and writes no history; deleted by retention
    and submitted again under the same id, the commit completes the new batch with its own history."""
    core, store = gated
    _submit(core, "a", "p", 1)
    completing = _hold_completion(core, store, _stop("a/0/0", [5, 6]))
    core.cancel_batch("a")
    _submit(core, "x", "other", 1)
    # Another batch finishing: retention (1 batch) deletes "a". (A completing commit would wait for
    # the build: history writers take turns.)
    core.cancel_batch("x")
    # The id again: a new batch, whose request a/0/0 the commit completes.
    assert not _submit(core, "a", "p", 1).already_submitted
    store.release.set()
    assert completing.result().request_finished
    assert core.get_batch("a").state == BatchState.COMPLETED
    (it,) = core.history("p")
    assert (it.batch_id, it.lengths) == ("a", [2])

    # Cancelled without a new batch under the id: the commit is not accepted, and no history.
    store.entered.clear()
    store.release.clear()
    _submit(core, "c", "r", 1)
    completing = _hold_completion(core, store, _stop("c/0/0", [5]))
    core.cancel_batch("c")
    store.release.set()
    assert completing.result().accepted is False
    assert core.history("r") == []
