"""The `seer rollout` summary and prompt-file parsing (pure functions; no suite)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.cli.rollout import build_groups, load_prompts, percentile, summarize


@dataclass
class R:
    token_ids: list[int]
    latency_seconds: float
    finish_reason: str = "stop"
    policy_version: int = 3
    num_chunks: int = 1
    stats: dict[str, float] = field(default_factory=dict)


def test_summary_tail_latency_and_accepted_length() -> None:
    # 10 responses finishing at 1..9 s and one straggler at 30 s: the last 10% (1 response) is the tail.
    results = [R([1] * 10, float(t), stats={"steps": 5, "draft_tokens": 8, "accepted_tokens": 5}) for t in range(1, 10)]
    results.append(R([1] * 40, 30.0, finish_reason="length", stats={"steps": 40}))
    s = summarize(results, wall_seconds=30.5)
    assert s["responses"] == 10 and s["tokens"] == 130
    assert s["tail_seconds"] == pytest.approx(30.0 - 9.0)
    assert s["tail_fraction"] == pytest.approx(21.0 / 30.0, abs=1e-3)
    assert s["latency_p50_seconds"] == 5.0 and s["latency_p99_seconds"] == 30.0
    assert s["mean_accepted_length"] == pytest.approx(130 / (9 * 5 + 40), abs=1e-3)
    assert s["draft_acceptance_rate"] == pytest.approx(45 / 72, abs=1e-3)
    assert s["finish_reasons"] == {"stop": 9, "length": 1}
    assert s["policy_versions"] == [3]
    assert s["tokens_per_second"] == pytest.approx(130 / 30.5, abs=0.01)


def test_percentile_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    assert percentile([], 50) == 0.0


def test_prompt_file_formats(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a?", "prompt_key": "k1", "answer": "4"}\n'
                 '\n# comment\n'
                 '{"prompt_token_ids": [5, 6], "id": "x"}\n'
                 'plain text prompt\n', encoding="utf-8")
    ps = load_prompts(f)
    assert [p["prompt"] for p in ps] == ["a?", [5, 6], "plain text prompt"]
    assert ps[0]["prompt_key"] == "k1" and ps[0]["labels"] == {"answer": "4"}
    assert ps[1]["prompt_key"] == "x"
    assert len(ps[2]["prompt_key"]) == 16  # a stable hash of the prompt
    groups = build_groups(ps, 3, 7, temperature=0.5, seed=10, chat=True)
    assert [g.group_size for g in groups] == [3, 3, 3] and groups[2].sampling.seed == 12
    assert isinstance(groups[0].prompt, str) and groups[0].prompt.startswith("<|im_start|>user\na?")
    assert list(groups[1].prompt) == [5, 6]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_prompts(bad)
