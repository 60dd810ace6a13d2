"""A step whose forward pass (or verification) throws leaves the engine as it was before the step:
the exception propagates, requests admitted in the step wait again and their pages are neither
held nor registered in the prefix cache (their KV was never written), running requests keep their
state, and the next steps produce exactly what an uninterrupted run produces (issue 2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine

from .conftest import chat
from .device import DEVICE

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
NEW = 10  # tokens per request


@pytest.fixture(scope="module")
def fresh(model_dir: Path) -> Iterator[ReferenceEngine]:
    """An engine of its own (each test admits prompts it has never seen in the failing step)."""
    eng = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=96, max_batch_size=8, num_threads=1)
    yield eng
    assert not eng.has_unfinished()


def _fail_once(obj: Any, name: str, exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Makes obj.name raise exc on its next call only; returns a list counting the calls."""
    real = getattr(obj, name)
    calls: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def _drain(engine: ReferenceEngine, acc: dict[str, list[int]],
           drafts: dict[str, Draft] | None = None) -> None:
    while engine.has_unfinished():
        for o in engine.step(drafts):
            acc.setdefault(o.request_id, []).extend(o.token_ids)


@pytest.mark.parametrize("where", ["run", "verify"])
def test_failed_step_rolls_back_its_admissions(fresh: ReferenceEngine, engine: ReferenceEngine,
                                               tokenizer: Tokenizer, prompts: list[tuple[int, ...]],
                                               where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new_prompt = chat(tokenizer, f"Failure test ({where}): summarise the plot of a detective novel in "
                                 "three sentences, naming the detective and the culprit.")
    reqs = [
        GenerateRequest("a", prompts[0], NEW, GREEDY),
        GenerateRequest("b", prompts[1], NEW, GREEDY),
        GenerateRequest("c", new_prompt, NEW, GREEDY),
        GenerateRequest("d", new_prompt, NEW, GREEDY),  # c's sibling: shares the pages c registers
    ]
    # The uninterrupted reference, on another engine.
    ref = {r.request_id: o.token_ids for r, o in
           zip(reqs, engine.generate([GenerateRequest(f"ref-{where}-{r.request_id}", r.prompt_token_ids, NEW,
                                                      GREEDY) for r in reqs]).values(), strict=True)}

    acc: dict[str, list[int]] = {}
    fresh.add_request(reqs[0])
    fresh.add_request(reqs[1])
    for _ in range(2):  # a and b are running
        for o in fresh.step():
            acc.setdefault(o.request_id, []).extend(o.token_ids)
    fresh.add_request(reqs[2])
    fresh.add_request(reqs[3])
    assert fresh.cached_prefix_tokens(new_prompt) == 0
    registered = dict(fresh.blocks.hash_to_page)
    free = fresh.blocks.num_free
    lens = {rid: len(fresh.request_tokens(rid)) for rid in ("a", "b")}
    prefill = fresh.stats().prefill_tokens

    if where == "run":
        calls = _fail_once(fresh.runner, "run", RuntimeError("injected forward failure"), monkeypatch)
    else:
        calls = _fail_once(fresh, "_verify", ValueError("injected verification failure"), monkeypatch)
    with pytest.raises((RuntimeError, ValueError), match="injected") as info:
        fresh.step()
    assert len(calls) == 1
    # (a) the error propagates, saying what happened to the requests.
    assert any("2 newly admitted put back to waiting" in n for n in getattr(info.value, "__notes__", []))
    # (d) nothing of c and d stays registered or held; a and b are untouched.
    assert fresh.blocks.hash_to_page == registered
    assert fresh.cached_prefix_tokens(new_prompt) == 0
    assert fresh.blocks.num_free == free
    assert {rid: len(fresh.request_tokens(rid)) for rid in ("a", "b")} == lens
    st = fresh.stats()
    assert (st.running, st.waiting) == (2, 2)
    assert st.prefill_tokens == prefill  # the failed step's prefill is not counted
    assert [s.request_id for s in fresh.scheduler.waiting] == ["c", "d"]  # same order, at the head

    # (b) the next step works and (c) every output equals the uninterrupted run.
    _drain(fresh, acc)
    assert len(calls) > 1
    assert acc == ref
    # c's prompt was computed once, after the failure, and shared with d in the same step.
    n = len(new_prompt)
    assert fresh.stats().prefill_tokens - prefill == n + (n - (n - 1) // 16 * 16)

    # (d) a sibling admitted afterwards reuses the registered pages, and they hold the right KV.
    before = fresh.stats()
    e = fresh.generate([GenerateRequest("e", new_prompt, NEW, GREEDY)])["e"].token_ids
    after = fresh.stats()
    assert after.cached_tokens - before.cached_tokens == (len(new_prompt) - 1) // 16 * 16 > 0
    assert e == ref["c"]


def test_failed_decode_step_changes_nothing(fresh: ReferenceEngine, engine: ReferenceEngine,
                                            prompts: list[tuple[int, ...]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in a step that admits nothing (pure decode, with drafts) loses no token."""
    sampled = SamplingParams(temperature=0.8, seed=7, ignore_eos=True)
    reqs = [GenerateRequest("s", prompts[2], NEW, sampled), GenerateRequest("g", prompts[3], NEW, GREEDY)]
    ref = engine.generate([GenerateRequest("ref-" + r.request_id, r.prompt_token_ids, NEW, r.sampling)
                           for r in reqs])
    acc: dict[str, list[int]] = {}
    for r in reqs:
        fresh.add_request(r)
    for o in fresh.step():
        acc.setdefault(o.request_id, []).extend(o.token_ids)
    registered = dict(fresh.blocks.hash_to_page)
    calls = _fail_once(fresh.runner, "run", RuntimeError("injected forward failure"), monkeypatch)
    # A wrong draft: its KV is written to scratch slots in the failed step; nothing may remain of it.
    wrong = {"g": Draft.chain([1, 2, 3])}
    with pytest.raises(RuntimeError, match="injected"):
        fresh.step(wrong)
    assert fresh.blocks.hash_to_page == registered
    assert fresh.stats().running == 2
    _drain(fresh, acc)
    assert len(calls) > 1
    assert acc == {"s": ref["ref-s"].token_ids, "g": ref["ref-g"].token_ids}


def test_failure_while_committing_aborts_the_step(fresh: ReferenceEngine, prompts: list[tuple[int, ...]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past verification some requests may have advanced: their tokens could not reach the caller,
    so the step's requests are aborted (and the error is not a ValueError a caller would retry)."""
    reqs = [GenerateRequest(f"x{i}", prompts[i], NEW, GREEDY) for i in (4, 5)]
    for r in reqs:
        fresh.add_request(r)
    fresh.step()
    real = fresh._apply
    calls: list[int] = []

    def flaky(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the first request has advanced already
            raise ValueError("injected commit failure")
        return real(*args)

    monkeypatch.setattr(fresh, "_apply", flaky)
    with pytest.raises(RuntimeError, match="2 requests were aborted") as info:
        fresh.step()
    assert isinstance(info.value.__cause__, ValueError)
    assert not fresh.has_unfinished()
    assert fresh.blocks.num_free == fresh.blocks.num_pages  # every page released (cached or free)
    monkeypatch.undo()
    # The engine keeps serving, and the committed pages of the aborted requests are reused.
    before = fresh.stats().cached_tokens
    out = fresh.generate([GenerateRequest("x-again", prompts[4], 2, GREEDY)])["x-again"]
    assert len(out.token_ids) == 2 and fresh.stats().cached_tokens > before
