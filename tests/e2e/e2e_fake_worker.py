"""A scripted WorkerService for the glue tests of the scheduler's dispatch loop (no model).

It emits deterministic tokens (so a re-dispatched chunk reproduces what was lost), registers with
the scheduler and heartbeats like the real worker, and can be told to die in the middle of a
chunk. The real engine is exercised by the e2e tests; this fake keeps the dispatch-loop tests fast.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
from seer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.common.grpc_server import loopback_server


def token_at(request_id: str, position: int) -> int:
    """Deterministic token for a position: the same on every worker and every retry."""
    return 100 + (sum(map(ord, request_id)) * 31 + position * 7) % 1000


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker_id: str, scheduler_address: str, *, token_delay: float = 0.005,
                 stop_after: int | None = None, strict_version: bool = False, failing_loads: int = 0,
                 version: int = 0, ignore_loads: bool = False) -> None:
        self.worker_id = worker_id
        self.version = version
        self.ignore_loads = ignore_loads  # a broken worker: loads "succeed" but its version stays
        self._loading = False
        self.token_delay = token_delay
        # Die (stream error) after this many tokens of the next chunk; None = never.
        self.fail_after = stop_after
        self.chunks: list[tuple[str, int, int]] = []  # (request_id, seq, tokens) of completed chunks
        self.started: list[tuple[str, int]] = []  # (request_id, seq) of every RunChunk received
        self.aborts: list[str] = []
        self.loads: list[int] = []
        self.sources: list[str] = []  # LoadWeights sources, in order
        # Refuse chunks of another policy version with FAILED_PRECONDITION, as the real worker does.
        self.strict_version = strict_version
        self.failing_loads = failing_loads  # this many LoadWeights calls fail (INTERNAL) first
        # request_id -> status code every RunChunk of that request is refused with.
        self.refuse: dict[str, grpc.StatusCode] = {}
        # Every RunChunk is refused with this status (a broken engine: every step fails); None = no.
        self.refuse_all: grpc.StatusCode | None = None
        self.registrations = 0
        # The next chunk waits this long (seconds) before its first token (a stuck chunk); None = no.
        self.stall_next: float | None = None
        # request_id -> first seq whose chunk comes back malformed (a logprob count that does not
        # match its tokens), on every attempt: a request the scheduler can never complete.
        self.broken: dict[str, int] = {}
        self._lock = threading.Lock()
        # Served until close(): an object's lifetime, not a with block.
        self._serving = contextlib.ExitStack()
        address = self._serving.enter_context(
            loopback_server(worker_pb2_grpc.add_WorkerServiceServicer_to_server, self, max_workers=16))
        self.port = int(address.rpartition(":")[2])
        self._scheduler = scheduler_pb2_grpc.SchedulerServiceStub(grpc.insecure_channel(scheduler_address))
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._register()
        self._beat.start()

    def _register(self) -> None:
        self.registrations += 1
        self._scheduler.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, address=f"127.0.0.1:{self.port}",
            capacity=scheduler_pb2.WorkerCapacity(total_kv_pages=4096, page_size=16, max_batch_size=8,
                                                  max_context=8192),
            engine="fake", policy_version=self.version), timeout=5)

    def _heartbeats(self) -> None:
        while not self._stop.wait(0.2):
            try:
                resp = self._scheduler.Heartbeat(scheduler_pb2.HeartbeatRequest(
                    worker_id=self.worker_id,
                    telemetry=scheduler_pb2.WorkerTelemetry(free_kv_pages=4096, policy_version=self.version)),
                    timeout=2)
                if not resp.known:
                    self._register()
            except grpc.RpcError:
                pass

    def RunChunk(self, request: worker_pb2.RunChunkRequest,
                 context: grpc.ServicerContext) -> Iterator[worker_pb2.RunChunkResponse]:
        start = len(request.output_token_ids)
        n = min(request.max_new_tokens, request.max_tokens - start)
        with self._lock:
            self.started.append((request.request_id, request.seq))
            refuse = self.refuse.get(request.request_id, self.refuse_all)
            stale = self.strict_version and request.policy_version != self.version
        if refuse is not None:
            context.abort(refuse, "request_id: refused by the fake worker")
        if stale:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"policy_version: chunk wants policy version {request.policy_version}, "
                          f"worker serves {self.version}")
        with self._lock:
            stall, self.stall_next = self.stall_next, None
            broken = request.seq >= self.broken.get(request.request_id, 1 << 31)
        if stall is not None:
            end = time.monotonic() + stall
            while context.is_active() and time.monotonic() < end:
                time.sleep(0.01)
            if not context.is_active():
                return
        for i in range(n):
            with self._lock:
                die = self.fail_after is not None and i >= self.fail_after
                if die:
                    self.fail_after = None
            if die:
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died mid-chunk")
            time.sleep(self.token_delay)
            yield worker_pb2.RunChunkResponse(tokens=worker_pb2.TokenDelta(
                token_ids=[token_at(request.request_id, start + i)], logprobs=[-0.5, -0.5] if broken else [-0.5]))
        with self._lock:
            self.chunks.append((request.request_id, request.seq, n))
        reason = common_pb2.FINISH_REASON_LENGTH if start + n >= request.max_tokens else common_pb2.FINISH_REASON_CHUNK
        yield worker_pb2.RunChunkResponse(done=worker_pb2.ChunkDone(
            finish_reason=reason, stats=common_pb2.ChunkStats(steps=n), policy_version=self.version))

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:
        with self._lock:
            self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=False)

    def LoadWeights(self, request: worker_pb2.LoadWeightsRequest,
                    context: grpc.ServicerContext) -> worker_pb2.LoadWeightsResponse:
        # As the real worker: one load at a time, never backwards.
        with self._lock:
            fail = self.failing_loads > 0
            self.failing_loads -= 1 if fail else 0
            busy, older = self._loading, request.version < self.version
            self._loading = self._loading or not (fail or older)
        if busy:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "version: another LoadWeights is in progress")
        if older:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"version: version {request.version} is older than the served version {self.version}")
        if fail:
            context.abort(grpc.StatusCode.INTERNAL, "fake weight load failed")
        with self._lock:
            if not self.ignore_loads:
                self.version = request.version
            self.loads.append(request.version)
            self.sources.append(request.source)
            self._loading = False
        return worker_pb2.LoadWeightsResponse(version=request.version, seconds=0.0)

    def GetWorkerStats(self, request: worker_pb2.GetWorkerStatsRequest,
                       context: grpc.ServicerContext) -> worker_pb2.GetWorkerStatsResponse:
        return worker_pb2.GetWorkerStatsResponse(worker_id=self.worker_id, policy_version=self.version)

    def close(self) -> None:
        """Stops heartbeats and the server (like a killed process: in-flight streams break)."""
        self._stop.set()
        self._serving.close()
