"""Losslessness of a re-dispatched chunk, statistically (review finding, /tmp/review/verif_exact.py).

The reference engine's randomness at an output position depends only on (seed, position). A failed
attempt streamed its sample d into the draft index; the re-dispatched chunk (same seed, same
position) may get d as its draft. Under the multi-draft residual rule the engine used until session
13 (accept tests with other streams of the same (seed, position), residual drawn with stream 0),
verifying d with the very numbers that produced it biased the output (the reviewer measured
0.224/0.554/0.221 for a uniform 1/3 target), which the worker's resume (the request's copy cut back
to its committed output) prevented. The verifier now draws every position exactly as plain sampling
does, so no draft, this one included, can change the output. Here the real GroupIndex supplies the
draft and the real Verifier decides; a chi-square test checks the output distribution with and
without resume, and the old rule without resume (a mutant kept in this file) must be detected.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from services.draft.index import GroupIndex  # noqa: E402
from services.worker.engines.reference.model_runner import DraftTree  # noqa: E402
from services.worker.engines.reference.sampler import sample_rows, uniform  # noqa: E402
from services.worker.engines.reference.verifier import Verifier  # noqa: E402

PROMPT = [100, 101, 102]
N = 3000


def inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The sampler before session 28: the token where p's CDF (in id order) first exceeds u."""
    cdf = p.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)
               .clamp(max=len(p) - 1)[0])


class ResidualRule(Verifier):
    """The rule before session 13 (the mutant): sibling j is accepted with p_res(d_j) tested on the
    uniform (seed, position, 1 + j); if every sibling is rejected, the token is drawn from the
    residual with (seed, position, 0), the number plain sampling uses, by inverse CDF: the sampler
    of that time. The bias comes from that pairing (the residual draw reuses the quantile that drew
    the failed attempt's token). Under the Gumbel-max sampler the bias depends on V: for V <= 256
    (one block, as here) the second best of a Gumbel-max is a draw without replacement and the rule
    keeps the distribution, changing only seeded tokens (tests/engine/test_verifier_stats.py's
    exactness test catches that); for V > 256 the block race is rerun and it is biased again (a
    review: V 512, p {0.5, 0.25, 0.25} across two blocks gave token 0 at 0.375). So the control
    pins the sampler it was written against."""

    def accept(self, tree: DraftTree, kids: list[int], tok: int, p: torch.Tensor, seed: int, pos: int
               ) -> tuple[int, int | None]:
        removed = 0.0
        rejected: list[int] = []
        for j, c in enumerate(kids):
            tok = tree.tokens[c]
            if tok in rejected:
                continue
            pk = float(p[tok])
            if uniform(seed, pos, 1 + j) < (pk / (1.0 - removed) if removed < 1.0 else 0.0):
                return tok, c
            removed += pk
            rejected.append(tok)
        q = p.clone()
        if rejected:
            q[rejected] = 0.0
        return inverse_cdf(q, uniform(seed, pos, 0)), None


def _rerun_first_tokens(resume: bool, ver: Verifier | None = None, old_sampler: bool = False) -> list[int]:
    p = torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    probs = torch.stack([p, p])  # [1 + draft nodes, V] target rows
    ver = ver or Verifier()
    out = []
    for seed in range(N):
        idx = GroupIndex(PROMPT)
        # Attempt 1 samples output position 0 and streams it into the index, then dies.
        u = uniform(seed, 0, 0)
        d = inverse_cdf(p, u) if old_sampler else sample_rows(p[None], [u])[0]
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


def test_a_failed_attempts_draft_cannot_bias_the_output() -> None:
    got = _rerun_first_tokens(resume=False)
    p = torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    assert got == [sample_rows(p[None], [uniform(seed, 0, 0)])[0] for seed in range(N)]  # plain sampling's
    assert _uniform_p(got) > 1e-3


def test_the_old_rule_without_resume_is_detected() -> None:
    # The failure the old rule had with the sampler of its time (the negative control of the
    # distribution test above).
    assert _uniform_p(_rerun_first_tokens(resume=False, ver=ResidualRule(), old_sampler=True)) < 1e-6
