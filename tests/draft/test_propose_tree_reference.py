"""GroupIndex.propose(width > 1) and drafts from a group with a prompt and cut responses, against a
from-scratch reference (test_propose_reference covers linear drafts of prompt-less groups only).

The reference keeps the raw sequences as the index lays them out (each response and history
response behind the prompt's last max(levels) - 1 tokens, so a response's first tokens match after
the prompt) and the occurrences of each level's k-grams in the order they were indexed, cut with
the responses. A tree is checked node by node: every node's path is a path of the reference with
its parent's, and the probabilities taken are the `cap * width` largest of the reference's
candidate nodes (each node's `width` most frequent children, ties to the smaller token, none below
min_prob), so the score matches too, whichever way equal probabilities were ordered.
"""

from __future__ import annotations

import math
import random

import pytest

from services.draft.index import HISTORY_WEIGHT, MAX_CANDIDATES, OWN_WEIGHT, GroupIndex


class _Reference:
    def __init__(self, prompt: list[int], levels: tuple[int, ...], max_spec_factor: float = 4.0) -> None:
        self.levels = levels
        self.factor = max_spec_factor
        self.lead = prompt[-(max(levels) - 1):] if max(levels) > 1 else []
        self.seqs: dict[str, list[int]] = {"": list(prompt)}  # "" = the prompt
        self.history: set[str] = set()
        self.order: dict[int, list[tuple[str, int]]] = {k: [(("", p)) for p in range(k, len(prompt) + 1)]
                                                        for k in levels}

    def append(self, rid: str, toks: list[int]) -> None:
        if not toks:
            return
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = list(self.lead)
            start = len(self.lead)  # the lead's own k-grams are the prompt's entries
        else:
            start = len(seq) + 1
        seq.extend(toks)
        for k in self.levels:
            for p in range(max(k, start), len(seq) + 1):
                self.order[k].append((rid, p))

    def cut(self, rid: str, offset: int) -> None:
        """The response becomes its first `offset` tokens (0: forgotten)."""
        seq = self.seqs.get(rid)
        if seq is None:
            return
        cut = len(self.lead) + offset
        for k in self.levels:
            self.order[k] = [(r, p) for r, p in self.order[k] if r != rid or (offset and p <= cut)]
        if offset:
            del seq[cut:]
        else:
            del self.seqs[rid]

    def add_history(self, name: str, toks: list[int]) -> None:
        self.history.add(name)
        self.append(name, toks)

    def response(self, rid: str) -> list[int]:
        return self.seqs.get(rid, self.lead)[len(self.lead):]

    def _conts(self, k: int, ctx: list[int], cap: int, own: str | None) -> list[tuple[list[int], float]]:
        suffix = ctx[-k:]
        occ = [(r, p) for r, p in self.order[k] if self.seqs[r][p - k : p] == suffix][-MAX_CANDIDATES:]
        conts = [(self.seqs[r][p : p + cap], OWN_WEIGHT if r == own else HISTORY_WEIGHT if r in self.history
                  else 1.0) for r, p in occ]
        return [(c, w) for c, w in conts if c]

    @staticmethod
    def _tree(conts: list[tuple[list[int], float]], cap: int, width: int,
              min_prob: float) -> dict[tuple[int, ...], float]:
        """Every candidate node (path -> probability)."""
        nodes: dict[tuple[int, ...], float] = {}

        def expand(path: tuple[int, ...], prob: float) -> None:
            d = len(path)
            if d >= cap:
                return
            live = [(c, w) for c, w in conts if len(c) > d and tuple(c[:d]) == path]
            total = sum(w for _c, w in live)
            counts: dict[int, float] = {}
            for c, w in live:
                counts[c[d]] = counts.get(c[d], 0.0) + w
            for tok, w in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:width]:
                p = prob * w / total
                if p < min_prob:
                    break
                nodes[(*path, tok)] = p
                expand((*path, tok), p)

        expand((), 1.0)
        return nodes

    def propose(self, ctx: list[int], max_len: int, width: int, min_prob: float, own: str | None
                ) -> tuple[dict[tuple[int, ...], float], list[float], int]:
        """(candidate nodes, the probabilities taken, largest first, match length) of the best level."""
        best: tuple[dict[tuple[int, ...], float], list[float], int] = ({}, [], 0)
        tried = 0
        for k in sorted(self.levels, reverse=True):
            if len(ctx) < k or (k > 1 and tried >= 2) or (k == 1 and best[1]):
                continue
            cap = min(max_len, max(1, math.ceil(self.factor * k)))
            conts = self._conts(k, ctx, cap, own)
            if not conts:
                continue
            nodes = self._tree(conts, cap, width, min_prob)
            taken = sorted(nodes.values(), reverse=True)[: cap * width]
            if sum(taken) > sum(best[1]):
                best = (nodes, taken, k)
            tried += 1
            if taken:
                break
        return best


@pytest.mark.parametrize("levels", [(2, 4, 7), (1, 2, 4, 7)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tree_drafts_with_a_prompt_history_and_cuts_equal_the_reference(seed: int, levels: tuple[int, ...]) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    base = [rng.randrange(vocab) for _ in range(100)]
    prompt = [rng.randrange(vocab) for _ in range(rng.choice([3, 12]))]
    idx = GroupIndex(prompt, levels=levels)
    ref = _Reference(prompt, levels)
    for h in range(2):
        toks = [t if rng.random() < 0.8 else rng.randrange(vocab) for t in base]
        idx.add_history(toks)
        ref.add_history(f"h{h}", toks)
    streams = {f"r{i}": [t if rng.random() < 0.85 else rng.randrange(vocab) for t in base] for i in range(4)}
    checked = trees = cuts = 0
    for _step in range(150):
        rid = rng.choice(list(streams))
        have = len(ref.response(rid))
        if rng.random() < 0.1 and have:
            # A resumed attempt: the response is cut (sometimes to nothing) and goes on differently.
            offset = rng.randrange(have)
            streams[rid][offset:] = [rng.randrange(vocab) for _ in range(len(base) - offset)]
            idx.truncate(rid, offset)
            ref.cut(rid, offset)
            cuts += 1
            have = offset
        toks = streams[rid][have : have + rng.randint(1, 4)]
        idx.append(rid, have, toks)
        ref.append(rid, toks)
        assert idx.tokens(rid) == ref.response(rid)
        q = rng.choice(list(streams))
        ctx = prompt + ref.response(q)
        max_len = rng.randint(1, 8)
        width = rng.choice([2, 3])
        min_prob = rng.choice([0.0, 0.1, 0.3])
        own = q if rng.random() < 0.5 else None
        got = idx.propose(ctx, max_len, width=width, min_token_prob=min_prob, request_id=own)
        nodes, taken, k = ref.propose(ctx, max_len, width, min_prob, own)
        paths: list[tuple[int, ...]] = []
        probs: list[float] = []
        for tok, parent in zip(got.tokens, got.parents, strict=True):
            assert -1 <= parent < len(paths)  # parents precede children
            path = (*(paths[parent] if parent >= 0 else ()), tok)
            assert path in nodes, (path, sorted(nodes))
            paths.append(path)
            probs.append(nodes[path])
        assert len(set(paths)) == len(paths)
        assert sorted(probs, reverse=True) == pytest.approx(taken)
        assert got.score == pytest.approx(sum(taken))
        if taken:
            assert got.match_len == k
        checked += 1
        trees += any(p >= 0 for p in got.parents) and len(set(got.parents)) < len(got.parents)
    assert checked == 150
    assert trees > 5  # trees with a fork were drafted, not only chains
    assert cuts > 5
