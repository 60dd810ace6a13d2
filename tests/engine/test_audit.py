"""Audit regressions: the engine at the model's context limit, duplicate draft branches, sampling
edge cases and page accounting under aborts and failed steps (real model); the planner's table and
step-time inputs; draft tokens outside the vocabulary on the way to SGLang."""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker import adaptive
from services.worker.adaptive import AdaptiveSpeculation, StepTimeTable, load_table
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine
from services.worker.engines.reference.model_runner import DraftTree
from services.worker.engines.reference.sequence import Sequence
from services.worker.engines.sglang.drafts import PAD_TOKEN, from_sglang, pack_batch, to_sglang

from .device import DEVICE

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def check_pages(eng: ReferenceEngine) -> None:
    """Every page is exactly one of: used (ref count = the live block tables holding it), cached
    (LRU, registered) or free (unregistered); the hash index agrees with the pages."""
    b = eng.blocks
    held: collections.Counter[int] = collections.Counter()
    for s in eng.scheduler.running:
        held.update(s.block_table)
    assert all(not s.block_table for s in eng.scheduler.waiting)
    assert [b.ref_count[p] for p in range(b.num_pages)] == [held[p] for p in range(b.num_pages)]
    assert len(set(b.free)) == len(b.free) and not set(b.free) & set(b.lru)
    assert all(b.ref_count[p] == 0 and b.page_hash[p] is None for p in b.free)
    for p in b.lru:
        h = b.page_hash[p]
        assert b.ref_count[p] == 0 and h is not None and b.hash_to_page[h] == p
    assert all(b.page_hash[p] == h for h, p in b.hash_to_page.items())
    assert len(b.free) + len(b.lru) + sum(1 for c in b.ref_count if c) == b.num_pages


@pytest.fixture(scope="module")
def short_context(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ReferenceEngine:
    """The real weights with a 48-token context: the rotary table ends where the context does."""
    d = tmp_path_factory.mktemp("short-context")
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    return ReferenceEngine.from_dir(d, device=DEVICE, num_pages=64, num_threads=1)


def test_drafts_at_the_context_limit(short_context: ReferenceEngine) -> None:
    eng = short_context
    prompt = tuple(range(100, 120))
    room = eng.max_context - len(prompt)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request(GenerateRequest("over", prompt, room + 1, GREEDY))
    ref = eng.generate([GenerateRequest("ref", prompt, room, GREEDY)])["ref"].token_ids
    assert len(ref) == room
    # Drafts longer than what is left (trimmed), right up to the last position; a chain and a tree
    # whose wrong branch comes first.
    for kind in ("chain", "tree"):
        eng.add_request(GenerateRequest(kind, prompt, room, GREEDY))
        out: list[int] = []
        while eng.has_unfinished():
            rest = ref[len(eng.request_tokens(kind)) - len(prompt):]
            if kind == "chain":
                d = Draft.chain([*rest, 5, 6, 7])
            else:
                d = Draft((9, 9, *rest), (-1, 0, -1, *range(2, 2 + len(rest) - 1)))
            for o in eng.step({kind: d}):
                out += o.token_ids
        assert out == ref, kind
    check_pages(eng)
    assert eng.stats().free_pages == eng.stats().total_pages


def test_a_prefix_that_fills_the_context_names_its_own_field(short_context: ReferenceEngine) -> None:
    """A prompt (or prompt + output) with no room left is the prefix's fault, not max_new_tokens'."""
    eng = short_context
    full = tuple(range(100, 100 + eng.max_context))
    with pytest.raises(ValueError, match=r"^prompt_token_ids: prompt \+ output = 48 tokens"):
        eng.add_request(GenerateRequest("full", full, 1, GREEDY))
    with pytest.raises(ValueError, match=r"^output_token_ids: "):
        eng.add_request(GenerateRequest("full-out", full[:40], 1, GREEDY, output_token_ids=full[40:]))
    with pytest.raises(ValueError, match=r"^max_new_tokens: "):  # room for some tokens, not for all
        eng.add_request(GenerateRequest("over", full[:40], 9, GREEDY))
    assert not eng.has_unfinished()


def test_duplicate_branches_and_sampling_edges(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    p = prompts[1]
    greedy = engine.generate([GenerateRequest("g", p, 8, GREEDY)])["g"].token_ids
    edge_lps: list[list[float]] = []
    for sp in (SamplingParams(temperature=0.7, top_k=1, seed=3, ignore_eos=True),
               SamplingParams(temperature=0.7, top_p=1e-9, seed=3, ignore_eos=True)):
        one = engine.generate([GenerateRequest("one", p, 8, sp)])["one"]
        assert one.token_ids == greedy
        edge_lps.append(one.logprobs)
    # Logprobs are log_softmax(logits / T) over the full vocabulary (sampler.py): a one-token
    # truncation changes which token is drawn, not its logprob (the old processed-distribution
    # logprob was 0.0 here, which no trainer recomputes).
    assert edge_lps[0] == edge_lps[1] and all(lp < 0.0 for lp in edge_lps[0])
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=5, ignore_eos=True)
    plain = engine.generate([GenerateRequest("plain", p, 8, sp)])["plain"]
    # The true next token twice at the root; the rest of the truth under the second copy.
    engine.add_request(GenerateRequest("dup", p, 8, sp))
    toks: list[int] = []
    lps: list[float] = []
    while engine.has_unfinished():
        rest = plain.token_ids[len(engine.request_tokens("dup")) - len(p):]
        d = Draft((rest[0], rest[0], *rest[1:]), (-1, -1, *range(1, len(rest))))
        for o in engine.step({"dup": d}):
            toks += o.token_ids
            lps += o.logprobs
    assert toks == plain.token_ids
    assert np.allclose(lps, plain.logprobs, atol=1e-4)


def test_pages_balance_under_aborts_drafts_and_failed_steps(model_dir: Path) -> None:
    """Random adds (shared prefixes), aborts, random draft trees and failed steps on a small cache
    (evictions): no page leaks or is freed twice, and every finished request's greedy output equals
    its output alone (a page holding KV it should not would change it)."""
    eng = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=40, page_size=4, num_threads=1,
                                   max_batch_size=6)
    base = [tuple(range(200, 209)), tuple(range(300, 313)), (*range(200, 205), 7, 8, 9)]
    n = 8
    ref = {i: eng.generate([GenerateRequest(f"r{i}", q, n, GREEDY)])[f"r{i}"].token_ids for i, q in enumerate(base)}
    rng = random.Random(1)
    live: dict[str, int] = {}
    outs: dict[str, list[int]] = collections.defaultdict(list)
    real_run = eng.runner.run
    failed = finished = 0
    for it in range(150):
        r = rng.random()
        if r < 0.25 and len(live) < 8:
            i = rng.randrange(len(base))
            eng.add_request(GenerateRequest(f"x{it}", base[i], n, GREEDY))
            live[f"x{it}"] = i
        elif r < 0.32 and live:
            rid = rng.choice(sorted(live))
            assert eng.abort(rid) and not eng.abort(rid)
            del live[rid]
            outs.pop(rid, None)
        else:
            drafts = {}
            for rid, i in live.items():
                if rng.random() < 0.6:
                    truth = ref[i][len(eng.request_tokens(rid)) - len(base[i]):]
                    toks = [rng.randrange(eng.vocab_size), *truth[: rng.randrange(6)], rng.randrange(eng.vocab_size)]
                    drafts[rid] = Draft(tuple(toks), (-1, -1, *range(1, len(toks) - 1)))
            fail = rng.random() < 0.1

            def run(seqs: list[Sequence], trees: list[DraftTree | None], _fail: bool = fail
                    ) -> tuple[torch.Tensor, list[int]]:
                res = real_run(seqs, trees)
                if _fail:
                    raise RuntimeError("injected")  # after the forward pass wrote its KV
                return res

            eng.runner.run = run  # type: ignore[method-assign]
            try:
                results = eng.step(drafts)
            except RuntimeError:
                failed += 1
                results = []
            finally:
                eng.runner.run = real_run  # type: ignore[method-assign]
            for o in results:
                outs[o.request_id] += o.token_ids
                if o.finished:
                    assert outs[o.request_id] == ref[live.pop(o.request_id)], o.request_id
                    finished += 1
        check_pages(eng)
    assert failed and finished


