"""A forward pass that throws inside the worker's step loop. Engine.step is exception-safe (a failed
step changes nothing), so the worker retries one failure and the chunks run on unharmed; a second
failure in a row fails the running chunks (the buffer re-dispatches them), and the worker keeps
serving. Glue over the fake engine, then the same over the real engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from worker_fake_engine import FakeEngine

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, ErrorEvent, TokensEvent, Worker
from services.worker.engine import FinishReason, SamplingParams, StepOutput
from services.worker.engines.reference.engine import ReferenceEngine

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def fake_job(rid: str, group: str = "", n: int = 5) -> ChunkJob:
    return ChunkJob(request_id=rid, prompt_token_ids=(1, 2, 3), max_new_tokens=n, max_tokens=n, sampling=GREEDY,
                    policy_version=0, group_id=group)


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_one_failure_is_retried_two_fail_the_chunks() -> None:
    eng = FakeEngine()
    w = Worker(eng, speculation=False).start()
    try:
        eng.fail_steps = 1
        for h in (w.submit(fake_job("a")), w.submit(fake_job("b"))):
            events = list(h.events())
            assert [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids] == [4, 5, 6, 7, 8]
            last = events[-1]
            assert isinstance(last, DoneEvent) and last.finish == ChunkFinish.LENGTH
        assert eng.fail_steps == 0
        eng.fail_steps = 2
        events = list(w.submit(fake_job("c")).events())
        assert len(events) == 1 and isinstance(events[-1], ErrorEvent)
        assert "injected" in str(events[-1].error)
        assert not eng.has_unfinished() and w.in_flight == 0
        assert w.run(fake_job("c"))[0] == [4, 5, 6, 7, 8]  # the re-dispatch runs normally
    finally:
        w.close()


def _flaky(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, failures: int, exc: Exception) -> list[int]:
    real = getattr(obj, name)
    calls: list[int] = []

    def flaky(*args: Any) -> Any:
        calls.append(1)
        if len(calls) <= failures:
            raise exc
        return real(*args)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def test_real_engine_failures(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    def job(rid: str) -> ChunkJob:
        return ChunkJob(request_id=rid, prompt_token_ids=prompts[3], max_new_tokens=6, max_tokens=6,
                        sampling=GREEDY, policy_version=0)

    w = Worker(ref_engine, speculation=False).start()
    try:
        ref, _, _ = w.run(job("fail-ref"))
        registered = dict(ref_engine.blocks.hash_to_page)

        # One failed forward pass: retried, the chunk never notices.
        calls = _flaky(monkeypatch, ref_engine.runner, "run", 1, RuntimeError("injected forward failure"))
        out, _, done = w.run(job("fail-a"))
        assert out == ref and done.finish == ChunkFinish.LENGTH and len(calls) > 1
        monkeypatch.undo()

        # Two in a row: the chunk fails; nothing of it stays in the engine.
        calls = _flaky(monkeypatch, ref_engine.runner, "run", 2, RuntimeError("injected forward failure"))
        events = list(w.submit(job("fail-b")).events())
        assert len(events) == 1 and isinstance(events[-1], ErrorEvent) and "injected" in str(events[-1].error)
        assert not ref_engine.has_unfinished() and w.in_flight == 0
        monkeypatch.undo()

        # A failure while committing: the engine dropped the request, so its chunk fails at once.
        calls = _flaky(monkeypatch, ref_engine, "_apply", 1, RuntimeError("injected commit failure"))
        events = list(w.submit(job("fail-c")).events())
        assert isinstance(events[-1], ErrorEvent) and "aborted" in str(events[-1].error)
        assert not ref_engine.has_unfinished() and w.in_flight == 0
        monkeypatch.undo()

        # The worker keeps serving; the re-dispatched chunks generate the undisturbed output.
        assert w.run(job("fail-b"))[0] == ref and w.run(job("fail-c"))[0] == ref
        assert set(registered.items()) <= set(ref_engine.blocks.hash_to_page.items())
    finally:
        w.close()


class _AsyncEngine(FakeEngine):
    """An engine whose tokens arrive some steps after the request (as SGLang's, which runs in
    another process: a step returns what has come so far)."""

    def __init__(self, silent_steps: int) -> None:
        super().__init__()
        self.silent_steps = silent_steps

    def step(self, drafts: Any = None) -> Any:
        if self.silent_steps > 0:
            self.silent_steps -= 1
            return []
        return super().step(drafts)


def test_the_canary_waits_for_an_engine_whose_tokens_come_later() -> None:
    """The canary that tells a broken engine from chunks that all carry the fault is bounded by
    time, not steps: 4 empty steps are normal for an engine in another process."""
    w = Worker(_AsyncEngine(silent_steps=20), speculation=False)
    with w._lock:
        assert w._canary_locked() is None
    broken = FakeEngine()
    broken.fail_steps = 1
    w = Worker(broken, speculation=False)
    with w._lock:
        assert "injected" in str(w._canary_locked())
    assert not broken.has_unfinished()  # the canary is gone from the engine either way


class _GivingUpEngine(FakeEngine):
    """An engine that gives up on every request (SGLang reports a failed generate as ABORTED)."""

    def step(self, drafts: Any = None) -> Any:
        outs = super().step(drafts)
        for o in outs:
            o.finished, o.finish_reason = True, FinishReason.ABORTED
            self.abort(o.request_id)
        return outs


def test_an_engine_that_aborts_a_request_fails_its_chunk() -> None:
    """ABORTED is what the scheduler's own aborts end in, so it costs no attempt: a chunk the
    engine gave up on must fail instead, or an engine that gives up on everything is fed for ever
    (and never quarantined)."""
    w = Worker(_GivingUpEngine(), speculation=False).start()
    try:
        events = list(w.submit(fake_job("a")).events())
        assert isinstance(events[-1], ErrorEvent) and "engine aborted" in str(events[-1].error)
        assert w.in_flight == 0
    finally:
        w.close()



class _BrokenAsyncEngine(FakeEngine):
    """An engine in another process that has broken (SGLang after a device fault): a step never
    raises, every request comes back given up on, with no token."""

    def __init__(self) -> None:
        super().__init__()
        self.gives_up = True

    def step(self, drafts: Any = None) -> Any:
        if not self.gives_up:
            return super().step(drafts)
        outs = [StepOutput(rid, [], [], finished=True, finish_reason=FinishReason.ABORTED) for rid in list(self._seqs)]
        for o in outs:
            self.abort(o.request_id)
        return outs


def test_an_engine_that_gives_up_on_every_group_is_found_broken() -> None:
    """Its step never raises, so the isolation never runs: chunks of 3 groups given up on with no
    token in between run the canary; the engine gives up on it too, so the worker turns
    NOT_SERVING, and the first token after the engine recovers makes it healthy again. Two
    groups are not enough (siblings of one refused prompt are one group)."""
    eng = _BrokenAsyncEngine()
    w = Worker(eng, speculation=False).start()
    heard: list[bool] = []
    w.on_engine_health(heard.append)

    try:
        for rid, group in (("a", "g1"), ("b", "g1"), ("c", "g2"), ("d", "g2")):
            assert isinstance(list(w.submit(fake_job(rid, group)).events())[-1], ErrorEvent)
        assert heard == [True]  # 2 groups: could be 2 refused prompts
        assert isinstance(list(w.submit(fake_job("e", "g3")).events())[-1], ErrorEvent)
        # The chunk's error is delivered with the step's outputs; the canary runs after them (on
        # the step loop), so the health change lands a moment after the caller sees the error.
        assert _wait_for(lambda: len(heard) >= 2), heard
        assert heard == [True, False] and not w.engine_healthy
        eng.gives_up = False
        assert w.run(fake_job("f", "g4"))[0] == [4, 5, 6, 7, 8]
        assert _wait_for(lambda: len(heard) >= 3), heard
        assert heard == [True, False, True]
    finally:
        w.close()


class _RefusingEngine(FakeEngine):
    """Gives up on the requests of groups named bad-* (a prompt it refuses), runs the others; its
    steps never raise (an engine in another process)."""

    def step(self, drafts: Any = None) -> Any:
        refused = [rid for rid, s in self._seqs.items() if s.req.group_id.startswith("bad-")]
        for rid in refused:
            self.abort(rid)
        # The aborted ones first: the canary they lead to must not deliver the other requests'
        # newer tokens before the rest of this step's.
        return [*(StepOutput(rid, [], [], finished=True, finish_reason=FinishReason.ABORTED) for rid in refused),
                *super().step(drafts)]


def test_the_canary_delivers_the_other_requests_tokens() -> None:
    """The canary after engine-side aborts steps an engine that keeps running the other requests:
    their outputs of those steps reach their chunks (dropped, a chunk would miss tokens), and after
    the rest of the step that had the aborts (run from inside its delivery, they overtook it). The
    canary steps, so the worker stays healthy: the aborts were the refused prompts' fault."""
    eng = _RefusingEngine()
    w = Worker(eng, speculation=False).start()
    heard: list[bool] = []
    w.on_engine_health(heard.append)

    try:
        with w._lock:  # all in the engine's batch together
            good = w.submit(fake_job("good", "ok", 30))
            bad = [w.submit(fake_job(f"b{i}", f"bad-{i}", 5)) for i in range(3)]
        for h in bad:
            assert isinstance(list(h.events())[-1], ErrorEvent)
        events = list(good.events())
        assert isinstance(events[-1], DoneEvent) and events[-1].finish == ChunkFinish.LENGTH
        assert [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids] == list(range(4, 34))
        assert heard == [True]
    finally:
        w.close()


