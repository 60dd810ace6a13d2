"""SubmitBatch builds its records and work items outside the core lock.

A 65,536-request SubmitBatch spent ~0.5 s of Python (seeds, record encodings, one WorkItem per
request for the watchers) holding the core lock, and every CommitChunk of every worker waited that
long (1.4 s with a watcher open, measured on the 2-core CI machine; 0.25 s after the change, which
leaves only the write and the in-memory index under the lock). The tests check where that work runs
(whether the submitting thread holds the core lock), not timings, which a shared machine makes
flaky; and that the work items built ahead still carry the version and submission the batch got.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import BufferHandle, Watcher, group, submit
from seer.v1 import buffer_pb2

import services.buffer.core as core_mod
from services.buffer.core import BufferCore, WorkItem, _Live
from services.buffer.events import Added
from services.buffer.model import ModelInfo
from services.buffer.records import GroupRecord, GroupSpec, Sampling
from services.buffer.store import Store


def test_submit_builds_records_and_work_items_outside_the_core_lock(
        buf: BufferHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    watcher = Watcher(buf.internal, "sched")
    try:
        while not watcher.next().HasField("snapshot_done"):
            pass
        held: list[tuple[str, bool]] = []
        real_seed, real_item, real_submit = core_mod.derive_seed, core_mod.WorkItem, buf.core.submit_batch
        # Only what the SubmitBatch call itself does counts: another thread building a work item
        # under the lock at the same time (the feed's snapshot for a watcher that reconnects under
        # load, say) is not this call's work.
        submitting = threading.local()

        def seed(*a: Any) -> int:
            if getattr(submitting, "on", False):
                held.append(("derive_seed", buf.core._lock._is_owned()))  # type: ignore[attr-defined]
            return real_seed(*a)

        def item(**kw: Any) -> Any:
            if getattr(submitting, "on", False):
                held.append(("WorkItem", buf.core._lock._is_owned()))  # type: ignore[attr-defined]
            return real_item(**kw)

        def submit_batch(*a: Any, **kw: Any) -> Any:
            submitting.on = True
            try:
                return real_submit(*a, **kw)
            finally:
                submitting.on = False

        monkeypatch.setattr(core_mod, "derive_seed", seed)
        monkeypatch.setattr(core_mod, "WorkItem", item)
        monkeypatch.setattr(buf.core, "submit_batch", submit_batch)
        out = submit(buf.rollout, "b-outside", [group(group_size=4), group(group_size=3)])
        monkeypatch.undo()
        assert out.num_requests == 7 and not out.already_submitted
        assert sorted({name for name, _ in held}) == ["WorkItem", "derive_seed"]
        assert [name for name, owned in held if owned] == [], held
        # The watcher got each request once, with the batch's version and submission.
        got: list[buffer_pb2.WorkItem] = []
        while len(got) < 7:
            ev = watcher.next()
            assert ev.HasField("added"), ev
            got.extend(ev.added.items)
        assert sorted(it.request_id for it in got) == sorted(
            [f"b-outside/0/{s}" for s in range(4)] + [f"b-outside/1/{s}" for s in range(3)])
        assert {(it.policy_version, it.submit_seq) for it in got} == {(0, out.submission_id)}
    finally:
        watcher.close()


def test_work_items_are_rebuilt_when_the_version_changed_while_they_were_built(tmp_path: Path) -> None:
    """An UpdateWeights between the items' construction (outside the lock) and the write: the
    batch runs at the new version, and so must the items the watchers get."""
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    try:
        _snap, sub = core.watch("w")
        real = core._new_work_items
        calls: list[int] = []  # the version of each build

        def racing(groups: list[GroupRecord], lives: list[_Live], version: int, submit_seq: int,
                   trace_context: Mapping[str, str]) -> list[WorkItem]:
            if not calls:
                core.update_weights(1, "", None)  # lands before the submission takes the lock
            calls.append(version)
            return real(groups, lives, version, submit_seq, trace_context)

        core._new_work_items = racing  # type: ignore[method-assign]
        spec = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=4,
                         sampling=Sampling(temperature=1.0))
        out = core.submit_batch("b1", [spec])
        assert out.policy_version == 1 and calls == [0, 1]  # built at 0, rebuilt at the new version
        events = sub.take(100, 1.0)
        assert [e.item.request_id for e in events if isinstance(e, Added)] == ["b1/0/0", "b1/0/1"]
        assert {(e.item.policy_version, e.item.submit_seq) for e in events if isinstance(e, Added)} == {
            (1, out.submission_id)}
        core.unwatch(sub)
    finally:
        core.close()


def _spec(n: int, key: str = "p") -> GroupSpec:
    return GroupSpec(prompt_key=key, prompt_token_ids=(1, 2, 3), group_size=n, max_tokens=4,
                     sampling=Sampling(temperature=1.0))


def _on_first(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    """Runs `action` at the first derive_seed: while the submission builds outside the lock."""
    real = core_mod.derive_seed
    done: list[int] = []

    def seed(*a: Any) -> int:
        if not done:
            done.append(1)
            action()
        return real(*a)

    monkeypatch.setattr(core_mod, "derive_seed", seed)


def _added(sub: Any) -> list[Any]:
    return [e.item for e in sub.take(1000, 0.2) if isinstance(e, Added)]


def test_a_watcher_joining_while_the_batch_is_built_gets_each_request_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No watcher when the build started, one when the batch is stored: its items must be built
    then (not yet in its snapshot, and never published to it otherwise)."""
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    try:
        joined: list[Any] = []
        _on_first(monkeypatch, lambda: joined.append(core.watch("late")))
        out = core.submit_batch("b", [_spec(3)])
        monkeypatch.undo()
        snap, sub = joined[0]
        items = _added(sub)
        assert sorted([it.request_id for it in snap] + [it.request_id for it in items]) == ["b/0/0", "b/0/1", "b/0/2"]
        assert {it.submit_seq for it in [*snap, *items]} == {out.submission_id}
    finally:
        core.close()


def test_items_carry_the_submission_number_taken_while_they_were_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another submission lands during the build and takes the number the items were built with."""
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))
    try:
        _snap, sub = core.watch("w")
        _on_first(monkeypatch, lambda: core.submit_batch("other", [_spec(1, key="q")]))
        out = core.submit_batch("b", [_spec(2)])
        monkeypatch.undo()
        mine = [it for it in _added(sub) if it.batch_id == "b"]
        assert len(mine) == 2 and {it.submit_seq for it in mine} == {out.submission_id}
        assert out.submission_id == core.get_batch("b").submission_id
    finally:
        core.close()