# ---- the planner's inputs -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[]", '{"batch_sizes": 5, "gammas": [0], "times_s": [[1.0]]}',
                                  '{"batch_sizes": [1], "gammas": [0], "times_s": [null]}'])
def test_a_malformed_default_table_falls_back_to_the_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             text: str) -> None:
    bad = tmp_path / "step_time.json"
    bad.write_text(text)
    monkeypatch.setattr(adaptive, "DEFAULT_TABLE_PATH", bad)
    assert load_table(None).source == "builtin"  # was a TypeError: the worker did not start
    with pytest.raises(ValueError, match=r"step-time table|malformed"):
        load_table(bad)  # an explicit --spec-table is an error naming what is wrong


@pytest.mark.parametrize("t", [math.inf, math.nan, 0.0])
def test_a_table_needs_finite_positive_times(t: float) -> None:
    with pytest.raises(ValueError, match="times_s"):
        StepTimeTable((1, 8), (0, 4), ((0.01, 0.02), (0.03, t)))


def test_an_infinite_step_time_is_not_a_measurement() -> None:
    planner = AdaptiveSpeculation(StepTimeTable.builtin(), gamma_max=4)
    for _ in range(4):
        planner.plan([("a", False), ("b", False)])
        planner.observe_step(2, 2, math.inf)
    assert "cost_by_bucket" not in planner.stats()  # still open loop: nothing was measured
    planner.plan([("a", False), ("b", False)])
    planner.observe_step(2, 2, 0.03)
    assert math.isfinite(planner.stats()["explore_credit_s"])


# ---- drafts for SGLang ------------------------------------------------------------------------


def test_sglang_drafts_drop_tokens_outside_the_vocabulary() -> None:
    # 0: 5 (root child), 1: 10**6 (root child, out of range), 2: 7 under 1, 3: 8 under 0, 4: -1 under 3.
    d = Draft((5, 10**6, 7, 8, -1), (-1, -1, 1, 0, 3))
    tokens, mask = to_sglang(d, 42, 6, vocab_size=100)
    last, back = from_sglang(tokens, mask, num_real=2)
    assert (last, back) == (42, Draft((5, 8), (-1, 0)))
    assert tokens[3:] == [PAD_TOKEN] * 3
    packed, _ = pack_batch([d, None], [42, 43], 6, vocab_size=100)
    assert packed.min() >= 0 and packed.max() < 100
    assert to_sglang(d, 42, 6)[0][:6] == [42, 5, 10**6, 8, 7, -1]  # no vocab_size: as before
