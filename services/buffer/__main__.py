"""`python -m services.buffer --port 50051 --data-dir /data/buffer [--model-dir DIR]`."""

from __future__ import annotations

import sys

from services.buffer.app import start
from services.buffer.config import BufferConfig
from services.buffer.records import RecordError
from services.buffer.store import StoreFormatError
from services.common import config
from services.common.log import get_logger, kv, setup_logging
from services.common.server import StopSignal, serve_until_signal

log = get_logger("services.buffer")

# The exit status of a buffer whose data dir it cannot read (not 2: the configuration was fine, and a
# restart loop will not help; an operator has to look at the store).
EXIT_STORE_UNREADABLE = 3


def main(argv: list[str] | None = None) -> int:
    setup_logging("buffer")
    cfg = config.load_or_exit(BufferConfig, "buffer", argv, prog="python -m services.buffer")
    stop = StopSignal()  # before the port opens (the store's recovery and the model info come first)
    try:
        running, _core = start(cfg)
    except StoreFormatError as e:  # its message names the data dir, the found and the supported format
        log.error(str(e), extra=kv(data_dir=cfg.data_dir, found_format=e.found))
        return EXIT_STORE_UNREADABLE
    except RecordError as e:  # recovery met a record it cannot decode: its message names key and field
        log.error(f"data dir {cfg.data_dir}: {e}", extra=kv(data_dir=cfg.data_dir, key=e.key.decode(errors="replace"),
                                                         field=e.record_field))
        return EXIT_STORE_UNREADABLE
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    sys.exit(main())
