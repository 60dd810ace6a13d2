"""Builds and starts a buffer (store + model info + core + gRPC server) from a BufferConfig."""

from __future__ import annotations

from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.buffer.model import load_model_info
from services.buffer.server import add_servicers
from services.buffer.store import Store
from services.common.server import RunningServer, announce_port, start_server


def start(cfg: BufferConfig) -> tuple[RunningServer, BufferCore]:
    model = load_model_info(cfg)
    core = BufferCore(Store(cfg.data_dir, sync=cfg.sync_writes), model,
                      max_requests_per_batch=cfg.max_requests_per_batch,
                      history_iterations=cfg.history_iterations, retain_batches=cfg.retain_batches,
                      watch_queue_events=cfg.watch_queue_limit(), results_page_bytes=cfg.results_page_bytes,
                      history_iteration_responses=cfg.history_iteration_responses)
    try:
        running = start_server("buffer", cfg, add_servicers(core, cfg), on_stop=core.close)
    except Exception:
        core.close()
        raise
    announce_port(cfg.port_file or None, running.port)
    return running, core
