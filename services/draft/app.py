"""Builds and starts a draft server (store + gRPC server) from a DraftConfig."""

from __future__ import annotations

from services.common.server import RunningServer, announce_port, start_server
from services.draft.config import DraftConfig
from services.draft.server import add_servicers
from services.draft.store import DraftStore


def start(cfg: DraftConfig) -> tuple[RunningServer, DraftStore]:
    store = DraftStore(cfg.limits())
    running = start_server("draft", cfg, add_servicers(store))
    announce_port(cfg.port_file or None, running.port)
    return running, store
