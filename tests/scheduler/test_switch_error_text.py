"""A weight update every worker failed reads once (new-user audit, session 33). It read, at the
trainer:

    INVALID_ARGUMENT: source: scheduler SwitchWeights failed: INVALID_ARGUMENT: source: no worker
    could load version 5 from it: {'worker-1': 'INVALID_ARGUMENT: source: /nonexistent/ckpt/config.json
    not found (...)', 'worker-0': <the same>}

The real Dispatcher behind its SchedulerService over gRPC on loopback; each worker's load goes
through a real WorkerLink to a stub worker server refusing LoadWeights as the worker does (so the
per-worker text is links.translate's), and the buffer's real SwitchFn (server.scheduler_switch)
calls the scheduler, as UpdateWeights does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from seer.v1 import scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.buffer.server import scheduler_switch
from services.common.errors import FailedPrecondition, InvalidArgument, SeerError
from services.scheduler.links import WorkerLink
from services.scheduler.server import add_to_server
from services.scheduler.worker_errors import MAX_NAMED_ERRORS, MAX_NAMED_WORKERS, strip_carried, worker_errors_text
from tests.common.grpc_server import loopback_server

from .test_dispatcher_faults import Rig
from .test_weight_refusals import ScriptedLoads, _switch

NOT_HF = "config.json not found (not a Hugging Face model directory)"


class _RefusingWorker(worker_pb2_grpc.WorkerServiceServicer):
    """LoadWeights refused as the worker refuses a directory without config.json; a source naming
    "gone" is NOT_FOUND instead (another way to fail, for the mixed case)."""

    def LoadWeights(self, request: worker_pb2.LoadWeightsRequest, context: grpc.ServicerContext) -> object:
        if "gone" in request.source:
            context.abort(grpc.StatusCode.NOT_FOUND, f"version: no checkpoint {request.version} here")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"source: {request.source}/{NOT_HF}")
        raise AssertionError("unreachable")


@pytest.fixture
def suite(make_rig: Callable[..., Rig]) -> Iterator[tuple[Rig, ScriptedLoads, str, str]]:
    """(rig, its worker links, the scheduler's address, the stub worker's address)."""
    workers = ScriptedLoads()
    t = make_rig(workers=workers)
    with loopback_server(worker_pb2_grpc.add_WorkerServiceServicer_to_server, _RefusingWorker(),
                         max_workers=4) as worker_address, loopback_server(add_to_server, t.d) as address:
        yield t, workers, address, worker_address


def _load_through(worker_address: str) -> Callable[[str, int, str], Exception | None]:
    """ScriptedLoads.refuse: every load goes to the stub worker over a real WorkerLink (worker w2's
    source with "-gone" appended, to fail it another way)."""

    def refuse(wid: str, version: int, source: str) -> Exception | None:
        link = WorkerLink(worker_address)
        try:
            link.load_weights(version, source + ("-gone" if wid == "w2" else ""), timeout=5)
        except SeerError as e:
            return e
        finally:
            link.close()
        return None

    return refuse


def test_a_source_every_worker_refused_reads_once(suite: tuple[Rig, ScriptedLoads, str, str]) -> None:
    t, workers, address, worker_address = suite
    t.register("w1")
    t.register("w0")
    with grpc.insecure_channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        assert _switch(stub, 4, "/ckpt/4") == 2
        workers.refuse = _load_through(worker_address)
        err = _switch(stub, 5, "/nonexistent/ckpt")
    expected = (f"source: no worker could load version 5 from '/nonexistent/ckpt': /nonexistent/ckpt/{NOT_HF} "
                "(w0, w1)")
    # Before: "source: no worker could load version 5 from it: {'w1': 'INVALID_ARGUMENT: source: ...', ...}".
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == expected

    # As the trainer gets it from UpdateWeights: the buffer passes it on as it reads (it was
    # "source: scheduler SwitchWeights failed: INVALID_ARGUMENT: source: ...").
    with pytest.raises(InvalidArgument) as e:
        scheduler_switch(address, 10.0)(5, "/nonexistent/ckpt")
    assert e.value.field == "source" and str(e.value) == expected


def test_workers_failing_in_different_ways_are_each_named(suite: tuple[Rig, ScriptedLoads, str, str]) -> None:
    t, workers, address, worker_address = suite
    for wid in ("w0", "w1", "w2"):
        t.register(wid)
    with grpc.insecure_channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        assert _switch(stub, 4, "/ckpt/4") == 3
        workers.refuse = _load_through(worker_address)
    # Not every worker found the source bad: FAILED_PRECONDITION naming version, and each error
    # keeps the code and field that are not the enclosing error's.
    with pytest.raises(FailedPrecondition) as e:
        scheduler_switch(address, 10.0)(5, "/p")
    assert str(e.value) == ("version: no worker loaded version 5 from '/p': INVALID_ARGUMENT: source: "
                            f"/p/{NOT_HF} (w0, w1); NOT_FOUND: version: no checkpoint 5 here (w2)"), str(e.value)


def test_strip_carried() -> None:
    carried = "INVALID_ARGUMENT: source: /x not found"
    assert strip_carried(carried, "INVALID_ARGUMENT", "source") == "/x not found"
    assert strip_carried(carried, "INVALID_ARGUMENT", "version") == "source: /x not found"
    assert strip_carried(carried, "FAILED_PRECONDITION", "source") == carried  # another code: all kept
    assert strip_carried("source: /x not found", "INVALID_ARGUMENT", "source") == "/x not found"  # no code
    assert strip_carried("link closed: gone", "UNAVAILABLE", None) == "link closed: gone"


def test_worker_errors_text_is_bounded() -> None:
    many = {f"w{i:02d}": "UNAVAILABLE: down" for i in range(MAX_NAMED_WORKERS + 3)}
    text = worker_errors_text(many, "UNAVAILABLE", None)
    assert text == f"down ({', '.join(f'w{i:02d}' for i in range(MAX_NAMED_WORKERS))} and 3 more)"
    distinct = {f"w{i:02d}": f"error {i}" for i in range(MAX_NAMED_ERRORS + 2)}
    text = worker_errors_text(distinct, "UNAVAILABLE", None)
    assert text.count("; ") == MAX_NAMED_ERRORS and text.endswith("; 2 other error(s) (2 worker(s))"), text


def test_long_distinct_worker_errors_stay_a_refusal_within_the_metadata_limit(
        suite: tuple[Rig, ScriptedLoads, str, str]) -> None:
    # Every worker fails differently on a long source path: the count caps alone let the details
    # grow past gRPC's 8 KiB metadata limit, and the buffer got UNAVAILABLE ("received metadata size
    # exceeds soft/hard limit": the outcome unknown, submissions held) instead of the refusal.
    t, workers, address, _ = suite
    ids = [f"w{i}" for i in range(MAX_NAMED_ERRORS + 2)]
    for wid in ids:
        t.register(wid)
    with grpc.insecure_channel(address) as ch:
        assert _switch(scheduler_pb2_grpc.SchedulerServiceStub(ch), 4, "/ckpt/4") == len(ids)
    source = "/ckpt/" + "d" * 1500

    def refuse(wid: str, version: int, src: str) -> Exception | None:
        return InvalidArgument(f"{wid} cannot read {src}/{NOT_HF}", field="source")

    workers.refuse = refuse
    with pytest.raises(InvalidArgument) as e:
        scheduler_switch(address, 10.0)(5, source)
    text = str(e.value)
    assert e.value.field == "source" and len(text.encode()) < 6000, len(text)
    assert "more characters)" in text and text.endswith("; 2 other error(s) (2 worker(s))"), text[-200:]
