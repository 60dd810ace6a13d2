"""Structured (JSON lines) logging with request and group ids from context variables.

Services never print; they log through `get_logger(__name__)` and bind ids with `log_context(...)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("seer_log_context", default=None)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Binds fields (request_id=..., group_id=..., batch_id=...) to every log record in this context."""
    current = dict(_context.get() or {})
    current.update({k: v for k, v in fields.items() if v is not None and v != ""})
    token = _context.set(current)
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_context.get() or {})
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, level: str | None = None) -> None:
    level = (level or os.environ.get("SEER_LOG_LEVEL", "info")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def kv(**fields: Any) -> dict[str, Any]:
    """`log.info("chunk done", extra=kv(tokens=12))` adds structured fields to one record."""
    return {"fields": fields}
