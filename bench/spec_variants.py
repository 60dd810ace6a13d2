"""Drafter variants on bench.spec's cached rollouts: the lockstep grouped (+ history) replay of
bench.spec with a scoring rule other than the index's, to decide what goes into services/draft/index.py.

    python -m bench.spec_variants [--temperature 0.7] [--group 16] [--prompt-offset 0] [--no-history]
        [--variant JSON ...]

A variant is a JSON object; with none given, a fixed set runs. Keys (all optional):
- "index": 1 = the index's own propose() (the baseline; other keys ignored);
- "alpha": weight each occurrence of the context's last 2 tokens by exp(alpha * (m - 2)), m = its
  backward match length (up to 32): a PPM / context-tree-like mixture over all match depths
  instead of only the deepest level; "deepest": 1 = only the occurrences of the deepest of the
  index's levels (its candidate set), "recent": N = only the N most recent;
- "own", "history": source weights (the requesting response's own output, history responses);
- "beta", "window": times exp(beta * s), s = the share of the context's last `window` bigrams
  found in the `window` tokens before the occurrence (local similarity: the occurrence is in a
  response that has been saying what this one says);
- "min_prob": stop below this path probability (default 0.1, as the index);
- "lookahead": 1 = the path maximising the expected accepted tokens under the weights (a child
  with fewer occurrences that agree for longer can win), not the heaviest child at each fork;
- "pos_tau": times exp(-|q - pos| / pos_tau), q the occurrence's and pos the requester's response
  position (the same passage of a similar answer);
- "sticky": times this for the sequences whose continuation predicted the request's previous
  advance whole (keep following the source that was right).
Where the variant has no candidate (no >= 2-token match), the index's proposal is used (its
order-1 escape), so variants differ only in how they pick among >= 2-token matches.
Weighted walk: the most heavily weighted token at each depth among the occurrences that agree with
the path so far. Pure Python, slow (seconds per variant); not for serving. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from bench.spec import CACHE, GAMMA, common_prefix_len, draft_accepted
from bench.spec_analysis import occurrences
from services.draft.index import GroupIndex

DEFAULT_VARIANTS: list[dict[str, Any]] = [
    {"index": 1},
    {"alpha": 0.0},
    {"alpha": 1.0},
    {"alpha": 2.0},
    {"alpha": 0.0, "deepest": 1, "recent": 16},
    {"alpha": 0.0, "deepest": 1, "recent": 16, "own": 3.0, "history": 0.5},
    {"alpha": 0.0, "deepest": 1, "recent": 16, "own": 3.0, "history": 0.5, "beta": 6.0, "window": 64},
    {"alpha": 0.5, "own": 3.0, "history": 0.5, "beta": 10.0, "window": 64},
]


def _bigrams(tokens: Sequence[int]) -> set[tuple[int, int]]:
    return set(pairwise(tokens))


def weighted_draft(idx: GroupIndex, ctx: Sequence[int], gamma: int, v: dict[str, Any], own: int,
                   sticky: frozenset[int] = frozenset()) -> list[int]:
    occ = occurrences(idx, ctx, 32)
    if v.get("deepest"):
        deep = max((m for _s, _q, m in occ), default=0)
        level = max((k for k in idx.levels if 2 <= k <= deep), default=2)
        occ = [o for o in occ if o[2] >= level]
    if v.get("recent"):
        occ = occ[-int(v["recent"]) :]
    if not occ:
        return []
    hist = set(idx._history)
    alpha = float(v.get("alpha", 0.0))
    beta = float(v.get("beta", 0.0))
    window = int(v.get("window", 64))
    near = _bigrams(list(ctx[-window:])) if beta else set()
    cands = []
    for s, q, m in occ:
        seq = idx._seqs[s]
        w = math.exp(alpha * (m - 2))
        if s == own:
            w *= float(v.get("own", 1.0))
        elif s in hist:
            w *= float(v.get("history", 1.0))
        if s in sticky:
            w *= float(v["sticky"])
        if v.get("pos_tau") and s != 0:
            # Position alignment: an occurrence at about the same response position as the
            # requester's is more likely the same passage of a similar answer.
            w *= math.exp(-abs(q - idx._bases[s] - (len(ctx) - len(idx.prompt))) / float(v["pos_tau"]))
        if beta:
            w *= math.exp(beta * len(near & _bigrams(seq[max(0, q - window) : q])) / max(1, len(near)))
        cands.append((seq[q : q + gamma], w))
    if v.get("lookahead"):
        return _best_path(cands, 0, gamma, float(v.get("min_prob", 0.1)), 1.0)[1]
    out: list[int] = []
    prob = 1.0
    for d in range(gamma):
        tot: dict[int, float] = {}
        for c, w in cands:
            if len(c) > d:
                tot[c[d]] = tot.get(c[d], 0.0) + w
        if not tot:
            break
        tok, wt = max(tot.items(), key=lambda kv: (kv[1], -kv[0]))
        prob *= wt / sum(tot.values())
        if prob < float(v.get("min_prob", 0.1)):
            break
        out.append(tok)
        cands = [(c, w) for c, w in cands if len(c) > d and c[d] == tok]
    return out


def _best_path(cands: list[tuple[list[int], float]], d: int, gamma: int, min_prob: float,
               prob: float) -> tuple[float, list[int]]:
    """The path from depth d maximising the expected accepted tokens under the candidates' weights
    (sum over depths of the path's probability), not the most frequent child at each fork."""
    if d >= gamma:
        return 0.0, []
    tot: dict[int, float] = {}
    for c, w in cands:
        if len(c) > d:
            tot[c[d]] = tot.get(c[d], 0.0) + w
    if not tot:
        return 0.0, []
    total = sum(tot.values())
    best: tuple[float, list[int]] = (0.0, [])
    for tok, wt in sorted(tot.items(), key=lambda kv: (-kv[1], kv[0])):
        p = wt / total
        if prob * p < min_prob:
            continue
        sub = [(c, w) for c, w in cands if len(c) > d and c[d] == tok]
        val, path = _best_path(sub, d + 1, gamma, min_prob, prob * p)
        val = p * (1.0 + val)
        if val > best[0]:
            best = (val, [tok, *path])
    return best


def replay_variant(data: dict[str, Any], group: int, history: bool, v: dict[str, Any]) -> float:
    """bench.spec's lockstep replay (accepted + bonus tokens per step) with variant v."""
    prompts, (it1, it2) = data["prompts"], data["iterations"]
    tokens = steps = 0
    for p, prompt in enumerate(prompts):
        prompt = list(prompt)
        responses = [list(x) for x in it2[p][:group]]
        idx = GroupIndex(prompt)
        for h in (it1[p][:group] if history else []):
            idx.add_history(list(h))
        pos = [0] * len(responses)
        # "sticky": the sequences whose continuation predicted a request's last advance whole.
        agreed: list[frozenset[int]] = [frozenset()] * len(responses)
        while True:
            live = [r for r in range(len(responses)) if pos[r] < len(responses[r])]
            if not live:
                break
            adv = {}
            for r in live:
                ctx = prompt + responses[r][: pos[r]]
                fut = responses[r][pos[r] : pos[r] + GAMMA]
                rid = f"r{r}"
                prop = idx.propose(ctx, GAMMA, request_id=rid)
                if v.get("index"):
                    acc = draft_accepted(prop, fut)
                else:
                    d = weighted_draft(idx, ctx, GAMMA, v, idx._by_request.get(rid, -1), agreed[r])
                    acc = common_prefix_len(d, fut) if d else draft_accepted(prop, fut)
                adv[r] = min(acc + 1, len(responses[r]) - pos[r])
                if v.get("sticky"):
                    step = fut[: adv[r]]
                    agreed[r] = frozenset(
                        s for s, q, _m in occurrences(idx, ctx, 32) if idx._seqs[s][q : q + len(step)] == step
                    )
            for r, a in adv.items():
                idx.append(f"r{r}", pos[r], responses[r][pos[r] : pos[r] + a])
                pos[r] += a
                tokens += a
                steps += 1
    return tokens / max(steps, 1)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_variants")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompt-offset", type=int, default=0)
    ap.add_argument("--no-history", action="store_true")
    ap.add_argument("--variant", action="append", default=[], help="JSON object (repeatable)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    key = f"t{args.temperature}_p1.0_n{args.prompts}_g16_m{args.max_tokens}"
    key += f"_o{args.prompt_offset}" if args.prompt_offset else ""
    data = json.loads((CACHE / f"rollouts_{key}.json").read_text())
    variants = [json.loads(x) for x in args.variant] or DEFAULT_VARIANTS
    results = []
    for v in variants:
        acc = replay_variant(data, args.group, not args.no_history, v)
        results.append({"variant": v, "accepted_per_step": round(acc, 3)})
        print(f"{json.dumps(v)}: {acc:.3f}", flush=True)
    print("RESULT " + json.dumps({"bench": "spec_variants", "rollouts": key, "group": args.group,
                                  "history": not args.no_history, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
