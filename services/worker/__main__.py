"""`python -m services.worker [--flags]`: one engine behind WorkerService, registered with the scheduler."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from services.common import config
from services.common.grpcutil import bracket_ipv6
from services.common.log import get_logger, kv, setup_logging
from services.common.server import StopSignal, announce_port, serve_until_signal, start_server
from services.worker.config import WorkerConfig
from services.worker.factory import build_worker
from services.worker.registration import Registrar
from services.worker.server import add_servicer


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging("worker")
    log = get_logger("services.worker")
    cfg = config.load_or_exit(WorkerConfig, "worker", argv, prog="python -m services.worker")
    sized = cfg.sized_for_batch()
    if sized.max_workers != cfg.max_workers:
        log.info("handler threads raised to hold a RunChunk stream per batch slot",
                 extra=kv(max_batch_size=cfg.max_batch_size, max_workers=sized.max_workers))
        cfg = sized
    worker_id = cfg.worker_id or f"worker-{socket.gethostname()}-{cfg.port or 'auto'}"
    try:
        worker = build_worker(cfg, worker_id).start()
    except (OSError, ValueError) as e:
        # A missing model directory or a bad engine setting: one line, exit 2, not a traceback.
        log.error("cannot start the engine: %s", e)
        return 2
    # After the engine is built, before the port opens: a signal while the model loads (minutes for
    # a large one) still ends the process at once, as there is nothing to drain yet.
    stop = StopSignal()
    registrar: Registrar | None = None

    def on_stop() -> None:
        if registrar is not None:
            registrar.stop()
        worker.close()
        shutdown = getattr(worker.engine, "shutdown", None)  # SGLang runs subprocesses
        if callable(shutdown):
            shutdown()

    running = start_server("worker", cfg, add_servicer(worker, cfg.drain_timeout_seconds, cfg.stream_limit()),
                           on_stop=on_stop)
    # A broken engine (every chunk and a canary failed) turns the gRPC health NOT_SERVING, so an
    # orchestrator's liveness probe restarts the process; the scheduler quarantines it meanwhile.
    worker.on_engine_health(running.set_serving)
    if not cfg.worker_id and not cfg.port:
        worker.worker_id = f"worker-{socket.gethostname()}-{running.port}"
    announce_port(cfg.port_file or None, running.port)
    host = cfg.host if cfg.host not in ("0.0.0.0", "::") else socket.gethostname()
    advertise = bracket_ipv6(cfg.advertise_address or f"{host}:{running.port}")
    if cfg.scheduler_address:
        registrar = Registrar(worker, cfg.scheduler_address, advertise, max_streams=cfg.stream_limit()).start()
    log.info("worker ready", extra=kv(worker_id=worker.worker_id, address=advertise))
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    raise SystemExit(main())
