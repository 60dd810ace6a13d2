"""GetBatch with include_requests: one stored request record that cannot be decoded costs the
caller that request's status, not every other one's.

Before, the first undecodable request record failed the whole call DATA_LOSS, and every retry
with it. Now, as StreamResults leaves an undecodable result out and names it, the other requests
are returned as stored, the bad one keeps its place in the list as unknown (its request id, from
its key; state and finish reason UNSPECIFIED), and GetBatchResponse.unreadable_requests names
each one's request id, RocksDB key and field; the core logs it and counts it
(seer_buffer_unreadable_requests_total). Real gRPC on loopback, real RocksDB, the buffer restarted
on a store with deliberately corrupted request records."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from buffer_helpers import BufferHandle, finish_all, group, snapshot, submit
from prometheus_client import REGISTRY
from seer.v1 import common_pb2, rollout_pb2
from seer_client import SeerClient

from services.buffer.records import RecordError, RequestRecord
from services.buffer.store import Store, request_key


def _unreadable_count() -> float:
    return REGISTRY.get_sample_value("seer_buffer_unreadable_requests_total") or 0.0


def _corrupt(data_dir: Path, batch_id: str) -> None:
    """Request 0/1 is no request record at all; request 1/0 has a state this buffer does not know."""
    store = Store(data_dir)
    try:
        raw = store.get(request_key(batch_id, 1, 0))
        assert raw is not None
        rec = RequestRecord.decode(raw, key=b"")
        bad_state = bytearray(rec.encode())
        bad_state[struct.calcsize("<3sHIIQ")] = 9  # the state byte: after the magic, ids and seed
        wb = store.new_batch()
        wb.put(request_key(batch_id, 0, 1), b"garbage")
        wb.put(request_key(batch_id, 1, 0), bytes(bad_state))
        store.write(wb)
    finally:
        store.close()


def test_an_undecodable_request_record_is_listed_as_unknown_and_named(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path) -> None:
    buf = make_buffer()
    submit(buf.rollout, "b", [group(group_size=2), group(group_size=2)])
    finish_all(buf.internal, snapshot(buf.internal), length=lambda it: 3 + it.sample_index)
    buf.stop()
    _corrupt(tmp_path / "db", "b")
    buf = make_buffer()  # a completed batch's request records are not read at recovery
    before = _unreadable_count()
    resp = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="b", include_requests=True), timeout=10)
    # Before: DATA_LOSS "stored record 'r/b/000000/0001': not a request record ..." and no reply.
    assert resp.state == rollout_pb2.BATCH_STATE_COMPLETED and resp.num_finished == 4
    assert [(r.request_id, r.state, r.generated_tokens, r.finish_reason) for r in resp.requests] == [
        ("b/0/0", rollout_pb2.REQUEST_STATE_FINISHED, 3, common_pb2.FINISH_REASON_STOP),
        ("b/0/1", rollout_pb2.REQUEST_STATE_UNSPECIFIED, 0, common_pb2.FINISH_REASON_UNSPECIFIED),
        ("b/1/0", rollout_pb2.REQUEST_STATE_UNSPECIFIED, 0, common_pb2.FINISH_REASON_UNSPECIFIED),
        ("b/1/1", rollout_pb2.REQUEST_STATE_FINISHED, 4, common_pb2.FINISH_REASON_STOP),
    ]
    text = resp.unreadable_requests
    assert text.startswith("2 stored request record(s) of batch 'b' cannot be decoded"), text
    assert "request 'b/0/1': stored record 'r/b/000000/0001': not a readable request record" in text, text
    assert "request 'b/1/0': stored record 'r/b/000001/0000' field 'state': 9 is not a RequestState" in text, text
    assert _unreadable_count() == before + 2
    with SeerClient(buf.address) as c:  # the client hands it on
        status = c.get_batch("b", include_requests=True)
    assert status.unreadable_requests == text
    assert [r.state for r in status.requests] == ["finished", "unspecified", "unspecified", "finished"]
    # Without include_requests nothing is read, nothing named.
    resp = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="b"), timeout=10)
    assert not resp.requests and not resp.unreadable_requests
    # The core's own call stays strict unless the caller collects such records.
    with pytest.raises(RecordError) as e:
        buf.core.get_batch("b", include_requests=True)
    assert e.value.key == request_key("b", 0, 1)


def test_many_undecodable_records_are_named_within_bounds(make_buffer: Callable[..., BufferHandle],
                                                           tmp_path: Path) -> None:
    """The reply names the first 20 (counting the rest): a batch of bad records still gets its
    reply, its other fields intact."""
    buf = make_buffer()
    submit(buf.rollout, "m", [group(group_size=30)])
    buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="m"), timeout=10)
    buf.stop()
    store = Store(tmp_path / "db")
    try:
        wb = store.new_batch()
        for si in range(30):
            wb.put(request_key("m", 0, si), "\u00e9tat".encode() * 40)  # not a record, and not ASCII
        store.write(wb)
    finally:
        store.close()
    buf = make_buffer()
    resp = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="m", include_requests=True), timeout=10)
    assert [r.request_id for r in resp.requests] == [f"m/0/{si}" for si in range(30)]
    assert {r.state for r in resp.requests} == {rollout_pb2.REQUEST_STATE_UNSPECIFIED}
    text = resp.unreadable_requests
    assert text.startswith("30 stored request record(s)") and "and 10 more" in text, text
    assert text.count("request 'm/0/") == 20, text
