"""RunChunkRequest.submit_seq (the buffer's submission of the batch) reaches the draft server's
RegisterGroup through the worker: the gRPC servicer's job, the core's registration of every chunk,
and the embedded DraftClient. With it the draft server tells a resubmitted batch id's new run from
the old run's retry (tests/draft/test_register_submit_seq.py); lost on the way (0), it falls back to
dispatch epochs, which a clock gone back or a lost commit's retry defeats.

Real worker core on the reference engine served over gRPC on loopback, a real DraftClient (its
background ticks stopped: flush() drives them) and a real draft server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from seer.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.grpcutil import channel
from services.common.server import RunningServer, ServiceConfig, start_server
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.server import add_servicer
from tests.draft.draft_helpers import DraftServer, manual


def _run(stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.RunChunkRequest) -> worker_pb2.ChunkDone:
    done: worker_pb2.ChunkDone | None = None
    stream: Iterator[worker_pb2.RunChunkResponse] = stub.RunChunk(req, timeout=60)
    for ev in stream:
        if ev.HasField("done"):
            done = ev.done
    assert done is not None
    return done


def test_the_chunk_submit_seq_reaches_register_group(ref_engine: ReferenceEngine,
                                                     draft_server: DraftServer) -> None:
    draft = manual(draft_server.address)
    worker = Worker(ref_engine, worker_id="w-seq", draft=draft, speculation=False).start()
    running: RunningServer = start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
                                          on_stop=worker.close)
    ch: grpc.Channel = channel(running.address)
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.RunChunkRequest(
            request_id="b/0/0", batch_id="b", group_id="b/0", prompt_key="k", prompt_token_ids=[1, 2, 3, 4],
            max_new_tokens=2, max_tokens=2, sampling=common_pb2.SamplingParams(temperature=1.0, seed=3,
                                                                               ignore_eos=True),
            policy_version=0, group_size=2, dispatch_epoch=5, submit_seq=4242)
        _run(stub, req)
        draft.flush()
        g = draft_server.store._groups["b/0"]
        assert g.submit_seq == 4242
        assert draft._groups["b/0"].submit_seq == 4242
    finally:
        ch.close()
        running.stop(1.0)
        draft.close()