class _FullBatchEngine(_RefusingEngine):
    """Runs at most one request at a time (a full batch: SGLang's max_running_requests), in arrival
    order; gives up on groups named bad-*."""

    def step(self, drafts: Any = None) -> Any:
        admitted = list(self._seqs)[:1]
        parked = {rid: self._seqs.pop(rid) for rid in list(self._seqs) if rid not in admitted
                  and not self._seqs[rid].req.group_id.startswith("bad-")}
        try:
            return super().step(drafts)
        finally:
            self._seqs.update(parked)


def test_a_canary_behind_a_full_batch_does_not_flip_health(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the batch full, the canary waits its turn; another request getting tokens meanwhile
    shows the engine works. It timed out instead: NOT_SERVING on a working engine, then SERVING at
    the next token (review)."""
    from services.worker import core

    monkeypatch.setattr(core, "_CANARY_TIMEOUT_S", 0.5)
    eng = _FullBatchEngine()
    eng.step_delay = 0.02  # "good" holds the slot for 60 x 20 ms, past the canary's timeout
    w = Worker(eng, speculation=False).start()
    heard: list[bool] = []
    w.on_engine_health(heard.append)

    try:
        with w._lock:
            good = w.submit(fake_job("good", "ok", 60))  # holds the only slot
            bad = [w.submit(fake_job(f"b{i}", f"bad-{i}", 5)) for i in range(3)]
        for h in bad:
            assert isinstance(list(h.events())[-1], ErrorEvent)
        assert isinstance(list(good.events())[-1], DoneEvent)
        assert heard == [True]
    finally:
        w.close()


def test_the_canarys_request_id_is_reserved() -> None:
    """A chunk named as the canary would be aborted by the canary's cleanup and never end."""
    from services.common.errors import InvalidArgument
    from services.worker.core import _CANARY_ID

    w = Worker(FakeEngine(), speculation=False).start()
    try:
        with pytest.raises(InvalidArgument) as e:
            w.submit(fake_job(_CANARY_ID))
        assert e.value.field == "request_id"
    finally:
        w.close()


class _SaysBrokenEngine(FakeEngine):
    """An engine that reports itself broken (Engine.broken) while its steps still return tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    @property
    def broken(self) -> str | None:
        return self.reason


def test_an_engine_that_says_it_is_broken_is_not_serving_for_good() -> None:
    """Engine.broken set outside a weight load is seen after the next step: NOT_SERVING at once
    (no failed chunks, no canary), and tokens afterwards do not make it healthy again (only a
    restart mends a broken engine)."""
    eng = _SaysBrokenEngine()
    w = Worker(eng, speculation=False).start()
    heard: list[bool] = []
    w.on_engine_health(heard.append)
    try:
        assert w.run(fake_job("a"))[0] == [4, 5, 6, 7, 8] and heard == [True]
        eng.reason = "weights unknown (injected)"
        assert w.run(fake_job("b"))[0] == [4, 5, 6, 7, 8]
        assert _wait_for(lambda: len(heard) >= 2), heard
        assert w.run(fake_job("c"))[0] == [4, 5, 6, 7, 8]
        assert heard == [True, False] and not w.engine_healthy
    finally:
        w.close()
