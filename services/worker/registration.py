"""Registration with the scheduler and heartbeats with telemetry, in a background thread.

The worker registers (RegisterWorker) and then heartbeats at the interval the scheduler returns.
When the scheduler answers known=false (it restarted, or declared the worker gone) the worker
registers again; when the scheduler is unreachable it keeps retrying with backoff. Registration is
best effort: the worker serves RunChunk whether or not the scheduler is up.

When the worker begins to stop (drain_before_stop(), RunningServer.before_stop), one draining
heartbeat goes out from the stopping thread and is answered before the server refuses anything; every
heartbeat after says draining too: the scheduler then places no new chunk here (they would be
refused UNAVAILABLE while the server drains), and the chunks in flight run to their end. A
draining worker does not register again.

Every RegisterWorker and every Heartbeat carries this process's incarnation (drawn once at start):
the scheduler tells a reconnect of the same process (after a failed Heartbeat RPC: its chunks keep
running) from a restarted worker (its chunks in flight are gone and re-dispatched), and ignores the
heartbeats of an old process that still drains after a new one registered under the same id.

Every heartbeat (and RegisterWorker) also says whether the engine is broken for good
(HeartbeatRequest.engine_broken: the scheduler places no new chunk here from then on, while the
orchestrator's liveness probe waits out its grace period before restarting the process) or failing
now (engine_failing: shown by the scheduler, not acted upon). A change of the engine's health sends
a heartbeat at once rather than at the next interval.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.common.grpcutil import channel
from services.common.log import get_logger, kv
from services.worker.core import EngineHealth, Worker

log = get_logger(__name__)

# RegisterWorkerRequest.incarnation and HeartbeatRequest.incarnation of this worker process.
INCARNATION = secrets.token_hex(8)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class Stopped(Exception):
    """The registrar's RPC in flight was cancelled by stop()."""


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
        engine_broken=worker.engine_health().broken,
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
        # Set by stop() and drain(): ends the wait between two heartbeats early.
        self._wake = threading.Event()
        # The worker stops (drain(), drain_now()): read by every heartbeat. A plain bool: it only
        # ever goes False -> True and nothing waits on it (the wait is _wake's).
        self._draining = False
        self._thread: threading.Thread | None = None
        # The registrar thread's RPC in flight (RegisterWorker or Heartbeat), cancelled by stop():
        # a scheduler that takes the call and never answers held the stop for the whole
        # rpc_timeout (5 s), past the 1 s drain-notice bound. Guarded by _call_lock with _stop.
        self._call_lock = threading.Lock()
        self._in_flight: grpc.Future[Any] | None = None
        self.registered = threading.Event()
        self.registrations = 0
        self.heartbeats = 0
        self._engine_healthy: bool | None = None  # the last value on_engine_health gave

    def start(self) -> Registrar:
        # The scheduler must stop placing chunks on a broken engine at once, not a heartbeat
        # interval later: each chunk placed meanwhile fails and costs its request an attempt.
        self._worker.on_engine_health(self._on_engine_health)
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._thread.start()
        return self

    def _on_engine_health(self, healthy: bool) -> None:
        """Worker.on_engine_health's listener (under the engine lock: only sets an event). The
        first call gives the current value: no change, no early heartbeat."""
        changed = self._engine_healthy is not None and healthy != self._engine_healthy
        self._engine_healthy = healthy
        if changed:
            self._wake.set()

    def drain(self) -> None:
        """The worker begins to stop: heartbeat draining=true at once and with every heartbeat
        after, so the scheduler places no new chunk here. stop() ends the heartbeats."""
        if not self._draining:
            log.info("draining: telling the scheduler to place no new chunk here")
        self._draining = True
        self._wake.set()

    def drain_before_stop(self, timeout: float = 1.0, settle: float = 0.1) -> None:
        """RunningServer.before_stop: the scheduler must hear the worker drains before the server
        refuses RunChunk. A refused chunk made it remove the worker and cancel every chunk in flight
        here, lost work (the drain notice used to come from a thread polling the stop flag on its
        own, racing the server's stop). Waits up to `timeout` for the scheduler's answer, then
        `settle` seconds: a placement the scheduler decided just before it took the notice may still
        be on its way. Not delivered: the registrar's thread retries at once and with every
        heartbeat; the stop goes on (the scheduler may be down, or slow)."""
        if self.drain_now(timeout):
            time.sleep(settle)
        else:
            # drain_now set the flag (and logged the miss): only wake the registrar's thread, so
            # its heartbeat retries now rather than at the next interval.
            self._wake.set()

    def drain_now(self, timeout: float = 0.5) -> bool:
        """One draining heartbeat sent from the calling thread, best effort, within `timeout`
        seconds (the worker is about to stop or exit and cannot wait for the registrar's thread).
        Whether the scheduler took it. Telemetry unset (not an empty one, which reads as "no free
        pages"): reading it may touch a dead engine (this runs when a failed SGLang SIGQUITs the
        worker), and a stopping worker is placed on no more. The engine's health is sent
        (Worker.engine_health: plain attribute reads, no engine lock, safe on that path): left out,
        the scheduler read the notice's empty engine_failing as the engine mended (it now also
        ignores engine_failing in a heartbeat without telemetry, for workers that leave it out)."""
        first = not self._draining
        self._draining = True
        # The RPC before any log line: on the SIGQUIT path this runs on a notifier thread while the
        # interrupted main thread may hold the logging handler's lock (a log line first blocked the
        # notice until the exit).
        try:
            health = self._worker.engine_health()
        except Exception:  # a dying engine's attribute: the notice matters more than its health
            health = EngineHealth()
        try:
            self._stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=self._worker.worker_id, draining=True,
                                                                incarnation=INCARNATION, engine_broken=health.broken,
                                                                engine_failing=health.failing),
                                 timeout=timeout)
        except Exception as e:  # best effort: the scheduler times the worker out anyway
            log.warning("draining heartbeat not delivered", extra=kv(error=str(e)))
            return False
        if first:
            log.info("draining: told the scheduler to place no new chunk here")
        return True

    def stop(self, timeout: float = 1.0) -> None:
        """Ends the heartbeats: the RPC in flight, if any, is cancelled rather than waited for (a
        hung scheduler never answers it), so the stop takes about nothing. Waits up to `timeout`
        seconds for the thread (it only logs after a cancelled call; daemon, so a stuck one does
        not hold the exit)."""
        with self._call_lock:
            self._stop.set()
            in_flight = self._in_flight
        self._wake.set()
        if in_flight is not None:
            in_flight.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
        # The Worker outlives its registrar (tests start several on one): a listener left behind
        # would pile up and keep waking a stopped registrar.
        self._worker.remove_engine_health_listener(self._on_engine_health)
        self._channel.close()

    def _call(self, method: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        """One RPC of the registrar's thread, as a future stop() can cancel. Raises Stopped when
        stop() came first or cancelled it; grpc.RpcError as the blocking call does."""
        with self._call_lock:
            if self._stop.is_set():
                raise Stopped()
            future = method.future(request, timeout=self._rpc_timeout)
            self._in_flight = future
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise Stopped() from None
        finally:
            with self._call_lock:
                self._in_flight = None

    def _register(self) -> float:
        req = register_request(self._worker, self._address, self._max_streams)
        resp = self._call(self._stub.RegisterWorker, req)
        self.registrations += 1
        self.registered.set()
        interval = resp.heartbeat_interval_seconds if resp.heartbeat_interval_seconds > 0 else 2.0
        log.info("registered with the scheduler",
                 extra=kv(address=self._address, heartbeat_s=interval, incarnation=INCARNATION))
        return float(interval)

    def _heartbeat_request(self) -> scheduler_pb2.HeartbeatRequest:
        health = self._worker.engine_health()
        return scheduler_pb2.HeartbeatRequest(worker_id=self._worker.worker_id, telemetry=telemetry(self._worker),
                                              draining=self._draining, incarnation=INCARNATION,
                                              engine_broken=health.broken, engine_failing=health.failing)

    def _wait(self, seconds: float) -> None:
        """Until the next heartbeat: `seconds`, or less when stop() or drain() wakes it. Cleared
        after the wait: a drain() after that is seen by the heartbeat that follows (the flag is set
        before the wake), one during it by the wait after."""
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        interval: float | None = None
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if interval is None:
                    if self._draining:
                        # Registering now would make a stopping worker placeable again.
                        self._wait(self._max_backoff)
                        continue
                    interval = self._register()
                    backoff = 0.2
                else:
                    resp = self._call(self._stub.Heartbeat, self._heartbeat_request())
                    self.heartbeats += 1
                    if not resp.known:
                        self.registered.clear()
                        if self._draining:
                            interval = None  # forgotten while it stops: stay so (see above)
                            continue
                        log.info("scheduler does not know this worker; registering again")
                        interval = self._register()
                        continue
                self._wait(interval)
            except Stopped:
                return
            except grpc.RpcError as e:
                log.warning("scheduler unreachable", extra=kv(code=str(e.code()), retry_s=backoff))
                if not self._draining:
                    # After an outage, register again: the scheduler may have restarted. A draining
                    # worker heartbeats on instead (see above; answered known=false, it stays away).
                    interval = None
                    self.registered.clear()
                self._wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            except Exception:
                log.exception("registrar error")
                self._wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
