"""A batch id used again after retention deleted the batch, through the real buffer and scheduler
processes with a scripted worker (no model).

A trainer restarted from a checkpoint submits its iteration's batch id again ("iter-1200"). Once
retention has deleted the old batch, the buffer takes it as a new batch; its request and group ids
are the old ones. Found by review (session 18): the scheduler remembered those ids as settled, took
the new requests for re-deliveries and failed every one of them in the buffer (ABORTED)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from e2e_fake_worker import FakeWorker, token_at
from e2e_helpers import collect, make_batch, scripted_suite
from seer.v1 import common_pb2, rollout_pb2

from services.cli.up import Suite


@pytest.fixture
def suite(tmp_path) -> Iterator[Suite]:
    with scripted_suite(tmp_path, policy="seer", extra_args={"buffer": ["--retain-batches", "1"]}) as s:
        yield s


def test_a_batch_id_used_again_after_retention_runs_as_a_new_batch(suite, rollout_stub_factory) -> None:
    worker = FakeWorker("w0", suite.scheduler_address)
    try:
        suite.wait_workers(1, timeout=10)
        stub = rollout_stub_factory(suite.address)
        first = make_batch(2, 2, max_tokens=12, batch_id="iter-7")
        stub.SubmitBatch(first, timeout=10)
        assert len(collect(stub, "iter-7", timeout=30)) == 4
        other = make_batch(1, 2, max_tokens=6, batch_id="iter-8")
        stub.SubmitBatch(other, timeout=10)
        assert len(collect(stub, "iter-8", timeout=30)) == 2
        with pytest.raises(grpc.RpcError) as e:  # retention (1 batch kept) deleted iter-7
            stub.GetBatch(rollout_pb2.GetBatchRequest(batch_id="iter-7"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        again = make_batch(2, 2, max_tokens=20, batch_id="iter-7", prompt_len=9)
        stub.SubmitBatch(again, timeout=10)
        results = collect(stub, "iter-7", timeout=30)
        assert len(results) == 4
        for r in results:
            assert r.result.finish_reason == common_pb2.FINISH_REASON_LENGTH, r.result
            assert list(r.result.token_ids) == [token_at(r.result.request_id, p) for p in range(20)]
    finally:
        worker.close()
