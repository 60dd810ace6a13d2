"""Contract of the SGLang backend: the pure conversions always; SGLang's own signatures when sglang is
importable (it needs CUDA and is not installed on CI machines, so that part skips there)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.kvstore.store import family_of
from services.worker.config import WorkerConfig
from services.worker.engine import Draft, FinishReason, SamplingParams
from services.worker.engines.sglang import pages, plugin
from services.worker.engines.sglang.drafts import PAD_TOKEN, bfs_order, from_sglang, pack_batch, to_sglang
from services.worker.engines.sglang.engine import (
    MissingLogprobs,
    parse_policy_version,
    sampling_dict,
    server_kwargs,
    stream_delta,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def paths(d: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a draft tree (its meaning, independent of node order)."""
    out = set()
    for i in range(len(d.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(d.tokens[j])
            j = d.parents[j]
        out.add(tuple(reversed(path)))
    return out


def ancestors_or_self(prevs: list[int], i: int) -> set[int]:
    out, j = set(), i
    while j >= 0:
        out.add(j)
        j = prevs[j]
    return out


def test_chain_block() -> None:
    tokens, mask = to_sglang(Draft.chain([5, 6, 7]), last_token=42, num_draft_tokens=6)
    assert tokens == [42, 5, 6, 7, PAD_TOKEN, PAD_TOKEN]
    # A chain is lower-triangular; padding hangs off the root.
    for i in range(4):
        assert list(np.nonzero(mask[i])[0]) == list(range(i + 1))
    for i in (4, 5):
        assert list(np.nonzero(mask[i])[0]) == [0, i]


def test_tree_is_reordered_breadth_first() -> None:
    # node0=10 (root child), node1=12 (child of node0), node2=11 (root child), node3=13 (child of node2)
    d = Draft((10, 12, 11, 13), (-1, 0, -1, 2))
    assert bfs_order(d.parents) == [0, 2, 1, 3]
    tokens, mask = to_sglang(d, last_token=1, num_draft_tokens=5)
    assert tokens == [1, 10, 11, 12, 13]
    prevs = [-1, 0, 0, 1, 2]
    for i in range(5):
        assert set(np.nonzero(mask[i])[0]) == ancestors_or_self(prevs, i)


def test_no_draft_is_all_padding() -> None:
    tokens, mask = to_sglang(None, last_token=9, num_draft_tokens=3)
    assert tokens == [9, PAD_TOKEN, PAD_TOKEN]
    assert mask.tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        to_sglang(None, 1, 0)


def random_tree(rng: random.Random, n: int) -> Draft:
    # Parents-first but not BFS: each node picks any earlier node (or the root) as its parent.
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return Draft(tuple(rng.randrange(1, 1000) for _ in range(n)), tuple(parents))


@pytest.mark.parametrize("seed", range(20))
def test_random_trees_round_trip_and_truncate(seed: int) -> None:
    rng = random.Random(seed)
    d = random_tree(rng, rng.randrange(1, 12))
    n = rng.randrange(2, 10)
    tokens, mask = to_sglang(d, last_token=7, num_draft_tokens=n)
    assert len(tokens) == n and mask.shape == (n, n)
    kept = min(len(d.tokens), n - 1)
    # Every row: the diagonal and the root; ancestors strictly before the node (BFS order).
    assert mask.diagonal().all() and mask[:, 0].all()
    assert not np.triu(mask, 1).any()
    last, back = from_sglang(tokens, mask, num_real=kept)
    assert last == 7
    back.validate(10_000)
    if kept == len(d.tokens):
        assert paths(back) == paths(d)
    else:  # a BFS prefix: every kept path is a path of the original tree
        assert paths(back) <= paths(d) and len(back.tokens) == kept


def test_pack_batch() -> None:
    drafts = [Draft.chain([3, 4]), None, Draft((8, 9), (-1, -1))]
    tokens, mask = pack_batch(drafts, [100, 200, 300], num_draft_tokens=4)
    assert tokens.dtype == np.int64 and tokens.shape == (12,)
    assert mask.dtype == np.bool_ and mask.shape == (48,)
    assert tokens.tolist() == [100, 3, 4, 0, 200, 0, 0, 0, 300, 8, 9, 0]
    m2 = mask[32:48].reshape(4, 4)
    assert m2[2].tolist() == [True, False, True, False]  # 9 is a sibling of 8, not its child
    with pytest.raises(ValueError, match="last_tokens"):
        pack_batch(drafts, [1], 4)


def test_page_keys_and_namespaces() -> None:
    h = pages.page_hash("a" * 64)
    assert len(h) == 16 and h == pages.page_hash("a" * 64) and h != pages.page_hash("b" * 64)
    ns0 = pages.namespace("smollm2", 0, tp_rank=1, tp_size=2)
    ns1 = pages.namespace("smollm2", 1, tp_rank=1, tp_size=2)
    assert ns0 != ns1 and ns0.endswith("@v0") and ns1.endswith("@v1")
    # One family per (model, rank) across versions: the store drops the old version's pages.
    assert family_of(ns0) == family_of(ns1) != family_of(pages.namespace("smollm2", 1, 0, 2))
    # Never the reference engine's namespace ("<family>@v<N>"): the layouts differ.
    assert family_of(ns0) != "smollm2"
    assert pages.extra_key("smollm2", 3) != pages.extra_key("smollm2", 4)
    for bad in (("", 0, 0, 1), ("a@b", 0, 0, 1), ("m", -1, 0, 1), ("m", 0, 2, 2)):
        with pytest.raises(ValueError):
            pages.namespace(*bad)
    lay = pages.page_layout("bfloat16", 64, 30, 3, 64, "layer_first", 0, 1)
    assert lay.page_bytes == 30 * 2 * 64 * 3 * 64 * 2 and "tp0of1" in lay.layout


def test_version_file(tmp_path: Path) -> None:
    vf = pages.VersionFile(str(tmp_path / "v"))
    assert vf.read(default=5) == 5
    vf.write(3)
    assert vf.read() == 3
    vf.write(4)
    assert vf.read() == 4
    assert vf.read_both(0, "start") == (4, "start")  # a version-only file keeps the backend's family
    vf.write(5, "m-abc")
    assert vf.read() == 5 and vf.read_both(0, "start") == (5, "m-abc")
    with pytest.raises(ValueError, match="family"):
        vf.write(6, "a\nb")


def test_request_conversions() -> None:
    s = sampling_dict(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=2**64 - 1,
                                     stop_token_ids=(5,), ignore_eos=True), 32)
    assert s["max_new_tokens"] == 32 and s["top_k"] == -1 and s["stop_token_ids"] == [5]
    assert 0 <= s["sampling_seed"] < 2**63 and s["ignore_eos"] is True
    assert "sampling_seed" not in sampling_dict(SamplingParams(), 1)
    assert parse_policy_version("smollm2@v12") == 12 and parse_policy_version("v0") == 0
    with pytest.raises(ValueError, match="version"):
        parse_policy_version("latest")
    meta = plugin.request_meta(plugin.custom_params("g1", "k", 8, True, request_id="g1/3", output_offset=5, epoch=9))
    assert meta == plugin.RequestMeta("g1", "k", 8, True, "g1/3", 5, 9)
    # Unknown group size stays 0 (unknown), never 1 (a group completed at its first finish).
    assert plugin.request_meta(None) == plugin.RequestMeta("", "", 0, False, "", 0, 0)
    assert plugin.request_meta(plugin.custom_params("g1", "k", 0, False)).group_size == 0


@pytest.mark.parametrize("cumulative", [True, False], ids=["cumulative", "incremental"])
def test_stream_deltas(cumulative: bool) -> None:
    """Streamed outputs become token deltas whatever SGLang's streaming mode: output_ids cumulative
    by default, the delta with incremental_streaming_output (tokenizer_manager.py:2674-2708), and
    output_token_logprobs likewise. SGLang's own speculation counts come with the final output only
    (tokenizer_manager.py:2742-2756); the SEER plugin's per-token draft values (one per output token,
    plugin.record_step) come as SGLang sends them: the whole accumulated list by default, the chunk's
    slice with incremental_streaming_output (_slice_streaming_output_meta_info,
    tokenizer_manager.py:364-374). The incremental case once put the whole list on the last chunk,
    which SGLang never sends, and hid that the counts of earlier chunks were dropped."""
    chunks = [[(-0.1, 11, None), (-0.2, 12, None)], [(-0.3, 13, None)], [(-0.4, 14, None), (-0.5, 2, None)]]
    seen: list[tuple[float, int, None]] = []
    reported = 0
    tokens: list[int] = []
    logprobs: list[float] = []
    accepted = proposed = 0
    reason = None
    # Per output token: a verify step's (real drafts, accepted) at its first token, None at the
    # others (3 steps: 2 tokens, 1 token, 2 tokens).
    drafts = [(2, 1), None, (1, 0), (1, 1), None]
    for i, c in enumerate(chunks):
        start = len(seen)
        seen += c
        last = i == 2
        meta: dict[str, object] = {"output_token_logprobs": list(seen) if cumulative else c,
                                   "completion_tokens": len(seen), "finish_reason": {"type": "stop"} if last else None}
        # SGLang's accumulation, sliced to the chunk when incremental.
        meta[plugin.DRAFT_INFO_KEY] = drafts[: len(seen)] if cumulative else drafts[start : len(seen)]
        if last:
            # SGLang's block capacity (12, padding included) next to the SEER plugin's real counts
            # per verify step (plugin.record_step): the real ones are reported.
            meta.update(spec_verify_ct=3, spec_num_correct_drafts=2, spec_num_proposed_drafts=12)
        out = {"output_ids": [e[1] for e in (seen if cumulative else c)], "meta_info": meta}
        d = stream_delta(out, reported)
        reported = d.total
        tokens += d.token_ids
        logprobs += d.logprobs
        accepted += d.accepted
        proposed += d.proposed
        reason = d.reason
    assert tokens == [11, 12, 13, 14, 2] and logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert reason == FinishReason.STOP and (accepted, proposed) == (2, 4)
    assert stream_delta({"meta_info": {"finish_reason": {"type": "abort"}}}, 5).reason == FinishReason.ABORTED
    assert stream_delta({"output_ids": [1] * 5, "meta_info": {"finish_reason": {"type": "length"},
                                                                "completion_tokens": 5}}, 5).token_ids == []


def test_stream_delta_takes_tokens_from_output_ids_not_from_logprob_entries() -> None:
    """H2: tokens come from output_ids; a token without a logprob entry (SGLang 0.5.4 under
    speculation: none at all) is MissingLogprobs, never a shorter response."""
    entries = [(-1.0, 7, None), (-2.0, 8, None), (-3.0, 9, None)]
    out = {"output_ids": [7, 8, 9], "meta_info": {"completion_tokens": 3, "output_token_logprobs": entries}}
    d = stream_delta(out, 1)
    assert d.token_ids == [8, 9] and d.logprobs == [-2.0, -3.0]
    with pytest.raises(MissingLogprobs, match="output_token_logprobs"):
        stream_delta({"output_ids": [7, 8, 9], "meta_info": {"completion_tokens": 3}}, 0)
    with pytest.raises(MissingLogprobs, match=r"output_token_logprobs\[0\]"):
        stream_delta({"output_ids": [7],
                      "meta_info": {"completion_tokens": 1, "output_token_logprobs": [(-1.0, 6, None)]}}, 0)


def test_seeds_fit_sglangs_int64() -> None:
    """H3: SGLang validates sampling_seed in [-2**63, 2**63 - 1] (sampling_params.py:308) and builds
    an int64 tensor (sampling_batch_info.py:157-171); Seer seeds are uint64."""
    for seed in (0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1):
        s = sampling_dict(SamplingParams(seed=seed), 1)["sampling_seed"]
        assert -(2**63) <= s <= 2**63 - 1 and s == seed % 2**63


def test_server_kwargs(tmp_path: Path) -> None:
    cfg = WorkerConfig(engine="sglang", gamma_max=6, draft_width=1, kv_addresses=("kv-0:1", "kv-1:1"), dtype="bfloat16")
    kw = server_kwargs(cfg, tmp_path, "smollm2", str(tmp_path / "v"))
    assert kw["speculative_algorithm"] == plugin.ALGORITHM and kw["speculative_num_draft_tokens"] == 7
    # What SGLang's _handle_ngram gives "NGRAM" only, and the synchronous scheduling a registered
    # algorithm without overlap support needs (spec_registry.py:134-141).
    assert kw["disable_overlap_schedule"] is True and kw["enable_mixed_chunk"] is False
    assert kw["speculative_eagle_topk"] == 1 and kw["speculative_num_steps"] == 7
    assert "attention_backend" not in kw  # a chain: any backend
    assert kw["hicache_storage_backend"] == "dynamic" and kw["enable_hierarchical_cache"] is True
    extra = json.loads(kw["hicache_storage_backend_extra_config"])
    assert {"backend_name", "module_path", "class_name"} <= set(extra)
    assert extra["kv_addresses"] == ["kv-0:1", "kv-1:1"] and extra["interface_v1"] == 1
    module_file = Path(*extra["module_path"].split(".")).with_suffix(".py")
    assert (Path(__file__).resolve().parents[2] / module_file).exists()
    assert f"class {extra['class_name']}(" in (Path(__file__).resolve().parents[2] / module_file).read_text()
    off = server_kwargs(WorkerConfig(engine="sglang", speculation=False), tmp_path, "m", "v")
    assert "speculative_algorithm" not in off and "hicache_storage_backend" not in off
    assert "disable_overlap_schedule" not in off


def test_a_draft_tree_on_paged_kv_needs_flashinfer(tmp_path: Path) -> None:
    """C1: SGLang verifies a tree (topk > 1) on paged KV (page_size > 1) only with flashinfer and
    refuses otherwise, for "NGRAM" only (speculative_hook.py:1356-1366): SEER, our defaults
    draft_width=2 and page_size=16, skipped that guard and ran on a backend that gets it wrong."""
    tree = WorkerConfig(engine="sglang", gamma_max=6, draft_width=2, page_size=16)
    kw = server_kwargs(tree, tmp_path, "m", "v")
    assert kw["attention_backend"] == "flashinfer" and kw["speculative_eagle_topk"] == 2
    assert kw["speculative_num_steps"] == 7 // 2
    assert server_kwargs(tree, tmp_path, "m", "v", "flashinfer")["attention_backend"] == "flashinfer"
    with pytest.raises(ValueError, match="draft_width"):
        server_kwargs(tree, tmp_path, "m", "v", "triton")
    chain = WorkerConfig(engine="sglang", gamma_max=6, draft_width=1, page_size=16)
    assert server_kwargs(chain, tmp_path, "m", "v", "triton")["attention_backend"] == "triton"
    flat = WorkerConfig(engine="sglang", gamma_max=6, draft_width=2, page_size=1)
    assert "attention_backend" not in server_kwargs(flat, tmp_path, "m", "v")
    # SGLang's own validate hook applies the same rule to the resolved server args.
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="draft_width"):
        plugin._validate_server_args(SimpleNamespace(speculative_eagle_topk=2, page_size=16, attention_backend="fa3"))
    ok = SimpleNamespace(speculative_eagle_topk=2, page_size=16, attention_backend="flashinfer")
    plugin._validate_server_args(ok)


