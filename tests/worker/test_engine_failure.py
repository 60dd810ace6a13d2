"""A forward pass that throws inside the worker's step loop: the chunks it was running fail (the
buffer re-dispatches them), the loop keeps serving, the engine holds nothing of them, and the
re-dispatched chunk generates what an undisturbed one does."""

from __future__ import annotations

from typing import Any

import pytest

from services.worker.core import ChunkJob, ErrorEvent, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine


def test_failed_step_fails_its_chunks_and_the_worker_keeps_serving(
        ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)

    def job(rid: str) -> ChunkJob:
        return ChunkJob(request_id=rid, prompt_token_ids=prompts[3], max_new_tokens=6, max_tokens=6,
                        sampling=greedy, policy_version=0)

    w = Worker(ref_engine, speculation=False).start()
    try:
        ref, _, _ = w.run(job("fail-ref"))
        registered = dict(ref_engine.blocks.hash_to_page)
        real = ref_engine.runner.run
        calls: list[int] = []

        def flaky(*args: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected forward failure")
            return real(*args)

        monkeypatch.setattr(ref_engine.runner, "run", flaky)
        events = list(w.submit(job("fail-a")).events())
        assert isinstance(events[-1], ErrorEvent) and "injected" in str(events[-1].error)
        assert len(events) == 1  # no token was streamed
        assert not ref_engine.has_unfinished() and w.in_flight == 0
        assert ref_engine.blocks.hash_to_page == registered
        # The re-dispatched chunk runs normally and generates the undisturbed output.
        again, _, _ = w.run(job("fail-a"))
        assert again == ref and len(calls) > 1
    finally:
        w.close()
