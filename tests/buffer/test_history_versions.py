"""A prompt key's history iterations are policy versions, as the draft service's are.

Before, every completed batch was an iteration of its own: a batch split into two submissions at
one version (or a prompt in two batches of one version) made two iterations, and with the default
two kept, the second pushed the previous version's responses out, and GetHistory (the scheduler's
length prior, the draft service's refill) saw only the last batch's. Now batches of one version
merge into one iteration (older responses first), bounded by `history_iteration_responses` (the
oldest go, never the completing batch's own), and a history record an older buffer stored (one
iteration per batch) is read as versions. Real gRPC on loopback, real RocksDB, restarts on the
same data dir."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from buffer_helpers import BufferHandle, finish_all, group, snapshot, submit
from seer.v1 import buffer_pb2, rollout_pb2

from services.buffer import codec
from services.buffer.records import HistoryIteration, decode_history, encode_history
from services.buffer.store import STORE_FORMAT, STORE_FORMAT_KEY, Store, history_key
from services.scheduler.core import history_prior


def _update(buf: BufferHandle, version: int) -> None:
    buf.rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=version), timeout=10)


def _history(buf: BufferHandle, key: str) -> tuple[list[int], int, list[int]] | None:
    """(lengths, policy_version, response lengths from the tokens) of the key's newest iteration."""
    resp = buf.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=[key], include_tokens=True), timeout=10)
    if not resp.histories:
        return None
    (h,) = resp.histories
    return list(h.lengths), h.policy_version, [len(r.token_ids) for r in h.responses]


def _run(buf: BufferHandle, batch_id: str, key: str, group_size: int, length: int) -> None:
    submit(buf.rollout, batch_id, [group(prompt_key=key, group_size=group_size)])
    finish_all(buf.internal, [it for it in snapshot(buf.internal) if it.batch_id == batch_id], length=length)


