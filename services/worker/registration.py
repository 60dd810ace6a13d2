"""Registration with the scheduler and heartbeats with telemetry, in a background thread.

The worker registers (RegisterWorker) and then heartbeats at the interval the scheduler returns.
When the scheduler answers known=false (it restarted, or declared the worker gone) the worker
registers again; when the scheduler is unreachable it keeps retrying with backoff. Registration is
best effort: the worker serves RunChunk whether or not the scheduler is up.

Every RegisterWorker carries this process's incarnation (drawn once at start): the scheduler tells
a reconnect of the same process (after a failed Heartbeat RPC: its chunks keep running) from a
restarted worker (its chunks in flight are gone and re-dispatched).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

import grpc
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.grpcutil import channel
from services.common.log import get_logger, kv
from services.worker.core import Worker

log = get_logger(__name__)

# RegisterWorkerRequest.incarnation of this worker process.
INCARNATION = secrets.token_hex(8)


def telemetry(worker: Worker) -> scheduler_pb2.WorkerTelemetry:
    s = worker.stats()
    e = s.engine
    return scheduler_pb2.WorkerTelemetry(
        free_kv_pages=e.free_pages,
        used_kv_pages=e.total_pages - e.free_pages,
        running=e.running,
        waiting=e.waiting,
        tokens_per_second=s.tokens_per_second,
        policy_version=s.policy_version,
        accepted_per_position=s.accepted_per_position,
        proposed_per_position=s.proposed_per_position,
    )


def register_request(worker: Worker, address: str, max_streams: int = 0) -> scheduler_pb2.RegisterWorkerRequest:
    """max_streams: the server's RunChunk stream limit (0 = none). The scheduler keeps at most
    max_batch_size chunks on a worker, so advertising more than the streams it may open would get
    the excess refused (RESOURCE_EXHAUSTED) time after time."""
    s = worker.stats().engine
    batch = min(s.max_batch_size, max_streams) if max_streams else s.max_batch_size
    return scheduler_pb2.RegisterWorkerRequest(
        worker_id=worker.worker_id,
        address=address,
        capacity=scheduler_pb2.WorkerCapacity(
            total_kv_pages=s.total_pages,
            page_size=s.page_size,
            max_batch_size=batch,
            max_context=s.max_context or worker.engine.max_context,
        ),
        engine=worker.engine_name,
        policy_version=worker.policy_version,
        incarnation=INCARNATION,
    )


class Registrar:
    """Keeps this worker registered with the scheduler until stop()."""

    def __init__(
        self,
        worker: Worker,
        scheduler_address: str,
        advertise_address: str,
        *,
        rpc_timeout: float = 5.0,
        max_backoff: float = 5.0,
        stub_factory: Callable[[grpc.Channel], scheduler_pb2_grpc.SchedulerServiceStub] | None = None,
        max_streams: int = 0,
    ) -> None:
        self._worker = worker
        self._max_streams = max_streams
        self._address = advertise_address
        self._channel = channel(scheduler_address)
        self._stub = (stub_factory or scheduler_pb2_grpc.SchedulerServiceStub)(self._channel)
        self._rpc_timeout = rpc_timeout
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = threading.Event()
        self.registrations = 0
        self.heartbeats = 0

    def start(self) -> Registrar:
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._rpc_timeout + 1)
        self._channel.close()

    def _register(self) -> float:
        req = register_request(self._worker, self._address, self._max_streams)
        resp = self._stub.RegisterWorker(req, timeout=self._rpc_timeout)
        self.registrations += 1
        self.registered.set()
        interval = resp.heartbeat_interval_seconds if resp.heartbeat_interval_seconds > 0 else 2.0
        log.info("registered with the scheduler",
                 extra=kv(address=self._address, heartbeat_s=interval, incarnation=INCARNATION))
        return float(interval)

    def _run(self) -> None:
        interval: float | None = None
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if interval is None:
                    interval = self._register()
                    backoff = 0.2
                else:
                    resp = self._stub.Heartbeat(
                        scheduler_pb2.HeartbeatRequest(worker_id=self._worker.worker_id,
                                                       telemetry=telemetry(self._worker)),
                        timeout=self._rpc_timeout,
                    )
                    self.heartbeats += 1
                    if not resp.known:
                        log.info("scheduler does not know this worker; registering again")
                        self.registered.clear()
                        interval = self._register()
                        continue
                self._stop.wait(interval)
            except grpc.RpcError as e:
                log.warning("scheduler unreachable", extra=kv(code=str(e.code()), retry_s=backoff))
                interval = None  # after an outage, register again: the scheduler may have restarted
                self.registered.clear()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            except Exception:
                log.exception("registrar error")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
