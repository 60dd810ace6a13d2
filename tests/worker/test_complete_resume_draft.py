"""A chunk resuming an already complete output ends at once (no tokens, STOP / LENGTH) and tells the
draft group the response is finished, as a chunk that generated its last token does: otherwise the
group never completes on the draft server (its responses never become history) and siblings keep
the response open.

Real worker core on the real reference engine (greedy: deterministic) + real DraftClient + a real
draft server on a loopback port.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.draft_client import DraftClient
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from tests.draft.draft_helpers import DraftServer, wait_until


def _job(prompt: tuple[int, ...], output: tuple[int, ...], **kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id="r", prompt_token_ids=prompt, max_new_tokens=4, max_tokens=40,
                                sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                                prompt_key="k", group_size=2, output_token_ids=output, dispatch_epoch=3)
    base.update(kw)
    return ChunkJob(**base)


@pytest.mark.parametrize("finish", [ChunkFinish.STOP, ChunkFinish.LENGTH])
def test_end_at_once_finishes_the_response_in_the_draft_group(
        draft_server: DraftServer, ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
        finish: ChunkFinish) -> None:
    store = draft_server.store
    client = DraftClient(draft_server.address, sync_interval_s=0.02)
    w = Worker(ref_engine, draft=client).start()
    try:
        # Earlier attempts: r's first chunk ran here (its tokens reached the group, its end as CHUNK
        # did not finish the response); the sibling finished on another worker.
        first, _, done = w.run(_job(prompts[0], (), dispatch_epoch=1))
        assert done.finish == ChunkFinish.CHUNK and len(first) == 4
        other = DraftClient(draft_server.address, sync_interval_s=0.02)
        try:
            other.register_group("g", "k", prompts[0], group_size=2)
            other.append("g", "s", 0, [7, 8], finished=True)
            other.flush()
        finally:
            other.close()
        wait_until(lambda: store.index_of("g").tokens("r") == first)
        # The output is complete: it ends with the model's EOS, or it fills max_tokens.
        if finish == ChunkFinish.STOP:
            output, max_tokens = (*first, ref_engine.eos_token_ids[0]), 40
        else:
            output, max_tokens = tuple(first), len(first)
        toks, _, done = w.run(_job(prompts[0], output, max_tokens=max_tokens, seq=1))
        assert toks == [] and done.finish == finish
        # The response is finished on the server: the group completes and both responses are history.
        wait_until(lambda: sorted(store._history.responses("k")) == sorted([output, (7, 8)]))
        assert store.stats().history_keys == 1
        assert client.stats().append_errors == 0
        # Under this attempt's epoch: an older attempt's late append is refused.
        assert store._groups["g"].epochs["r"] == 3
    finally:
        w.close()
    assert not ref_engine.has_unfinished()


def test_end_at_once_without_anything_on_the_server_sends_the_whole_response(
        draft_server: DraftServer, ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    store = draft_server.store
    output = (4, 5, ref_engine.eos_token_ids[0])
    w = Worker(ref_engine, draft=DraftClient(draft_server.address, sync_interval_s=0.02)).start()
    try:
        toks, _, done = w.run(_job(prompts[1], output, group_size=1))
        assert toks == [] and done.finish == ChunkFinish.STOP
        wait_until(lambda: store._history.responses("k") == [output])
    finally:
        w.close()
