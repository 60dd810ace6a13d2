"""An engine abort that raises (an engine in another process whose event loop is momentarily
unreachable) must not leave the request in the engine for good: it would keep generating for a
chunk that has ended and hold the request id, so a retry of the request on this worker would be
refused "already live" (INVALID_ARGUMENT, which costs the request an attempt). Glue over the fake
engine: the failure is injected."""

from __future__ import annotations

import time

from test_engine_failure import GREEDY
from worker_fake_engine import FakeEngine

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, TokensEvent, Worker


class _FlakyAbortEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.fail_aborts = 0  # the next this many aborts raise (before changing anything)
        self.abort_calls = 0

    def abort(self, request_id: str) -> bool:
        self.abort_calls += 1
        if self.fail_aborts > 0:
            self.fail_aborts -= 1
            raise RuntimeError("injected abort failure")
        return super().abort(request_id)


def _job(rid: str, n: int) -> ChunkJob:
    return ChunkJob(request_id=rid, prompt_token_ids=(1, 2, 3), max_new_tokens=n, max_tokens=n, sampling=GREEDY,
                    policy_version=0)


def _wait_for_steps(eng: FakeEngine) -> None:
    deadline = time.monotonic() + 10
    while eng.steps < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_failed_abort_is_retried_and_the_request_can_run_again() -> None:
    eng = _FlakyAbortEngine()
    eng.step_delay = 0.01
    w = Worker(eng, speculation=False).start()
    try:
        h = w.submit(_job("a", 500))
        _wait_for_steps(eng)
        eng.fail_aborts = 1
        assert w.abort("a")
        events = list(h.events())
        assert isinstance(events[-1], DoneEvent) and events[-1].finish == ChunkFinish.ABORTED
        # The step loop retries the abort: the engine lets the request go.
        deadline = time.monotonic() + 10
        while eng.has_unfinished():
            assert time.monotonic() < deadline, "the request whose abort failed is still in the engine"
            time.sleep(0.005)
        assert not w._orphans
        # The same request again (the scheduler's retry of it) runs.
        toks = [t for e in w.submit(_job("a", 5)).events() if isinstance(e, TokensEvent) for t in e.token_ids]
        assert toks == [4, 5, 6, 7, 8]
    finally:
        w.close()


def test_a_retry_of_the_request_aborts_the_orphan_first() -> None:
    """No step loop (the worker is not started), so only the admission's own retry can free the id."""
    eng = _FlakyAbortEngine()
    w = Worker(eng, speculation=False)
    try:
        h = w.submit(_job("a", 5))
        assert eng.has_unfinished()
        eng.fail_aborts = 1
        assert w.abort("a")
        assert isinstance(list(h.events())[-1], DoneEvent)
        assert eng.has_unfinished()  # the orphan
        h = w.submit(_job("a", 3))
        assert w.in_flight == 1 and eng.request_tokens("a") == (1, 2, 3)
        assert eng.abort_calls == 2 and not w._orphans
    finally:
        w.close()
