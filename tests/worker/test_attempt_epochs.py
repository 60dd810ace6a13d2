"""Attempts of one request on one worker, ordered by their dispatch epoch (found by an audit).

  - The scheduler raises a request's epoch only after giving up on the attempt before (a failed
    stream, a deadline). The abandoned attempt may still run here when the re-dispatch arrives
    (its cancel still on the way): the re-dispatch was refused ALREADY_EXISTS, which costs the
    request an attempt. A strictly newer epoch now supersedes the running attempt (it ends
    ABORTED); an equal or unordered (0) one is still refused.
  - An Abort for any attempt (epoch 0: the request was cancelled) aborted only the running
    attempt when there was one, and a newer attempt being admitted meanwhile (fetching its KV)
    then ran its whole chunk for the cancelled request.

Real gRPC on loopback and the real reference engine on the embedded model.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from seer.v1 import common_pb2, worker_pb2
from test_worker_faults import _HeldFetchPool
from worker_grpc import tokens_and_done

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, TokensEvent, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine

SEEDED = common_pb2.SamplingParams(temperature=1.0, seed=11, ignore_eos=True)


def chunk_req(rid: str, prompt: tuple[int, ...], max_new: int, epoch: int) -> worker_pb2.RunChunkRequest:
    return worker_pb2.RunChunkRequest(request_id=rid, batch_id="b", group_id="g", prompt_key="k",
                                      prompt_token_ids=prompt, max_new_tokens=max_new, max_tokens=max_new,
                                      sampling=SEEDED, policy_version=0, group_size=1, dispatch_epoch=epoch)


def test_a_newer_attempt_supersedes_the_abandoned_one(served: Any, prompts: list[tuple[int, ...]]) -> None:
    worker, stub = served
    prompt = prompts[2]
    reference, _ = tokens_and_done(stub.RunChunk(chunk_req("ref", prompt, 6, 0)))
    old = stub.RunChunk(chunk_req("r", prompt, 400, 10))
    assert next(old).WhichOneof("event") == "tokens"  # attempt 10 runs
    # The same attempt again, or one without an order, is refused: it is no re-dispatch.
    for epoch in (10, 0):
        with pytest.raises(grpc.RpcError) as ei:
            tokens_and_done(stub.RunChunk(chunk_req("r", prompt, 6, epoch)))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in (ei.value.details() or "")
    # The scheduler gave up on attempt 10 and dispatched r here again before its cancel arrived.
    toks, done = tokens_and_done(stub.RunChunk(chunk_req("r", prompt, 6, 11)))
    assert toks == reference
    assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    rest = list(old)
    assert rest[-1].done.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert sum(len(m.tokens.token_ids) for m in rest) < 399
    deadline = time.monotonic() + 10
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.in_flight == 0 and not worker.engine.has_unfinished()


def test_an_abort_of_any_attempt_also_ends_a_newer_one_being_admitted(
    ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
) -> None:
    pool = _HeldFetchPool()
    w = Worker(ref_engine, kv_pool=pool, kv_offload=False, speculation=False).start()  # type: ignore[arg-type]
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    old = w.submit(ChunkJob(request_id="r", prompt_token_ids=prompts[1], max_new_tokens=400, max_tokens=400,
                            sampling=sampling, policy_version=0, dispatch_epoch=5))
    # Tokens no other test caches: the worker fetches only what its engine lacks.
    prompt = prompts[1] + tuple(range(3000, 3040))
    newer = ChunkJob(request_id="r", prompt_token_ids=prompt, max_new_tokens=4, max_tokens=64, sampling=sampling,
                     policy_version=0, fetch_kv=True, dispatch_epoch=6)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("run", w.run(newer)))
    try:
        first = old.next_event(30)
        assert isinstance(first, TokensEvent)  # attempt 5 runs
        t.start()
        assert pool.fetching.wait(30)  # attempt 6 is being admitted
        assert w.abort("r", dispatch_epoch=0) is True  # the request was cancelled: any attempt
        events = list(old.events())
        assert isinstance(events[-1], DoneEvent) and events[-1].finish == ChunkFinish.ABORTED
        pool.go.set()
        t.join(60)
        tokens, _logprobs, done = out["run"]
        assert done.finish == ChunkFinish.ABORTED and tokens == []
    finally:
        pool.go.set()
        t.join(60)
        w.close()
    assert not ref_engine.has_unfinished()
