"""`seer demo`: start the suite, run a sample rollout on examples/prompts.jsonl, print the summary, stop.

    seer demo [--workers 1] [--limit 8] [--group-size 4] [--max-tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from services.cli import rollout
from services.cli.up import Suite, SuiteError, ensure_embedded_model

EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="seer demo", description="start the suite, run a sample rollout, stop", allow_abbrev=False
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--prompts", default=str(EXAMPLE_PROMPTS))
    p.add_argument("--limit", type=int, default=8, help="prompts to use")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="seer")
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--speculation", choices=["on", "off"], default="on")
    p.add_argument("--base-port", type=int, default=0, help="first port (0 = any free ports)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON only")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    say = (lambda *_a: None) if args.json else (lambda *a: print(*a, flush=True))
    from seer_client import SeerError

    try:
        # Before the model and the suite: a bad --limit or prompts file should cost neither.
        prompts = rollout.load_prompts(args.prompts, args.limit)
    except (ValueError, OSError) as e:
        print(f"seer demo: {e}", file=sys.stderr)
        return 1
    if args.workers < 1:  # a suite without workers would wait out the rollout's hour-long timeout
        print(f"seer demo: --workers: must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    say("preparing the embedded model ...")
    model_dir = ensure_embedded_model()
    try:
        suite = Suite(workers=args.workers, base_port=args.base_port, policy=args.policy, model_dir=model_dir,
                      chunk_size=args.chunk_size, speculation=args.speculation == "on")
    except ValueError as e:  # --workers, --base-port: a usage error, as in `seer up`, not a traceback
        print(f"seer demo: {e}", file=sys.stderr)
        return 2
    say(f"starting the suite ({args.workers} worker(s)) ...")
    try:
        suite.start(keep_data_on_error=True)
    except SuiteError as e:
        print(f"seer demo: {e}\nseer demo: logs kept in {suite.log_dir}", file=sys.stderr)
        return 1
    failed = False
    try:
        for name, ep in suite.endpoints().items():
            say(f"  {name:<10} {ep['address']}")
        groups = rollout.build_groups(prompts, args.group_size, args.max_tokens, temperature=args.temperature,
                                      seed=args.seed)
        say(f"rollout: {len(groups)} prompts x {args.group_size} samples, up to {args.max_tokens} tokens each")
        try:
            results, wall = rollout.run(suite.address, groups, f"demo-{uuid.uuid4().hex[:8]}",
                                        progress=not args.json)
        except (ValueError, TimeoutError, SeerError) as e:
            print(f"seer demo: {e}", file=sys.stderr)
            failed = True
            return 1
        summary = rollout.summarize(results, wall)
        acc = rollout.accuracy(results)
        if acc is not None:
            summary["accuracy"] = round(acc, 4)
        if args.json:
            print(json.dumps(summary))
        else:
            if results:  # none when every group was cancelled: nothing to show, the summary says so
                best = max(results, key=lambda r: len(r.token_ids))
                say(f"\nsample response ({best.prompt_key}, answer {best.labels.get('answer', '?')}): "
                    f"{best.text!r}\n")
            say(rollout.format_summary(summary))
    except Exception:
        failed = True
        raise
    finally:
        say("stopping the suite ...")
        # The logs outlive the temporary data directory when something went wrong.
        codes = suite.stop(keep_data=True)
        bad = {n: c for n, c in codes.items() if c not in (0, None)}
        say("stopped" + (f" (non-zero exits: {bad})" if bad else " cleanly"))
        if bad or failed:
            print(f"seer demo: logs kept in {suite.log_dir}", file=sys.stderr)
        else:
            suite.remove_data()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
