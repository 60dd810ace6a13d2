"""prompt_text is held to the vocabulary as prompt_token_ids are: a tokenizer with more tokens than
the model's vocab_size (or a --vocab-size below the tokenizer's) is refused at submission, naming
the group's prompt_text, instead of failing later on every worker that runs the request."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest
from buffer_helpers import WORDS, BufferHandle, expect_error, group, snapshot, submit
from seer.v1 import rollout_pb2

VOCAB = 10  # below the tiny tokenizer's 18 words: "the" is 12, "cat" 13


def test_prompt_text_beyond_the_vocabulary_is_refused(make_buffer: Callable[..., BufferHandle],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.buffer.model"):
        h = make_buffer(vocab_size=VOCAB)
    # Said once at startup, before any prompt hits it.
    assert any("more tokens than the vocabulary" in r.getMessage() for r in caplog.records)
    assert WORDS.index("the") >= VOCAB
    details = expect_error(
        lambda: submit(h.rollout, "t", [group(prompt_text="what is two"), group(prompt_text="what is the cat")]),
        grpc.StatusCode.INVALID_ARGUMENT, "groups[1].prompt_text")
    assert "token id 12 (token 2)" in details and f"[0, {VOCAB})" in details, details
    # Nothing was stored.
    expect_error(lambda: h.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="t")), grpc.StatusCode.NOT_FOUND)
    assert snapshot(h.internal) == []
    # Token ids inside the vocabulary still go, as text or as ids; ids outside it were refused before.
    assert submit(h.rollout, "ok", [group(prompt_text="what is two", group_size=1)]).num_requests == 1
    assert [list(it.prompt_token_ids) for it in snapshot(h.internal)] == [[4, 5, 6]]
    expect_error(lambda: submit(h.rollout, "ids", [group(prompt_token_ids=[4, 12])]), grpc.StatusCode.INVALID_ARGUMENT,
                 "groups[0].prompt_token_ids[1]")
