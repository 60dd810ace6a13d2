"""Generates arithmetic word problems with verifiable integer answers (JSONL).

Each line: {"prompt_key": "arith-0-0007", "prompt": "Question: ... Answer:", "answer": "42"}.
The prompt key is stable across runs for a given seed and index, so the same prompt in the next
iteration has the same key (history drafts and length priors key on it).

    python examples/make_prompts.py --n 64 --seed 0 > examples/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable

NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "shells"]

Template = Callable[[random.Random], tuple[str, int]]


def _add(r: random.Random) -> tuple[str, int]:
    n, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 60), r.randint(2, 60)
    return f"{n} has {a} {item} and finds {b} more. How many {item} does {n} have now?", a + b


def _sub(r: random.Random) -> tuple[str, int]:
    n, item = r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(20, 99)
    b = r.randint(1, a - 1)
    return f"{n} had {a} {item} and gave away {b}. How many {item} are left?", a - b


def _mul(r: random.Random) -> tuple[str, int]:
    item = r.choice(ITEMS)
    a, b = r.randint(2, 12), r.randint(2, 12)
    return f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?", a * b


def _div(r: random.Random) -> tuple[str, int]:
    n, item = r.choice(NAMES), r.choice(ITEMS)
    b, q = r.randint(2, 9), r.randint(2, 12)
    return f"{n} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?", q


def _two_step(r: random.Random) -> tuple[str, int]:
    n, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20)
    return (f"{n} buys {a} packs of {item} with {b} in each pack, then loses {c}. "
            f"How many {item} does {n} have?"), a * b - c


TEMPLATES: list[Template] = [_add, _sub, _mul, _div, _two_step]


def make(n: int, seed: int) -> list[dict[str, str]]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = TEMPLATES[i % len(TEMPLATES)](r)
        out.append({"prompt_key": f"arith-{seed}-{i:04d}", "prompt": f"Question: {question}\nAnswer:",
                    "answer": str(answer)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="-", help="output file ('-' = stdout)")
    args = p.parse_args(argv)
    lines = "".join(json.dumps(x) + "\n" for x in make(args.n, args.seed))
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
