"""Linear-drafter variants against bench.spec's ideal replay (research script, not served).

    .venv/bin/python docs/research/linear_drafter/measure.py [--cells T,OFFSET,G ...] [VARIANT_JSON ...]
    .venv/bin/python docs/research/linear_drafter/measure.py --ranks T,OFFSET,G

Needs bench.spec's cached full rollouts (.cache/bench_spec/rollouts_t{T}_p1.0_n4_g16_m192[_o4].json;
`python -m bench.spec --threads 1 --skip-throughput --skip-index --temperatures 0.7,1.0
[--prompt-offset 4]` makes them). Each variant swaps bench.spec's GroupIndex for a subclass and runs
bench.spec.acceptance unchanged, so every number is the bench's own (linear and tree, every source,
the same ideal). Variant keys (all optional; {} = the index as committed):
- "own", "hist": the index's own_weight / history_weight;
- "msf": max_spec_factor (draft cap = msf x match length; 8 lets the order-1 escape draft 8 tokens);
- "chain": 1 = when a linear draft stops short of max_len, propose again from context + draft and
  append that draft (up to "chain_n" times, default 1);
- "min_prob": min_token_prob; "levels": n-gram levels; "maxc": MAX_CANDIDATES;
- "lam", "order": at a fork, pick argmax(weight share + lam x share of the token among the
  continuations of the path's last `order` tokens): an interpolated lower-order prior (order 0: the
  token's frequency in the group). Pure Python; costs a scan of up to 256 occurrences per fork.
--ranks: at each step with a draft, the rank of the real next token among the drafter's first-token
candidates (-1 = not a candidate) and the drafter's mean top-candidate share (its confidence).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench.spec as bs
import services.draft.index as ix

P: dict[str, Any] = {}
_LINEAR = ix._linear
_STATE: dict[str, Any] = {}


def load(temp: float, offset: int) -> dict[str, Any]:
    key = f"t{temp}_p1.0_n4_g16_m192" + (f"_o{offset}" if offset else "")
    return json.loads((Path(".cache/bench_spec") / f"rollouts_{key}.json").read_text())  # type: ignore[no-any-return]


def _lower_share(idx: ix.GroupIndex, ctx: Sequence[int], order: int, own: int) -> tuple[dict[int, float], float]:
    """Weighted counts of the continuations of ctx's last `order` tokens (order >= 1)."""
    cnt: defaultdict[int, float] = defaultdict(float)
    v = idx._tables[idx.levels.index(order)].get(ix._key(ctx, order))
    codes = [] if v is None else [v] if type(v) is int else v[-256:]  # type: ignore[index]
    for c in codes:
        s, p = c >> ix._POS_BITS, c & ix._POS_MASK
        seq = idx._seqs[s]
        if p < len(seq):
            cnt[seq[p]] += idx.own_weight if s == own else idx._weights[s]
    return cnt, float(sum(cnt.values()))


def linear_prior(conts: list[list[int]], ws: list[float] | None, cap: int, min_prob: float,
                 match_len: int) -> ix.Proposal:
    """index._linear with a lower-order prior at forks (variant keys lam, order)."""
    idx, ctx, own = _STATE["idx"], _STATE["ctx"], _STATE["own"]
    lam, order = float(P["lam"]), int(P.get("order", 1))
    weights = ws or [1.0] * len(conts)
    tokens: list[int] = []
    score, prob, lo, hi, d = 0.0, 1.0, 0, len(conts), 0
    while d < cap:
        while lo < hi and len(conts[lo]) <= d:
            lo += 1
        if lo >= hi:
            break
        runs = []
        i = lo
        while i < hi:
            j = i + 1
            while j < hi and conts[j][d] == conts[i][d]:
                j += 1
            runs.append((conts[i][d], i, j, sum(weights[i:j])))
            i = j
        total = sum(r[3] for r in runs)
        if len(runs) > 1 and match_len > order:
            if order == 0:  # the token's occurrences in the group (its level-1 entry)
                t1 = idx._tables[0]
                cnt: dict[int, float] = {r[0]: (len(v) if type(v := t1.get(r[0])) is list else 1) for r in runs}
                tot = float(sum(cnt.values()))
            else:
                cnt, tot = _lower_share(idx, list(ctx) + tokens, order, own)
            best = max(runs, key=lambda r: (r[3] / total + lam * (cnt.get(r[0], 0) / tot if tot else 0.0), -r[1]))
        else:
            best = max(runs, key=lambda r: (r[3], -r[1]))
        prob *= best[3] / total
        if prob < min_prob:
            break
        tokens.append(best[0])
        score += prob
        lo, hi, d = best[1], best[2], d + 1
    return ix._proposal(tuple(tokens), ix._chain_parents(len(tokens)), score, match_len)