def test_engine_module_imports_without_sglang() -> None:
    code = ("import sys; import services.worker.engines.sglang.engine, services.worker.engines.sglang.plugin; "
            "print('sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (it needs CUDA; not on CI machines)")
def test_sglang_registers_seer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With SGLang importable (a GPU machine): SEER registers and reads as NGRAM. Without it,
    tests/worker/test_sglang_api.py checks the same API in the pinned wheel's source."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from services.worker.engines.sglang.storage import SeerHiCacheStorage

    assert issubclass(SeerHiCacheStorage, HiCacheStorage)
    monkeypatch.setenv(plugin.ENV_SPECULATION, "1")
    algo = plugin.register()
    assert algo.is_ngram() and SpeculativeAlgorithm.from_string("SEER") is algo
    assert plugin.register() is algo


def test_kv_pool_pages_from_the_scheduler_info_or_a_fallback_the_scheduler_accepts() -> None:
    """A worker registering 0 KV pages is refused by the scheduler (capacity.total_kv_pages), so
    the SGLang engine must report its pool (review finding: it reported 0)."""
    from types import SimpleNamespace

    from services.worker.engines.sglang.engine import kv_pool_pages

    assert kv_pool_pages(SimpleNamespace(scheduler_info={"max_total_num_tokens": 160_000}), 16, 4096, 8) == 10_000
    later = SimpleNamespace(_scheduler_init_result=SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 3200}]))
    assert kv_pool_pages(later, 32, 4096, 8) == 100
    assert kv_pool_pages(SimpleNamespace(), 16, 4096, 8) == 4096 * 8 // 16  # unknown: every slot at full context


