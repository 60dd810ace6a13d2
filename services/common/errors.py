"""Typed errors of the pure cores. The one edge that maps them to gRPC status codes is
services.common.grpcutil; cores never import grpc."""

from __future__ import annotations

import re


class SeerError(Exception):
    """Base class. `field` names the offending request field when there is one."""

    code_name = "INTERNAL"
    # Sent to the caller as trailing metadata `seer-retry-reason` when set: a transient state with a
    # known, possibly long, end that a client may wait out beyond its usual retry window.
    retry_reason = ""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def field_of(details: str) -> str | None:
    """The field a status detail names: SeerError's "field: message" form, as a peer sent it."""
    m = _FIELD.match(details or "")
    return m.group(1) if m else None


class InvalidArgument(SeerError, ValueError):
    code_name = "INVALID_ARGUMENT"


class NotFound(SeerError, KeyError):
    code_name = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class AlreadyExists(SeerError):
    code_name = "ALREADY_EXISTS"


class ResourceExhausted(SeerError):
    code_name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(SeerError):
    code_name = "FAILED_PRECONDITION"


class Unavailable(SeerError):
    code_name = "UNAVAILABLE"


class Aborted(SeerError):
    code_name = "ABORTED"


class DataLoss(SeerError):
    code_name = "DATA_LOSS"


class OutOfRange(SeerError):
    code_name = "OUT_OF_RANGE"


class DeadlineExceeded(SeerError):
    """A call ran past its deadline. Not Unavailable: one slow call says nothing about the health
    of the peer's other calls."""

    code_name = "DEADLINE_EXCEEDED"
