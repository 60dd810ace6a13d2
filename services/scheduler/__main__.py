"""`python -m services.scheduler --buffer-address HOST:PORT [--port P] [--policy baseline] ...`"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.common import config
from services.common.log import get_logger, setup_logging
from services.common.server import StopSignal, announce_port, serve_until_signal, start_server
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import add_to_server
from services.scheduler.service import Dispatcher

log = get_logger("services.scheduler")


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging("scheduler")
    cfg = config.load_or_exit(SchedulerConfig, "scheduler", argv, prog="python -m services.scheduler")
    dispatcher = Dispatcher(cfg)
    stop = StopSignal()  # before the port opens
    running = start_server("scheduler", cfg, lambda server: add_to_server(dispatcher, server), on_stop=dispatcher.stop)
    dispatcher.start()
    announce_port(cfg.port_file or None, running.port)
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    sys.exit(main())
