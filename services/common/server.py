"""gRPC server bootstrap shared by every service: health, reflection, tracing, metrics, graceful stop.

A service's __main__ builds its config and core, then calls `serve(...)` with a function that adds
its servicers. On SIGTERM/SIGINT: health goes NOT_SERVING, `before_stop` runs (a worker tells its
scheduler it drains), in-flight calls drain for `grace_seconds` while new ones are refused,
`on_stop` runs (flush, close RocksDB), and the process exits 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.config import ServiceConfig
from services.common.grpcutil import MAX_MESSAGE_BYTES, bracket_ipv6
from services.common.log import get_logger, kv
from services.common.telemetry import server_interceptors, setup_tracing, start_metrics_server

log = get_logger(__name__)

# Server-side keepalive: the server pings each connection every KEEPALIVE_TIME_MS and closes it when
# no ack comes within KEEPALIVE_TIMEOUT_MS. Without it a client that vanished without a FIN (a killed
# node, a network partition) keeps its streams open forever: each waiting stream holds a handler
# thread (services/buffer: StreamResults, WatchWork) and a slot of the buffer's max_streams.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


class RunningServer:
    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 service_names: Sequence[str], on_stop: Callable[[], None] | None, grace: float,
                 metrics_port: int) -> None:
        self.server = server
        self.port = port
        self.metrics_port = metrics_port
        self.health = health_servicer
        self.service_names = list(service_names)
        self._on_stop = on_stop
        # Runs in stop() before the server refuses new calls (set it once the service can use it,
        # e.g. a worker's registrar exists). Bounded by its owner: stop() waits for it.
        self.before_stop: Callable[[], None] | None = None
        self._grace = grace
        self._stopped = threading.Event()
        self._stopping = False
        self._stop_lock = threading.Lock()
        # Orders set_serving against stop's NOT_SERVING (not _stop_lock: stop holds that for the
        # whole drain, while a caller of set_serving may hold a worker's engine lock).
        self._serving_lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        """The health status of every service name. SERVING is ignored once stop() began (e.g. a
        worker whose engine recovers while the process drains must not look ready again)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._serving_lock:
            if serving and self._stopping:
                return
            for name in ["", *self.service_names]:
                self.health.set(name, status)

    def stop(self, grace: float | None = None) -> None:
        """Idempotent graceful stop: NOT_SERVING, before_stop, drain (new calls refused), on_stop."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            log.info("stopping: health NOT_SERVING, draining in-flight calls")
            with self._serving_lock:
                self._stopping = True
            self.set_serving(False)
            if self.before_stop is not None:
                # Before server.stop: from then on a new call is refused UNAVAILABLE, and a worker's
                # scheduler took a refused chunk for a dead worker (and cancelled all its chunks)
                # unless it had heard the worker drains first.
                try:
                    self.before_stop()
                except Exception:
                    log.exception("before_stop failed")
            self.server.stop(self._grace if grace is None else grace).wait()
            if self._on_stop is not None:
                try:
                    self._on_stop()
                except Exception:
                    log.exception("on_stop failed")
            self._stopped.set()
            log.info("stopped")

    def wait(self) -> None:
        self._stopped.wait()


def start_server(
    name: str,
    cfg: ServiceConfig,
    add_servicers: Callable[[grpc.Server], Sequence[str]],
    on_stop: Callable[[], None] | None = None,
) -> RunningServer:
    """Starts a server; `add_servicers` registers servicers and returns their full service names."""
    setup_tracing(name)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix=f"{name}-rpc"),
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # Recent gRPC cores time an unacknowledged ping out by this one (default 1 min), not by
            # keepalive_timeout_ms alone: without it a dead peer is noticed a minute later.
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # gRPC stops sending pings after 2 without data by default: a stream quiet for minutes
            # (a long generation) would then lose its dead-peer detection.
            ("grpc.http2.max_pings_without_data", 0),
            # Tolerate client keepalive pings (Seer's clients and internal channels ping every 30 s;
            # lenient so a third-party client with a shorter interval is not cut off with
            # "too_many_pings").
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    service_names = list(add_servicers(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    # grpcio's health servicer answers SERVING for "" from the start: a launcher or probe that
    # polled it between server.start() and a failure of the rest of the start (the metrics port
    # taken) took a dying process for a ready one. Not serving until set_serving(True) below.
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    # A bare IPv6 host (--host ::1) bracketed: gRPC refuses "::1:port" ("Failed to bind").
    port = server.add_insecure_port(bracket_ipv6(f"{cfg.host}:{cfg.port}"))
    if port == 0:
        raise OSError(f"port: cannot bind {cfg.host}:{cfg.port}")
    server.start()
    try:
        metrics_port = start_metrics_server(cfg.metrics_port)
    except BaseException:
        # A taken metrics port used to leave the started gRPC server running behind the exception.
        server.stop(None).wait()
        raise
    running = RunningServer(server, port, health_servicer, service_names, on_stop, cfg.grace_seconds, metrics_port)
    running.set_serving(True)
    log.info("serving", extra=kv(service=name, port=port, metrics_port=metrics_port))
    return running


class StopSignal:
    """SIGTERM / SIGINT handlers that only record the request; `serve_until_signal` acts on it.

    A service's main installs them before its gRPC port opens (before `start_server`). Installed
    later, as they were until session 24, by `serve_until_signal` itself, a signal in the gap (the
    port open and health SERVING, the worker registering with its scheduler, the port file being
    written) took the default action: the process died with in-flight calls cut off and no
    `on_stop` (no RocksDB close, no deregistration). A signal that arrives before the server is up
    is kept, and the server then stops as soon as it is: drain (nothing is in flight yet), `on_stop`,
    exit 0. A second signal before the server is up exits at once (128 + its number): a start can
    take long (RocksDB recovery, loading a model), and whoever sends a second Ctrl-C wants out now;
    nothing is in flight, and RocksDB recovers from an exit like from a kill. (Python runs handlers
    between bytecodes of the main thread: two signals that arrive during one long C call, such as
    RocksDB's open, count as one, and the exit waits for that call to return.) Main thread only
    (Python's `signal.signal` rule); `wait` may be called from any thread.

    The handler only assigns an int: no lock. A threading.Event's set() takes its condition's lock,
    which the interrupted main thread may hold (inside Event.wait), and would deadlock there.
    """

    _POLL_S = 0.05  # how often wait() looks at the flag

    def __init__(self) -> None:
        self._signum = 0
        self._serving = False  # serve_until_signal reached: a second signal is no longer "while starting"
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, _frame: object) -> None:
        if self._signum and not self._serving:
            # The write may fail (stderr a pipe whose reader died with the first Ctrl-C, or
            # closed): the exit must not, or the error surfaces in the start code instead.
            with contextlib.suppress(OSError):
                os.write(2, f"signal {signum} again while starting: exiting now\n".encode())
            os._exit(128 + signum)
        self._signum = self._signum or signum

    @property
    def requested(self) -> bool:
        return self._signum != 0

    @property
    def signum(self) -> int:
        return self._signum

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop was requested; False when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._signum:
            left = self._POLL_S if deadline is None else min(self._POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True


def serve_until_signal(running: RunningServer, stop: StopSignal | None = None) -> int:
    """Blocks until SIGTERM/SIGINT (received now or, with `stop`, since it was installed), then
    stops gracefully; returns the exit code (0)."""
    if stop is None:
        stop = StopSignal()
    elif stop.requested:
        log.info("stop was requested while starting: stopping now")
    stop._serving = True
    stop.wait()
    log.info("signal %d received", stop.signum)
    running.stop()
    return 0


def announce_port(path: str | None, port: int) -> None:
    """Writes the bound port to a file (for `seer up` and tests that start services on port 0)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(port))
        import os

        os.replace(tmp, path)
