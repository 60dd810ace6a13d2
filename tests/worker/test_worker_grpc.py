"""WorkerService over real gRPC on loopback with the real reference engine (short outputs)."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from seer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from worker_grpc import collect

from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.registration import Registrar
from tests.common.grpc_server import loopback_server


def chunk_req(rid: str, prompt: tuple[int, ...], **kw: Any) -> worker_pb2.RunChunkRequest:
    base: dict[str, Any] = dict(request_id=rid, batch_id="b", group_id="g", prompt_key="k", seq=0,
                                prompt_token_ids=prompt, max_new_tokens=6, max_tokens=6,
                                sampling=common_pb2.SamplingParams(temperature=0.0), policy_version=0,
                                group_size=2)
    base.update(kw)
    return worker_pb2.RunChunkRequest(**base)


def test_run_chunk_streams_then_done(served: Any, prompts: list[tuple[int, ...]]) -> None:
    _worker, stub = served
    toks, lps, done = collect(stub.RunChunk(chunk_req("r1", prompts[0], max_new_tokens=4, max_tokens=10)))
    assert 1 <= len(toks) <= 4 and len(lps) == len(toks) and all(lp <= 0 for lp in lps)
    assert done.finish_reason in (common_pb2.FINISH_REASON_CHUNK, common_pb2.FINISH_REASON_STOP)
    assert done.policy_version == 0 and done.stats.steps >= 1 and done.stats.wall_seconds > 0
    assert done.stats.prefill_tokens + done.stats.cached_tokens == len(prompts[0])
    # The same request continues in a second chunk up to max_tokens: LENGTH (or STOP).
    if done.finish_reason == common_pb2.FINISH_REASON_CHUNK:
        toks2, _, done2 = collect(stub.RunChunk(chunk_req("r1", prompts[0], output_token_ids=toks, seq=1,
                                                          max_new_tokens=100, max_tokens=10)))
        assert len(toks2) <= 6
        assert done2.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert done2.stats.cached_tokens > 0
    stats = stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
    assert stats.worker_id == "w-grpc" and stats.total_kv_pages == 512 and stats.page_size == 16
    assert stats.free_kv_pages <= stats.total_kv_pages and stats.policy_version == 0


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"prompt_token_ids": [1, 2, 999_999]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[2]"),
        ({"max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ({"request_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ({"sampling": common_pb2.SamplingParams(temperature=-2)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"sampling": common_pb2.SamplingParams(top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"policy_version": 5}, grpc.StatusCode.FAILED_PRECONDITION, "policy_version"),
    ],
)
def test_bad_chunk_names_field(served: Any, prompts: list[tuple[int, ...]], change: dict[str, Any],
                               code: grpc.StatusCode, field: str) -> None:
    _worker, stub = served
    req = chunk_req("bad", prompts[0])
    for k, v in change.items():
        if isinstance(v, list):
            del getattr(req, k)[:]
            getattr(req, k).extend(v)
        elif k == "sampling":
            req.sampling.CopyFrom(v)
        else:
            setattr(req, k, v)
    with pytest.raises(grpc.RpcError) as ei:
        collect(stub.RunChunk(req))
    assert ei.value.code() == code
    assert field in (ei.value.details() or "")
    # Still serving.
    toks, _, _ = collect(stub.RunChunk(chunk_req("ok", prompts[0], max_new_tokens=2, max_tokens=2)))
    assert toks


def test_cancelled_stream_aborts_request(served: Any, prompts: list[tuple[int, ...]]) -> None:
    worker, stub = served
    stream = stub.RunChunk(chunk_req("long", prompts[1], max_new_tokens=400, max_tokens=400,
                                     sampling=common_pb2.SamplingParams(temperature=1.0, seed=3, ignore_eos=True)))
    first = next(stream)
    assert first.WhichOneof("event") == "tokens"
    stream.cancel()
    deadline = time.monotonic() + 10
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.in_flight == 0
    assert not worker.engine.has_unfinished()


def test_abort_rpc(served: Any, prompts: list[tuple[int, ...]]) -> None:
    _worker, stub = served
    stream = stub.RunChunk(chunk_req("ab", prompts[1], max_new_tokens=400, max_tokens=400,
                                     sampling=common_pb2.SamplingParams(temperature=1.0, seed=5, ignore_eos=True)))
    assert next(stream).WhichOneof("event") == "tokens"
    assert stub.Abort(worker_pb2.AbortRequest(request_id="ab")).found is True
    rest = list(stream)
    assert rest[-1].done.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert stub.Abort(worker_pb2.AbortRequest(request_id="ab")).found is False


class _Scheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Records registrations and forgets the worker once, like a restarted scheduler."""

    def __init__(self) -> None:
        self.registered: list[scheduler_pb2.RegisterWorkerRequest] = []
        self.heartbeats: list[scheduler_pb2.HeartbeatRequest] = []
        self.forget_once = True
        self.reregistered = threading.Event()

    def RegisterWorker(self, request: Any, context: Any) -> scheduler_pb2.RegisterWorkerResponse:
        self.registered.append(request)
        if len(self.registered) >= 2:
            self.reregistered.set()
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=0.1)

    def Heartbeat(self, request: Any, context: Any) -> scheduler_pb2.HeartbeatResponse:
        self.heartbeats.append(request)
        if self.forget_once and len(self.heartbeats) >= 2:
            self.forget_once = False
            return scheduler_pb2.HeartbeatResponse(known=False)
        return scheduler_pb2.HeartbeatResponse(known=True)


def test_registration_heartbeats_and_reregister(ref_engine: ReferenceEngine) -> None:
    sched = _Scheduler()
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, sched) as address:
        reg = Registrar(Worker(ref_engine, worker_id="w-reg", speculation=False), address, "127.0.0.1:5555").start()
        try:
            assert sched.reregistered.wait(10), "worker did not register again after known=false"
            first = sched.registered[0]
            assert first.worker_id == "w-reg" and first.address == "127.0.0.1:5555" and first.engine == "reference"
            assert first.capacity.total_kv_pages == 512 and first.capacity.page_size == 16
            assert first.capacity.max_context > 0 and first.capacity.max_batch_size == 16
            hb = sched.heartbeats[0]
            assert hb.worker_id == "w-reg" and hb.telemetry.free_kv_pages > 0
        finally:
            reg.stop()


def test_registrar_retries_until_scheduler_up(ref_engine: ReferenceEngine) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Worker(ref_engine, worker_id="w-late", speculation=False)
    reg = Registrar(worker, f"127.0.0.1:{port}", "127.0.0.1:5556", rpc_timeout=0.5, max_backoff=0.3).start()
    sched = _Scheduler()
    try:
        time.sleep(0.8)
        assert not reg.registered.is_set()
        # The scheduler comes up late, on the port the registrar has been dialling.
        with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, sched, port=port):
            assert reg.registered.wait(10)
            assert sched.registered[0].worker_id == "w-late"
    finally:
        reg.stop()
