"""An invalid draft from the draft mirror (audit): the worker drops that request's draft alone,
counts it and logs it once per chunk without a traceback. Before, the reference engine refused the
whole step (ValueError), the worker stepped again without any drafts and logged "engine rejected
drafts" with a traceback on every step: one bad draft took every other request's draft away."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from draft_fakes import FixedPlanner, RecordingDraft

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, TokensEvent, Worker
from services.worker.engine import Draft, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.server import worker_stats_to_proto

BAD = "bad/0/0"
GOOD = "good/0/0"


class Drafter(RecordingDraft):
    """Proposes a valid chain (a repeat of the context's last tokens) for every request but BAD,
    which gets `bad` on every step (a draft mirror gone wrong keeps proposing the same)."""

    def __init__(self, bad: Draft) -> None:
        super().__init__()
        self.bad = bad

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        if request_id == BAD:
            return self.bad
        return Draft.chain(list(context[-max_len:]))


def job(rid: str, prompt: Sequence[int], n: int) -> ChunkJob:
    return ChunkJob(request_id=rid, prompt_token_ids=tuple(prompt), max_new_tokens=n, max_tokens=n,
                    sampling=SamplingParams(temperature=0.0, ignore_eos=True), policy_version=0,
                    group_id=rid.split("/")[0], prompt_key=rid, group_size=1)


@pytest.mark.parametrize("bad", [
    Draft.chain([5, 49152, 7]),  # a token outside the vocabulary
    Draft((5, 6), (-1, 1)),  # a node that is its own parent
])
def test_a_bad_draft_costs_only_its_own_request_and_is_logged_once(
        ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]], bad: Draft,
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError):
        bad.validate(ref_engine.vocab_size)
    w = Worker(ref_engine, draft=Drafter(bad), planner=FixedPlanner(3), gamma_max=3).start()
    try:
        with caplog.at_level(logging.WARNING, logger="services.worker"):
            # BAD first and longer: every step of GOOD shares the batch with BAD's bad draft.
            hb = w.submit(job(BAD, prompts[0], 12))
            hg = w.submit(job(GOOD, prompts[1], 6))
            events = {rid: list(h.events()) for rid, h in ((BAD, hb), (GOOD, hg))}
        stats = w.stats()
    finally:
        w.close()
    done = {rid: ev[-1] for rid, ev in events.items()}
    assert all(isinstance(d, DoneEvent) and d.finish == ChunkFinish.LENGTH for d in done.values())
    good, bad_done = done[GOOD], done[BAD]
    assert isinstance(good, DoneEvent) and isinstance(bad_done, DoneEvent)
    assert sum(len(e.token_ids) for e in events[GOOD] if isinstance(e, TokensEvent)) == 6
    # GOOD kept its drafts on every step; BAD stepped without any.
    assert good.stats.draft_tokens >= good.stats.steps > 0
    assert bad_done.stats.draft_tokens == 0
    # Counted on every step it was proposed (BAD drafts while 2 or more tokens remain).
    assert stats.invalid_drafts >= 2
    # Visible to an operator: GetWorkerStats carries the count.
    assert worker_stats_to_proto(stats).invalid_drafts == stats.invalid_drafts
    dropped = [r for r in caplog.records if "invalid draft" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].exc_info is None
    assert getattr(dropped[0], "fields", {}).get("request_id") == BAD
    assert not [r for r in caplog.records if "engine rejected drafts" in r.getMessage()]
