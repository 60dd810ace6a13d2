"""Ids in every RPC that takes one: a malformed batch or request id is INVALID_ARGUMENT naming the
field, a well-formed one the buffer does not know is NOT_FOUND (review, session 18: GetBatch,
CancelBatch and StreamResults answered NOT_FOUND for ids no batch can have, such as "a/b")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from buffer_helpers import BufferHandle, commit, expect_error, group, submit
from seer.v1 import rollout_pb2

IA, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
MALFORMED_BATCH_IDS = ["", "a/b", "x" * 129, "b\n", "with space", "caf\u00e9"]


def _batch_rpcs(buf: BufferHandle) -> list[tuple[str, Callable[[str], Any]]]:
    return [
        ("GetBatch", lambda b: buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id=b), timeout=10)),
        ("CancelBatch", lambda b: buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id=b), timeout=10)),
        ("StreamResults", lambda b: list(buf.rollout.StreamResults(
            rollout_pb2.StreamResultsRequest(batch_id=b), timeout=10))),
    ]


def test_batch_ids(buf: BufferHandle) -> None:
    submit(buf.rollout, "known", [group(group_size=1)])
    for name, call in _batch_rpcs(buf):
        for bad in MALFORMED_BATCH_IDS:
            msg = expect_error(lambda c=call, b=bad: c(b), IA, "batch_id")  # type: ignore[misc]
            assert "must match" in msg, (name, bad, msg)
        msg = expect_error(lambda c=call: c("unknown"), NF, "batch_id")  # type: ignore[misc]
        assert "unknown batch 'unknown'" in msg, (name, msg)
    # SubmitBatch refuses them too (test_buffer_submit.py), and nothing above touched the known batch.
    expect_error(lambda: submit(buf.rollout, "a/b", [group()]), IA, "batch_id")
    assert buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="known")).num_requests == 1


def test_request_ids(buf: BufferHandle) -> None:
    submit(buf.rollout, "c", [group(group_size=1)])
    for bad in ["", "c", "c/0", "c/0/0/0", "/0/0", "c\n/0/0", "a/b/0/0", "c/-1/0", "c/0/x", "c/00/0"]:
        expect_error(lambda b=bad: commit(buf.internal, b, 0, [5]), IA, "request_id")  # type: ignore[misc]
    # Well-formed but unknown: no such batch, or no such request in a known batch.
    for unknown in ["nope/0/0", "c/0/7", "c/3/0"]:
        expect_error(lambda u=unknown: commit(buf.internal, u, 0, [5]), NF, "request_id")  # type: ignore[misc]
    assert commit(buf.internal, "c/0/0", 0, [5]).next_seq == 1
