"""SchedulerService over gRPC: converts messages and calls the Dispatcher; @rpc maps typed errors."""

from __future__ import annotations

import grpc
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.grpcutil import rpc
from services.common.log import log_context
from services.scheduler.service import Dispatcher


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    @rpc
    def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        with log_context(worker_id=request.worker_id):
            interval = self.dispatcher.register_worker(
                request.worker_id,
                request.address,
                request.capacity,
                request.engine,
                request.policy_version,
                request.incarnation,
                request.engine_broken,
            )
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=interval)

    @rpc
    def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        # An unset telemetry (a worker's last draining notice, sent without reading its engine) is
        # no report: read as zeros it would set the worker's free pages to 0.
        telemetry = request.telemetry if request.HasField("telemetry") else None
        known = self.dispatcher.heartbeat(request.worker_id, telemetry, request.draining, request.incarnation,
                                          request.engine_broken, request.engine_failing)
        return scheduler_pb2.HeartbeatResponse(known=known)

    @rpc
    def SwitchWeights(
        self, request: scheduler_pb2.SwitchWeightsRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SwitchWeightsResponse:
        num, seconds = self.dispatcher.switch_weights(request.version, request.source)
        return scheduler_pb2.SwitchWeightsResponse(num_workers=num, seconds=seconds)

    @rpc
    def GetSchedulerStats(
        self, request: scheduler_pb2.GetSchedulerStatsRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.GetSchedulerStatsResponse:
        s = self.dispatcher.stats()
        return scheduler_pb2.GetSchedulerStatsResponse(
            policy_version=s.policy_version,
            policy=s.policy,
            pending_requests=s.pending_requests,
            in_flight_chunks=s.in_flight_chunks,
            dispatched_chunks=s.dispatched_chunks,
            redispatched_chunks=s.redispatched_chunks,
            workers=[
                scheduler_pb2.WorkerInfo(
                    worker_id=w.worker_id,
                    address=w.address,
                    healthy=w.healthy,
                    quarantined=w.quarantined,
                    in_flight_chunks=w.in_flight_chunks,
                    telemetry=w.telemetry,
                    draining=w.draining,
                    quarantine_reason=w.quarantine_reason,
                    engine_broken=w.engine_broken,
                    engine_failing=w.engine_failing,
                )
                for w in s.workers
            ],
        )


def add_to_server(dispatcher: Dispatcher, server: grpc.Server) -> list[str]:
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(dispatcher), server)
    return [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]
