"""A result the buffer accepted can always be delivered. One StreamResults message carries one whole
result, and the buffer's server sends at most services.common.grpcutil.MAX_MESSAGE_BYTES (64 MiB; the
Python and Node clients receive as much): with a long enough context, a max_tokens whose response
would not fit one message was accepted, generated and stored, then failed at every send, and a
reader resuming at its cursor failed forever. SubmitBatch now refuses such a max_tokens
(INVALID_ARGUMENT naming it); the largest one it accepts, filled with the vocabulary's longest
token, is delivered by a real server to the Python client."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from buffer_helpers import CHUNK, LENGTH, BufferHandle, commit, expect_error, group, submit
from seer.v1 import rollout_pb2
from seer_client import SeerClient
from seer_client import client as seer_client

from services.buffer import convert, validation
from services.buffer.validation import max_response_tokens
from services.common import grpcutil
from services.common import server as common_server

LABELS = {"answer": "x" * 1000}


def test_the_bound_is_the_message_limit_of_the_server_and_the_clients() -> None:
    assert validation.MAX_RESULT_MESSAGE_BYTES == grpcutil.MAX_MESSAGE_BYTES
    assert seer_client.MAX_MESSAGE_BYTES >= grpcutil.MAX_MESSAGE_BYTES
    node = (Path(__file__).resolve().parents[2] / "clients" / "node" / "rollout.js").read_text()
    m = re.search(r"const MAX_MESSAGE_BYTES = (\d+) \* (\d+) \* (\d+);", node)
    assert m is not None and int(m[1]) * int(m[2]) * int(m[3]) >= grpcutil.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("limit_bytes", [
    4 * 1024 * 1024,  # the server's send limit and the bound lowered together: the same checks, 1/16 the bytes
    pytest.param(grpcutil.MAX_MESSAGE_BYTES, marks=pytest.mark.slow, id="64MiB"),  # ~150 MB of RocksDB writes
])
def test_the_longest_response_max_tokens_allows_is_delivered(make_buffer: Callable[..., BufferHandle],
                                                           model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                           limit_bytes: int) -> None:
    monkeypatch.setattr(validation, "MAX_RESULT_MESSAGE_BYTES", limit_bytes)
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", limit_bytes)  # read when the server starts
    buf = make_buffer(model_dir=str(model_dir), max_context=4_000_000)
    tok = buf.core._model.tokenizer
    assert tok is not None
    limit = max_response_tokens(buf.core._model, len("pk"), LABELS)
    # ~88 bytes a SmolLM2 token at most (its longest: 81 bytes of text): ~750K tokens at 64 MiB.
    assert limit_bytes // 90 < limit < limit_bytes // 85
    kw = {"prompt_key": "pk", "group_size": 1, "labels": LABELS}
    # Before: accepted (the context allows it), and a response of that length could not be sent.
    expect_error(lambda: submit(buf.rollout, "over", [group(max_tokens=limit + 1, **kw)]),
                 grpc.StatusCode.INVALID_ARGUMENT, "groups[0].max_tokens")
    submit(buf.rollout, "max", [group(max_tokens=limit, **kw)])
    # The worst response: the token whose text is the longest, throughout.
    texts = [len(tok.decode([i]).encode()) for i in range(tok.size)]
    longest = max(range(len(texts)), key=texts.__getitem__)
    step = 200_000
    for seq, start in enumerate(range(0, limit, step)):
        n = min(step, limit - start)
        out = commit(buf.internal, "max/0/0", seq, [longest] * n, LENGTH if start + n == limit else CHUNK,
                     logprobs=[-0.5] * n)
        assert out.accepted
    with SeerClient(buf.address, retry_seconds=5) as c:
        results = list(c.iter_results("max", timeout=120))
    assert len(results) == 1 and len(results[0].token_ids) == limit and results[0].finish_reason == "length"
    assert len(results[0].text.encode()) == limit * texts[longest]
    # The bound is close to what such a response takes: a few percent more tokens would not fit.
    page, _ = buf.core.read_results("max", 0)
    msg = rollout_pb2.StreamResultsResponse(cursor=1, submission_id=1, result=convert.result_to_pb(page[0][1]))
    assert 0.97 * limit_bytes < msg.ByteSize() <= limit_bytes, msg.ByteSize()
