"""SubmitBatch and UpdateWeights errors a new user met (audit of session 33), over real gRPC on
loopback against a real buffer (RocksDB in a temp dir, the tiny word-level tokenizer):

- a prompt longer than the model context was blamed on max_tokens ("groups[0].max_tokens: prompt
  length 9001 + max_tokens 16 exceeds the model context 8192"): lowering max_tokens never helps;
- ALREADY_EXISTS said "submitted before with different content" without saying what content is
  (seed_scope is part of it, the submission_token is not) or what to do;
- a float32 sampling field was echoed as float32 widened ("got -0.10000000149011612" for -0.1);
- a failed weight update read "source: scheduler SwitchWeights failed: INVALID_ARGUMENT: source:
  ...": the buffer re-wrapped the scheduler's refusal with the code and field it carries itself.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc
import pytest
from buffer_helpers import TINY_CONTEXT, BufferHandle, expect_error, group, submit
from seer.v1 import common_pb2, scheduler_pb2_grpc

from services.buffer.server import scheduler_switch
from services.buffer.validation import as_typed
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from tests.common.grpc_server import loopback_server

IA = grpc.StatusCode.INVALID_ARGUMENT


# ---- item 1: a prompt at or over the context names the prompt ----------------------------------


def test_a_prompt_over_the_context_names_the_prompt_and_by_how_much(buf: BufferHandle) -> None:
    # Before: "groups[0].max_tokens: prompt length 58 + max_tokens 4 exceeds the model context 48".
    msg = expect_error(lambda: submit(buf.rollout, "long", [group(prompt_token_ids=[5] * (TINY_CONTEXT + 10),
                                                                   max_tokens=4)]), IA)
    assert msg == (f"groups[0].prompt_token_ids: prompt length {TINY_CONTEXT + 10} exceeds the model context "
                   f"{TINY_CONTEXT} by 10 tokens; a prompt may have at most {TINY_CONTEXT - 1} tokens "
                   "(shorten it by 11)"), msg


def test_a_prompt_that_fills_the_context_names_the_prompt(buf: BufferHandle) -> None:
    msg = expect_error(lambda: submit(buf.rollout, "full", [group(prompt_token_ids=[5] * TINY_CONTEXT,
                                                                   max_tokens=1)]), IA)
    assert msg.startswith(f"groups[0].prompt_token_ids: prompt length {TINY_CONTEXT} fills the model context "
                          f"{TINY_CONTEXT}, leaving no token to generate"), msg
    assert "(shorten it by 1)" in msg


def test_a_prompt_text_over_the_context_names_prompt_text(buf: BufferHandle) -> None:
    text = " ".join(["cat"] * (TINY_CONTEXT + 2))  # one token a word (the word-level tokenizer)
    msg = expect_error(lambda: submit(buf.rollout, "long-text", [group(prompt_text=text, max_tokens=2)]), IA)
    assert msg.startswith(f"groups[0].prompt_text: prompt length {TINY_CONTEXT + 2} exceeds the model context "
                          f"{TINY_CONTEXT} by 2 tokens"), msg


def test_a_prompt_that_fits_names_max_tokens_and_the_largest_that_fits(buf: BufferHandle) -> None:
    msg = expect_error(lambda: submit(buf.rollout, "mt", [group(prompt_token_ids=[1, 2, 3],
                                                                 max_tokens=TINY_CONTEXT)]), IA)
    assert msg == (f"groups[0].max_tokens: prompt length 3 + max_tokens {TINY_CONTEXT} exceeds the model context "
                   f"{TINY_CONTEXT}: max_tokens can be at most {TINY_CONTEXT - 3} for this prompt"), msg
    # And that largest is accepted.
    assert submit(buf.rollout, "mt", [group(prompt_token_ids=[1, 2, 3], max_tokens=TINY_CONTEXT - 3)]).num_requests


# ---- item 2: ALREADY_EXISTS says what content is and what to do --------------------------------


CONTENT = "(content: every group's prompt, prompt_key, group_size, max_tokens, sampling and labels, and the seed_scope"
WHAT_TO_DO = "submit this one under a new batch_id, or resubmit exactly the stored content to collect that batch"


def test_other_content_says_what_content_is_and_what_to_do(buf: BufferHandle) -> None:
    submit(buf.rollout, "same", [group(group_size=2)])
    # Before: "batch_id: batch 'same' was submitted before with different content".
    msg = expect_error(lambda: submit(buf.rollout, "same", [group(group_size=2, max_tokens=9)]),
                       grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    assert msg.startswith("batch_id: batch 'same' was submitted before with different content (content:"), msg
    assert CONTENT in msg and "not the submission_token" in msg and WHAT_TO_DO in msg, msg


def test_other_group_sizes_are_named_from_the_stored_counts(buf: BufferHandle) -> None:
    submit(buf.rollout, "sizes", [group(group_size=2), group(group_size=3)])
    msg = expect_error(lambda: submit(buf.rollout, "sizes", [group(group_size=2)]),
                       grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    assert ("different content: the stored batch has 2 group(s) and 5 request(s), this submission 1 and 2 "
            f"{CONTENT}") in msg, msg
    assert WHAT_TO_DO in msg


def test_only_another_seed_scope_is_named(buf: BufferHandle) -> None:
    seeded = group(group_size=2, sampling=common_pb2.SamplingParams(temperature=1.0, seed=7))
    submit(buf.rollout, "scoped", [seeded])
    msg = expect_error(lambda: submit(buf.rollout, "scoped", [seeded], seed_scope="rep-1"),
                       grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    assert ("different content: only seed_scope differs (the stored batch has none, which means its batch id; "
            "this one 'rep-1')") in msg, msg
    # The batch id spelled out as the scope is the stored batch itself, as before.
    assert submit(buf.rollout, "scoped", [seeded], seed_scope="scoped").already_submitted


# ---- item 3: float32 sampling values echoed as typed -------------------------------------------


@pytest.mark.parametrize(("sampling", "field", "got"), [
    # Before: "got -0.10000000149011612".
    (common_pb2.SamplingParams(top_p=-0.1), "top_p", "got -0.1"),
    (common_pb2.SamplingParams(top_p=1.3), "top_p", "got 1.3"),
    (common_pb2.SamplingParams(temperature=-0.7), "temperature", "got -0.7"),
    (common_pb2.SamplingParams(temperature=3e-6), "temperature", "got 3e-06"),
])
def test_a_float_sampling_value_is_echoed_as_typed(buf: BufferHandle, sampling: common_pb2.SamplingParams,
                                                   field: str, got: str) -> None:
    msg = expect_error(lambda: submit(buf.rollout, "fl", [group(sampling=sampling)]), IA,
                       f"groups[0].sampling.{field}")
    assert msg.endswith(got), msg


def _f32(v: float) -> float:
    return float(struct.unpack("f", struct.pack("f", v))[0])


def test_as_typed() -> None:
    assert [as_typed(_f32(v)) for v in (-0.1, 0.95, 1.5, 1e9, -1.0, 1e-5)] == [
        "-0.1", "0.95", "1.5", "1000000000.0", "-1.0", "1e-05"]
    # A float64 float32 cannot hold (an in-process caller's) is Python's repr, and so is nan.
    assert as_typed(0.1 + 0.2) == "0.30000000000000004"
    assert [as_typed(v) for v in (float("nan"), float("inf"), 1e300)] == ["nan", "inf", "1e+300"]


# ---- item 4: the scheduler's refusal passed on as it reads ---------------------------------------


class _Refusing(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.code, self.details = grpc.StatusCode.OK, ""

    def SwitchWeights(self, request: object, context: grpc.ServicerContext) -> object:
        context.abort(self.code, self.details)
        raise AssertionError("unreachable")


@pytest.fixture
def refusing() -> Iterator[tuple[_Refusing, str]]:
    servicer = _Refusing()
    with loopback_server(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer,
                         max_workers=2) as address:
        yield servicer, address


REFUSAL = ("no worker could load version 5 from '/nonexistent/ckpt': /nonexistent/ckpt/config.json not found "
           "(not a Hugging Face model directory) (worker-0, worker-1)")


@pytest.mark.parametrize(("code", "details", "cls", "text"), [
    # Before: "source: scheduler SwitchWeights failed: INVALID_ARGUMENT: source: no worker could ...".
    (grpc.StatusCode.INVALID_ARGUMENT, f"source: {REFUSAL}", InvalidArgument, f"source: {REFUSAL}"),
    (grpc.StatusCode.FAILED_PRECONDITION, "version: no worker loaded version 5: boom (w0)", FailedPrecondition,
     "version: no worker loaded version 5: boom (w0)"),
    # No field named: the buffer's own field, and the text says who refused (its code once).
    (grpc.StatusCode.INVALID_ARGUMENT, "bad", InvalidArgument, "source: scheduler SwitchWeights failed: bad"),
    # A code other than the error's own stays in the text.
    (grpc.StatusCode.INTERNAL, "oops", Unavailable, "scheduler SwitchWeights failed: INTERNAL: oops"),
    (grpc.StatusCode.UNAVAILABLE, "no worker confirmed loading version 5: x (w0)", Unavailable,
     "scheduler SwitchWeights failed: no worker confirmed loading version 5: x (w0)"),
])
def test_the_schedulers_refusal_is_passed_on_once(refusing: tuple[_Refusing, str], code: grpc.StatusCode,
                                                  details: str, cls: type[Exception], text: str) -> None:
    servicer, address = refusing
    servicer.code, servicer.details = code, details
    with pytest.raises(cls) as e:
        scheduler_switch(address, 10.0)(5, "/nonexistent/ckpt")
    assert str(e.value) == text
