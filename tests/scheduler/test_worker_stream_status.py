"""How a RunChunk stream's end status is read, over real gRPC on loopback: a worker-like
WorkerService server and the scheduler's real WorkerLink (the buffer is still scripted).

A worker that ends a chunk's stream ABORTED aborted the attempt itself (superseded, a weight
switch, its own abort). links mapped ABORTED and CANCELLED both to errors.Aborted, and the
dispatcher read every Aborted as its own cancellation: such a chunk was retried free, a worker
doing it every time looped the request for ever and was never quarantined. ABORTED (and a
CANCELLED the worker's end caused) now costs an attempt and counts as the worker's fault; a stream
the scheduler cancelled itself (Cancelled.local) still costs nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
from seer.v1 import worker_pb2, worker_pb2_grpc

from services.common import errors
from services.scheduler.links import Cancelled, WorkerLink
from services.scheduler.service import MAX_CHUNK_ATTEMPTS
from tests.common.grpc_server import loopback_server

from .test_dispatcher_faults import ABORTED, Rig, capacity, chunk_events, item, wait_for


class ScriptedWorker(worker_pb2_grpc.WorkerServiceServicer):
    """RunChunk by `mode`: "ok" streams an honest chunk; "abort" ends the call ABORTED (the worker
    aborted the attempt); "cancel" cancels the call from the server's side; "hang" waits until the
    client cancels the call or Abort is called (then ends it ABORTED, as a worker may)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lock = threading.Lock()
        self.chunks: list[worker_pb2.RunChunkRequest] = []
        self.aborts: list[worker_pb2.AbortRequest] = []
        self.released = threading.Event()
        self.ended = threading.Event()  # a "hang" chunk's call is over

    def RunChunk(self, request: worker_pb2.RunChunkRequest,
                 context: grpc.ServicerContext) -> Iterator[worker_pb2.RunChunkResponse]:
        with self.lock:
            self.chunks.append(request)
        if self.mode == "ok":
            yield from chunk_events(request)
        elif self.mode == "abort":
            context.abort(grpc.StatusCode.ABORTED, "request_id: superseded by a newer dispatch epoch")
        elif self.mode == "cancel":
            context.cancel()
        else:
            try:
                while context.is_active() and not self.released.wait(0.01):
                    pass
                if self.released.is_set():
                    context.abort(grpc.StatusCode.ABORTED, "request_id: aborted")
            finally:
                self.ended.set()

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:
        with self.lock:
            self.aborts.append(request)
        self.released.set()
        return worker_pb2.AbortResponse(found=True)


class Servers:
    """Serves ScriptedWorkers on loopback until the test ends."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack

    def start(self, worker: ScriptedWorker) -> str:
        return self._stack.enter_context(
            loopback_server(worker_pb2_grpc.add_WorkerServiceServicer_to_server, worker, max_workers=16))


@pytest.fixture
def servers() -> Iterator[Servers]:
    with contextlib.ExitStack() as stack:
        yield Servers(stack)


def _rig(make_rig: Callable[..., Rig], **cfg: object) -> Rig:
    t = make_rig(**cfg)
    t.d._worker_link_factory = WorkerLink  # real links to the loopback servers
    return t


def _register(t: Rig, wid: str, address: str) -> None:
    t.d.register_worker(wid, address, capacity(), "fake", 0, "")


# ---- the link --------------------------------------------------------------------------------------


def _run(link: WorkerLink, cancel_after: float | None = None) -> errors.SeerError:
    stream = link.run_chunk(worker_pb2.RunChunkRequest(request_id="a", max_new_tokens=4, max_tokens=8), timeout=10)
    if cancel_after is not None:
        threading.Timer(cancel_after, stream.cancel).start()
    with pytest.raises(errors.SeerError) as err:
        list(stream)
    return err.value


def test_the_link_tells_a_workers_abort_from_our_cancel(servers: Servers) -> None:
    aborting = WorkerLink(servers.start(ScriptedWorker("abort")))
    cancelling = WorkerLink(servers.start(ScriptedWorker("cancel")))
    hanging = WorkerLink(servers.start(ScriptedWorker("hang")))
    try:
        e = _run(aborting)
        assert type(e) is errors.Aborted and e.field == "request_id"  # the worker's own abort
        e = _run(cancelling)
        assert isinstance(e, Cancelled) and not isinstance(e, errors.Aborted) and not e.local  # the peer's
        e = _run(hanging, cancel_after=0.2)
        assert isinstance(e, Cancelled) and e.local  # ours
    finally:
        for link in (aborting, cancelling, hanging):
            link.close()


# ---- the dispatcher --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["abort", "cancel"])
def test_a_worker_ending_streams_aborted_unasked_costs_attempts(
        make_rig: Callable[..., Rig], servers: Servers, mode: str) -> None:
    worker = ScriptedWorker(mode)
    t = _rig(make_rig)
    _register(t, "w0", servers.start(worker))
    t.run()
    t.d._add_items([item("a")])
    # Failed in the buffer (an ABORTED commit) after its attempts; it was retried for ever before.
    wait_for(lambda: [c.finish_reason for c in t.buffer.of("a")] == [ABORTED], timeout=10)
    assert len(worker.chunks) == MAX_CHUNK_ATTEMPTS
    assert "a" not in t.d._requests


def test_a_worker_aborting_every_chunk_is_quarantined_and_the_batch_completes(
        make_rig: Callable[..., Rig], servers: Servers) -> None:
    good, bad = ScriptedWorker("ok"), ScriptedWorker("abort")
    t = _rig(make_rig, worker_failure_limit=3)
    _register(t, "good", servers.start(good))
    _register(t, "bad", servers.start(bad))
    t.run()
    rids = [f"r{i}" for i in range(12)]
    t.d._add_items([item(rid) for rid in rids])  # 12 groups (item(): one group per request)
    wait_for(lambda: not t.d._requests, timeout=15)
    assert bad.chunks, "the bad worker was never tried"
    assert t.d.core.is_quarantined("bad")
    assert "the chunk stream ended ABORTED unasked" in t.d.core.quarantine_reason("bad")
    for rid in rids:  # every request completed on the good worker, none given up on
        assert t.buffer.of(rid)[-1].finish_reason != ABORTED


def test_a_chunk_we_stopped_costs_nothing(make_rig: Callable[..., Rig], servers: Servers) -> None:
    """Our own stops: a cancelled request's chunk the worker then ends ABORTED, and a chunk whose
    stream we cancel (its batch id submitted again) cost neither the request nor the worker."""
    worker = ScriptedWorker("hang")
    t = _rig(make_rig, worker_failure_limit=1)
    _register(t, "w0", servers.start(worker))
    t.run()
    t.d._add_items([item("a")])
    wait_for(lambda: len(worker.chunks) == 1)
    t.d._cancel_request("a")  # Abort on the worker, which ends the stream ABORTED
    wait_for(lambda: t.d.stats().in_flight_chunks == 0)
    assert worker.aborts and worker.ended.is_set()

    worker.released.clear()
    worker.ended.clear()
    t.d._add_items([item("b")])
    wait_for(lambda: len(worker.chunks) == 2)
    again = item("b")
    again.submit_seq = 2
    worker.mode = "ok"
    t.d._add_items([again])  # the old request's stream is cancelled by us, the new one runs
    wait_for(lambda: worker.ended.is_set() and not t.d._requests)
    assert t.d.core.stats()["worker_fault_quarantines"] == 0
    assert not t.d.core.is_quarantined("w0")
    assert t.buffer.of("a") == []
    assert [c.submit_seq for c in t.buffer.of("b")] == [2, 2]
