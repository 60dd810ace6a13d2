"""`seer rollout --prompts FILE --group-size G --max-tokens M [--address A] [--temperature T] [--json]`

Submits one batch through the public API (the Python client, RolloutService), shows a progress bar
while results stream in, and prints a summary: responses, tokens, throughput, the time taken by the
last 10% of responses (the tail), per-response latency p50/p99 and the mean accepted length per
step (tokens per engine step, the bonus token included: 1.0 = no speculation benefit).
`--timeout T` (default 3600 s from submission) bounds the wait for the buffer too (at most 60 s),
and holds also while no result arrives: then the batch is cancelled and the exit status is 1.
A batch cancelled elsewhere before it completed (another process's cancel_batch, an operator) ends
the run with one line saying so, how many of its responses finished, and exit status 1 (no summary,
as for a timeout); this run cancels nothing then.
Ctrl-C (SIGINT) or SIGTERM cancels the submitted batch too; the exit status is then 128 + the signal
(130, 143). The cancel names this run's submission (a random submission token the submission
carried), so it cancels only a batch this run stored: --batch-id naming another run's batch (one
with other content, or the same content submitted first by another run: already_submitted) leaves
that batch running, also when the interrupt came before SubmitBatch's reply. Interrupted during the
submission, it cancels the call, and the buffer's answer to the cancel is final: stored (then
cancelled), or not stored and refused from then on. Only a buffer older than submission tokens
leaves that unknown: the cancel is retried for 3 s while it does not know the batch, and the line
then says the submission may still be stored and how to cancel it. A second signal during the cancel
ends the wait, saying that the batch may still be running. A submission the buffer refused
(ALREADY_EXISTS: --batch-id names another batch; INVALID_ARGUMENT...) cancels nothing.

FILE is JSON lines: {"prompt": "...", "prompt_key": "...", "answer": "..."} (or "prompt_token_ids"
instead of "prompt"; other string fields become labels echoed into the results), or plain text, one
prompt per line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from services.cli.flags import positive_int, positive_seconds
from services.cli.signals import StopRequest, signals_to

if TYPE_CHECKING:  # imported where used at run time, as the client's other names here
    from seer_client import BatchCancelled

CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Prompt records from JSON lines or plain text; each has prompt (str | list[int]), key, labels.

    limit: at most this many prompts (None = all); must be at least 1."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: must be at least 1, got {limit}")
    out: list[dict[str, Any]] = []
    for lineno, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if limit is not None and len(out) >= limit:
            break
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
            prompt: str | list[int]
            if "prompt_token_ids" in obj:
                prompt = [int(t) for t in obj["prompt_token_ids"]]
            elif isinstance(obj.get("prompt"), str):
                prompt = obj["prompt"]
            elif isinstance(obj.get("question"), str):
                prompt = obj["question"]
            else:
                raise ValueError(f"{path}:{lineno}: needs a \"prompt\" string or \"prompt_token_ids\"")
            # The first key field present and not empty; not `or`: an id of 0 is a valid key.
            key = next((str(obj[k]) for k in ("prompt_key", "key", "id") if obj.get(k) not in (None, "")), "")
            skip = ("prompt", "prompt_token_ids", "prompt_key", "key")
            labels = {k: str(v) for k, v in obj.items() if k not in skip and isinstance(v, str | int | float)}
        else:
            prompt, key, labels = line, "", {}
        if not key:
            key = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:16]
        out.append({"prompt": prompt, "prompt_key": key, "labels": labels})
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def build_groups(prompts: Sequence[dict[str, Any]], group_size: int, max_tokens: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = False) -> list[Any]:
    from seer_client import PromptGroup, Sampling

    groups = []
    for i, p in enumerate(prompts):
        prompt = p["prompt"]
        if chat and isinstance(prompt, str):
            prompt = CHATML.format(prompt=prompt)
        sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=None if seed is None else seed + i)
        groups.append(PromptGroup(prompt=prompt, group_size=group_size, max_tokens=max_tokens,
                                  prompt_key=p["prompt_key"], sampling=sampling, labels=p["labels"]))
    return groups


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    s = sorted(values)
    if not s:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(s)))
    return float(s[rank - 1])


def summarize(results: Sequence[Any], wall_seconds: float) -> dict[str, Any]:
    """The rollout summary from client RolloutResults and the submit-to-last-result wall time."""
    n = len(results)
    tokens = sum(len(r.token_ids) for r in results)
    latencies = sorted(float(r.latency_seconds) for r in results)
    # Tail: from the moment 90% of the responses were done to the last one (DESIGN.md section 1).
    tail = latencies[-1] - latencies[max(0, math.ceil(0.9 * n) - 1)] if n else 0.0
    steps = sum(int(r.stats.get("steps", 0)) for r in results)
    drafted = sum(int(r.stats.get("draft_tokens", 0)) for r in results)
    accepted = sum(int(r.stats.get("accepted_tokens", 0)) for r in results)
    return {
        "responses": n,
        "tokens": tokens,
        "wall_seconds": round(wall_seconds, 3),
        "tokens_per_second": round(tokens / wall_seconds, 2) if wall_seconds > 0 else 0.0,
        "tail_seconds": round(tail, 3),
        "tail_fraction": round(tail / latencies[-1], 3) if n and latencies[-1] > 0 else 0.0,
        "latency_p50_seconds": round(percentile(latencies, 50), 3),
        "latency_p99_seconds": round(percentile(latencies, 99), 3),
        "mean_accepted_length": round(tokens / steps, 3) if steps else 0.0,
        "draft_acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "finish_reasons": dict(Counter(r.finish_reason for r in results)),
        "policy_versions": sorted({int(r.policy_version) for r in results}),
        "chunks": sum(int(r.num_chunks) for r in results),
    }


def summarize_with_accuracy(results: Sequence[Any], wall_seconds: float) -> dict[str, Any]:
    """summarize(), plus "accuracy" when examples/reward.py scores results that carry an answer
    (the summary of `seer rollout` and `seer demo`)."""
    summary = summarize(results, wall_seconds)
    acc = accuracy(results)
    if acc is not None:
        summary["accuracy"] = round(acc, 4)
    return summary


def run(address: str, groups: Sequence[Any], batch_id: str | None = None, *, progress: bool = True,
        on_result: Callable[[Any], None] | None = None, timeout: float = 3600.0) -> tuple[list[Any], float]:
    """Submits `groups` as one batch and collects every result; returns (results, wall seconds).

    A batch cancelled elsewhere before it completed: the client's BatchCancelled, its .results
    the ones read here, nothing cancelled by this run. Any other way out cancels the batch."""
    from seer_client import BatchCancelled, SeerClient, SeerTimeout

    batch_id = batch_id or f"rollout-{uuid.uuid4().hex[:12]}"
    # This submission's name: the cancel below carries it, and the buffer cancels only the batch
    # stored with it. By id alone, an interrupt before the reply with --batch-id naming another
    # run's live batch cancelled that run's batch.
    token = uuid.uuid4().hex
    total = sum(g.group_size for g in groups)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="resp", desc="rollout", file=sys.stderr, dynamic_ncols=True)
    results: list[Any] = []
    tokens = 0
    with SeerClient(address, retry_seconds=min(timeout, 120.0)) as client:
        # Bounded by --timeout too: an unreachable address waited the full 60 s whatever it said.
        # SeerTimeout (a SeerError) names the address: "buffer at HOST:PORT not ready after Ns".
        client.wait_ready(timeout=min(60.0, timeout))
        t0 = time.monotonic()
        # From the submission on the batch runs on the cluster whether or not anyone reads it: every
        # way out of this function short of the last result cancels it. The submission is inside:
        # a Ctrl-C that lands after the buffer stored the batch but before its reply arrived (the
        # reply is slow under load) left the batch generating, never cancelled. A submission the
        # buffer refused is not cancelled: nothing of ours was stored (see REFUSED).
        submitted = False
        try:
            client.submit_batch(batch_id, groups, submission_token=token)
            submitted = True
            # The deadline rides on the stream: checked per result it would never fire while no
            # result arrives (no scheduler, stuck workers), the very case it is for.
            for r in client.iter_results(batch_id, timeout=max(0.0, timeout - (time.monotonic() - t0))):
                results.append(r)
                if on_result is not None:
                    on_result(r)
                tokens += len(r.token_ids)
                if bar is not None:
                    bar.set_postfix(tokens=tokens, refresh=False)
                    bar.update(1)
        except BatchCancelled as e:
            # Cancelled elsewhere (another process, an operator, `seer` run again) before every
            # response finished: nothing of it is left to cancel, and a cancel of our own reported
            # "cancelled it (3 unfinished responses)", as if this run had cancelled them. The results
            # read so far travel with the error (iter_results leaves its .results empty).
            if bar is not None:
                bar.close()
            e.results = results
            raise
        except BaseException as e:
            # Ctrl-C, a stream that failed for good, an on_result callback that raised: nobody will
            # read the rest, so stop the workers generating it, then let the error through.
            if bar is not None:
                bar.close()
            if not submitted and _refused(e):
                # The buffer refused the submission: nothing of ours is stored, and the id may
                # name another run's batch (ALREADY_EXISTS), which a cancel would stop.
                raise
            if not submitted:
                # Closed first: that cancels the submission still in flight, and the buffer does
                # not store a submission whose call was cancelled (services/buffer: SubmitCancelled).
                client.close()
            what = _cancel_reporting(address, batch_id, token,
                                     retry_not_found=0.0 if submitted else NOT_FOUND_RETRY)
            if isinstance(e, SeerTimeout) and submitted:
                raise TimeoutError(f"batch {batch_id} not done after {timeout}s ({len(results)} of {total} "
                                   f"responses); {what}") from None
            print(f"seer rollout: batch {batch_id}: {what}", file=sys.stderr)
            raise
        wall = time.monotonic() - t0
    if bar is not None:
        bar.close()
    return results, wall


# Status codes of a submission the buffer (or the client's own checks) refused for certain: nothing
# was stored. Any other failure of the call (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN,
# INTERNAL, a Ctrl-C) leaves the outcome unknown: the batch may be stored, so it is cancelled.
REFUSED = frozenset({"INVALID_ARGUMENT", "ALREADY_EXISTS", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                     "NOT_FOUND", "OUT_OF_RANGE", "PERMISSION_DENIED", "UNAUTHENTICATED", "UNIMPLEMENTED"})
# How long a cancel after an interrupted submission retries NOT_FOUND from a buffer older than
# submission tokens (it names batch_id, not submission_token): the submission may still be in that
# buffer's validation, to be stored after the cancel arrived. A buffer that knows tokens answers
# for good at once (it refuses the token from then on): no wait.
NOT_FOUND_RETRY = 3.0


def _refused(e: BaseException) -> bool:
    from seer_client import SeerError

    return isinstance(e, SeerError) and e.code in REFUSED


def _cancel_reporting(address: str, batch_id: str, token: str, retry_not_found: float) -> str:
    """_cancel(), and a line on stderr when a signal interrupts it (a second Ctrl-C during a slow
    cancel): without it the run ended saying nothing about the batch, which may still be running."""
    try:
        return _cancel(address, batch_id, token, retry_not_found)
    except KeyboardInterrupt:
        print(f"seer rollout: cancelling batch {batch_id} was interrupted: it may still be running", file=sys.stderr)
        raise


def _cancel(address: str, batch_id: str, token: str, retry_not_found: float = 0.0) -> str:
    """Best-effort CancelBatch of this run's submission (the one that carried `token`); returns
    what happened. A fresh client with short retries: the run's own client may be the broken part,
    and a user who pressed Ctrl-C should not wait minutes for a buffer that is down (a second
    Ctrl-C ends the wait too).

    retry_not_found: seconds NOT_FOUND from a buffer older than submission tokens is retried for
    (an interrupted submission it may still store); when it holds that long the line says the
    batch may still be stored after all. A buffer that knows tokens answers for good at once."""
    from seer_client import SeerClient, SeerError

    deadline = time.monotonic() + retry_not_found
    try:
        with SeerClient(address, retry_seconds=5.0, timeout=5.0) as client:
            while True:
                try:
                    # The buffer's final answer about this run's submission (cancelled, not stored
                    # and refused from now on, or another submission's batch) is read by the client.
                    outcome = client.cancel_submission(batch_id, token)
                    break
                except SeerError as e:
                    # NOT_FOUND naming batch_id: a buffer older than submission tokens, which may
                    # still store the interrupted submission (or a batch deleted by retention).
                    if e.code != "NOT_FOUND":
                        raise
                    if time.monotonic() >= deadline:
                        if retry_not_found:
                            return (f"nothing to cancel after {retry_not_found:g}s ({e}); the interrupted "
                                    "submission may still be stored: SeerClient"
                                    f"({address!r}).get_batch({batch_id!r}) shows it, .cancel_batch({batch_id!r}) "
                                    "cancels it")
                        return f"nothing to cancel ({e})"
                    time.sleep(0.2)
    except Exception as e:  # best effort: the error that ended the run is the one to report
        return f"cancelling it failed: {e}"
    # The CLI's own wording (the Node client's too), naming this run and the address.
    if outcome.kind == "not_stored":
        return "nothing to cancel: this run's submission was not stored, and the buffer refuses it from now on"
    if outcome.kind == "completed":
        return "nothing to cancel: the batch had completed"
    if outcome.kind == "other_submission":
        return ("not cancelled: the batch id names another submission than this run's (another run's batch, "
                f"left running; SeerClient({address!r}).cancel_batch({batch_id!r}) cancels it)")
    return f"cancelled it ({outcome.num_cancelled} unfinished responses)"


def cancelled_elsewhere(e: BatchCancelled) -> str:
    """The line for a BatchCancelled: the batch was cancelled by someone else than this run."""
    return (f"batch {e.batch_id} was cancelled elsewhere before it completed: {e.num_finished} of "
            f"{e.num_requests} responses finished ({len(e.results)} received here); this run cancelled nothing")


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"responses            {s['responses']}",
        f"tokens               {s['tokens']}",
        f"wall time            {s['wall_seconds']:.2f} s",
        f"throughput           {s['tokens_per_second']:.1f} tokens/s",
        f"tail (last 10%)      {s['tail_seconds']:.2f} s ({100 * s['tail_fraction']:.0f}% of the batch time)",
        f"latency p50 / p99    {s['latency_p50_seconds']:.2f} s / {s['latency_p99_seconds']:.2f} s",
        f"mean accepted length {s['mean_accepted_length']:.2f} tokens/step"
        + (f" (draft acceptance {100 * s['draft_acceptance_rate']:.0f}%)" if s["draft_acceptance_rate"] else ""),
        f"finish reasons       {s['finish_reasons']}",
        f"policy version(s)    {s['policy_versions']}",
    ]
    if "accuracy" in s:
        lines.append(f"reward (accuracy)    {s['accuracy']:.3f}")
    return "\n".join(lines)


def load_reward() -> Callable[[str, str], float] | None:
    """examples/reward.py's reward(text, answer), when the repository's examples are present."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "reward.py"
    spec = importlib.util.spec_from_file_location("seer_example_reward", path)
    if spec is None or spec.loader is None or not path.exists():
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[[str, str], float] = module.reward
    return fn


