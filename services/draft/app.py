"""Builds and starts a draft server (store + gRPC server + optional history refill) from a DraftConfig."""

from __future__ import annotations

from services.common.server import RunningServer, announce_port, start_server
from services.draft.backfill import HistoryBackfill
from services.draft.buffer_link import BufferHistoryLink
from services.draft.config import DraftConfig
from services.draft.server import add_servicers
from services.draft.store import DraftStore


def start(cfg: DraftConfig) -> tuple[RunningServer, DraftStore]:
    store = DraftStore(cfg.limits())
    backfill: HistoryBackfill | None = None
    link: BufferHistoryLink | None = None
    if cfg.buffer_address:
        link = BufferHistoryLink(cfg.buffer_address)
        backfill = HistoryBackfill(store, link.fetch_iteration, retry_after_s=cfg.history_refill_retry_seconds).start()

    def on_stop() -> None:
        if backfill is not None:
            backfill.close()
        if link is not None:
            link.close()

    running = start_server("draft", cfg, add_servicers(store, backfill), on_stop=on_stop)
    announce_port(cfg.port_file or None, running.port)
    return running, store
