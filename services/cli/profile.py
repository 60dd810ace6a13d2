"""`seer profile [--model-dir DIR] [--out FILE]`: the step-time table T(B, gamma) for adaptive speculation.

Runs the reference engine over batch sizes B and draft lengths gamma: B requests decode with a
chain draft of gamma tokens each per step (random tokens: nearly always rejected, so the context
grows by one token per step, as in a real step), and the median step time is recorded. The JSON
table is what services.worker.adaptive.StepTimeTable loads (default ~/.cache/seer/step_time.json,
which workers pick up when no --spec-table is given).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.cli.flags import int_list
from services.worker.adaptive import DEFAULT_TABLE_PATH, StepTimeTable


def measure(engine, batch_sizes: Sequence[int], gammas: Sequence[int], *, context: int = 64,  # type: ignore[no-untyped-def]
            steps: int = 3, seed: int = 0, log: bool = True, clock: str = "wall") -> StepTimeTable:
    """Median seconds per engine step for each (B, gamma) on an existing engine.

    clock="cpu" measures the calling thread's CPU time: with a single-threaded engine
    (num_threads=1) that is the step's compute time without the time spent descheduled, the
    robust choice on a shared machine.
    """
    from services.worker.engine import Draft, GenerateRequest, SamplingParams

    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: {clock!r} is not wall or cpu")
    # Checked before any request is added: the median of no timed step does not exist, and failing
    # after the engine worked for minutes would waste them.
    if steps < 1:
        raise ValueError(f"steps: must be at least 1, got {steps}")
    if context < 1:
        raise ValueError(f"context: must be at least 1, got {context}")
    now = time.perf_counter if clock == "wall" else time.thread_time
    rng = random.Random(seed)
    vocab = engine.vocab_size
    rows: list[tuple[float, ...]] = []
    total_steps = len(gammas) * (steps + 1) + 4
    for b in batch_sizes:
        ids = [f"profile-{b}-{i}" for i in range(b)]
        for rid in ids:
            prompt = tuple(rng.randrange(vocab) for _ in range(context))
            engine.add_request(GenerateRequest(rid, prompt, max_new_tokens=total_steps * (max(gammas) + 1) + 8,
                                               sampling=SamplingParams(temperature=0.0, ignore_eos=True)))
        started: set[str] = set()
        while len(started) < b:  # prefill (possibly over several steps)
            started.update(o.request_id for o in engine.step() if o.token_ids)
        row = []
        for g in gammas:
            times = []
            for s in range(steps + 1):
                drafts = {rid: Draft.chain([rng.randrange(vocab) for _ in range(g)]) for rid in ids} if g else None
                t0 = now()
                engine.step(drafts)
                if s:  # the first step after a change of shape is a warm-up
                    times.append(now() - t0)
            row.append(statistics.median(times))
            if log:
                sys.stdout.write(f"B={b:<4d} gamma={g:<2d} step={row[-1] * 1e3:8.2f} ms\n")
                sys.stdout.flush()
        rows.append(tuple(row))
        for rid in ids:
            engine.abort(rid)
    return StepTimeTable(tuple(batch_sizes), tuple(gammas), tuple(rows), source=f"seer profile ({clock} clock)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="seer profile", description=__doc__.splitlines()[0] if __doc__ else None, allow_abbrev=False
    )
    ap.add_argument("--model-dir", default="", help="safetensors model dir (default: the embedded model)")
    ap.add_argument("--out", default=str(DEFAULT_TABLE_PATH), help="output JSON (default %(default)s)")
    ap.add_argument("--batch-sizes", type=int_list(), default="1,2,4,8,16,32", help="comma-separated batch sizes")
    ap.add_argument("--gammas", type=int_list(), default="0,1,2,4,8", help="comma-separated draft lengths")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per cell (median)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or the thread's CPU time (robust on a shared machine; use with --threads 1)")
    ap.add_argument("--quick", action="store_true", help="batch sizes 1,4,16 and gammas 0,1,2,8")
    args = ap.parse_args(list(argv) if argv is not None else None)
    # argparse converts the string defaults with the type too.
    batch_sizes: tuple[int, ...] = (1, 4, 16) if args.quick else args.batch_sizes
    gammas: tuple[int, ...] = (0, 1, 2, 8) if args.quick else args.gammas
    if not batch_sizes or batch_sizes[0] < 1:
        ap.error("--batch-sizes: need positive integers")
    if not gammas or gammas[0] < 0:
        ap.error("--gammas: need non-negative integers")
    if args.steps < 1:
        ap.error(f"--steps: need at least 1 timed step per cell, got {args.steps}")
    if args.context < 1:
        ap.error(f"--context: need at least 1 prompt token, got {args.context}")

    from services.worker.engines.reference.engine import ReferenceEngine

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from services.worker.model.prepare import ensure_model

        model_dir = ensure_model()
    engine = ReferenceEngine.from_dir(model_dir, device=args.device, max_batch_size=max(batch_sizes),
                                      num_threads=args.threads or None)
    table = measure(engine, batch_sizes, gammas, context=args.context, steps=args.steps, clock=args.clock)
    table.save(args.out)
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
