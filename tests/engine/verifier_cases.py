"""Model-free harness for statistical tests of the speculative-sampling verifier.

A synthetic "model" maps a token prefix to a target distribution (a row), so draft trees can be
built whose rows are consistent (two nodes with the same path have the same row, as with a real
model) and differ by path (the row after token a is not the row after token b), which is what makes
path-dependent mistakes visible. A trial runs Verifier.verify_sampling once and, when it emitted
fewer than K tokens, continues with plain sampling (stream 0 at the following positions, exactly as
the engine's next step without drafts would); a lossless verifier makes the first K tokens follow
the model's joint distribution prod_i row(t_<i)[t_i] exactly (DESIGN.md section 4).

Mutants: one Verifier subclass per known mistake; each must fail the test that the real verifier
passes: the distribution test, or (for a mistake that keeps every token's distribution) the
exactness test against plain seeded sampling.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.stats import chisquare

from services.worker.engine import SamplingParams
from services.worker.engines.reference.model_runner import DraftTree
from services.worker.engines.reference.sampler import sample_rows, target_probs, uniform
from services.worker.engines.reference.verifier import Verifier

POSITION = 11  # output index of the first emitted token (any value works; fixed for reproducibility)
MIN_EXPECTED = 5.0  # chi-square cells expected fewer times than this are pooled into one cell


class SyntheticModel:
    """prefix -> row [V] float32. Rows are target_probs() of seeded random logits (so top-k/top-p
    truncation is the real one), unless a row is fixed explicitly for a prefix."""

    def __init__(self, vocab: int, params: SamplingParams, seed: int = 0, scale: float = 1.5,
                 fixed: dict[tuple[int, ...], dict[int, float]] | None = None) -> None:
        self.vocab = vocab
        self.params = params
        self.seed = seed
        self.scale = scale
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._cdf: dict[tuple[int, ...], list[float]] = {}
        for prefix, masses in (fixed or {}).items():
            row = torch.zeros(vocab, dtype=torch.float64)
            for tok, m in masses.items():
                row[tok] = m
            self._cache[prefix] = (row / row.sum()).to(torch.float32)

    def row(self, prefix: tuple[int, ...]) -> torch.Tensor:
        got = self._cache.get(prefix)
        if got is None:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            logits = torch.from_numpy(rng.normal(0.0, self.scale, self.vocab).astype(np.float32))
            got = target_probs(logits[None], [self.params])[0]
            self._cache[prefix] = got
        return got

    def sample(self, prefix: tuple[int, ...], u: float) -> int:
        """Inverse-CDF draw from row(prefix) in plain Python (sample_rows' torch overhead would
        dominate the trials; any exact sampler will do for the continuation)."""
        cdf = self._cdf.get(prefix)
        if cdf is None:
            cdf = list(itertools.accumulate(self.row(prefix).double().tolist()))
            self._cdf[prefix] = cdf
        tok = bisect.bisect_right(cdf, u * cdf[-1])
        while tok >= len(cdf) or cdf[tok] <= (cdf[tok - 1] if tok else 0.0):  # never a p = 0 token
            tok -= 1
        return tok

    def joint(self, k: int) -> dict[tuple[int, ...], float]:
        """Exact probability of every k-token sequence with non-zero probability."""
        out: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(k):
            nxt: dict[tuple[int, ...], float] = {}
            for seq, pr in out.items():
                row = self.row(seq).double()
                for tok in torch.nonzero(row > 0)[:, 0].tolist():
                    nxt[(*seq, tok)] = pr * float(row[tok])
            out = nxt
        return out


@dataclass(frozen=True)
class Spec:
    """A draft node spec: a literal token, or the token of the given rank (0 = most likely) in the
    parent's row, so drafts carry real mass whatever the random rows are."""

    tok: int | None = None
    rank: int | None = None
    kids: tuple[Spec, ...] = ()


def T(tok: int, *kids: Spec) -> Spec:
    return Spec(tok=tok, kids=kids)


def R(rank: int, *kids: Spec) -> Spec:
    return Spec(rank=rank, kids=kids)


@dataclass
class Case:
    model: SyntheticModel
    tree: DraftTree
    probs: torch.Tensor  # [1 + n, V]: row 0 = model.row(()), row 1 + m = row after node m's path
    paths: list[tuple[int, ...]] = field(default_factory=list)  # token path of each node


def build_case(model: SyntheticModel, roots: list[Spec]) -> Case:
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[tuple[int, ...]] = []

    def add(spec: Spec, parent: int, prefix: tuple[int, ...]) -> None:
        if spec.tok is not None:
            tok = spec.tok
        else:
            assert spec.rank is not None
            tok = int(torch.argsort(model.row(prefix), descending=True, stable=True)[spec.rank])
        m = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        paths.append((*prefix, tok))
        for kid in spec.kids:
            add(kid, m, paths[m])

    for spec in roots:
        add(spec, -1, ())
    tree = DraftTree.build(tokens, parents)
    probs = torch.stack([model.row(())] + [model.row(p) for p in paths])
    return Case(model, tree, probs, paths)


@dataclass
class Trials:
    seqs: Counter[tuple[int, ...]]  # first K tokens of every trial
    accepted_depth: Counter[int]  # number of accepted draft nodes per trial
    zero_prob: int  # verifier-emitted tokens whose row gives them probability 0


