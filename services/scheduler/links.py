"""gRPC links from the scheduler to the buffer and to workers.

The dispatch loop (service.py) talks to these links only; they turn grpc.RpcError into the typed
errors of services.common.errors so the loop can decide (retry, re-dispatch, drop) without
knowing gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from seer.v1 import buffer_pb2, buffer_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common import errors
from services.common.grpcutil import channel as common_channel

# A slow chunk says nothing about its worker's health (its other chunks are fine): only that chunk
# is aborted and re-dispatched.
DeadlineExceeded = errors.DeadlineExceeded


class Cancelled(errors.SeerError):
    """The call ended CANCELLED. `local`: by our own Stream.cancel(); otherwise by the peer (its
    handler cancelled the call) or the transport.

    Not errors.Aborted: a worker that ends a chunk's stream ABORTED aborted the attempt itself,
    which the dispatcher must not read as its own cancellation (that one costs the request nothing;
    an abort nobody asked for costs an attempt, or a worker that does it every time loops the
    request for ever)."""

    code_name = "CANCELLED"

    def __init__(self, message: str, *, field: str | None = None, local: bool = False) -> None:
        super().__init__(message, field=field)
        self.local = local


_CODES: dict[grpc.StatusCode, type[errors.SeerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: errors.Aborted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
}


def channel(address: str) -> grpc.Channel:
    """services.common.grpcutil.channel: limits, tracing and a short reconnect backoff (a restarted
    buffer or scheduler must be reachable again within about a second)."""
    return common_channel(address)


# A Seer service's status details start with the offending field ("policy_version: ...", see
# services.common.errors.SeerError): the typed error carries it again, so callers test the field,
# not the text.
# GetHistory keys per call: far below the buffer's limits (100,000 keys, 8 MiB of key text: prompt
# keys of up to 2 KiB fit).
HISTORY_KEYS_PER_CALL = 4096



def translate(err: grpc.RpcError) -> errors.SeerError:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    cls = _CODES.get(code, errors.SeerError) if code is not None else errors.SeerError
    out = cls(f"{code.name if code else 'UNKNOWN'}: {details}")
    out.field = errors.field_of(details)
    return out


class Stream:
    """A server stream whose errors come out typed; cancel() ends it from another thread. A
    CANCELLED end says whether our cancel() ended it (Cancelled.local)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            out = translate(e)
            if isinstance(out, Cancelled):
                out.local = self._cancelled
            raise out from e

    def cancel(self) -> None:
        self._cancelled = True  # before the call ends: its iterator may raise at once
        self._call.cancel()


class BufferLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self._stub = buffer_pb2_grpc.BufferInternalServiceStub(self._channel)

    def watch(self, watcher_id: str) -> Stream:
        return Stream(self._stub.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id=watcher_id)))

    def commit(self, req: buffer_pb2.CommitChunkRequest, timeout: float) -> buffer_pb2.CommitChunkResponse:
        try:
            return self._stub.CommitChunk(req, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as e:
            raise translate(e) from e

    def history(self, prompt_keys: Sequence[str], timeout: float = 10.0) -> list[buffer_pb2.PromptHistory]:
        """Lengths of the newest history of every key. A call takes HISTORY_KEYS_PER_CALL keys (the
        buffer refuses more than 100,000, or 8 MiB of them), and the keys a bounded reply left out
        (omitted_prompt_keys) are asked for again: a batch of many new prompts gets all its priors."""
        out: list[buffer_pb2.PromptHistory] = []
        todo = list(dict.fromkeys(prompt_keys))
        while todo:
            ask, todo = todo[:HISTORY_KEYS_PER_CALL], todo[HISTORY_KEYS_PER_CALL:]
            try:
                resp = self._stub.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=ask), timeout=timeout)
            except grpc.RpcError as e:
                raise translate(e) from e
            out.extend(resp.histories)
            omitted = list(resp.omitted_prompt_keys)
            if len(omitted) >= len(ask):  # no progress (the buffer always returns one key that fits)
                break
            todo[:0] = omitted
        return out

    def close(self) -> None:
        self._channel.close()


class WorkerLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)

    def run_chunk(self, req: worker_pb2.RunChunkRequest, timeout: float) -> Stream:
        return Stream(self._stub.RunChunk(req, timeout=timeout))

    def load_weights(self, version: int, source: str, timeout: float) -> worker_pb2.LoadWeightsResponse:
        try:
            req = worker_pb2.LoadWeightsRequest(version=version, source=source)
            return self._stub.LoadWeights(req, timeout=timeout)
        except grpc.RpcError as e:
            raise translate(e) from e

    def abort(self, request_id: str, timeout: float = 5.0, *, dispatch_epoch: int = 0) -> bool:
        """Aborts the request's chunk on the worker; with dispatch_epoch (the attempt's
        RunChunkRequest.dispatch_epoch) only that attempt or an older one: a late abort never kills
        a newer dispatch of the request. False when the worker ran no such chunk."""
        try:
            req = worker_pb2.AbortRequest(request_id=request_id, dispatch_epoch=dispatch_epoch)
            return bool(self._stub.Abort(req, timeout=timeout).found)
        except grpc.RpcError as e:
            raise translate(e) from e

    def close(self) -> None:
        self._channel.close()
