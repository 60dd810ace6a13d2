"""SubmitBatch: validation naming fields, idempotency, tokenization, seeds, limits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import TINY_CONTEXT, TINY_VOCAB, BufferHandle, expect_error, group, snapshot, submit
from seer.v1 import common_pb2, rollout_pb2
from tokenizers import Tokenizer

from services.buffer.validation import BATCH_ID_RE

IA = grpc.StatusCode.INVALID_ARGUMENT


def test_submit_splits_groups_into_requests(buf: BufferHandle) -> None:
    resp = submit(buf.rollout, "it-1", [group(group_size=3), group(group_size=2, prompt_key="k2")])
    assert (resp.num_requests, resp.already_submitted, resp.policy_version) == (5, False, 0)
    items = {it.request_id: it for it in snapshot(buf.internal)}
    assert sorted(items) == ["it-1/0/0", "it-1/0/1", "it-1/0/2", "it-1/1/0", "it-1/1/1"]
    it = items["it-1/1/1"]
    assert (it.group_id, it.group_index, it.sample_index, it.group_size) == ("it-1/1", 1, 1, 2)
    assert (it.prompt_key, list(it.prompt_token_ids)) == ("k2", [1, 2, 3])
    assert (it.next_seq, list(it.output_token_ids)) == (0, [])
    # A missing prompt key defaults to a stable hash of the prompt tokens (same prompt -> same key).
    assert items["it-1/0/0"].prompt_key.startswith("tok:")
    submit(buf.rollout, "it-2", [group(group_size=1)])
    again = {i.request_id: i for i in snapshot(buf.internal)}
    assert again["it-2/0/0"].prompt_key == items["it-1/0/0"].prompt_key


def test_submit_is_idempotent_by_batch_id(buf: BufferHandle) -> None:
    groups = [group(group_size=4, labels={"answer": "5"})]
    first = submit(buf.rollout, "same", groups)
    second = submit(buf.rollout, "same", groups)
    assert not first.already_submitted and second.already_submitted
    assert second.num_requests == first.num_requests == 4
    assert len(snapshot(buf.internal)) == 4  # nothing new was created
    msg = expect_error(lambda: submit(buf.rollout, "same", [group(group_size=5)]), grpc.StatusCode.ALREADY_EXISTS,
                       "batch_id")
    assert "different content" in msg


BAD_CASES: list[tuple[str, Callable[[], Any], grpc.StatusCode, str]] = [
    ("empty batch id", lambda: ("", [group()]), IA, "batch_id"),
    ("bad charset", lambda: ("a/b", [group()]), IA, "batch_id"),
    ("too long", lambda: ("x" * 129, [group()]), IA, "batch_id"),
    ("trailing newline", lambda: ("b\n", [group()]), IA, "batch_id"),
    ("no groups", lambda: ("b", []), IA, "groups"),
    ("group size 0", lambda: ("b", [group(), group(group_size=0)]), IA, "groups[1].group_size"),
    ("group size 1025", lambda: ("b", [group(group_size=1025)]), IA, "groups[0].group_size"),
    ("max_tokens 0", lambda: ("b", [group(max_tokens=0)]), IA, "groups[0].max_tokens"),
    ("context", lambda: ("b", [group(max_tokens=TINY_CONTEXT - 2)]), IA, "groups[0].max_tokens"),
    ("token out of vocab", lambda: ("b", [group(prompt_token_ids=[1, TINY_VOCAB])]), IA,
     "groups[0].prompt_token_ids[1]"),
    ("negative token", lambda: ("b", [group(prompt_token_ids=[-1])]), IA, "groups[0].prompt_token_ids[0]"),
    ("empty prompt", lambda: ("b", [group(prompt_token_ids=[])]), IA, "groups[0].prompt_token_ids"),
    ("both prompts", lambda: ("b", [group(prompt_token_ids=[1], prompt_text="two")]), IA, "groups[0].prompt_text"),
    ("text tokenizes to nothing", lambda: ("b", [group(prompt_text="   ")]), IA, "groups[0].prompt_text"),
    ("negative temperature", lambda: ("b", [group(sampling=common_pb2.SamplingParams(temperature=-1))]), IA,
     "groups[0].sampling.temperature"),
    ("nan temperature", lambda: ("b", [group(sampling=common_pb2.SamplingParams(temperature=float("nan")))]), IA,
     "groups[0].sampling.temperature"),
    ("inf temperature", lambda: ("b", [group(sampling=common_pb2.SamplingParams(temperature=float("inf")))]), IA,
     "groups[0].sampling.temperature"),
    ("top_p > 1", lambda: ("b", [group(sampling=common_pb2.SamplingParams(top_p=1.5))]), IA,
     "groups[0].sampling.top_p"),
    ("top_p < 0", lambda: ("b", [group(sampling=common_pb2.SamplingParams(top_p=-0.1))]), IA,
     "groups[0].sampling.top_p"),
    ("top_k < 0", lambda: ("b", [group(sampling=common_pb2.SamplingParams(top_k=-2))]), IA,
     "groups[0].sampling.top_k"),
    ("stop token out of vocab", lambda: ("b", [group(sampling=common_pb2.SamplingParams(stop_token_ids=[2, 999]))]),
     IA, "groups[0].sampling.stop_token_ids[1]"),
    ("prompt key too long", lambda: ("b", [group(prompt_key="k" * 600)]), IA, "groups[0].prompt_key"),
    ("too many requests", lambda: ("b", [group(group_size=1000)] * 70), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "groups"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_the_field_and_keeps_serving(buf: BufferHandle, case: Any) -> None:
    _name, make, code, field = case
    submit(buf.rollout, "good-before", [group()])
    batch_id, groups = make()
    expect_error(lambda: submit(buf.rollout, batch_id, groups), code, field)
    # Nothing was stored for the refused batch (a malformed id is refused as such: test_buffer_ids.py),
    # and the service keeps serving everything else.
    well_formed = BATCH_ID_RE.fullmatch(batch_id) is not None
    expect_error(lambda: buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id=batch_id)),
                 grpc.StatusCode.NOT_FOUND if well_formed else IA, "batch_id")
    assert submit(buf.rollout, "good-after", [group()]).num_requests == 2
    assert {i.batch_id for i in snapshot(buf.internal)} == {"good-before", "good-after"}


def test_top_p_zero_means_off_and_sampling_is_forwarded(buf: BufferHandle) -> None:
    sp = common_pb2.SamplingParams(temperature=0.7, top_p=0, top_k=5, stop_token_ids=[1], ignore_eos=True)
    submit(buf.rollout, "s", [group(sampling=sp)])
    s = snapshot(buf.internal)[0].sampling
    assert (round(s.temperature, 5), s.top_p, s.top_k, list(s.stop_token_ids), s.ignore_eos) == (0.7, 1.0, 5, [1], True)


def test_prompt_text_is_tokenized_with_the_model_tokenizer(buf: BufferHandle, tiny_model_dir: Path) -> None:
    text = "question : what is two plus three ?"
    submit(buf.rollout, "txt", [group(prompt_text=text, group_size=1)])
    expected = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert list(snapshot(buf.internal)[0].prompt_token_ids) == expected == [2, 3, 4, 5, 6, 7, 8, 11]


def test_prompt_text_without_tokenizer_is_failed_precondition(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer(model_dir="")
    expect_error(lambda: submit(h.rollout, "t", [group(prompt_text="hello")]), grpc.StatusCode.FAILED_PRECONDITION,
                 "groups[0].prompt_text")
    # Without a model dir the embedded model's limits apply (vocab 49152, context 8192).
    assert submit(h.rollout, "ok", [group(prompt_token_ids=[49151], max_tokens=8000)]).num_requests == 2
    expect_error(lambda: submit(h.rollout, "bad", [group(prompt_token_ids=[49152])]), IA,
                 "groups[0].prompt_token_ids[0]")


def test_request_limit_is_configurable(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer(max_requests_per_batch=8)
    assert submit(h.rollout, "eight", [group(group_size=4), group(group_size=4)]).num_requests == 8
    expect_error(lambda: submit(h.rollout, "nine", [group(group_size=4), group(group_size=5)]),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "groups")


def test_seeds_are_derived_per_sample_and_persisted(make_buffer: Callable[..., BufferHandle]) -> None:
    h = make_buffer()
    seeded = group(group_size=3, sampling=common_pb2.SamplingParams(temperature=1.0, seed=1234))
    submit(h.rollout, "seeded", [seeded, group(group_size=3)])
    before = {i.request_id: i.sampling.seed for i in snapshot(h.internal)}
    assert len(set(before.values())) == 6  # distinct per request, including the unseeded group
    h.stop()
    h2 = make_buffer()
    submit(h2.rollout, "seeded-again", [seeded])
    after = {i.request_id: i.sampling.seed for i in snapshot(h2.internal)}
    for rid, seed in before.items():
        assert after[rid] == seed  # the drawn seed of the unseeded group survived the restart
    # Same base seed in another batch -> other request seeds: a trainer that passes one seed every
    # iteration must still get fresh random numbers per iteration (services.buffer.core.derive_seed).
    again = [after[f"seeded-again/0/{s}"] for s in range(3)]
    assert len(set(again)) == 3
    assert not set(again) & {before[f"seeded/0/{s}"] for s in range(3)}
    # ... but they are reproducible: derived from (base seed, batch id, sample index) only.
    from services.buffer.core import derive_seed

    assert again == [derive_seed(1234, "seeded-again", s) for s in range(3)]


def test_seed_scope_reproduces_samples_across_batch_ids(buf: BufferHandle) -> None:
    from services.buffer.core import derive_seed

    seeded = group(group_size=3, sampling=common_pb2.SamplingParams(temperature=1.0, seed=77))
    submit(buf.rollout, "arm-a", [seeded], seed_scope="rep-0")
    submit(buf.rollout, "arm-b", [seeded], seed_scope="rep-0")
    submit(buf.rollout, "arm-c", [seeded])
    seeds = {i.request_id: i.sampling.seed for i in snapshot(buf.internal)}
    a, b, c = ([seeds[f"{bid}/0/{s}"] for s in range(3)] for bid in ("arm-a", "arm-b", "arm-c"))
    assert a == b == [derive_seed(77, "rep-0", s) for s in range(3)]  # same scope: same samples
    assert not set(a) & set(c)  # no scope: the batch id keys the seeds, as before
    assert c == [derive_seed(77, "arm-c", s) for s in range(3)]
    # The scope is part of the submission: a resubmission must repeat it.
    assert submit(buf.rollout, "arm-a", [seeded], seed_scope="rep-0").already_submitted
    msg = expect_error(lambda: submit(buf.rollout, "arm-a", [seeded], seed_scope="rep-1"),
                       grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    assert "different content" in msg
    expect_error(lambda: submit(buf.rollout, "arm-a", [seeded]), grpc.StatusCode.ALREADY_EXISTS, "batch_id")
    # The batch id spelled out as the scope is the default: the same submission.
    assert submit(buf.rollout, "arm-c", [seeded], seed_scope="arm-c").already_submitted
    # A bad scope names the field, and nothing is stored.
    for bad in ("a/b", "x" * 129, "rep-0\n"):
        expect_error(functools.partial(submit, buf.rollout, "arm-d", [seeded], seed_scope=bad), IA, "seed_scope")
    expect_error(lambda: buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="arm-d")),
                 grpc.StatusCode.NOT_FOUND, "batch_id")


def test_oversized_message_is_refused_by_grpc(buf: BufferHandle) -> None:
    # A 65 MiB prompt text, sent from a channel allowed to send it: the server refuses it (> 64 MiB).
    ch = grpc.insecure_channel(buf.address, options=[("grpc.max_send_message_length", 200 * 1024 * 1024)])
    try:
        from seer.v1 import rollout_pb2_grpc

        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        huge = [rollout_pb2.PromptGroup(prompt_text="x" * (65 * 1024 * 1024), group_size=1, max_tokens=1)]
        expect_error(lambda: stub.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id="huge", groups=huge),
                                              timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        ch.close()
    assert submit(buf.rollout, "small", [group()]).num_requests == 2


def test_a_group_too_large_names_its_group_size(buf: BufferHandle) -> None:
    """One group over the limit cannot be split: INVALID_ARGUMENT naming it, not the batch total's
    RESOURCE_EXHAUSTED "split the batch" (review, session 17)."""
    for size in (70_000, 2**31 - 1):
        expect_error(lambda s=size: submit(buf.rollout, "big", [group(group_size=s)]),  # type: ignore[misc]
                     grpc.StatusCode.INVALID_ARGUMENT, "groups[0].group_size")
