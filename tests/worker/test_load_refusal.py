"""A LoadWeights refusal (INVALID_ARGUMENT / FAILED_PRECONDITION) must mean "nothing changed": the
scheduler keeps every refusing worker serving the old version. The reference engine checks a
checkpoint whole before swapping anything in (test_worker_faults, test_worker_engine). SGLang's
update_weights_from_disk, failing after it started writing weights, answers "Rolling back to
original weights" but reloads the NEW path (it set model_config.model_path first): the adapter
answered that as a bad source (ValueError -> INVALID_ARGUMENT) while the weights were changed. It is
now a broken engine (RuntimeError, INTERNAL at the server), over the SGLang stand-in of
test_sglang_attempts; the worker's health turns NOT_SERVING at once (a liveness probe restarts it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from seer.v1 import worker_pb2, worker_pb2_grpc
from test_sglang_attempts import (  # noqa: F401  (fixtures)
    GREEDY,
    UpdateWeightFromDiskReqInput,
    _sglang,
    engine,
    model_dir,
    run,
)

from services.common.grpcutil import channel
from services.common.server import ServiceConfig, start_server
from services.worker.core import Worker
from services.worker.engine import FinishReason, GenerateRequest
from services.worker.engines.sglang import engine as sg
from services.worker.server import add_servicer


def test_a_load_sglang_failed_mid_way_is_no_refusal(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    tm = engine._sgl.tokenizer_manager

    async def mid_load(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        return False, "Failed to update weights: shard 2 truncated.\nRolling back to original weights.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", mid_load)
    with pytest.raises(RuntimeError, match="weights unknown"):
        engine.load_weights(str(tmp_path), "m@v1")
    assert engine._broken is not None and engine.model_version == "m@v0"
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2), max_new_tokens=3, sampling=GREEDY))
    assert [o.finish_reason for o in outs] == [FinishReason.ABORTED]  # serves nothing under the old name


def test_a_load_sglang_refused_before_writing_stays_a_refusal(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    tm = engine._sgl.tokenizer_manager

    async def refused(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        return False, "Failed to get weights iterator: no safetensors found.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", refused)
    with pytest.raises(ValueError, match="refused the weights"):
        engine.load_weights(str(tmp_path), "m@v1")
    assert engine._broken is None and engine.model_version == "m@v0"


@pytest.fixture
def served_sglang(engine: sg.SGLangEngine) -> Iterator[tuple[Worker, Any, Any]]:  # noqa: F811
    """A Worker on the SGLang stand-in, served over real gRPC on loopback with its engine health
    wired to the standard health service as `python -m services.worker` wires it."""
    worker = Worker(engine, worker_id="w-sgl", speculation=False).start()
    running = start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
                           on_stop=worker.close)
    worker.on_engine_health(running.set_serving)
    ch = channel(running.address)
    try:
        yield worker, worker_pb2_grpc.WorkerServiceStub(ch), health_pb2_grpc.HealthStub(ch)
    finally:
        ch.close()
        running.stop(1.0)


def _health(health: Any) -> int:
    return int(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


@pytest.mark.parametrize("failure", ["mid_load", "timeout"])
def test_a_load_that_breaks_the_engine_turns_health_not_serving_at_once(
        served_sglang: tuple[Worker, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        failure: str) -> None:
    """MEDIUM (review of c2e97f6): a load that left SGLang broken answered INTERNAL, but health
    stayed SERVING until chunks failed and a canary too. A scheduler that dropped the worker then
    only retried its catch-up load (INTERNAL every 30 s) and never placed a chunk on it, so the
    canary never ran and no liveness probe ever restarted it. Now the failed load itself turns
    the health NOT_SERVING (both broken paths: SGLang's "Rolling back" and the load timing out),
    and it stays so: the next load fails the same way."""
    worker, stub, health = served_sglang
    tm = worker.engine._sgl.tokenizer_manager  # type: ignore[attr-defined]
    gate = asyncio.Event()

    async def broken_load(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        if failure == "timeout":
            await gate.wait()  # a scheduler stuck reading the checkpoint
        return False, "Failed to update weights: shard 2 truncated.\nRolling back to original weights.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", broken_load)
    monkeypatch.setattr(sg, "LOAD_TIMEOUT_S", 0.2)
    assert _health(health) == health_pb2.HealthCheckResponse.SERVING
    for version in (1, 2):  # the catch-up load retried: INTERNAL each time, health stays down
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadWeights(worker_pb2.LoadWeightsRequest(version=version, source=str(tmp_path)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
        assert _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not worker.engine_healthy and worker.policy_version == 0


def test_a_refused_load_leaves_health_serving(
        served_sglang: tuple[Worker, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal (nothing written) is INVALID_ARGUMENT naming source, and the worker stays SERVING."""
    worker, stub, health = served_sglang
    tm = worker.engine._sgl.tokenizer_manager  # type: ignore[attr-defined]

    async def refused(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        return False, "Failed to get weights iterator: no safetensors found.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", refused)
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadWeights(worker_pb2.LoadWeightsRequest(version=1, source=str(tmp_path)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "source" in (err.value.details() or "")
    assert _health(health) == health_pb2.HealthCheckResponse.SERVING and worker.engine_healthy
