"""Lossless end to end: rollouts through the public API (seer_client -> the whole suite) with
speculation on and off have the same token distribution (temperature 1.0, and 0.7 with top-p 0.9).

Per response position, a chi-square test of homogeneity between the two arms (rare tokens pooled);
Bonferroni over positions. Negative control: the same test must tell apart two arms whose
distributions really differ (temperature 1.0 vs 0.7), so a passing equality test is not a test
without power. Slow (two suites, four batches): run with `pytest -m slow tests/draft`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

scipy_stats = pytest.importorskip("scipy.stats")

PROMPT = "List the colors of the rainbow, separated by commas."
GROUPS, GROUP_SIZE, MAX_TOKENS = 6, 16, 8
CASES = {"t1.0": (1.0, 1.0), "t0.7_p0.9": (0.7, 0.9)}


def _run_arm(model_dir: Path, tmp: Path, speculation: bool, seed: int) -> dict[str, list[list[int]]]:
    from seer_client import PromptGroup, Sampling, SeerClient

    from services.cli.up import Suite
    from services.worker.adaptive import StepTimeTable

    # A step-time table where drafts cost nothing, so the adaptive planner always drafts gamma_max:
    # the test must exercise the verifier on every step it can, not only when speculation pays.
    tmp.mkdir(parents=True, exist_ok=True)
    table = tmp / "free_drafts.json"
    StepTimeTable((1, 256), (0, 8), ((0.1, 0.1), (0.1, 0.1)), source="test").save(table)
    out: dict[str, list[list[int]]] = {}
    with Suite(workers=1, data_dir=tmp, base_port=0, speculation=speculation, model_dir=model_dir,
               metrics=False, extra_args={"worker-0": ["--spec-table", str(table)]}) as suite:
        client = SeerClient(suite.address)
        try:
            drafted = 0
            for name, (temp, top_p) in CASES.items():
                groups = [PromptGroup(PROMPT, GROUP_SIZE, MAX_TOKENS, prompt_key=f"{name}-{g}",
                                      sampling=Sampling(temperature=temp, top_p=top_p, seed=seed * 1000 + g,
                                                        ignore_eos=True))
                          for g in range(GROUPS)]
                results = client.run_batch(f"lossless-{name}-{int(speculation)}", groups)
                out[name] = [r.token_ids for r in results]
                drafted += sum(int(r.stats.get("accepted_tokens", 0)) for r in results)
            if speculation:
                assert drafted > 0, "speculation was on but no draft token was accepted: the test tests nothing"
        finally:
            client.close()
    return out


def _homogeneity_p(a: list[list[int]], b: list[list[int]]) -> float:
    """Bonferroni-adjusted min p-value over positions 1.. of a chi-square homogeneity test."""
    ps = []
    for pos in range(1, MAX_TOKENS):
        ca = Counter(r[pos] for r in a if len(r) > pos)
        cb = Counter(r[pos] for r in b if len(r) > pos)
        tokens = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
        big = [t for t in tokens if ca[t] + cb[t] >= 10]
        rows = [[ca[t] for t in big], [cb[t] for t in big]]
        rest_a = sum(ca.values()) - sum(rows[0])
        rest_b = sum(cb.values()) - sum(rows[1])
        if rest_a + rest_b:
            rows[0].append(rest_a)
            rows[1].append(rest_b)
        if len(rows[0]) < 2:
            continue  # one outcome only: nothing to compare
        ps.append(float(scipy_stats.chi2_contingency(rows)[1]))
    return min(1.0, min(ps) * len(ps)) if ps else 1.0


def test_speculation_is_lossless_through_the_public_api(model_dir: Path, tmp_path: Path) -> None:
    on = _run_arm(model_dir, tmp_path / "on", speculation=True, seed=1)
    off = _run_arm(model_dir, tmp_path / "off", speculation=False, seed=2)
    for name in CASES:
        assert len(on[name]) == len(off[name]) == GROUPS * GROUP_SIZE
        p = _homogeneity_p(on[name], off[name])
        assert p > 0.001, f"{name}: speculation changed the distribution (p={p:.2g})"
    # Negative control: a real difference in distribution is detected by the same test.
    p_ctrl = _homogeneity_p(on["t1.0"], off["t0.7_p0.9"])
    assert p_ctrl < 0.01, f"negative control not detected (p={p_ctrl:.2g}): the test has no power"
