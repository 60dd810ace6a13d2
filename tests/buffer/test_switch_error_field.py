"""UpdateWeights passes on the field the scheduler's refusal names (glue between the buffer and the
scheduler's SwitchWeights; the scheduler is a stub gRPC server answering with a fixed status): every
INVALID_ARGUMENT was reported as naming `source`, a FAILED_PRECONDITION as naming nothing."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from seer.v1 import scheduler_pb2_grpc

from services.buffer.server import scheduler_switch
from services.common.errors import FailedPrecondition, InvalidArgument
from tests.common.grpc_server import loopback_server


class _Refusing(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        self.address = ""  # where it is served (set by the fixture)

    def SwitchWeights(self, request: object, context: grpc.ServicerContext) -> object:
        context.abort(self.code, self.details)
        raise AssertionError("unreachable")


@pytest.fixture
def refusing() -> Iterator[_Refusing]:
    servicer = _Refusing(grpc.StatusCode.OK, "")
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer,
                         max_workers=2) as address:
        servicer.address = address
        yield servicer


@pytest.mark.parametrize(("code", "details", "cls", "field"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "version: must be above the current 3", InvalidArgument, "version"),
    (grpc.StatusCode.INVALID_ARGUMENT, "source: no such checkpoint", InvalidArgument, "source"),
    (grpc.StatusCode.INVALID_ARGUMENT, "no field named here", InvalidArgument, "source"),
    (grpc.StatusCode.FAILED_PRECONDITION, "version: a switch to 4 is in progress", FailedPrecondition, "version"),
])
def test_the_refusals_field_is_passed_on(refusing: _Refusing, code: grpc.StatusCode, details: str,
                                         cls: type[Exception], field: str) -> None:
    refusing.code, refusing.details = code, details
    switch = scheduler_switch(refusing.address, 10.0)
    with pytest.raises(cls) as e:
        switch(4, "ckpt")
    assert e.value.field == field, str(e.value)  # type: ignore[attr-defined]
