"""A StreamResults end that left results out keeps its trailer under gRPC's 8 KiB metadata limit.

The end's trailer carries the status message (grpc-message, naming up to 20 undecodable and 20
oversize results), the left-out count and the left-out cursors. With both kinds of left-out results
and a 128-character batch id the message alone was ~8.4 KB: over gRPC's soft limit, the client's
call failed RESOURCE_EXHAUSTED ("received metadata size exceeds soft limit") 3 times in 10, losing
DATA_LOSS and the left-out mark the clients read to tell a finished batch from a failed stream
(review 4417). The message is now cut to what the cursors leave of the bound. Real gRPC on loopback,
real RocksDB, the buffer restarted on a store with deliberately corrupted records.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from buffer_helpers import CHUNK, STOP, BufferHandle, commit, group, submit
from seer.v1 import rollout_pb2

from services.buffer import codec, validation
from services.buffer.server import RESULTS_LEFT_OUT_CURSORS_KEY, RESULTS_LEFT_OUT_KEY
from services.buffer.store import Store, result_key
from services.common import server as common_server

SEND_LIMIT = 16 * 1024  # the server's message limit here: a 3,200-token result is over it
BATCH = "b" * 128  # the longest batch id SubmitBatch takes
OVERSIZE = 24  # results over the send limit (more than the 20 the status names)
UNREADABLE = 24  # results whose stored record lost a required field
METADATA_SOFT_LIMIT = 8192  # gRPC's default (grpc.max_metadata_size)


def _status_bytes(text: str) -> int:
    """grpc-message as sent: percent-encoded."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


def _drop_policy_version(data_dir: Path, cursors: range) -> None:
    store = Store(data_dir)
    try:
        wb = store.new_batch()
        for c in cursors:
            raw = store.get(result_key(BATCH, c))
            assert raw is not None, c
            meta, arrays = codec.decode(raw)
            meta.pop("policy_version")
            wb.put(result_key(BATCH, c), codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()


def test_both_kinds_left_out_keep_the_code_and_the_mark(make_buffer: Callable[..., BufferHandle],
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", SEND_LIMIT)  # read when the server starts
    # The submission bound as it was before it existed: responses this long are accepted.
    monkeypatch.setattr(validation, "MAX_RESULT_MESSAGE_BYTES", 64 * 1024 * 1024)
    n = OVERSIZE + UNREADABLE
    buf = make_buffer(max_context=8192)
    submit(buf.rollout, BATCH, [group(group_size=n, max_tokens=4096)])
    for s in range(n):
        rid = f"{BATCH}/0/{s}"
        if s < OVERSIZE:  # two commits under the limit each, a result over it
            commit(buf.internal, rid, 0, [4 + (i % 14) for i in range(1600)], CHUNK)
            commit(buf.internal, rid, 1, [4 + (i % 14) for i in range(1600)], STOP)
        else:
            commit(buf.internal, rid, 0, [5, 6], STOP)
    assert buf.core.get_batch(BATCH).num_finished == n
    buf.stop()
    _drop_policy_version(tmp_path / "db", range(OVERSIZE, n))
    buf = make_buffer(max_context=8192)  # the same data dir, restarted on the corrupted store

    # The soft limit fails a call over it only with some probability: several reads, each checked.
    for _ in range(10):
        got = 0
        with pytest.raises(grpc.RpcError) as info:
            for _msg in buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=BATCH), timeout=30):
                got += 1
        err = info.value
        assert got == 0  # every result is left out, one way or the other
        details = err.details() or ""
        # Before: RESOURCE_EXHAUSTED "received metadata size exceeds soft limit" now and then.
        assert err.code() == grpc.StatusCode.DATA_LOSS, (err.code(), details[:200])
        assert details.startswith(f"cursor: {UNREADABLE} stored result(s) of batch {BATCH!r} cannot be decoded")
        assert f"also {OVERSIZE} result(s) over the {SEND_LIMIT}-byte message limit" in details, details[:3000]
        md: tuple[tuple[str, str], ...] = tuple(err.trailing_metadata() or ())  # type: ignore[attr-defined,arg-type]
        trailing = dict(md)
        assert trailing[RESULTS_LEFT_OUT_KEY] == str(n)
        assert trailing[RESULTS_LEFT_OUT_CURSORS_KEY] == ",".join(str(c) for c in range(n))
        # The whole trailer as gRPC counts it (name + value + 32 an entry) under the soft limit,
        # every time, not only when the call happened to pass.
        size = _status_bytes(details) + len("grpc-message") + 32 + len("grpc-status") + 1 + 32
        size += sum(len(k) + len(v) + 32 for k, v in trailing.items())
        assert size < METADATA_SOFT_LIMIT, size


def test_fit_status_cuts_to_the_encoded_size() -> None:
    from services.buffer.server import fit_status

    assert fit_status("short", "cursor", 100) == "short"
    long = "é" * 1000  # two UTF-8 bytes, six percent-encoded bytes each
    cut = fit_status(long, "cursor", 600)
    assert cut.endswith("(cut to fit gRPC's metadata limit)")
    assert 600 - 6 < _status_bytes(f"cursor: {cut}") <= 600  # as much as fits, to the last character
