"""Unit tests of the worker core's glue over a tiny deterministic fake engine (worker_fake_engine.py).

What the fake makes checkable: finish-reason mapping (STOP / LENGTH / CHUNK / ABORTED), chunk-limit
clamping, draft plumbing (offsets of appends, acceptance bookkeeping), drain before LoadWeights and
the KV pool calls. The real engine is exercised in test_worker_engine.py / test_worker_grpc.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from draft_fakes import ChainDraft, FixedPlanner
from worker_fake_engine import FakeEngine, FakePool

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, TokensEvent, Worker
from services.worker.engine import SamplingParams


def job(rid: str = "r0", prompt: Sequence[int] = (1, 2, 3), **kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id=rid, prompt_token_ids=tuple(prompt), max_new_tokens=5, max_tokens=20,
                                sampling=SamplingParams(temperature=0.0), policy_version=0, group_id="g0",
                                prompt_key="k0", group_size=2)
    base.update(kw)
    return ChunkJob(**base)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def worker(engine: FakeEngine) -> Any:
    w = Worker(engine, speculation=False).start()
    yield w
    w.close()


def test_chunk_then_length_then_stop(worker: Worker) -> None:
    toks, lps, done = worker.run(job(max_new_tokens=5, max_tokens=8))
    assert toks == [4, 5, 6, 7, 8] and len(lps) == 5
    assert done.finish == ChunkFinish.CHUNK and done.stats.steps == 5
    # The next chunk resumes after the output and is clamped to max_tokens (3 more, not 5).
    toks2, _, done2 = worker.run(job(output_token_ids=tuple(toks), max_new_tokens=5, max_tokens=8, seq=1))
    assert toks2 == [9, 10, 11] and done2.finish == ChunkFinish.LENGTH
    toks3, _, done3 = worker.run(job("r1", prompt=(95,), max_new_tokens=10, max_tokens=10))
    assert toks3 == [96, 97, 98, 99] and done3.finish == ChunkFinish.STOP


def test_max_tokens_zero_means_single_chunk(worker: Worker) -> None:
    _, _, done = worker.run(job(max_new_tokens=3, max_tokens=0))
    assert done.finish == ChunkFinish.LENGTH


def test_bad_input_names_the_field(worker: Worker) -> None:
    cases = [
        (job(prompt=(1, 500)), "prompt_token_ids[1]"),
        (job(output_token_ids=(-1,)), "output_token_ids[0]"),
        (job(max_new_tokens=0), "max_new_tokens"),
        (job(request_id=""), "request_id"),
        (job(prompt=()), "prompt_token_ids"),
        (job(output_token_ids=(1,) * 21, max_tokens=20), "output_token_ids"),
        (job(max_new_tokens=600, max_tokens=0), "max_new_tokens"),
        (job(sampling=SamplingParams(top_p=0.0)), "top_p"),
    ]
    for j, name in cases:
        with pytest.raises(InvalidArgument) as ei:
            worker.submit(j)
        assert name in str(ei.value), (name, str(ei.value))
    with pytest.raises(FailedPrecondition, match="policy_version"):
        worker.submit(job(policy_version=3))
    # The worker still serves after the refusals.
    assert worker.run(job())[2].finish == ChunkFinish.CHUNK


def test_duplicate_request_and_abort(engine: FakeEngine, worker: Worker) -> None:
    engine.step_delay = 0.01
    h = worker.submit(job(max_new_tokens=90, max_tokens=90))
    with pytest.raises(AlreadyExists, match="request_id"):
        worker.submit(job(max_new_tokens=90, max_tokens=90))
    other = worker.submit(job("r2", max_new_tokens=3, max_tokens=3))
    assert worker.abort("r0") is True
    assert worker.abort("r0") is False
    events = list(h.events())
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish == ChunkFinish.ABORTED
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokensEvent)) < 90
    last = list(other.events())[-1]
    assert isinstance(last, DoneEvent) and last.finish == ChunkFinish.LENGTH
    assert not engine.has_unfinished()


def test_handle_cancel_aborts(engine: FakeEngine, worker: Worker) -> None:
    engine.step_delay = 0.01
    h = worker.submit(job(max_new_tokens=90, max_tokens=90))
    assert h.cancel() is True
    assert worker.in_flight == 0 and not engine.has_unfinished()
    h.release()  # after the end: a no-op
    assert isinstance(list(h.events())[-1], DoneEvent)


def test_drafts_accepted_and_appended_in_order(engine: FakeEngine) -> None:
    drafter, planner = ChainDraft(wrong_at=2), FixedPlanner(3)
    w = Worker(engine, draft=drafter, planner=planner, gamma_max=8).start()
    try:
        toks, _, done = w.run(job(max_new_tokens=12, max_tokens=12))
        toks2, _, _ = w.run(job("r1", max_new_tokens=4, max_tokens=30))
    finally:
        w.close()
    assert toks == list(range(4, 16))  # drafts never change what is generated
    assert done.finish == ChunkFinish.LENGTH
    # 2 of every 3 drafted tokens match, plus the bonus token: 3 tokens per step.
    assert done.stats.steps == 4 and done.stats.accepted_tokens == 8
    assert done.stats.draft_tokens >= done.stats.accepted_tokens
    # every chunk registers its attempt
    assert [(c.group_id, c.request_id) for c in drafter.of("register_attempt")] == [("g0", "r0"), ("g0", "r1")]
    appends = drafter.of("append")
    mine = [a for a in appends if a.request_id == "r0"]
    offsets = [a.offset for a in mine]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert [t for a in mine for t in a.token_ids] == toks
    assert mine[-1].finished is True  # the response is complete
    assert appends[-1].request_id == "r1" and appends[-1].finished is False  # CHUNK: not complete
    assert toks2 == [4, 5, 6, 7]
    assert planner.observed and all(p[0] >= a[0] for p, a in planner.observed)
    stats = w.stats()
    assert stats.accepted_per_position[0] > 0 and stats.accepted_per_position[2] == 0


def test_speculation_off_sends_no_drafts(engine: FakeEngine) -> None:
    w = Worker(engine, draft=ChainDraft(), speculation=False).start()
    try:
        w.run(job())
    finally:
        w.close()
    assert all(not d for d in engine.seen_drafts)


def test_load_weights_drains_first(engine: FakeEngine, worker: Worker) -> None:
    engine.step_delay = 0.02
    h = worker.submit(job(max_new_tokens=40, max_tokens=40))  # about 0.8 s of steps
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(s=worker.load_weights(1, None, 10.0)))
    t.start()
    time.sleep(0.3)
    assert not engine.loaded and worker.in_flight == 1  # still draining
    with pytest.raises(Unavailable):
        worker.submit(job("r9", policy_version=0))
    t.join(10)
    assert engine.loaded == [(None, "v1")] and result["s"] >= 0.3
    assert worker.policy_version == 1
    events = list(h.events())
    assert isinstance(events[-1], DoneEvent) and events[-1].policy_version == 0
    assert events[-1].finish == ChunkFinish.LENGTH  # drained, not aborted
    with pytest.raises(FailedPrecondition, match="policy_version"):
        worker.submit(job("r3", policy_version=0))
    assert worker.run(job("r3", policy_version=1))[2].policy_version == 1
    with pytest.raises(FailedPrecondition, match="version"):
        worker.load_weights(0, None)


def test_kv_offload_fetch_release() -> None:
    e1, e2 = FakeEngine(), FakeEngine()
    pool = FakePool()
    w1 = Worker(e1, kv_pool=pool, speculation=False).start()
    w2 = Worker(e2, kv_pool=pool, speculation=False).start()
    try:
        prompt = tuple(range(1, 11))
        toks, _, done = w1.run(job(prompt=prompt, max_new_tokens=9, max_tokens=20))
        assert done.finish == ChunkFinish.CHUNK
        assert pool.offloaded and pool.offloaded[0][1] == "r0"
        assert len(pool.offloaded[0][0].token_ids) == 16  # full pages of prompt + output minus the last
        # The next chunk moves to another worker and loads the prefix instead of recomputing it.
        _, _, done2 = w2.run(job(prompt=prompt, output_token_ids=tuple(toks), max_new_tokens=11, max_tokens=20,
                                 seq=1, fetch_kv=True))
        assert done2.finish == ChunkFinish.LENGTH
        assert done2.stats.kv_loaded_tokens == 16 and done2.stats.cached_tokens == 16
        assert done2.stats.prefill_tokens == 19 - 16
        assert done2.stats.kv_recomputed_pages == 0
        assert pool.released == [("v0", "r0")]
        assert w2.stats().kv_loaded_tokens == 16
    finally:
        w1.close()
        w2.close()


def test_stats_never_wait_for_a_long_step(engine: FakeEngine, worker: Worker) -> None:
    """Heartbeats read stats while a (slow) engine step holds the engine: they must not stall."""
    engine.step_gate = threading.Event()
    h = worker.submit(job(max_new_tokens=3, max_tokens=3))
    time.sleep(0.2)  # the loop is now blocked inside engine.step
    t0 = time.monotonic()
    st = worker.stats()
    assert time.monotonic() - t0 < 0.1
    assert st.in_flight == 1 and st.engine.total_pages == 64
    engine.step_gate.set()
    assert isinstance(list(h.events())[-1], DoneEvent)
