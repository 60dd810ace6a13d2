"""Regression (review finding, /tmp/review/stale_draft.py): a re-dispatched chunk must not draft
from what a failed attempt of the same chunk streamed into the draft index.

The reference engine's sampling/verification randomness depends only on (seed, output position); the
re-dispatched chunk has the same seed and positions, so a draft made of the failed attempt's tokens
is correlated with the verifier's random numbers and biases the output. The worker core therefore
resumes the request's response in the draft index from the committed output before any drafting.

Real worker core + real DraftClient + a real draft server on a loopback port; the engine is the
deterministic fake of worker_fake_engine.py: these tests assert on the drafts each step received
(FakeEngine.seen_drafts), which the real engine does not expose, and need a continuation the stale
tokens differ from on cue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from worker_fake_engine import FakeEngine

from services.worker.core import ChunkFinish, ChunkJob, TokensEvent, Worker
from services.worker.draft_client import DraftClient
from services.worker.engine import Draft, SamplingParams
from tests.draft.draft_helpers import DraftServer, wait_until

PROMPT = (1, 2, 3)


def job(output: Sequence[int] = (), **kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id="r", prompt_token_ids=PROMPT, max_new_tokens=6, max_tokens=40,
                                sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                                prompt_key="", group_size=4, output_token_ids=tuple(output))
    base.update(kw)
    return ChunkJob(**base)


class CheckedClient(DraftClient):
    """Asserts, on every proposal, that the mirror holds none of the request's own tokens at or
    beyond its current length (the context is the prompt + everything it generated so far)."""

    violations: list[tuple[str, int, int]]

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        own = self.own_length(group_id, request_id)
        if own > len(context) - len(PROMPT):
            self.violations.append((request_id, own, len(context) - len(PROMPT)))
        return super().propose(group_id, request_id, context, max_len, width)


def _client(address: str) -> CheckedClient:
    c = CheckedClient(address, sync_interval_s=0.02)
    c.violations = []
    return c


def _drafts_for(engine: FakeEngine, rid: str) -> list[tuple[int, ...]]:
    return [d[rid].tokens for d in engine.seen_drafts if rid in d]


def test_redispatched_chunk_after_a_dead_worker(draft_server: DraftServer) -> None:
    store = draft_server.store
    committed = [4, 5]
    stale = [40, 41, 42, 43, 44]  # what the dead worker streamed for chunk 1 (its own sampling)
    dead = DraftClient(draft_server.address, sync_interval_s=0.02)
    client = _client(draft_server.address)
    engine = FakeEngine()
    w = Worker(engine, draft=client, gamma_max=4).start()
    try:
        dead.register_group("g", "", PROMPT, group_size=4)
        dead.append("g", "r", 0, committed)
        dead.append("g", "r", 2, stale)
        dead.flush()
        dead.close()
        # Worst case: the new worker's mirror already holds the stale tokens when the chunk arrives.
        client.register_group("g", "", PROMPT, group_size=4)
        wait_until(lambda: client.own_length("g", "r") == len(committed) + len(stale))
        toks, _, done = w.run(job(committed))
        assert toks == [6, 7, 8, 9, 10, 11] and done.finish == ChunkFinish.CHUNK
        # No draft for r came from the stale continuation (it is the only source here).
        assert all(not set(d) & set(stale) for d in _drafts_for(engine, "r")), _drafts_for(engine, "r")
        assert client.violations == []
        # The new attempt's appends are accepted: the server and the mirror hold exactly the truth.
        wait_until(lambda: store.index_of("g").tokens("r") == committed + toks)
        assert client.own_length("g", "r") == len(committed) + len(toks)
        assert client.stats().append_errors == 0
    finally:
        w.close()


def test_same_worker_abort_then_rerun_drafts_only_from_the_truth(
        draft_server: DraftServer) -> None:
    store = draft_server.store
    client = _client(draft_server.address)
    engine = FakeEngine()
    engine.step_delay = 0.01
    w = Worker(engine, draft=client, gamma_max=4).start()
    try:
        first, _, _ = w.run(job(max_new_tokens=2))  # chunk 0, committed
        h = w.submit(job(first, max_new_tokens=30, seq=1))  # chunk 1, first attempt
        streamed: list[int] = []
        cancelled = False
        for ev in h.events(poll_seconds=0.05):
            if isinstance(ev, TokensEvent):
                streamed += ev.token_ids
            if len(streamed) >= 5 and not cancelled:
                cancelled = h.cancel()
        assert cancelled
        assert client.own_length("g", "r") >= len(first) + 5
        engine.seen_drafts.clear()
        # The scheduler re-dispatches chunk 1 from the committed output (same seed and positions).
        toks, _, done = w.run(job(first, max_new_tokens=3, seq=1))
        assert done.finish == ChunkFinish.CHUNK and toks == streamed[:3]
        # Without the resume the attempt's own stale tokens were a perfect draft here.
        assert _drafts_for(engine, "r") == []
        assert client.violations == []
        assert client.own_length("g", "r") == len(first) + 3
        wait_until(lambda: store.index_of("g").tokens("r") == first + toks)
    finally:
        w.close()


def test_the_scenario_is_real_without_resume(draft_server: DraftServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with the old behaviour (fill-in append only, deltas applied) the stale tokens are
    proposed, so the tests above can fail."""

    def old_resume(self: DraftClient, group_id: str, request_id: str, output: Sequence[int]) -> None:
        self.append(group_id, request_id, 0, output)

    monkeypatch.setattr(DraftClient, "resume", old_resume)
    client = _client(draft_server.address)
    engine = FakeEngine()
    w = Worker(engine, draft=client, gamma_max=4).start()
    try:
        client.register_group("g", "", PROMPT, group_size=4)
        client.append("g", "r", 0, [4, 5, 40, 41, 42])
        w.run(job([4, 5], max_new_tokens=2))
        assert (40, 41, 42)[: len(_drafts_for(engine, "r")[0])] == _drafts_for(engine, "r")[0]
        assert client.violations
    finally:
        w.close()
