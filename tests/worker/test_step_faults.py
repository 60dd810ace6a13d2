"""Faults around the engine step, on the real reference engine with the embedded model.

Two kinds the step loop must tell apart:
  - a fault of the worker's own code after `engine.step` returned (delivering outputs, observers,
    metrics, a chunk's end bookkeeping): the engine has committed the step's tokens, so "retrying
    the step" would lose them; such a fault fails at most the chunk whose output it was handling;
  - a request that makes every engine step fail: only that request's chunk fails, the chunks
    running beside it keep their progress and end with the tokens they would have produced alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.worker import core
from services.worker.core import ChunkFinish, ChunkHandle, ChunkJob, DoneEvent, ErrorEvent, TokensEvent, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine

MAX_NEW = 6


def job(rid: str, prompt: tuple[int, ...], seed: int) -> ChunkJob:
    # Seeded sampling (not greedy): the tokens at every position depend only on (seed, position), so
    # a chunk that was taken out of the engine and put back must still produce exactly these.
    return ChunkJob(request_id=rid, prompt_token_ids=prompt, max_new_tokens=MAX_NEW, max_tokens=MAX_NEW,
                    sampling=SamplingParams(temperature=0.9, seed=seed, ignore_eos=True), policy_version=0)


def drain(h: ChunkHandle, timeout: float = 20.0) -> tuple[list[int], DoneEvent | ErrorEvent | None]:
    """Tokens streamed and the terminal event (None: none came within `timeout`: a hung chunk)."""
    toks: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = h.next_event(0.1)
        if ev is None:
            continue
        if isinstance(ev, TokensEvent):
            toks += ev.token_ids
        else:
            return toks, ev
    return toks, None


def submit_together(w: Worker, jobs: Sequence[ChunkJob]) -> list[ChunkHandle]:
    """Admits every job before the loop steps again, so they share the engine's batch."""
    with w._lock:
        return [w.submit(j) for j in jobs]


