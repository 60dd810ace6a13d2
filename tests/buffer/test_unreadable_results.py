"""One stored result that cannot be decoded costs the reader that result, not its whole page.

Before, decoding a results page raised at the first bad value: StreamResults failed DATA_LOSS with
nothing of the page (up to 256 good results), and a reader resuming at its cursor failed there
forever; the batch's completing commit, which reads every result for the prompt history, failed as
well (and every retry of it), so the batch could never complete. Now the bad result is left out
(its slot still moves the cursor), every other result is delivered, and the stream ends DATA_LOSS
naming each left-out result's cursor, RocksDB key and field; the core logs it and counts it in
seer_buffer_unreadable_results_total. Real gRPC on loopback, real RocksDB, the buffer restarted on
a store with deliberately corrupted records."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import STOP, BufferHandle, commit, edit_record, group, put_raw, submit
from prometheus_client import REGISTRY
from seer.v1 import buffer_pb2, rollout_pb2
from seer_client import SeerClient, SeerError

from services.buffer.store import result_key, result_size_key
from services.common.errors import DataLoss


def _corrupt(data_dir: Path, batch_id: str, sized: bool) -> None:
    """Result 1 loses a required field, result 2 is no record at all. sized=False also drops the
    results' stored sizes (a store written before they were kept: the page's scan path)."""
    edit_record(data_dir, result_key(batch_id, 1), lambda m: m.pop("policy_version"))
    put_raw(data_dir, result_key(batch_id, 2), b"SB1\x05\x00\x00\x00{oops")
    if not sized:
        for i in range(4):
            put_raw(data_dir, result_size_key(batch_id, i), None)


def _read(buf: BufferHandle, batch_id: str, cursor: int = 0
          ) -> tuple[list[tuple[int, str]], grpc.RpcError | None]:
    got: list[tuple[int, str]] = []
    try:
        for r in buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch_id, cursor=cursor),
                                           timeout=30):
            got.append((r.cursor, r.result.request_id))
    except grpc.RpcError as e:
        return got, e
    return got, None


def _unreadable_count(read: str) -> float:
    return REGISTRY.get_sample_value("seer_buffer_unreadable_results_total", {"read": read}) or 0.0


@pytest.mark.parametrize("sized", [True, False], ids=["sized-page", "unsized-page"])
def test_a_corrupted_result_is_named_and_every_other_result_is_delivered(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path, sized: bool) -> None:
    buf = make_buffer()
    submit(buf.rollout, "b", [group(group_size=4)])
    for s in range(4):
        commit(buf.internal, f"b/0/{s}", 0, [5 + s, 6], STOP)
    buf.stop()
    _corrupt(tmp_path / "db", "b", sized)
    buf = make_buffer()  # the same data dir, restarted on the corrupted store
    before = _unreadable_count("results")

    got, err = _read(buf, "b")
    # Before: DATA_LOSS for the page, no result at all (the batch's 4 results are one page).
    assert got == [(1, "b/0/0"), (4, "b/0/3")]  # result 3's cursor steps past the two left out
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    details = err.details() or ""
    assert details.startswith("cursor: 2 stored result(s) of batch 'b' cannot be decoded"), details
    assert "cursor 1: stored record 'l/b/0000000001' field 'policy_version': missing" in details, details
    assert "cursor 2: stored record 'l/b/0000000002': not a readable record" in details, details
    assert _unreadable_count("results") == before + 2

    # A reader resuming at a bad result's cursor is told again (never a quiet end), and gets the rest.
    got, err = _read(buf, "b", cursor=2)
    assert got == [(4, "b/0/3")]
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
    assert "'l/b/0000000002'" in (err.details() or "") and "'l/b/0000000001'" not in (err.details() or "")

    # The trainer's client: every good result, then the error (not a complete-looking batch).
    client = SeerClient(buf.address, retry_seconds=2)
    try:
        seen: list[str] = []
        with pytest.raises(SeerError) as e:
            for r in client.iter_results("b", timeout=30):
                seen.append(r.request_id)
        assert seen == ["b/0/0", "b/0/3"]
        assert e.value.code == "DATA_LOSS" and "'l/b/0000000001'" in e.value.message, e.value
    finally:
        client.close()


def test_the_strict_core_read_still_fails_naming_key_and_field(make_buffer: Callable[..., BufferHandle],
                                                                tmp_path: Path) -> None:
    """read_results without `unreadable` (a caller that needs every result) raises, as before."""
    buf = make_buffer()
    submit(buf.rollout, "b", [group(group_size=4)])
    for s in range(4):
        commit(buf.internal, f"b/0/{s}", 0, [5 + s, 6], STOP)
    buf.stop()
    _corrupt(tmp_path / "db", "b", sized=True)
    buf = make_buffer()
    with pytest.raises(DataLoss, match=r"'l/b/0000000001' field 'policy_version'"):
        buf.core.read_results("b", 0)
    skipped: list[Any] = []
    page, done = buf.core.read_results("b", 0, unreadable=skipped)
    assert [i for i, _r in page] == [0, 3] and done
    assert [(u.cursor, u.error.key, u.error.record_field) for u in skipped] == [
        (1, b"l/b/0000000001", "policy_version"), (2, b"l/b/0000000002", "")]


def test_a_running_batch_with_corrupted_results_completes_and_streams_the_rest(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path) -> None:
    """A page of nothing but bad results does not stall the stream, and the completing commit (which
    reads every result for the prompt history) leaves them out of the history instead of failing."""
    buf = make_buffer()
    submit(buf.rollout, "r", [group(group_size=3, prompt_key="pk")])
    commit(buf.internal, "r/0/0", 0, [5, 6], STOP)
    commit(buf.internal, "r/0/1", 0, [7, 8, 9], STOP)
    buf.stop()
    edit_record(tmp_path / "db", result_key("r", 0), lambda m: m.update(group_index="zero"))
    put_raw(tmp_path / "db", result_key("r", 1), b"garbage")
    buf = make_buffer()
    before = _unreadable_count("history")

    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="r"), timeout=30)
    # The completing commit. Before: DATA_LOSS naming 'l/r/0000000000' (the history build), on every retry.
    assert commit(buf.internal, "r/0/2", 0, [10, 11, 12, 13], STOP).accepted
    got: list[tuple[int, str]] = []
    with pytest.raises(grpc.RpcError) as e:
        for r in stream:
            got.append((r.cursor, r.result.request_id))
    assert got == [(3, "r/0/2")]
    err: Any = e.value
    assert err.code() == grpc.StatusCode.DATA_LOSS
    assert "'l/r/0000000000' field 'group_index'" in err.details() and "'l/r/0000000001'" in err.details()
    assert buf.core.get_batch("r").state == rollout_pb2.BATCH_STATE_COMPLETED
    assert _unreadable_count("history") == before + 2
    # The history holds the one response that could be read.
    hist = buf.internal.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=["pk"]), timeout=10)
    assert [list(h.lengths) for h in hist.histories] == [[4]]
