"""WorkerService over gRPC: converts messages, calls services.worker.core, lets @rpc map errors.

RunChunk is a server stream: token deltas as the engine produces them, then one done message. A
stream the caller cancels (or whose deadline passes) aborts the request in the engine. Each stream
holds a handler thread for its whole chunk, so at most `max_streams` run at once (StreamSlots):
the threads left over serve Abort, GetWorkerStats and LoadWeights however many chunks queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from seer.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.grpcutil import rpc
from services.common.log import log_context
from services.common.streams import StreamSlots
from services.worker import metrics
from services.worker.config import WorkerConfig
from services.worker.core import (
    ChunkFinish,
    ChunkHandle,
    ChunkJob,
    ChunkStats,
    ErrorEvent,
    TokensEvent,
    Worker,
    WorkerStats,
)
from services.worker.engine import SamplingParams

FINISH_TO_PROTO = {
    ChunkFinish.STOP: common_pb2.FINISH_REASON_STOP,
    ChunkFinish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    ChunkFinish.CHUNK: common_pb2.FINISH_REASON_CHUNK,
    ChunkFinish.ABORTED: common_pb2.FINISH_REASON_ABORTED,
}


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,  # proto: 0 reads as 1 (off)
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
    )


def job_from_proto(req: worker_pb2.RunChunkRequest) -> ChunkJob:
    return ChunkJob(
        request_id=req.request_id,
        prompt_token_ids=tuple(req.prompt_token_ids),
        output_token_ids=tuple(req.output_token_ids),
        max_new_tokens=int(req.max_new_tokens),
        max_tokens=int(req.max_tokens),
        sampling=sampling_from_proto(req.sampling),
        policy_version=int(req.policy_version),
        batch_id=req.batch_id,
        group_id=req.group_id,
        prompt_key=req.prompt_key,
        seq=int(req.seq),
        is_probe=bool(req.is_probe),
        group_size=int(req.group_size),
        fetch_kv=bool(req.fetch_kv),
        dispatch_epoch=int(req.dispatch_epoch),
        submit_seq=int(req.submit_seq),
    )


def stats_to_proto(s: ChunkStats) -> common_pb2.ChunkStats:
    return common_pb2.ChunkStats(
        prefill_tokens=s.prefill_tokens,
        cached_tokens=s.cached_tokens,
        kv_loaded_tokens=s.kv_loaded_tokens,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        steps=s.steps,
        wall_seconds=s.wall_seconds,
        kv_recomputed_pages=s.kv_recomputed_pages,
    )


def worker_stats_to_proto(s: WorkerStats) -> worker_pb2.GetWorkerStatsResponse:
    e = s.engine
    return worker_pb2.GetWorkerStatsResponse(
        worker_id=s.worker_id,
        total_kv_pages=e.total_pages,
        free_kv_pages=e.free_pages,
        page_size=e.page_size,
        running=e.running,
        waiting=e.waiting,
        tokens_per_second=s.tokens_per_second,
        policy_version=s.policy_version,
        accepted_per_position=s.accepted_per_position,
        proposed_per_position=s.proposed_per_position,
        prefill_tokens=s.prefill_tokens,
        cached_tokens=s.cached_tokens,
        kv_loaded_tokens=s.kv_loaded_tokens,
        kv_recomputed_pages=s.kv_recomputed_pages,
        kv_refetches=s.kv_refetches,
        invalid_drafts=s.invalid_drafts,
        kv_releases_dropped=s.kv_releases_dropped,
    )


def stream_slots(limit: int) -> StreamSlots:
    """Admission of RunChunk streams (services.common.streams): a stream holds a handler thread for
    its whole chunk, and Abort, GetWorkerStats and LoadWeights must still find one. A refused
    chunk names max_streams; the scheduler re-dispatches it without counting an attempt."""
    return StreamSlots(limit, "max_streams", on_open=metrics.STREAMS.inc,
                       on_refused=lambda _m: metrics.STREAMS_REFUSED.inc())


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker: Worker, drain_timeout_seconds: float = 300.0,
                 streams: StreamSlots | None = None) -> None:
        self.worker = worker
        self.drain_timeout = drain_timeout_seconds
        self.streams = streams or stream_slots(WorkerConfig().stream_limit())
        # gRPC runs done callbacks on the server's one polling thread, which also starts every
        # other call: aborting a chunk there waited for the engine lock (a whole step, seconds for
        # a long prefill) and stalled every call on the worker. The abort runs here instead.
        self._releaser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunk-release")

    def _release_soon(self, handle: ChunkHandle) -> None:
        """The RunChunk's done callback: nothing to do after a normal end; an abort otherwise."""
        if handle.finished:
            return
        try:
            self._releaser.submit(handle.release)
        except RuntimeError:  # the interpreter is shutting down: no thread can start
            handle.release()

    @rpc
    def RunChunk(
        self, request: worker_pb2.RunChunkRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.RunChunkResponse]:
        with self.streams.hold("RunChunk"), log_context(request_id=request.request_id, group_id=request.group_id):
            # Its KV fetch (before admission) stops when the stream ends meanwhile.
            handle = self.worker.submit(job_from_proto(request), cancelled=lambda: not context.is_active())
            # Runs when the RPC ends for any reason; after a normal end the chunk is done and
            # cancel() is a no-op, after a cancellation or deadline it aborts the request.
            if not context.add_callback(lambda: self._release_soon(handle)):
                handle.release()  # the RPC already ended (cancelled while we queued the chunk)
                return
            for ev in handle.events():
                if isinstance(ev, TokensEvent):
                    yield worker_pb2.RunChunkResponse(
                        tokens=worker_pb2.TokenDelta(token_ids=ev.token_ids, logprobs=ev.logprobs)
                    )
                elif isinstance(ev, ErrorEvent):
                    raise ev.error
                else:
                    yield worker_pb2.RunChunkResponse(
                        done=worker_pb2.ChunkDone(
                            finish_reason=FINISH_TO_PROTO[ev.finish],
                            stats=stats_to_proto(ev.stats),
                            policy_version=ev.policy_version,
                        )
                    )

    @rpc
    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:
        with log_context(request_id=request.request_id):
            return worker_pb2.AbortResponse(
                found=self.worker.abort(request.request_id, int(request.dispatch_epoch)))

    @rpc
    def LoadWeights(
        self, request: worker_pb2.LoadWeightsRequest, context: grpc.ServicerContext
    ) -> worker_pb2.LoadWeightsResponse:
        seconds = self.worker.load_weights(int(request.version), request.source or None, self.drain_timeout)
        return worker_pb2.LoadWeightsResponse(version=self.worker.policy_version, seconds=seconds)

    @rpc
    def GetWorkerStats(
        self, request: worker_pb2.GetWorkerStatsRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetWorkerStatsResponse:
        return worker_stats_to_proto(self.worker.stats())


def add_servicer(worker: Worker, drain_timeout_seconds: float = 300.0,
                 max_streams: int = 0) -> Callable[[grpc.Server], Sequence[str]]:
    """The `add_servicers` callback for services.common.server.start_server. max_streams: the
    server's WorkerConfig.stream_limit() (0 = that of the default config, 64 handler threads)."""

    def _add(server: grpc.Server) -> Sequence[str]:
        slots = stream_slots(max_streams or WorkerConfig().stream_limit())
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(worker, drain_timeout_seconds, slots),
                                                            server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    return _add
