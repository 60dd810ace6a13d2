"""Where the online drafter loses against the ideal replay (bench.spec), measured step by step.

    python -m bench.spec_analysis [--temperature 0.7] [--group 16] [--prompt-offset 0] [--no-history]

Replays iteration 2 of a cached bench.spec rollout set in lockstep with the online drafter (as
bench.spec does) and, at every step, in the same index state, also evaluates:
- the ideal oracle (best continuation of any >= 2-token suffix match: bench.spec's ideal);
- the oracle restricted to occurrences whose backward match is >= m tokens, for several m;
- the drafter's own candidate set (best of the continuations it walked);
- whether the drafted path was cut by the length cap / min token probability / ended candidates.

Reports where the lost tokens (ideal - online, same state) are: by the drafter's match length,
by the number of occurrences, by the source of the ideal's best continuation (sibling, own output,
history, prompt), and whether the ideal's first token was among the candidates' first tokens, the
most frequent one, or missing. State-matched: the ideal is evaluated in the online replay's states,
so the split is exact for these states (the separate ideal replay in bench.spec follows its own,
faster-advancing states; the two totals differ a little).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from bench.spec import CACHE, GAMMA, common_prefix_len, draft_accepted
from services.draft.index import _POS_BITS, _POS_MASK, GroupIndex, _key


def occurrences(idx: GroupIndex, ctx: Sequence[int], max_back: int = 64) -> list[tuple[int, int, int]]:
    """Every occurrence of the context's last 2 tokens with a continuation: (seq, pos, backward
    match length m >= 2)."""
    v = idx._tables[idx.levels.index(2)].get(_key(ctx, 2))
    if v is None:
        return []
    codes = [v] if type(v) is int else v
    out = []
    n = len(ctx)
    for c in codes:  # type: ignore[union-attr]
        s, p = c >> _POS_BITS, c & _POS_MASK
        seq = idx._seqs[s]
        if p >= len(seq) or seq[p - 2 : p] != list(ctx[-2:]):
            continue
        m = 2
        while m < max_back and m < p and m < n and seq[p - 1 - m] == ctx[n - 1 - m]:
            m += 1
        out.append((s, p, m))
    return out


def analyse(data: dict[str, Any], group: int, history: bool) -> dict[str, Any]:
    prompts, (it1, it2) = data["prompts"], data["iterations"]
    lost: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    min_ms = (2, 3, 4, 5, 7, 10)
    for p, prompt in enumerate(prompts):
        prompt = list(prompt)
        responses = [list(x) for x in it2[p][:group]]
        idx = GroupIndex(prompt)
        for h in (it1[p][:group] if history else []):
            idx.add_history(list(h))
        hist_seqs = set(idx._history)
        n = len(responses)
        pos = [0] * n
        while True:
            live = [r for r in range(n) if pos[r] < len(responses[r])]
            if not live:
                break
            adv = {}
            for r in live:
                ctx = prompt + responses[r][: pos[r]]
                fut = responses[r][pos[r] : pos[r] + GAMMA]
                prop = idx.propose(ctx, GAMMA, request_id=f"r{r}")
                a_on = draft_accepted(prop, fut)
                occ = occurrences(idx, ctx)
                own = idx._by_request.get(f"r{r}")
                best = (0, -1, 0)
                by_m = dict.fromkeys(min_ms, 0)
                for s, q, m in occ:
                    lcp = common_prefix_len(idx._seqs[s][q : q + GAMMA], fut)
                    if lcp > best[0]:
                        best = (lcp, s, m)
                    for mm in min_ms:
                        if m >= mm and lcp > by_m[mm]:
                            by_m[mm] = lcp
                a_id = best[0]
                totals["steps"] += 1
                totals["online"] += a_on
                totals["ideal"] += a_id
                for mm in min_ms:
                    totals[f"ideal_m{mm}"] += by_m[mm]
                gap = a_id - a_on
                # Drafter's deepest usable match: the longest backward match over all occurrences.
                deepest = max((m for _s, _q, m in occ), default=0)
                totals["deepest_ge7"] += deepest >= 7
                if gap > 0:
                    src = ("none" if best[1] < 0 else "history" if best[1] in hist_seqs else
                           "prompt" if best[1] == 0 else "own" if best[1] == own else "sibling")
                    lost["by_source"][src] += gap
                    lost["by_drafter_match"][str(prop.match_len)] += gap
                    lost["by_oracle_match"][str(min(best[2], 10))] += gap
                    n_occ = len(occ)
                    lost["by_occurrences"]["1" if n_occ <= 1 else "2-4" if n_occ <= 4 else "5-16" if n_occ <= 16
                                           else "17-64" if n_occ <= 64 else ">64"] += gap
                    # Where did the draft first go wrong (position a_on), and was the real token
                    # among the continuations that agree with the draft so far?
                    cands = [idx._seqs[s][q : q + GAMMA] for s, q, _m in occ]
                    pref = fut[:a_on]
                    nxt = Counter(c[a_on] for c in cands if len(c) > a_on and c[:a_on] == pref)
                    real = fut[a_on] if a_on < len(fut) else None
                    if a_on >= len(prop.tokens):
                        kind = "draft_ended"  # the draft was correct but stopped
                    elif real in nxt and nxt.most_common(1)[0][0] == real:
                        kind = "wrong_but_real_is_most_frequent_over_all_2gram_occ"
                    elif real in nxt:
                        kind = "wrong_real_among_candidates"
                    else:
                        kind = "wrong_real_not_among_candidates"
                    lost["by_failure"][kind] += gap
                    lost["by_position"][str(a_on)] += gap
                adv[r] = min(a_on + 1, len(responses[r]) - pos[r])
            for r, a in adv.items():
                idx.append(f"r{r}", pos[r], responses[r][pos[r] : pos[r] + a])
                pos[r] += a
    steps = totals["steps"]
    res: dict[str, Any] = {
        "online_per_step": (totals["online"] + steps) / steps,
        "ideal_same_state_per_step": (totals["ideal"] + steps) / steps,
        **{f"ideal_min_match_{mm}_per_step": (totals[f"ideal_m{mm}"] + steps) / steps for mm in min_ms},
        "share_steps_with_match_ge7": totals["deepest_ge7"] / steps,
        "lost_tokens": totals["ideal"] - totals["online"],
    }
    for key, cnt in lost.items():
        tot = sum(cnt.values())
        res[key] = {k: round(v / tot, 3) for k, v in sorted(cnt.items(), key=lambda kv: -kv[1])}
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_analysis")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompt-offset", type=int, default=0)
    ap.add_argument("--no-history", action="store_true")
    args = ap.parse_args(list(argv) if argv is not None else None)
    key = f"t{args.temperature}_p1.0_n{args.prompts}_g16_m{args.max_tokens}"
    key += f"_o{args.prompt_offset}" if args.prompt_offset else ""
    data = json.loads((CACHE / f"rollouts_{key}.json").read_text())
    res = analyse(data, args.group, not args.no_history)
    for k, v in res.items():
        sys_out = f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
        print(sys_out)
    print("RESULT " + json.dumps({"bench": "spec_analysis", "rollouts": key, "group": args.group,
                                  "history": not args.no_history, **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
