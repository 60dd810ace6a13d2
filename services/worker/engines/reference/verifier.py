"""Lossless verification of draft trees (DESIGN.md section 4; multi-draft speculative sampling).

Rows: row 0 holds the target distribution at the root (after the last verified token), row 1 + m
the distribution after draft node m. Both walks start at the root and return the emitted tokens
(accepted draft tokens, then one token from the target: the correction or the bonus token).

Greedy: at each node the target token is the argmax; descend into the child carrying it, otherwise
emit the argmax and stop. Output equals plain greedy decoding exactly.

Sampling: at every node the token of this position is drawn exactly as plain sampling draws it, by
Gumbel-max over the target p keyed by the counter-based number (seed, position, stream 0) (sampler.py);
descend into the child carrying it, otherwise emit it and stop. The output therefore IS plain seeded
sampling, token for token, whatever was drafted (given the same logits: sampler.py says when last-bit
differences between batch shapes move a draw): speculation changes speed, never the tokens. A
draft token is accepted exactly when the sample equals it, with probability p(token), and a node's
siblings together with probability sum of p over their distinct tokens: the acceptance of the
multi-draft residual rule (SpecInfer; point-mass drafts), which this replaced in session 13. That
rule drew the accept tests from other random numbers, so a seeded request gave other tokens with
speculation than without, and a request cut into chunks other tokens than uninterrupted (review
finding); with this rule drafts made from any source (even a failed attempt's tokens, sampled with
these very numbers) cannot bias the output.

Logprobs are not the verifier's business: the walks return the row each emitted token was chosen
at, and the engine reads its logprob from that row's logits, log_softmax(logits / T)[token] over the
full vocabulary (sampler.token_logprobs), as plain decoding does: an accepted draft token, the
correction and the bonus token get exactly the logprob they get without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.engines.reference.model_runner import DraftTree
from services.worker.engines.reference.sampler import sample_rows, uniform


class Verifier:
    def verify_greedy(self, tree: DraftTree, argmax: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(tokens, accepted node path, row of each token)."""
        tokens: list[int] = []
        path: list[int] = []
        rows: list[int] = []
        node, kids = -1, tree.root_children
        while True:
            row = 0 if node < 0 else 1 + node
            target = argmax[row]
            tokens.append(target)
            rows.append(row)
            nxt = next((c for c in kids if tree.tokens[c] == target), None)
            if nxt is None:
                return tokens, path, rows
            path.append(nxt)
            node, kids = nxt, tree.children[nxt]

    def verify_sampling(
        self, tree: DraftTree, probs: torch.Tensor, seed: int, position: int, drawn: Sequence[int] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """probs [1 + n, V] target rows; position = output index of the first emitted token.
        drawn: the plain-sampling token of every row, when the caller has drawn them already (the
        engine on a GPU draws every tree's rows in one batched call, row_uniforms below); None: drawn
        here, lazily."""
        draws = drawn if drawn is not None else self._RowDraws(self, tree, probs, seed, position)
        tokens: list[int] = []
        path: list[int] = []
        rows: list[int] = []
        node, kids = -1, tree.root_children
        while True:
            row = 0 if node < 0 else 1 + node
            tok, child = self.accept(tree, kids, draws[row], probs[row], seed, self.row_position(tree, row, position))
            tokens.append(tok)
            rows.append(row)
            if child is None:
                return tokens, path, rows
            path.append(child)
            node, kids = child, tree.children[child]

    def row_uniforms(self, tree: DraftTree, seed: int, position: int) -> list[float]:
        """The uniforms of a tree's rows 0..n, in row order: what `drawn` must be drawn with."""
        return [self.uniform(seed, self.row_position(tree, r, position)) for r in range(1 + len(tree))]

    class _RowDraws:
        """The plain-sampling token of each row, drawn on first use: row 0 alone (most steps stop
        at the root), then every other row in one sample_rows call (a draw costs ~0.1 ms of torch
        overhead whatever its rows; one per node made an 8-token accepted chain 3.6x slower)."""

        def __init__(self, ver: Verifier, tree: DraftTree, probs: torch.Tensor, seed: int, position: int) -> None:
            self.ver, self.probs = ver, probs
            self.us = ver.row_uniforms(tree, seed, position)
            self.got: list[int] = []

        def __getitem__(self, row: int) -> int:
            if not self.got:
                self.got = [self.ver.draw_rows(self.probs[:1], self.us[:1])[0]]
            if row >= len(self.got):
                self.got += self.ver.draw_rows(self.probs[1:], self.us[1:])
            return self.got[row]

    # The rule's parts (tests/engine/verifier_cases.py overrides them to build its mutants).

    def row_position(self, tree: DraftTree, row: int, position: int) -> int:
        """Output position of the token drawn from `row`: row 0 follows the last verified token,
        row 1 + m follows draft node m (depth 1 for the root's children)."""
        return position if row == 0 else position + tree.depth[row - 1]

    def uniform(self, seed: int, pos: int) -> float:
        """Plain sampling's number for output position `pos` (stream 0)."""
        return uniform(seed, pos, 0)

    def draw_rows(self, probs: torch.Tensor, us: list[float]) -> list[int]:
        """Draws, one per row, exactly as plain sampling draws (sampler.sample_rows). [N, V] -> N."""
        return sample_rows(probs, us)

    def accept(self, tree: DraftTree, kids: list[int], tok: int, p: torch.Tensor, seed: int, pos: int
               ) -> tuple[int, int | None]:
        """(the token emitted at this node, the child accepted): the drawn token, and the child
        carrying it (None when no child does: emit it and stop)."""
        return tok, next((c for c in kids if tree.tokens[c] == tok), None)
