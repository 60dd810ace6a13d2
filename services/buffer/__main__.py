"""`python -m services.buffer --port 50051 --data-dir /data/buffer [--model-dir DIR]`."""

from __future__ import annotations

import sys

from services.buffer.app import start
from services.buffer.config import BufferConfig
from services.common import config
from services.common.log import setup_logging
from services.common.server import StopSignal, serve_until_signal


def main(argv: list[str] | None = None) -> int:
    setup_logging("buffer")
    cfg = config.load_or_exit(BufferConfig, "buffer", argv, prog="python -m services.buffer")
    stop = StopSignal()  # before the port opens (the store's recovery and the model info come first)
    running, _core = start(cfg)
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    sys.exit(main())
