"""Lossless verification of draft trees (DESIGN.md section 4; multi-draft speculative sampling).

Rows: row 0 holds the target distribution at the root (after the last verified token), row 1 + m
the distribution after draft node m. Both walks start at the root and return the emitted tokens
(accepted draft tokens, then one token from the target: the correction or the bonus token).

Greedy: at each node the target token is the argmax; descend into the child carrying it, otherwise
emit the argmax and stop. Output equals plain greedy decoding exactly.

Sampling (point-mass drafts, SpecInfer / multi-draft speculative sampling): at a node with target p,
try the children in order; child c is accepted with probability p_res(c) where p_res is p with every
rejected sibling's token zeroed and renormalized (min(1, p/q) with q a point mass on c). If all
children are rejected, the token is drawn from the final residual; after the last accepted node
the bonus token is drawn from p. By induction over siblings the emitted token at every position is
distributed exactly as p, so speculation changes speed, never the distribution.
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
            accepted = self.try_children(tree, kids, probs[row], seed, pos)
            rows.append(row)
            if isinstance(accepted, int) and accepted >= 0:
                tokens.append(tree.tokens[accepted])
                path.append(accepted)
                node, kids = accepted, tree.children[accepted]
                pos += 1
                continue
            rejected = accepted if isinstance(accepted, list) else []
            p = probs[row]
            if rejected:
                p = p.clone()
                p[rejected] = 0.0
                if float(p.sum()) <= 0.0:  # only reachable through float rounding
                    p = probs[row]
            tokens.append(sample_rows(p[None], [uniform(seed, pos, 0)])[0])
            return tokens, path, rows

    def try_children(self, tree: DraftTree, kids: list[int], p: torch.Tensor, seed: int, pos: int) -> int | list[int]:
        """The accepted child, or the list of rejected tokens when none is accepted."""
        if not kids:
            return []
        pk = p[[tree.tokens[c] for c in kids]].tolist()
        removed = 0.0
        rejected: list[int] = []
        for j, c in enumerate(kids):
            tok = tree.tokens[c]
            if tok in rejected:
                continue  # its residual probability is already 0
            denom = 1.0 - removed
            accept_p = pk[j] / denom if denom > 0.0 else 0.0
            if uniform(seed, pos, 1 + j) < accept_p:
                return c
            removed += pk[j]
            rejected.append(tok)
        return rejected