def test_batches_of_one_version_are_one_iteration(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer(history_iterations=2)
    _run(buf, "v0", "p", 2, 5)
    _update(buf, 1)
    # Version 1 runs the prompt in two submissions (a batch split in two), and twice in the second.
    _run(buf, "v1a", "p", 2, 3)
    submit(buf.rollout, "v1b", [group(prompt_key="p", group_size=1), group(prompt_key="p", group_size=1)])
    finish_all(buf.internal, snapshot(buf.internal), length=lambda it: 6 + it.group_index)
    # Before: ([6, 7], 1): the newest batch alone, and version 0 was pushed out by v1a.
    assert _history(buf, "p") == ([3, 3, 6, 7], 1, [3, 3, 6, 7])
    # The scheduler's prior (the longest response of the newest iteration) is over the whole version.
    assert history_prior(_history(buf, "p")[0]) == 7  # type: ignore[index]
    its = buf.core.history("p")
    assert [(it.policy_version, it.batch_id, it.lengths) for it in its] == [(1, "v1b", [3, 3, 6, 7]),
                                                                            (0, "v0", [5, 5])]
    # The next version is a new iteration; the oldest version goes (history_iterations = 2).
    _update(buf, 2)
    _run(buf, "v2", "p", 1, 4)
    assert [(it.policy_version, it.lengths) for it in buf.core.history("p")] == [(2, [4]), (1, [3, 3, 6, 7])]
    buf.stop()
    buf = make_buffer(history_iterations=2)  # as stored
    assert _history(buf, "p") == ([4], 2, [4])
    assert [it.policy_version for it in buf.core.history("p")] == [2, 1]


def test_one_version_keeps_at_most_its_bound_of_responses(make_buffer: Callable[..., BufferHandle]) -> None:
    """A loop that never updates the weights runs every batch at one version: the iteration keeps
    the newest `history_iteration_responses`, the oldest going first, never the completing batch's
    own (a batch with more responses to the key than the bound is kept whole)."""
    buf = make_buffer(history_iteration_responses=4)
    _run(buf, "a", "p", 3, 2)
    _run(buf, "b", "p", 3, 3)
    assert _history(buf, "p") == ([2, 3, 3, 3], 0, [2, 3, 3, 3])
    _run(buf, "c", "p", 3, 4)
    assert _history(buf, "p") == ([3, 4, 4, 4], 0, [3, 4, 4, 4])
    _run(buf, "d", "p", 6, 5)
    assert _history(buf, "p") == ([5] * 6, 0, [5] * 6)
    for n in range(5):
        _run(buf, f"e{n}", "p", 1, 6 + n % 2)
    lengths, version, _ = _history(buf, "p") or ([], -1, [])
    assert (lengths, version) == ([7, 6, 7, 6], 0)
    assert len(buf.core.history("p")) == 1  # one version, one iteration


def _old_record(tokens: Callable[[int], list[int]]) -> bytes:
    """The h/<key> value a buffer before versions wrote with history_iterations 3: one iteration
    per batch, newest first (two batches of version 1, one of version 0). The layout is unchanged
    (encode_history then and now): meta {"iterations": [{batch_id, policy_version, lengths}]} and
    one token array t<i> per iteration."""
    its = [HistoryIteration("old-b", 1, [7, 7], [codec.i32(tokens(7)), codec.i32(tokens(7))]),
           HistoryIteration("old-a", 1, [3], [codec.i32(tokens(3))]),
           HistoryIteration("old-0", 0, [5], [codec.i32(tokens(5))])]
    raw = encode_history(its)
    meta, arrays = codec.decode(raw)
    assert meta == {"iterations": [{"batch_id": "old-b", "policy_version": 1, "lengths": [7, 7]},
                                   {"batch_id": "old-a", "policy_version": 1, "lengths": [3]},
                                   {"batch_id": "old-0", "policy_version": 0, "lengths": [5]}]}
    assert sorted(arrays) == ["t0", "t1", "t2"]
    return raw


def test_history_an_older_buffer_stored_is_read_as_versions(make_buffer: Callable[..., BufferHandle],
                                                            tmp_path: Path) -> None:
    buf = make_buffer(history_iterations=2)
    _update(buf, 1)  # the store is at version 1, as the older buffer's was
    buf.stop()
    store = Store(tmp_path / "db")
    try:
        wb = store.new_batch()
        wb.put(history_key("p"), _old_record(lambda n: [9] * n))
        store.write(wb)
    finally:
        store.close()
    buf = make_buffer(history_iterations=2)  # recovers
    # Read as versions: version 1's two batches are one iteration (the older batch's first).
    assert _history(buf, "p") == ([3, 7, 7], 1, [3, 7, 7])
    assert [(it.policy_version, it.lengths) for it in buf.core.history("p")] == [(1, [3, 7, 7]), (0, [5])]
    # A batch of version 1 completing merges into it; version 0 stays (before: it was pushed out).
    _run(buf, "new", "p", 2, 4)
    assert _history(buf, "p") == ([3, 7, 7, 4, 4], 1, [3, 7, 7, 4, 4])
    assert [(it.policy_version, it.batch_id) for it in buf.core.history("p")] == [(1, "new"), (0, "old-0")]
    buf.stop()
    store = Store(tmp_path / "db")
    try:
        # Rewritten in the same layout, under the same format stamp: a buffer before this one
        # reads it (an iteration per entry, each a version now).
        assert store.get(STORE_FORMAT_KEY) == str(STORE_FORMAT).encode() == b"1"
        raw = store.get(history_key("p"))
        assert raw is not None
        assert [(it.batch_id, it.policy_version, it.lengths)
                for it in decode_history(raw, key=history_key("p"))] == [("new", 1, [3, 7, 7, 4, 4]),
                                                                         ("old-0", 0, [5])]
    finally:
        store.close()


def test_a_batch_older_than_every_kept_version_is_logged_and_counted(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """UpdateWeights waits for the batches of the version it replaces, so a batch never completes
    at a version older than every one its keys keep; a store written otherwise (here: history of
    versions 5 and 6 at a buffer at version 0) made its responses vanish from the history silently.
    Now that is logged and counted (seer_buffer_history_dropped_total); the kept versions stay."""
    from services.buffer import metrics
    buf = make_buffer(history_iterations=2)
    buf.stop()
    store = Store(tmp_path / "db")
    try:
        wb = store.new_batch()
        wb.put(history_key("p"), encode_history([HistoryIteration("b6", 6, [2], [codec.i32([9, 9])]),
                                                 HistoryIteration("b5", 5, [1], [codec.i32([9])])]))
        store.write(wb)
    finally:
        store.close()
    buf = make_buffer(history_iterations=2)
    before = metrics.HISTORY_DROPPED._value.get()
    with caplog.at_level(logging.WARNING, logger="services.buffer.core"):
        _run(buf, "v0", "p", 2, 4)
    assert metrics.HISTORY_DROPPED._value.get() == before + 1
    assert any("older than every kept history version" in r.getMessage() for r in caplog.records), caplog.text
    assert [(it.policy_version, it.lengths) for it in buf.core.history("p")] == [(6, [2]), (5, [1])]
