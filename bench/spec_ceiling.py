"""A causal ceiling for linear drafts on bench.spec's rollouts: the model's own greedy draft.

    python -m bench.spec_ceiling [--temperatures 0.7,1.0] [--prompt-offset 0] [--groups 8,16]

bench.spec compares the online drafter with an ideal that knows the real continuation. No drafter
that only sees the past can reach that. This measures what a drafter that knew the policy's next
token distribution exactly would get. The draft is the model's greedy chain, so under the
greedy-match proxy its first token is accepted with probability max_t p(t | context), the most any
linear draft can get. Computed with one teacher-forced pass per response: as long as the draft
matches the real tokens, the model's argmax chain from position i is the teacher-forced argmax at
i, i + 1, ...
The replay advances each response by accepted + 1 per step, gamma_max = 8, as bench.spec does.
Also reported: E[max p] per position at the rollout temperature (its first-token acceptance in
expectation). Needs the cached rollouts of bench.spec (same --prompts / --max-tokens /
--prompt-offset). Not a timing benchmark. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.spec import CACHE, GAMMA


def _model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def greedy_ceiling(model: Any, data: dict[str, Any], group: int, temperature: float) -> dict[str, float]:
    import torch

    tokens = steps = 0
    pmax_sum = 0.0
    positions = 0
    for prompt, responses in zip(data["prompts"], data["iterations"][1], strict=True):
        for resp in responses[:group]:
            if not resp:
                continue
            ids = torch.tensor([list(prompt) + list(resp)])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(resp), vocab]
            hit = (logits.argmax(-1) == torch.tensor(resp)).tolist()
            pmax_sum += torch.softmax(logits / temperature, -1).max(-1).values.sum().item()
            positions += len(resp)
            pos = 0
            while pos < len(resp):
                acc = 0
                while acc < GAMMA and pos + acc < len(resp) and hit[pos + acc]:
                    acc += 1
                adv = min(acc + 1, len(resp) - pos)
                pos += adv
                tokens += adv
                steps += 1
    return {"model_greedy_per_step": tokens / steps, "expected_first_token_acceptance": pmax_sum / positions}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_ceiling")
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--groups", default="8,16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompt-offset", type=int, default=0)
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from services.worker.model.prepare import ensure_model

        model_dir = ensure_model()
    model = _model(model_dir)
    result: dict[str, Any] = {"bench": "spec_ceiling", "prompt_offset": args.prompt_offset}
    for temp in (float(t) for t in args.temperatures.split(",") if t.strip()):
        key = f"t{temp}_p1.0_n{args.prompts}_g16_m{args.max_tokens}"
        key += f"_o{args.prompt_offset}" if args.prompt_offset else ""
        data = json.loads((CACHE / f"rollouts_{key}.json").read_text())
        for g in (int(x) for x in args.groups.split(",")):
            res = greedy_ceiling(model, data, g, temp)
            result[f"t{temp}_g{g}"] = {k: round(v, 3) for k, v in res.items()}
            sys.stdout.write(f"T={temp} G={g}: " + "  ".join(f"{k}={v:.3f}" for k, v in res.items()) + "\n")
            sys.stdout.flush()
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
