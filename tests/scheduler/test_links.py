"""links.translate: a worker's status becomes the typed error, with the field it names."""

from __future__ import annotations

import grpc

from services.common import errors
from services.scheduler.links import translate


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_translate_keeps_code_message_and_field() -> None:
    e = translate(_Rpc(grpc.StatusCode.FAILED_PRECONDITION, "policy_version: chunk wants 2, worker serves 1"))
    assert isinstance(e, errors.FailedPrecondition) and e.field == "policy_version"
    assert str(e) == "FAILED_PRECONDITION: policy_version: chunk wants 2, worker serves 1"
    e = translate(_Rpc(grpc.StatusCode.INVALID_ARGUMENT, "groups[3].sampling.top_p: must be in (0, 1]"))
    assert e.field == "groups[3].sampling.top_p"
    e = translate(_Rpc(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert isinstance(e, errors.Unavailable) and e.field is None
