"""The store format version and the decoding of stored records, on a real RocksDB in a temp dir.

A store stamped with a newer format than this buffer reads is refused at open with one error naming
the data dir, the found and the supported version (the process exits non-zero with it, no trace); a
store written before stamps were kept is the current format. Within a supported format a field this
buffer does not know (an additive field of a newer buffer) is ignored with one warning per field
name; a required field missing or wrongly typed is RecordError naming the RocksDB key and the field
(it was a bare TypeError from `cls(**m)` that failed recovery)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import REPO, edit_record, put_raw

from services.buffer import codec, records
from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.records import BatchRecord, FinishReason, GroupSpec, RecordError, RolloutResult
from services.buffer.store import (
    STORE_FORMAT,
    STORE_FORMAT_KEY,
    Store,
    StoreFormatError,
    batch_key,
    group_key,
    request_key,
    result_key,
)
from services.common.errors import DataLoss

MODEL = ModelInfo(1000, 4096, None)


def _core(path: Path) -> BufferCore:
    return BufferCore(Store(path), MODEL)


def _seed_store(path: Path, batch_ids: tuple[str, ...] = ("a",)) -> None:
    """A store with running batches (one group of two requests each) and one finished request."""
    core = _core(path)
    try:
        for bid in batch_ids:
            core.submit_batch(bid, [GroupSpec(prompt_token_ids=(1, 2), group_size=2, max_tokens=8)])
        from services.buffer.core import Commit
        assert core.commit_chunk(Commit(f"{batch_ids[0]}/0/0", 0, [5], [-1.0], FinishReason.STOP, 0)).request_finished
    finally:
        core.close()




def _run_buffer(path: Path) -> subprocess.CompletedProcess[str]:
    """`python -m services.buffer` on the data dir, expected to refuse it at startup."""
    return subprocess.run(
        [sys.executable, "-m", "services.buffer", "--port", "0", "--data-dir", str(path), "--model-dir", "",
         "--grace-seconds", "0"],
        cwd=REPO, env={**os.environ, "SEER_LOG_LEVEL": "info"}, capture_output=True, text=True, timeout=60)


# ---- the store format version -------------------------------------------------------------------


def test_a_new_store_is_stamped_with_the_current_format(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    try:
        assert store.get(STORE_FORMAT_KEY) == str(STORE_FORMAT).encode()
        assert store.format == STORE_FORMAT
    finally:
        store.close()


def test_a_store_with_records_and_no_stamp_is_the_current_format(tmp_path: Path) -> None:
    """A data dir written before stamps were kept keeps working: stamped at open, recovered whole."""
    _seed_store(tmp_path / "db", ("a", "b"))
    put_raw(tmp_path / "db", STORE_FORMAT_KEY, None)
    core = _core(tmp_path / "db")
    try:
        assert core._store.get(STORE_FORMAT_KEY) == str(STORE_FORMAT).encode()
        assert sorted(core._batches) == ["a", "b"]
        assert len(core._live) == 3  # a/0/1, b/0/0, b/0/1 (a/0/0 finished)
    finally:
        core.close()


def test_a_store_of_a_newer_format_is_refused_at_open_naming_dir_and_versions(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    newer = STORE_FORMAT + 1
    put_raw(path, STORE_FORMAT_KEY, str(newer).encode())
    with pytest.raises(StoreFormatError) as e:
        Store(path)
    msg = str(e.value)
    assert str(path) in msg and f"store format {newer}" in msg and f"up to {STORE_FORMAT}" in msg, msg
    # Refused before anything was written, and the DB's LOCK was released: it opens again once the
    # stamp is one this buffer reads (here: put back by hand).
    import rocksdict
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True))
    try:
        assert db.get(STORE_FORMAT_KEY) == str(newer).encode()
        db[STORE_FORMAT_KEY] = str(STORE_FORMAT).encode()
    finally:
        db.close()
    core = _core(path)
    core.close()


def test_a_stamp_that_is_no_version_is_refused(tmp_path: Path) -> None:
    put_raw(tmp_path / "db", STORE_FORMAT_KEY, b"two")
    with pytest.raises(StoreFormatError, match="'two', not a format version"):
        Store(tmp_path / "db")


def test_the_process_exits_non_zero_with_the_message_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    put_raw(path, STORE_FORMAT_KEY, str(STORE_FORMAT + 1).encode())
    proc = _run_buffer(path)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1, proc.stderr
    assert str(path) in errors[0] and f"store format {STORE_FORMAT + 1}" in errors[0], errors[0]
    assert f"up to {STORE_FORMAT}" in errors[0], errors[0]


# ---- unknown fields: ignored, one warning per field name ------------------------------------------


def test_unknown_fields_of_a_newer_buffer_are_ignored_with_one_warning_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "_warned_unknown", set())
    path = tmp_path / "db"
    _seed_store(path, ("a", "b"))
    for bid in ("a", "b"):  # the same new field on every batch record: warned about once
        edit_record(path, batch_key(bid), lambda m: m.update(priority_class="gold"))
    edit_record(path, group_key("a", 0), lambda m: m["sampling"].update(min_p=0.05))
    with caplog.at_level(logging.WARNING, logger="services.buffer.records"):
        core = _core(path)
    try:
        assert sorted(core._batches) == ["a", "b"]
        assert core._batches["a"].num_requests == 2
        assert core._groups[("a", 0)].sampling.temperature == 0.0
        assert len(core._live) == 3
    finally:
        core.close()
    warned = [r for r in caplog.records if r.name == "services.buffer.records"]
    assert [r.fields["field"] for r in warned] == ["priority_class", "sampling.min_p"]  # type: ignore[attr-defined]
    assert warned[0].fields["record"] == "BatchRecord"  # type: ignore[attr-defined]


def test_an_unknown_field_of_a_result_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "_warned_unknown", set())
    path = tmp_path / "db"
    _seed_store(path)
    edit_record(path, result_key("a", 0), lambda m: (m.update(reward=1.0), m["stats"].update(gpu_joules=3)))
    core = _core(path)
    try:
        page, _done = core.read_results("a", 0)
        assert [r.request_id for _i, r in page] == ["a/0/0"]
    finally:
        core.close()


# ---- missing or wrongly typed fields: an error naming the key and the field ------------------------


@pytest.mark.parametrize(("change", "field", "problem"), [
    (lambda m: m.pop("num_groups"), "num_groups", "missing"),
    (lambda m: m.update(num_requests="two"), "num_requests", "an integer expected, got str"),
    (lambda m: m.update(state=9), "state", "9 is not a BatchState"),
    (lambda m: m.update(trace_context={"traceparent": 1}), "trace_context", "an object of strings expected"),
])
def test_a_batch_record_missing_or_mistyping_a_field_fails_recovery_naming_key_and_field(
        tmp_path: Path, change: Callable[[dict[str, Any]], object], field: str, problem: str) -> None:
    path = tmp_path / "db"
    _seed_store(path, ("a", "b"))
    edit_record(path, batch_key("b"), change)
    with pytest.raises(RecordError) as e:
        _core(path)
    assert e.value.key == b"b/b" and e.value.record_field == field
    assert "'b/b'" in str(e.value) and repr(field) in str(e.value) and problem in str(e.value), str(e.value)
    assert isinstance(e.value, DataLoss)
    # The store was not left locked by the failed recovery (a caller may report and retry).
    Store(path).close()


def test_a_nested_field_is_named_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    edit_record(path, group_key("a", 0), lambda m: m["sampling"].update(top_k=1.5))
    with pytest.raises(RecordError, match=r"'g/a/000000' field 'sampling.top_k': an integer expected"):
        _core(path)


def test_a_result_missing_a_field_is_data_loss_naming_key_and_field(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    edit_record(path, result_key("a", 0), lambda m: m.pop("policy_version"))
    core = _core(path)  # results are not read at recovery: the batch is still running
    try:
        with pytest.raises(RecordError, match=r"'l/a/0000000000' field 'policy_version': missing"):
            core.read_results("a", 0)
    finally:
        core.close()


def test_a_value_that_is_no_record_names_its_key(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    put_raw(path, request_key("a", 0, 1), b"RQ9" + bytes(60))
    with pytest.raises(RecordError, match=r"'r/a/000000/0001': not a request record"):
        _core(path)
    put_raw(path, request_key("a", 0, 1), b"RQ1")
    with pytest.raises(RecordError, match=r"'r/a/000000/0001': not a readable request record"):
        _core(path)
    put_raw(path, batch_key("a"), b"SB1\x05\x00\x00\x00{oops")
    with pytest.raises(RecordError, match=r"'b/a': not a readable record"):
        _core(path)


def test_the_process_exits_non_zero_naming_the_record_and_field(tmp_path: Path) -> None:
    path = tmp_path / "db"
    _seed_store(path)
    edit_record(path, batch_key("a"), lambda m: m.pop("content_hash"))
    proc = _run_buffer(path)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1, proc.stderr
    assert "'b/a'" in errors[0] and "'content_hash'" in errors[0] and str(path) in errors[0], errors[0]


def test_records_round_trip_unchanged_through_the_checked_decoding() -> None:
    b = BatchRecord("b", "h", 3, 1.5, 2, 10, trace_context={"traceparent": "00-x"}, submit_seq=7,
                    submission_token="tok")
    assert BatchRecord.decode(b.encode(), key=b"b/b") == b
    res = RolloutResult("b/1/2", "b", 1, 2, "k", codec.i32([7, 8]), codec.f32([-0.5, -0.25]), FinishReason.STOP,
                        3, records.ChunkStats(steps=2, wall_seconds=0.5), 1, 0.5, {"a": "b"}, "text", [1, 2],
                        FinishReason.STOP)
    assert RolloutResult.decode(res.encode(), key=b"l/b/0") == res