def test_seer_refuses_tensor_parallelism_and_guards_the_tree_after_setting_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """L (review): each TP rank would draft from its own mirror (drafts could differ between
    ranks): refused. SGLang runs validate_server_args before handle_server_args, so the tree guard
    is applied again on the width handle_server_args sets (a hand-launched SEER had none yet)."""
    import types
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="tp_size"):
        plugin._validate_server_args(SimpleNamespace(tp_size=2, speculative_eagle_topk=1, page_size=1))
    plugin._validate_server_args(SimpleNamespace(tp_size=1, speculative_eagle_topk=1, page_size=1))

    class CustomSpecAlgo:  # stand-in base: SeerSpecAlgo's own methods are under test
        pass

    spec_info = types.ModuleType("sglang.srt.speculative.spec_info")
    spec_info.CustomSpecAlgo = CustomSpecAlgo  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_info", spec_info)
    monkeypatch.setenv(plugin.ENV_DRAFT_WIDTH, "2")
    algo = plugin._spec_class()()
    # The validator saw topk unset (1) and let it pass; the hook sets topk 2 on paged KV.
    plugin._validate_server_args(SimpleNamespace(speculative_eagle_topk=None, page_size=16, attention_backend="fa3"))
    with pytest.raises(ValueError, match="draft_width"):
        algo.handle_server_args(SimpleNamespace(speculative_num_draft_tokens=5, page_size=16, attention_backend="fa3"))
    unset = SimpleNamespace(speculative_num_draft_tokens=5, page_size=16, attention_backend=None)
    algo.handle_server_args(unset)
    assert unset.speculative_eagle_topk == 2 and unset.attention_backend == "flashinfer"
    assert not algo.carries_draft_hidden_states() and not algo.need_topk()


def test_accepted_drafts_walks_real_nodes_only() -> None:
    """Review (b1346aa): a padding node (token 0 under the root) matched by the model's sample is
    no accepted draft; a real node with the same token is (the draft's own match)."""
    from services.worker.engines.sglang.drafts import accepted_drafts, to_block

    block = to_block(Draft((5, 6, 7), (-1, 0, -1)), 9, 6)  # 5 -> 6 and 7 under the root; 2 padding
    assert block.real == 3 and block.tokens == [9, 5, 7, 6, 0, 0]
    assert accepted_drafts(block, [0]) == 0  # a padding match
    assert accepted_drafts(block, [5, 6]) == 2 and accepted_drafts(block, [7]) == 1
    assert accepted_drafts(block, [5, 0]) == 1  # padding hangs off the root only
    assert accepted_drafts(to_block(Draft((0,), (-1,)), 9, 4), [0]) == 1
    assert accepted_drafts(to_block(None, 9, 4), [0]) == 0