def accuracy(results: Sequence[Any]) -> float | None:
    """Mean reward (examples/reward.py) over results whose labels carry an answer."""
    reward = load_reward()
    if reward is None:
        return None
    scored = [float(reward(r.text, r.labels["answer"])) for r in results if "answer" in r.labels]
    return sum(scored) / len(scored) if scored else None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="seer rollout", description="submit a batch of prompts and print a summary", allow_abbrev=False
    )
    p.add_argument("--prompts", required=True, help="JSON lines (prompt, prompt_key, answer...) or plain text")
    p.add_argument("--group-size", type=positive_int, required=True, help="samples per prompt (G)")
    p.add_argument("--max-tokens", type=positive_int, required=True, help="max new tokens per response")
    p.add_argument("--address", default="127.0.0.1:50051", help="RolloutService (buffer) address")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="base seed (prompt i uses seed + i)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--batch-id", default=None)
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the ChatML turn of the instruct model")
    # Checked here, by its name: the client's own check named retry_seconds (derived from it).
    p.add_argument("--timeout", type=positive_seconds, default=3600.0,
                   help="seconds from submission; then the batch is cancelled and the exit status is 1")
    p.add_argument("--json", action="store_true", help="print the summary as JSON only")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from seer_client import BatchCancelled, SeerError

    stop = StopRequest()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        # Every signal raises (a second Ctrl-C also ends a slow cancel); the first names the exit.
        stop.handle(signum, frame)
        raise KeyboardInterrupt

    try:
        # Installed explicitly, not left to Python's default: a process started with SIGINT ignored
        # (any `cmd &` of a non-interactive shell, a test run under such a job) inherits SIG_IGN,
        # which Python keeps, so Ctrl-C / kill -INT did nothing and the batch ran on; SIGTERM (a
        # supervisor's or timeout(1)'s stop) killed the process outright, the batch left running.
        # As `seer up` and `seer demo` (services/cli/signals.py), whatever was inherited.
        with signals_to(interrupt):
            prompts = load_prompts(args.prompts, args.limit)
            groups = build_groups(prompts, args.group_size, args.max_tokens, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=args.chat)
            results, wall = run(args.address, groups, args.batch_id,
                                progress=not args.no_progress and not args.json, timeout=args.timeout)
    except BatchCancelled as e:
        # Before the SeerError below: the client's message is right but names no cause, and this
        # run cancelled nothing. Exit 1 as any batch that did not complete (a timeout); no summary,
        # as for a timeout: part of a batch is not its rollout.
        print(f"seer rollout: {cancelled_elsewhere(e)}", file=sys.stderr)
        return 1
    except (ValueError, OSError, TimeoutError, SeerError) as e:
        print(f"seer rollout: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # run() has cancelled the batch already; a traceback would only hide that line. No signal
        # recorded: a KeyboardInterrupt raised some other way (main() on a thread): SIGINT's status.
        signum = stop.signum or signal.SIGINT
        print(f"seer rollout: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    summary = summarize_with_accuracy(results, wall)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
