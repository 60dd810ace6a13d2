"""GroupIndex.propose against a from-scratch reference over random token streams.

The reference rebuilds everything per call from the raw sequences: the occurrences of each level's
k-gram in the order they were indexed, the MAX_CANDIDATES most recent, the most frequent path with
Counter counts (ties to the smallest token), the level fallback rules. The index's fast path (hash
tables, sorted-range walk) must give exactly the same proposals, scores included.
"""

from __future__ import annotations

import math
import random

import pytest

from services.draft.index import HISTORY_WEIGHT, MAX_CANDIDATES, OWN_WEIGHT, GroupIndex

LEVELS = (2, 4, 7)


class _Reference:
    def __init__(self, levels: tuple[int, ...] = LEVELS, max_spec_factor: float = 4.0) -> None:
        self.levels = levels
        self.factor = max_spec_factor
        self.seqs: dict[str, list[int]] = {}
        self.history: set[str] = set()
        self.order: dict[int, list[tuple[str, int]]] = {k: [] for k in levels}  # (request, p) as indexed

    def append(self, rid: str, toks: list[int]) -> None:
        seq = self.seqs.setdefault(rid, [])
        old = len(seq)
        seq.extend(toks)
        for k in self.levels:
            for p in range(max(k, old + 1), len(seq) + 1):
                self.order[k].append((rid, p))

    def add_history(self, name: str, toks: list[int]) -> None:
        self.history.add(name)
        self.append(name, toks)

    def _weight(self, rid: str, own: str | None) -> float:
        return OWN_WEIGHT if rid == own else HISTORY_WEIGHT if rid in self.history else 1.0

    def _conts(self, k: int, ctx: list[int], cap: int, own: str | None) -> list[tuple[list[int], float]]:
        suffix = ctx[-k:]
        occ = [(r, p) for r, p in self.order[k] if self.seqs[r][p - k : p] == suffix]
        conts = [(self.seqs[r][p : p + cap], self._weight(r, own)) for r, p in occ[-MAX_CANDIDATES:]]
        return [(c, w) for c, w in conts if c]

    @staticmethod
    def _walk(conts: list[tuple[list[int], float]], cap: int, min_prob: float) -> tuple[list[int], float]:
        out: list[int] = []
        prob, score = 1.0, 0.0
        live = conts
        for d in range(cap):
            live = [(c, w) for c, w in live if len(c) > d]
            if not live:
                break
            counts: dict[int, float] = {}
            for c, w in live:
                counts[c[d]] = counts.get(c[d], 0.0) + w
            tok, n = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
            prob *= n / sum(w for _c, w in live)
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            live = [(c, w) for c, w in live if c[d] == tok]
        return out, score

    def propose(self, ctx: list[int], max_len: int, min_prob: float,
                own: str | None = None) -> tuple[tuple[int, ...], float, int]:
        best: tuple[tuple[int, ...], float, int] = ((), 0.0, 0)
        tried = 0
        for k in sorted(self.levels, reverse=True):
            if len(ctx) < k:
                continue
            # At most two levels >= 2 with occurrences; level 1 (the order-1 escape) whenever
            # nothing longer drafted.
            if k > 1 and tried >= 2:
                continue
            cap = min(max_len, max(1, math.ceil(self.factor * k)))
            conts = self._conts(k, ctx, cap, own)
            if not conts:
                continue
            toks, score = self._walk(conts, cap, min_prob)
            if score > best[1]:
                best = (tuple(toks), score, k)
            tried += 1
            if toks:
                break
        return best


@pytest.mark.parametrize("levels", [LEVELS, (1, 2, 4), (1, *LEVELS)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_propose_equals_from_scratch_reference(seed: int, levels: tuple[int, ...]) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 12])  # small vocabularies: many occurrences, forks and ties
    idx = GroupIndex([], levels=levels)
    ref = _Reference(levels)
    base = [rng.randrange(vocab) for _ in range(120)]
    streams = {f"r{i}": [t if rng.random() < 0.85 else rng.randrange(vocab) for t in base] for i in range(5)}
    pos = dict.fromkeys(streams, 0)
    # Two history responses (an earlier iteration): their occurrences count HISTORY_WEIGHT times.
    for h in range(2):
        toks = [t if rng.random() < 0.8 else rng.randrange(vocab) for t in base]
        idx.add_history(toks)
        ref.add_history(f"h{h}", toks)
    checked = forks = 0
    for _step in range(200):
        rid = rng.choice(list(streams))
        n = rng.randint(1, 4)
        toks = streams[rid][pos[rid] : pos[rid] + n]
        if toks:
            idx.append(rid, pos[rid], toks)
            ref.append(rid, toks)
            pos[rid] += len(toks)
        # Propose for a random request from its current output, as a decoding step would.
        q = rng.choice(list(streams))
        ctx = streams[q][: max(pos[q], 1)]
        max_len = rng.randint(1, 10)
        min_prob = rng.choice([0.0, 0.1, 0.3])
        # Half the proposals name the requesting response: its own occurrences count OWN_WEIGHT times.
        own = q if rng.random() < 0.5 else None
        got = idx.propose(ctx, max_len, min_token_prob=min_prob, request_id=own)
        want_toks, want_score, want_k = ref.propose(ctx, max_len, min_prob, own)
        assert got.tokens == want_toks, (ctx[-8:], max_len, min_prob)
        assert got.score == pytest.approx(want_score)
        assert got.parents == tuple(range(-1, len(want_toks) - 1))
        if want_toks:
            assert got.match_len == want_k
        checked += 1
        forks += 0 < want_score < len(want_toks)  # a draft that went through a fork (prob < 1)
    assert checked == 200
    assert forks > 5  # the streams do exercise the counting path, not only common runs
