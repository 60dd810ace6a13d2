"""Losslessness of a re-dispatched chunk, statistically (review finding, /tmp/review/verif_exact.py).

The reference engine's randomness at an output position depends only on (seed, position). A failed
attempt streamed its sample d into the draft index; the re-dispatched chunk (same seed, same
position) must not get d as its draft: verifying d with the very random numbers that produced it
biases the output (the reviewer measured 0.224/0.554/0.221 for a uniform 1/3 target). Here the real
GroupIndex (with the worker's resume, `replace_from(request, 0, committed)`) supplies the draft and
the real reference Verifier decides; a chi-square test checks the output distribution, and the same
test on the unfixed path (no resume) must detect the bias, so it has power.
"""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from services.draft.index import GroupIndex  # noqa: E402
from services.worker.engines.reference.model_runner import DraftTree  # noqa: E402
from services.worker.engines.reference.sampler import sample_rows, uniform  # noqa: E402
from services.worker.engines.reference.verifier import Verifier  # noqa: E402

PROMPT = [100, 101, 102]
N = 3000


def _rerun_first_tokens(resume: bool) -> list[int]:
    p = torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    probs = torch.stack([p, p])  # [1 + draft nodes, V] target rows
    ver = Verifier()
    out = []
    for seed in range(N):
        idx = GroupIndex(PROMPT)
        # Attempt 1 samples output position 0 and streams it into the index, then dies.
        d = sample_rows(p[None], [uniform(seed, 0, 0)])[0]
        idx.append("r", 0, [d])
        if resume:
            idx.replace_from("r", 0, [])  # what the worker core does when the chunk starts again
        prop = idx.propose(PROMPT, 1, request_id="r")
        tree = DraftTree.build(list(prop.tokens), list(prop.parents))
        toks, _path, _rows = ver.verify_sampling(tree, probs[: 1 + len(prop.tokens)], seed, 0)
        out.append(toks[0])
    return out


def _uniform_p(tokens: list[int]) -> float:
    c = Counter(tokens)
    return float(scipy_stats.chisquare([c[i] for i in range(3)], [N / 3] * 3).pvalue)


def test_resumed_chunk_samples_the_target_distribution() -> None:
    assert _uniform_p(_rerun_first_tokens(resume=True)) > 1e-3


def test_without_resume_the_bias_is_detected() -> None:
    assert _uniform_p(_rerun_first_tokens(resume=False)) < 1e-6