@pytest.fixture(scope="module")
def refs(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> dict[str, list[int]]:
    """Each request's tokens when it runs alone."""
    w = Worker(ref_engine, speculation=False).start()
    try:
        return {f"r{i}": w.run(job(f"r{i}", p, seed=10 + i))[0] for i, p in enumerate(prompts)}
    finally:
        w.close()


def jobs_for(prompts: list[tuple[int, ...]]) -> list[ChunkJob]:
    return [job(f"r{i}", p, seed=10 + i) for i, p in enumerate(prompts)]


def assert_complete(toks: list[int], end: Any, want: list[int]) -> None:
    assert isinstance(end, DoneEvent), end
    assert end.finish == ChunkFinish.LENGTH and toks == want


# ---- item 1: a fault after engine.step returned ---------------------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
def test_delivery_fault_fails_only_its_chunk(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                             refs: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch,
                                             when: str) -> None:
    """A fault while delivering r0's second output (before or after its tokens reached the stream):
    r0's chunk fails (the scheduler re-runs it from its committed output), and no other chunk
    loses or repeats a token: the step's other outputs are still delivered, and the step (which
    the engine committed) is not run again."""
    real = Worker._deliver_locked
    seen: list[str] = []

    def faulty(self: Worker, act: Any, out: Any) -> None:
        seen.append(out.request_id)
        fire = out.request_id == "r0" and seen.count("r0") == 2
        if fire and when == "before":
            raise RuntimeError("injected delivery fault")
        real(self, act, out)
        if fire:
            raise RuntimeError("injected delivery fault")

    monkeypatch.setattr(Worker, "_deliver_locked", faulty)
    w = Worker(ref_engine, speculation=False).start()
    try:
        handles = submit_together(w, jobs_for(prompts))
        results = {h.request_id: drain(h) for h in handles}
        toks, end = results.pop("r0")
        assert isinstance(end, ErrorEvent) and "injected" in str(end.error)
        for rid, (toks, end) in results.items():
            assert_complete(toks, end, refs[rid])
        assert not ref_engine.has_unfinished() and w.in_flight == 0
        monkeypatch.undo()
        assert w.run(jobs_for(prompts)[0])[0] == refs["r0"]  # the re-dispatch
    finally:
        w.close()


def test_chunk_end_fault_still_ends_the_chunk(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                              refs: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in a chunk's end bookkeeping (here its metric) after every token was delivered: the
    chunk still ends with its DoneEvent (before: it was taken off the worker and its stream hung)."""
    real = core.metrics.CHUNKS
    fired = threading.Event()

    class Faulty:
        def labels(self, **kw: str) -> Any:
            if not fired.is_set():
                fired.set()
                raise RuntimeError("injected metrics fault")
            return real.labels(**kw)

    monkeypatch.setattr(core.metrics, "CHUNKS", Faulty())
    w = Worker(ref_engine, speculation=False).start()
    try:
        handles = submit_together(w, jobs_for(prompts[:2]))
        for h in handles:
            toks, end = drain(h)
            assert_complete(toks, end, refs[h.request_id])
        assert fired.is_set() and w.in_flight == 0 and not ref_engine.has_unfinished()
    finally:
        w.close()


def test_observer_fault_every_step_harms_no_chunk(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                                  refs: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own accounting after each step fails every time: not an engine failure (two of
    which in a row used to fail every running chunk); the chunks finish untouched."""
    calls: list[int] = []

    class Broken:
        def inc(self, n: float = 1) -> None:
            calls.append(1)
            raise RuntimeError("injected metrics fault")

    monkeypatch.setattr(core.metrics, "TOKENS", Broken())
    w = Worker(ref_engine, speculation=False).start()
    try:
        for h in submit_together(w, jobs_for(prompts[:2])):
            toks, end = drain(h)
            assert_complete(toks, end, refs[h.request_id])
        assert len(calls) >= 2
    finally:
        w.close()


# ---- item 2: one request makes every step fail ----------------------------------------------


def poison(monkeypatch: pytest.MonkeyPatch, engine: ReferenceEngine, rid: str, from_output: int) -> list[int]:
    """The forward pass fails whenever `rid` is in the batch at output position >= from_output (a
    fault that follows the request: bad input the engine cannot run, say). Engine.step is
    exception-safe, so nothing advances in a failed step."""
    real = engine.runner.run
    failures: list[int] = []

    def run(seqs: list[Any], trees: list[Any]) -> Any:
        for s in seqs:
            if s.request_id == rid and len(s.token_ids) - s.num_prompt_tokens >= from_output:
                failures.append(1)
                raise RuntimeError(f"injected fault of {rid}")
        return real(seqs, trees)

    monkeypatch.setattr(engine.runner, "run", run)
    return failures


@pytest.mark.parametrize("from_output", [0, 2])
def test_poisoned_request_fails_alone(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                      refs: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch,
                                      from_output: int) -> None:
    """r2 makes every step it is part of fail (from its first step, or after 2 tokens): its chunk
    fails; r0, r1, r3 end with exactly the tokens they produce alone."""
    failures = poison(monkeypatch, ref_engine, "r2", from_output)
    w = Worker(ref_engine, speculation=False).start()
    try:
        handles = submit_together(w, jobs_for(prompts))
        results = {h.request_id: drain(h) for h in handles}
        toks, end = results.pop("r2")
        assert isinstance(end, ErrorEvent) and "injected fault of r2" in str(end.error)
        # The request's fault, not the worker's (INVALID_ARGUMENT: the scheduler does not count it
        # towards quarantining the worker).
        assert isinstance(end.error, InvalidArgument) and "cannot run this request" in str(end.error)
        assert len(toks) == from_output
        for rid, (toks, end) in results.items():
            assert_complete(toks, end, refs[rid])
        assert failures and not ref_engine.has_unfinished() and w.in_flight == 0
        monkeypatch.undo()
        assert w.run(jobs_for(prompts)[2])[0] == refs["r2"]  # the worker serves on
    finally:
        w.close()


def faulty_worker(monkeypatch: pytest.MonkeyPatch, engine: ReferenceEngine,
                  fails: Callable[[list[Any]], bool]) -> tuple[Worker, list[bool]]:
    """A started worker whose engine's forward raises for the steps `fails` picks (by their
    sequences), and the engine health it reports (every change, from the current value on)."""
    real = engine.runner.run

    def run(seqs: list[Any], trees: list[Any]) -> Any:
        if fails(seqs):
            raise RuntimeError("injected fault")
        return real(seqs, trees)

    monkeypatch.setattr(engine.runner, "run", run)
    w = Worker(engine, speculation=False).start()
    heard: list[bool] = []
    w.on_engine_health(heard.append)
    return w, heard


def test_broken_engine_still_fails_every_chunk(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step fails whatever runs: each chunk fails (after a bounded number of tries), none hangs."""
    calls: list[int] = []

    def always(seqs: list[Any]) -> bool:
        calls.append(1)
        return True

    w, heard = faulty_worker(monkeypatch, ref_engine, always)
    try:
        handles = submit_together(w, jobs_for(prompts))
        for h in handles:
            toks, end = drain(h)
            assert toks == [] and isinstance(end, ErrorEvent) and "injected" in str(end.error)
            assert not isinstance(end.error, InvalidArgument)  # the engine's fault (INTERNAL)
        # Two tries, then at most 2n - 1 group steps to single every request out, then the canary.
        assert len(calls) <= 2 + 2 * len(prompts) - 1 + 1
        assert not ref_engine.has_unfinished() and w.in_flight == 0
        # Every chunk failed alone and so did the canary: the engine is broken (health NOT_SERVING,
        # so an orchestrator restarts the process).
        assert heard == [True, False] and not w.engine_healthy
        monkeypatch.undo()  # the device comes back: the next step that succeeds makes it healthy
        assert w.run(jobs_for(prompts)[0])[0]
        assert heard == [True, False, True] and w.engine_healthy
    finally:
        w.close()


def test_every_chunk_poisoned_is_not_a_broken_engine(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every running chunk fails alone (a group of siblings of one prompt the engine cannot run),
    but the engine runs a canary request: their fault, so the worker stays healthy."""
    w, heard = faulty_worker(monkeypatch, ref_engine, lambda seqs: any(s.request_id.startswith("r") for s in seqs))
    try:
        for h in submit_together(w, jobs_for(prompts)):
            toks, end = drain(h)
            assert toks == [] and isinstance(end, ErrorEvent) and isinstance(end.error, InvalidArgument)
        assert heard == [True] and w.engine_healthy
        assert not ref_engine.has_unfinished() and w.in_flight == 0
    finally:
        w.close()


def test_a_commit_fault_while_isolating_ends_every_chunk(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails while committing aborts every request in it (Engine.step), including chunks
    of groups that had already passed the group test. Those used to stay active with no terminal
    event: hung until the scheduler's deadline, and counted in flight."""
    real_run, real_apply = ref_engine.runner.run, ref_engine._apply
    forward_faults = [0]

    def run(seqs: list[Any], trees: list[Any]) -> Any:
        if any(s.request_id == "r2" for s in seqs) and forward_faults[0] < 2:
            forward_faults[0] += 1
            raise RuntimeError("forward fault of r2")  # rolled back; two in a row start the isolation
        return real_run(seqs, trees)

    def apply(seq: Any, *a: Any) -> Any:
        if seq.request_id == "r2" and forward_faults[0] >= 2:
            raise RuntimeError("commit fault of r2")  # the engine aborts every request of the step
        return real_apply(seq, *a)

    monkeypatch.setattr(ref_engine.runner, "run", run)
    monkeypatch.setattr(ref_engine, "_apply", apply)
    w = Worker(ref_engine, speculation=False).start()
    try:
        handles = submit_together(w, jobs_for(prompts))
        ends = {h.request_id: drain(h, timeout=10)[1] for h in handles}
        assert all(end is not None for end in ends.values()), ends
        assert isinstance(ends["r2"], ErrorEvent)
        assert w.in_flight == 0
    finally:
        monkeypatch.undo()
        w.close()


@pytest.mark.parametrize("broken", [True, False])
def test_one_chunk_alone_gets_the_canarys_verdict(ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]],
                                                  monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """One chunk running alone whose steps fail: the engine is broken (every step fails, the canary
    too: NOT_SERVING) or the request carries the fault (the canary steps: INVALID_ARGUMENT, healthy).
    With one chunk at a time (low load, or a worker on the scheduler's probation) the broken engine
    was never noticed."""
    w, heard = faulty_worker(monkeypatch, ref_engine, lambda seqs: broken or any(s.request_id == "r0" for s in seqs))
    try:
        toks, end = drain(w.submit(jobs_for(prompts)[0]))
        assert toks == [] and isinstance(end, ErrorEvent) and "injected" in str(end.error)
        assert isinstance(end.error, InvalidArgument) is not broken
        assert heard == ([True, False] if broken else [True])
        assert not ref_engine.has_unfinished() and w.in_flight == 0
    finally:
        monkeypatch.undo()
        w.close()

