"""GetHistory's reply is bounded: whole keys while they fit HISTORY_REPLY_BYTES, the rest named in
omitted_prompt_keys (review, session 18: 64 keys of 32 responses x 12K tokens made a ~75 MB reply,
which gRPC refused as an opaque RESOURCE_EXHAUSTED over its 64 MiB message limit)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from buffer_helpers import BufferHandle, expect_error, finish_all, group, snapshot, submit, token_for
from seer.v1 import buffer_pb2, buffer_pb2_grpc

from services.buffer import codec
from services.buffer import core as buffer_core
from services.buffer import store as keys
from services.buffer.records import HistoryIteration, encode_history
from services.common.grpcutil import MAX_MESSAGE_BYTES, channel
from services.draft.buffer_link import BufferHistoryLink


def _ask(stub: buffer_pb2_grpc.BufferInternalServiceStub, keys_: list[str], tokens: bool = True
         ) -> buffer_pb2.GetHistoryResponse:
    return stub.GetHistory(buffer_pb2.GetHistoryRequest(prompt_keys=keys_, include_tokens=tokens), timeout=30)


def test_reply_is_cut_at_whole_keys_and_names_the_rest(make_buffer: Callable[..., BufferHandle],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    h = make_buffer()
    # p0..p3: 2 responses of 6 tokens each (ids < 64: one byte); "big": 2 responses of 40 tokens.
    submit(h.rollout, "it", [group(prompt_key=f"p{k}", group_size=2, max_tokens=40) for k in range(4)]
           + [group(prompt_key="big", group_size=2, max_tokens=40)])
    finish_all(h.internal, snapshot(h.internal), length=lambda it: 40 if it.prompt_key == "big" else 6)
    # Sizes as the buffer counts them (an upper bound of the encoding): a key 11 bytes + its length,
    # a p-key's history 91 more with tokens, 35 without; big's 159. 250 bytes hold the 5 keys' names
    # (67) and p0's and p1's histories.
    monkeypatch.setattr(buffer_core, "HISTORY_REPLY_BYTES", 250)
    first = _ask(h.internal, ["p0", "p1", "none", "p2", "p3"])
    assert [x.prompt_key for x in first.histories] == ["p0", "p1"]
    assert list(first.omitted_prompt_keys) == ["p2", "p3"]  # "none" has no history: neither
    assert first.ByteSize() <= 250
    again = _ask(h.internal, list(first.omitted_prompt_keys))
    assert ([x.prompt_key for x in again.histories], list(again.omitted_prompt_keys)) == (["p2", "p3"], [])
    assert [len(r.token_ids) for r in again.histories[0].responses] == [6, 6]
    monkeypatch.setattr(buffer_core, "HISTORY_REPLY_BYTES", 150)
    # Lengths only: bounded alike (4 names, 52 bytes, and 35 for each history).
    plain = _ask(h.internal, ["p0", "p1", "p2", "p3"], tokens=False)
    assert ([x.prompt_key for x in plain.histories], list(plain.omitted_prompt_keys)) == (
        ["p0", "p1"], ["p2", "p3"])
    assert plain.ByteSize() <= 150
    # A key that alone is over the bound: after keys that fit it is omitted like the others; first,
    # it is RESOURCE_EXHAUSTED naming it (by its index in the request), never truncated.
    cut = _ask(h.internal, ["p0", "big", "p1"])
    assert ([x.prompt_key for x in cut.histories], list(cut.omitted_prompt_keys)) == (["p0"], ["big", "p1"])
    assert cut.ByteSize() <= 150
    expect_error(lambda: _ask(h.internal, ["none", "big", "p1"]), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "prompt_keys[1]")
    # The draft service's link asks for one key at a time: a key that fits comes whole; one that
    # does not is an RpcError, which its backfill logs and retries later.
    link = BufferHistoryLink(h.address)
    try:
        assert link.fetch("p3") == [[token_for(f"it/3/{s}", i) for i in range(6)] for s in range(2)]
        with pytest.raises(grpc.RpcError) as e:
            link.fetch("big")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    finally:
        link.close()


def test_history_over_the_message_limit_comes_in_several_replies(buf: BufferHandle) -> None:
    """The real bound: three keys whose histories (one 4.6M-token response each, 5-byte varints)
    make one 69 MB reply, over the 64 MiB message limit. Stored directly (committing that many tokens
    would take minutes)."""
    n = 4_600_000
    response = codec.i32([1 << 28]) * n
    wb = buf.core._store.new_batch()
    for key in ("a", "b", "c"):
        wb.put(keys.history_key(key), encode_history([HistoryIteration("x", 0, [n], [response])]))
    buf.core._store.write(wb)
    assert 3 * 5 * n > MAX_MESSAGE_BYTES
    ch = channel(buf.address)  # Seer's message limits, as the draft service's link
    try:
        reply = _ask(buffer_pb2_grpc.BufferInternalServiceStub(ch), ["a", "b", "c"])
    finally:
        ch.close()
    assert ([x.prompt_key for x in reply.histories], list(reply.omitted_prompt_keys)) == (["a"], ["b", "c"])
    assert len(reply.histories[0].responses[0].token_ids) == n


def test_the_scheduler_gets_every_prior_of_a_large_batch(make_buffer: Callable[..., BufferHandle],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler asked for every new prompt key of a batch in one call: over the buffer's key
    limit that was INVALID_ARGUMENT ("history unavailable": no prior at all), and keys a bounded
    reply omitted were never asked for again. It now pages its keys and follows the omitted ones."""
    from services.scheduler import links

    h = make_buffer()
    submit(h.rollout, "it", [group(prompt_key=f"p{k}", group_size=2, max_tokens=40) for k in range(6)])
    finish_all(h.internal, snapshot(h.internal), length=lambda it: 3 + it.group_index)
    monkeypatch.setattr(buffer_core, "HISTORY_REPLY_BYTES", 150)  # two keys' lengths a reply
    monkeypatch.setattr(buffer_core, "MAX_HISTORY_KEYS", 4)
    monkeypatch.setattr(links, "HISTORY_KEYS_PER_CALL", 4)
    link = links.BufferLink(h.address)
    try:
        got = link.history([f"p{k}" for k in range(6)] + ["none", "p0"])
        assert {x.prompt_key: list(x.lengths) for x in got} == {f"p{k}": [3 + k] * 2 for k in range(6)}
    finally:
        link.close()