def run_trials(verifier: Verifier, case: Case, seeds: range, k: int) -> Trials:
    seqs: Counter[tuple[int, ...]] = Counter()
    depth: Counter[int] = Counter()
    zero = 0
    rows = case.probs.tolist()
    for s in seeds:
        toks, path, used = verifier.verify_sampling(case.tree, case.probs, s, POSITION)
        zero += sum(1 for t, r in zip(toks, used, strict=True) if rows[r][t] <= 0.0)
        depth[len(path)] += 1
        out = toks[:k]
        while len(out) < k:  # the next steps, without drafts
            out.append(case.model.sample(tuple(out), uniform(s, POSITION + len(out), 0)))
        seqs[tuple(out)] += 1
    return Trials(seqs, depth, zero)


def gof_p(observed: Counter[tuple[int, ...]], expected_p: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit of observed sequences to exact probabilities; cells expected fewer
    than MIN_EXPECTED times are pooled. An impossible sequence observed gives p = 0."""
    n = sum(observed.values())
    if any(expected_p.get(seq, 0.0) <= 0.0 for seq in observed):
        return 0.0
    obs: list[float] = []
    exp: list[float] = []
    pool_o, pool_e = 0.0, 0.0
    for seq, pr in expected_p.items():
        if pr * n >= MIN_EXPECTED:
            obs.append(observed.get(seq, 0))
            exp.append(pr * n)
        else:
            pool_o += observed.get(seq, 0)
            pool_e += pr * n
    if pool_e > 0.0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp_arr = np.asarray(exp) * (n / sum(exp))  # float rounding: sums must match exactly for scipy
    return float(chisquare(np.asarray(obs), exp_arr).pvalue)


def marginal(seqs: Counter[tuple[int, ...]], k: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for seq, c in seqs.items():
        out[seq[:k]] += c
    return out


def lossless_p(trials: Trials, model: SyntheticModel, k: int) -> float:
    """THE test: Bonferroni-combined p-value of the goodness of fit of the first 1..k tokens."""
    ps = [gof_p(marginal(trials.seqs, j), model.joint(j)) for j in range(1, k + 1)]
    return min(1.0, k * min(ps))


# ---- mutants: one per known mistake ------------------------------------------------------------


def plain_tokens(case: Case, seed: int, n: int) -> list[int]:
    """What plain seeded sampling emits for the first n positions (the engine's undrafted steps:
    sample_rows at (seed, position, stream 0)); the verifier must emit exactly these."""
    out: list[int] = []
    for _ in range(n):
        row = case.model.row(tuple(out))
        out.append(sample_rows(row[None], [uniform(seed, POSITION + len(out), 0)])[0])
    return out


class AlwaysAcceptFirst(Verifier):
    """Mistake 1: accepts the first child at every node."""

    def accept(self, tree: DraftTree, kids: list[int], tok: int, p: torch.Tensor, seed: int, pos: int
               ) -> tuple[int, int | None]:
        return (tree.tokens[kids[0]], kids[0]) if kids else (tok, None)


class AcceptTestThenPlainDraw(Verifier):
    """Mistake 2: the classic rejection rule done halfway: the first child is accepted with
    probability p(token) (its own uniform, stream 1), and after a rejection the token is drawn from
    p itself, rejected token included: that token comes out with p + (1 - p) p."""

    def accept(self, tree: DraftTree, kids: list[int], tok: int, p: torch.Tensor, seed: int, pos: int
               ) -> tuple[int, int | None]:
        if kids and uniform(seed, pos, 1) < float(p[tree.tokens[kids[0]]]):
            return tree.tokens[kids[0]], kids[0]
        return tok, None  # tok: the plain draw from p


class BonusFromParent(Verifier):
    """Mistake 3: after the last accepted node (a leaf) the bonus token is drawn from the parent's row
    instead of the leaf's own. Needs K >= 2 and an accepted leaf whose row differs from its parent's."""

    def verify_sampling(self, tree: DraftTree, probs: torch.Tensor, seed: int, position: int,
                        drawn: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
        tokens, path, rows = super().verify_sampling(tree, probs, seed, position, drawn)
        if not path or tree.children[path[-1]]:
            return tokens, path, rows
        parent = tree.parents[path[-1]]
        prow = 0 if parent < 0 else 1 + parent
        tokens[-1] = sample_rows(probs[prow][None], [uniform(seed, position + len(path), 0)])[0]
        rows[-1] = prow
        return tokens, path, rows


class PositionNotAdvanced(Verifier):
    """Mistake 4: the output position is not advanced after an accepted node, so every depth reuses
    the uniform of the first position: the tokens of consecutive positions are correlated (and no
    longer those of plain sampling). Needs depth >= 2."""

    def row_position(self, tree: DraftTree, row: int, position: int) -> int:
        return position


class OtherStream(Verifier):
    """Mistake 5: the verifier draws with another stream than plain sampling (stream 1). Every token
    still follows p, so no distribution test sees it; but a seeded request then gives other tokens
    with drafts than without, and a chunked run other tokens than an uninterrupted one (the
    exactness test catches it)."""

    def uniform(self, seed: int, pos: int) -> float:
        return uniform(seed, pos, 1)


MUTANTS: dict[str, type[Verifier]] = {
    "1-always-accept-first": AlwaysAcceptFirst,
    "2-accept-test-then-plain-draw": AcceptTestThenPlainDraw,
    "3-bonus-from-parent": BonusFromParent,
    "4-position-not-advanced": PositionNotAdvanced,
    "5-other-stream": OtherStream,
}
