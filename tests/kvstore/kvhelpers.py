"""Helpers of the kvstore tests: a small page layout, random pages, an in-process replica."""

from __future__ import annotations

import os
from pathlib import Path

from services.common.kvlayout import KVLayout
from services.common.pagehash import chain_hashes
from services.common.server import RunningServer
from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve
from services.kvstore.store import KvStore
from services.worker.engine import KVPages

# A small layout keeps tests fast: 2 layers x K/V x 4 tokens x 1 head x 8 dims x 4 bytes = 512 B.
KV_LAYOUT = KVLayout(dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
LAYOUT = KVLayout(dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
PAGE_BYTES = LAYOUT.page_bytes


def make_pages(tokens: list[int], version: str = "m@v1", seed: int = 0) -> KVPages:
    """Random page bytes for the full pages of tokens, hashed with the shared page hash."""
    hashes = chain_hashes(tokens, KV_LAYOUT.page_size, version)
    rnd = [
        os.urandom(PAGE_BYTES) if seed == 0 else bytes((seed + i + j) % 256 for j in range(PAGE_BYTES))
        for i in range(len(hashes))
    ]
    n = len(hashes) * KV_LAYOUT.page_size
    return KVPages(version, KV_LAYOUT, tuple(tokens[:n]), tuple(hashes), tuple(rnd))


class Replica:
    """One kvstore server; stop() + start() is a restart on the same data dir and port."""

    def __init__(self, data_dir: Path, **cfg: object) -> None:
        params: dict[str, object] = {"grace_seconds": 0.0, "max_workers": 8, "min_blob_bytes": 256, **cfg}
        self.cfg = KvStoreConfig(data_dir=str(data_dir), **params)  # type: ignore[arg-type]
        self.running: RunningServer | None = None
        self.store: KvStore | None = None
        self.start()

    def start(self) -> None:
        running, self.store = serve(self.cfg)
        self.running = running
        if self.cfg.port == 0:  # keep the port across restarts so clients' addresses stay valid
            self.cfg = self.cfg.replace(port=running.port)  # type: ignore[assignment]

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop(0)
            self.running = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.cfg.port}"
