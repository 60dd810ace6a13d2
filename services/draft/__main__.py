"""`python -m services.draft --port 50053 [--memory-budget-mb 2048] [--history-iterations 2]`."""

from __future__ import annotations

import sys

from services.common import config
from services.common.log import setup_logging
from services.common.server import StopSignal, serve_until_signal
from services.draft.app import start
from services.draft.config import DraftConfig


def main(argv: list[str] | None = None) -> int:
    setup_logging("draft")
    cfg = config.load_or_exit(DraftConfig, "draft", argv, prog="python -m services.draft")
    stop = StopSignal()  # before the port opens
    running, _store = start(cfg)
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    sys.exit(main())