class Variant(ix.GroupIndex):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("own_weight", P.get("own", ix.OWN_WEIGHT))
        kw.setdefault("history_weight", P.get("hist", ix.HISTORY_WEIGHT))
        kw.setdefault("max_spec_factor", P.get("msf", 4.0))
        if "levels" in P:
            kw.setdefault("levels", tuple(P["levels"]))
        super().__init__(*args, **kw)

    def propose(self, context: Sequence[int], max_len: int, *, width: int = 1, min_token_prob: float = 0.1,
                request_id: str | None = None) -> ix.Proposal:
        mp = float(P.get("min_prob", min_token_prob))
        if "lam" in P:
            _STATE.update(idx=self, ctx=context, own=self._by_request.get(request_id or "", -1))
            ix._linear = linear_prior
        else:
            ix._linear = _LINEAR
        prop = super().propose(context, max_len, width=width, min_token_prob=mp, request_id=request_id)
        for _ in range(int(P.get("chain_n", 1)) if P.get("chain") and width == 1 else 0):
            if not 0 < len(prop.tokens) < max_len:
                break
            ext = super().propose([*context, *prop.tokens], max_len - len(prop.tokens), width=1,
                                  min_token_prob=mp, request_id=request_id)
            if not ext.tokens:
                break
            toks = prop.tokens + ext.tokens
            prop = ix._proposal(toks, ix._chain_parents(len(toks)), prop.score + ext.score, prop.match_len)
        return prop


KEYS = ("grouped_history_vs_ideal", "self_vs_ideal", "grouped_vs_ideal", "tree2_vs_ideal", "tree4_vs_ideal",
        "self_tree2_vs_ideal", "grouped_tree2_vs_ideal")


def run(variant: dict[str, Any], cells: Sequence[tuple[float, int, int]]) -> None:
    P.clear()
    P.update(variant)
    ix.MAX_CANDIDATES = int(variant.get("maxc", 16))
    bs.GroupIndex = Variant  # type: ignore[misc]
    for temp, off, g in cells:
        r = bs.acceptance(load(temp, off), g)
        row = {"variant": variant, "cell": [temp, off, g], "gh": round(r["grouped_history"], 3),
               "gh_ideal": round(r["grouped_history_ideal"], 3), **{k: round(r[k], 3) for k in KEYS}}
        print(json.dumps(row), flush=True)


def ranks(temp: float, off: int, g: int) -> None:
    data = load(temp, off)
    rk: Counter[int] = Counter()
    top: list[float] = []
    for p, prompt in enumerate(data["prompts"]):
        resps = [list(x) for x in data["iterations"][1][p][:g]]
        idx = ix.GroupIndex(list(prompt))
        for h in data["iterations"][0][p][:g]:
            idx.add_history(list(h))
        pos = [0] * g
        while live := [r for r in range(g) if pos[r] < len(resps[r])]:
            adv = {}
            for r in live:
                ctx = list(prompt) + resps[r][: pos[r]]
                fut = resps[r][pos[r] : pos[r] + bs.GAMMA]
                prop = idx.propose(ctx, bs.GAMMA, request_id=f"r{r}")
                if prop.tokens:
                    conts, ws = idx._continuations(idx.levels.index(prop.match_len), ctx, 8,
                                                   idx._by_request.get(f"r{r}", -1))
                    c: defaultdict[int, float] = defaultdict(float)
                    for x, w in zip(conts, ws or [1.0] * len(conts), strict=True):
                        if x:
                            c[x[0]] += w
                    order = sorted(c, key=lambda t: -c[t])
                    rk[order.index(fut[0]) if fut[0] in c else -1] += 1
                    top.append(c[order[0]] / sum(c.values()))
                adv[r] = min(bs.draft_accepted(prop, fut) + 1, len(resps[r]) - pos[r])
            for r, a in adv.items():
                idx.append(f"r{r}", pos[r], resps[r][pos[r] : pos[r] + a])
                pos[r] += a
    n = sum(rk.values())
    print(json.dumps({"steps_with_draft": n, "rank_share": {k: round(v / n, 3) for k, v in sorted(rk.items())},
                      "mean_top_share": round(sum(top) / len(top), 3)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="*", default=["0.7,0,16", "0.7,4,16"])
    ap.add_argument("--ranks", default="")
    ap.add_argument("variants", nargs="*", default=["{}"])
    args = ap.parse_args()
    if args.ranks:
        t, o, g = args.ranks.split(",")
        ranks(float(t), int(o), int(g))
        return
    cells = [(float(t), int(o), int(g)) for t, o, g in (c.split(",") for c in args.cells)]
    for v in args.variants:
        run(json.loads(v), cells)


if __name__ == "__main__":
    main()
