"""A chunk resuming from a committed output that is already complete (it ends with a stop / EOS
token, or fills max_tokens) ends at once with no tokens and the finish reason of that end, over real
gRPC with the real reference engine: generating on would append tokens past the response's end."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from seer.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_grpc import tokens_and_done

from services.worker.engines.reference.engine import ReferenceEngine


def _req(prompt: tuple[int, ...], output: list[int], **kw: Any) -> worker_pb2.RunChunkRequest:
    sampling = kw.pop("sampling", common_pb2.SamplingParams(temperature=0.0))
    base: dict[str, Any] = dict(request_id="r", batch_id="b", group_id="g", prompt_key="k", seq=1,
                                prompt_token_ids=prompt, output_token_ids=output, max_new_tokens=4, max_tokens=20,
                                sampling=sampling, policy_version=0, group_size=1)
    base.update(kw)
    return worker_pb2.RunChunkRequest(**base)


def _first_output(stub: worker_pb2_grpc.WorkerServiceStub, prompt: tuple[int, ...]) -> list[int]:
    toks, done = tokens_and_done(stub.RunChunk(_req(prompt, [], seq=0)))
    assert done.finish_reason == common_pb2.FINISH_REASON_CHUNK and len(toks) == 4
    return toks


def test_output_ending_with_eos_ends_stop_at_once(served: Any, ref_engine: ReferenceEngine,
                                                  prompts: list[tuple[int, ...]]) -> None:
    worker, stub = served
    eos = ref_engine.eos_token_ids[0]
    output = [*_first_output(stub, prompts[0]), eos]
    toks, done = tokens_and_done(stub.RunChunk(_req(prompts[0], output)))
    assert toks == [] and done.finish_reason == common_pb2.FINISH_REASON_STOP
    assert done.policy_version == 0 and done.stats.steps == 0
    # With ignore_eos the EOS is an ordinary token: the request goes on.
    toks, done = tokens_and_done(stub.RunChunk(_req(prompts[0], output, sampling=common_pb2.SamplingParams(
        temperature=0.0, ignore_eos=True))))
    assert len(toks) == 4 and done.finish_reason == common_pb2.FINISH_REASON_CHUNK
    assert worker.in_flight == 0 and not ref_engine.has_unfinished()


def test_output_ending_with_a_stop_token_ends_stop_at_once(served: Any, prompts: list[tuple[int, ...]]) -> None:
    _, stub = served
    output = _first_output(stub, prompts[1])
    stop = common_pb2.SamplingParams(temperature=0.0, stop_token_ids=[output[-1]])
    toks, done = tokens_and_done(stub.RunChunk(_req(prompts[1], output, sampling=stop)))
    assert toks == [] and done.finish_reason == common_pb2.FINISH_REASON_STOP


def test_output_at_max_tokens_ends_length_at_once(served: Any, prompts: list[tuple[int, ...]]) -> None:
    _, stub = served
    output = _first_output(stub, prompts[2])
    toks, done = tokens_and_done(stub.RunChunk(_req(prompts[2], output, max_tokens=len(output))))
    assert toks == [] and done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Past max_tokens is no response this worker could have produced: refused, naming the field.
    with pytest.raises(grpc.RpcError) as ei:
        tokens_and_done(stub.RunChunk(_req(prompts[2], output, max_tokens=len(output) - 1)))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_token_ids" in str(ei.value.details())


def test_complete_resume_is_still_refused_for_a_wrong_policy_version(served: Any,
                                                                     prompts: list[tuple[int, ...]],
                                                                     ref_engine: ReferenceEngine) -> None:
    _, stub = served
    output = [5, ref_engine.eos_token_ids[0]]
    with pytest.raises(grpc.RpcError) as ei:
        tokens_and_done(stub.RunChunk(_req(prompts[3], output, policy_version=7)))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "policy_version" in str(ei.value.details())
