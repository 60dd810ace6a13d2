"""Reference engine behaviour on the real model: chunked resume, drafts under greedy decoding,
prefix sharing, KV export/import, weight reload, stats and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engine import Draft, FinishReason, GenerateRequest, SamplingParams
from services.worker.engines.reference import ReferenceEngine

from .device import DEVICE

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def run_chunked(engine: ReferenceEngine, prompts: dict[str, tuple[int, ...]], plans: dict[str, list[int]],
                sampling: SamplingParams) -> dict[str, list[int]]:
    """Runs every request as a sequence of calls (chunks) of the planned sizes, all concurrently."""
    out: dict[str, list[int]] = {k: [] for k in plans}
    idx = dict.fromkeys(plans, 0)

    def submit(k: str) -> None:
        engine.add_request(GenerateRequest(f"{k}#{idx[k]}", prompts[k], plans[k][idx[k]], sampling,
                                           output_token_ids=tuple(out[k])))

    for k in plans:
        submit(k)
    while engine.has_unfinished():
        for o in engine.step():
            k = o.request_id.split("#")[0]
            out[k].extend(o.token_ids)
            if o.finished:
                assert o.finish_reason == FinishReason.LENGTH
                idx[k] += 1
                if idx[k] < len(plans[k]):
                    submit(k)
    return out


def test_chunked_resume_equals_uninterrupted(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    # Chunks of 7, of 50 and a 7 + 50 + rest mix; short enough for a shared 2-core CI machine.
    total = 64
    p = prompts[0]
    plans = {"whole": [total], "by7": [7] * (total // 7) + [total % 7], "by50": [50, 14], "mixed": [7, 50, 7]}
    for sampling in (GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)):
        out = run_chunked(engine, dict.fromkeys(plans, p), plans, sampling)
        for k in plans:
            assert len(out[k]) == total
            assert out[k] == out["whole"], f"{k} diverged at {sampling}"


def test_greedy_drafts_do_not_change_output(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    n = 24
    p = prompts[1]
    ref = engine.generate([GenerateRequest("ref", p, n, GREEDY)])["ref"].token_ids
    wrong = (ref[0] + 1) % engine.vocab_size

    def run(kind: str) -> tuple[list[int], int]:
        rid = f"d-{kind}"
        engine.add_request(GenerateRequest(rid, p, n, GREEDY))
        got: list[int] = []
        accepted = 0
        while engine.has_unfinished():
            k = len(got)
            if kind == "right":  # the true continuation, 5 deep
                d = Draft.chain(ref[k : k + 5])
            elif kind == "wrong":  # every token wrong
                d = Draft.chain([(t + 1) % engine.vocab_size for t in ref[k : k + 5]])
            else:  # a tree: a wrong sibling first, the right one second, a right grandchild
                nxt = ref[k : k + 2]
                d = Draft((wrong, *nxt), (-1, -1, 1)[: 1 + len(nxt)]) if nxt else Draft((), ())
            for o in engine.step({rid: d}):
                got.extend(o.token_ids)
                accepted += o.num_accepted
        return got, accepted

    right, acc_right = run("right")
    assert right == ref and acc_right >= n - n // 6 - 1  # about 5 of every 6 tokens came from drafts
    wrong_out, acc_wrong = run("wrong")
    assert wrong_out == ref and acc_wrong == 0
    tree_out, acc_tree = run("tree")
    assert tree_out == ref and acc_tree > 0
    st = engine.stats()
    assert st.proposed_per_position[0] > 0 and st.accepted_per_position[0] > 0


def test_group_prefix_computed_once(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    p = (7, 7, 7, *prompts[2], *(42,) * 40)  # a prompt no other test used (no cached pages)
    before = engine.stats()
    reqs = [GenerateRequest(f"g{i}", p, 2, GREEDY, group_id="grp") for i in range(4)]
    outs = engine.generate(reqs)
    after = engine.stats()
    full = (len(p) - 1) // 16 * 16
    # The first request computes the whole prompt; its siblings only their last partial page.
    assert after.prefill_tokens - before.prefill_tokens == len(p) + 3 * (len(p) - full)
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    assert engine.cached_prefix_tokens(p) >= full


def test_kv_export_import_skips_prefill(model_dir: Path, engine: ReferenceEngine,
                                        prompts: list[tuple[int, ...]]) -> None:
    p = prompts[3]
    first = engine.generate([GenerateRequest("src", p, 20, GREEDY)])["src"].token_ids
    prefix = p + tuple(first)
    pages = engine.export_kv(prefix)
    assert len(pages.pages) == len(prefix) // 16 >= 2
    assert all(len(b) == pages.layout.page_bytes for b in pages.pages)
    other = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=256)
    assert other.import_kv(pages) == len(pages.token_ids)
    before = other.stats()
    assert before.imported_tokens == len(pages.token_ids)
    cont = other.generate([GenerateRequest("dst", p, 10, GREEDY, output_token_ids=tuple(first))])["dst"].token_ids
    after = other.stats()
    # Only the partial last page was computed: no prefill for the imported prefix.
    assert after.prefill_tokens - before.prefill_tokens == len(prefix) - len(pages.token_ids) < 16
    whole = engine.generate([GenerateRequest("whole", p, 30, GREEDY)])["whole"].token_ids
    assert list(first) + cont == whole
    # Pages of another version or with tampered hashes are refused, naming the field.
    from dataclasses import replace

    with pytest.raises(ValueError, match="model_version"):
        other.import_kv(replace(pages, model_version="v9"))
    bad = replace(pages, page_hashes=(b"\x01" * 16, *pages.page_hashes[1:]))
    with pytest.raises(ValueError, match=r"page_hashes\[0\]"):
        other.import_kv(bad)


def test_weight_reload_new_version(model_dir: Path, engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    eng = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=128, model_version="v1")
    p = prompts[4]
    a = eng.generate([GenerateRequest("a", p, 5, GREEDY)])["a"].token_ids
    assert eng.cached_prefix_tokens(p) > 0
    eng.add_request(GenerateRequest("busy", p, 5, GREEDY))
    with pytest.raises(RuntimeError, match="drain"):
        eng.load_weights(None, "v2")
    eng.abort("busy")
    eng.load_weights(str(model_dir), "v2")
    assert eng.model_version == "v2"
    assert eng.cached_prefix_tokens(p) == 0  # old-version pages are never reused
    before = eng.stats().prefill_tokens
    b = eng.generate([GenerateRequest("b", p, 5, GREEDY)])["b"].token_ids
    assert eng.stats().prefill_tokens - before == len(p)
    assert a == b  # same weights, same output
    with pytest.raises(ValueError, match="model_version"):
        eng.import_kv(engine.export_kv(p))


def test_stats_and_abort(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    engine.add_request(GenerateRequest("s1", prompts[0], 50, GREEDY))
    engine.add_request(GenerateRequest("s2", prompts[1], 50, GREEDY))
    engine.step()
    st = engine.stats()
    assert st.running == 2 and st.waiting == 0 and st.free_pages < st.total_pages
    assert st.tokens_per_second > 0 and st.model_version == engine.model_version
    assert engine.request_tokens("s1")[: len(prompts[0])] == prompts[0]
    assert engine.abort("s1") and engine.abort("s2") and not engine.abort("s1")
    assert not engine.has_unfinished()
    assert engine.stats().running == 0


def test_stop_tokens_and_seeds(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    p = prompts[5]
    ref = engine.generate([GenerateRequest("r", p, 10, GREEDY)])["r"].token_ids
    stop = SamplingParams(temperature=0.0, stop_token_ids=(ref[3],))
    o = engine.generate([GenerateRequest("st", p, 10, stop)])["st"]
    assert o.token_ids == ref[: ref.index(ref[3]) + 1] and o.finish_reason == FinishReason.STOP
    s = SamplingParams(temperature=1.0, seed=7, ignore_eos=True)
    outs = engine.generate([GenerateRequest(f"seed{i}", p, 12, s) for i in range(2)])
    assert outs["seed0"].token_ids == outs["seed1"].token_ids  # same seed, same tokens
    assert all(lp <= 0 for lp in outs["seed0"].logprobs)


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (GenerateRequest("b1", (), 5), "prompt_token_ids"),
        (GenerateRequest("b2", (1, 99999), 5), r"prompt_token_ids\[1\]"),
        (GenerateRequest("b3", (1, 2), 0), "max_new_tokens"),
        (GenerateRequest("b4", (1, 2), 10**6), "max_new_tokens"),
        (GenerateRequest("b5", (1, 2), 5, SamplingParams(top_p=0.0)), "sampling.top_p"),
        (GenerateRequest("b6", (1, 2), 5, SamplingParams(top_p=1.5)), "sampling.top_p"),
        (GenerateRequest("b7", (1, 2), 5, SamplingParams(temperature=-1.0)), "sampling.temperature"),
        (GenerateRequest("b8", (1, 2), 5, output_token_ids=(-3,)), r"output_token_ids\[0\]"),
    ],
)
def test_bad_requests_name_the_field(engine: ReferenceEngine, req: GenerateRequest, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.add_request(req)
    assert not engine.has_unfinished()


def test_bad_draft_keeps_serving(engine: ReferenceEngine, prompts: list[tuple[int, ...]]) -> None:
    engine.add_request(GenerateRequest("ok", prompts[0], 6, GREEDY))
    engine.add_request(GenerateRequest("victim", prompts[1], 6, GREEDY))
    for bad, field in [(Draft((1, 2), (-1, 5)), r"parents\[1\]"), (Draft((1,), (-1, 0)), "parents"),
                       (Draft((10**6,), (-1,)), r"tokens\[0\]")]:
        with pytest.raises(ValueError, match=field):
            engine.step({"victim": bad})
    n = 0
    while engine.has_unfinished():
        n += sum(len(o.token_ids) for o in engine.step())
    assert n == 12
