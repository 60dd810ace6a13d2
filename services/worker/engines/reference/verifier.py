"""Lossless verification of draft trees (DESIGN.md section 4; multi-draft speculative sampling).

Rows: row 0 holds the target distribution at the root (after the last verified token), row 1 + m
the distribution after draft node m. Both walks start at the root and return the emitted tokens
(accepted draft tokens, then one token from the target: the correction or the bonus token).

Greedy: at each node the target token is the argmax; descend into the child carrying it, otherwise
emit the argmax and stop. Output equals plain greedy decoding exactly.

Sampling: at every node the token of this position is drawn exactly as plain sampling draws it, by
inverse CDF of the target p at the counter-based uniform (seed, position, stream 0) (sampler.py);
descend into the child carrying it, otherwise emit it and stop. The output therefore IS plain seeded
sampling, token for token, whatever was drafted: speculation changes speed, never the tokens. A
draft token is accepted exactly when the sample equals it, with probability p(token), and a node's
siblings together with probability sum of p over their distinct tokens: the acceptance of the
multi-draft residual rule (SpecInfer; point-mass drafts), which this replaced in session 13. That
rule drew the accept tests from other random numbers, so a seeded request gave other tokens with
speculation than without, and a request cut into chunks other tokens than uninterrupted (review
finding); with this rule drafts made from any source (even a failed attempt's tokens, sampled with
these very numbers) cannot bias the output.
"""

from __future__ import annotations

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
        self, tree: DraftTree, probs: torch.Tensor, seed: int, position: int
    ) -> tuple[list[int], list[int], list[int]]:
        """probs [1 + n, V] target rows; position = output index of the first emitted token."""
        tokens: list[int] = []
        path: list[int] = []
        rows: list[int] = []
        node, kids = -1, tree.root_children
        pos = position
        while True:
            row = 0 if node < 0 else 1 + node
            tok, child = self.draw(tree, kids, probs[row], seed, pos)
            tokens.append(tok)
            rows.append(row)
            if child is None:
                return tokens, path, rows
            path.append(child)
            node, kids = child, tree.children[child]
            pos += 1

    def draw(self, tree: DraftTree, kids: list[int], p: torch.Tensor, seed: int, pos: int) -> tuple[int, int | None]:
        """(the token at output position `pos`, drawn as plain sampling draws it; the child carrying
        that token, None when no child does). p [V]."""
        tok = sample_rows(p[None], [uniform(seed, pos, 0)])[0]
        return tok, next((c for c in kids if tree.tokens[c] == tok), None)
