"""`python -m services.kvstore --port P --data-dir D --dram-bytes N --ssd-bytes N`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from prometheus_client.registry import REGISTRY

from services.common import config
from services.common.log import setup_logging
from services.common.memtune import tune_malloc
from services.common.server import StopSignal, announce_port, serve_until_signal
from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging("kvstore")
    cfg = config.load_or_exit(KvStoreConfig, "kvstore", argv, prog="python -m services.kvstore")
    if cfg.tune_malloc:
        tune_malloc(trim_bytes=cfg.malloc_trim_bytes, arenas=cfg.malloc_arenas)
    stop = StopSignal()  # before the port opens (RocksDB recovery comes first)
    running, _store = serve(cfg, registry=REGISTRY)
    announce_port(cfg.port_file or None, running.port)
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    sys.exit(main())
