"""`seer demo`: start the suite, run a sample rollout on examples/prompts.jsonl, print the summary, stop.

    seer demo [--workers 1] [--limit 8] [--group-size 4] [--max-tokens 48] [--json]

Ctrl-C or SIGTERM while the suite starts or the rollout runs (as `seer up`): the batch is cancelled,
the suite stopped, its temporary data removed (kept, with the logs, if a service did not stop
cleanly), one line says so, and the exit status is 128 + the signal number.

While the rollout runs, the services are watched by `seer up`'s HealthSupervisor: a service that
exits, or whose gRPC health answers NOT_SERVING for longer than --health-grace (default 60 s, as
`seer up`), ends the demo: a line names it and its log files (<logs>/<service>.log, its stdout
<logs>/<service>.out), the batch is cancelled, the suite stopped, the logs kept, exit status 1.
Unlike `seer up` it restarts nothing (see _Watch).

As in `seer up`, the suite's services also read their SEER_<SERVICE>_<FIELD> variables (and config
files): --policy, --chunk-size and --speculation given here override them (a `seer demo: warning:`
line names both), left out they yield to them, else the demo's defaults apply (policy seer, chunk
size 32, speculation on). The embedded model is the default of SEER_WORKER_MODEL_DIR /
SEER_BUFFER_MODEL_DIR too. A bad setting (option or variable) is refused before anything starts
(exit 2, naming it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from services.cli import rollout
from services.cli.flags import positive_int, positive_seconds
from services.cli.signals import StopRequest, signals_to
from services.cli.up import (
    DEFAULT_POLICY,
    HEALTH_GRACE_SECONDS,
    HealthSupervisor,
    Suite,
    SuiteArgumentError,
    SuiteError,
    SuiteInterrupted,
    ensure_embedded_model,
    flag_error,
    policy_choices,
    prepare_model,
    stop_keeping_data,
)

EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"
# The demo's chunk size when neither --chunk-size nor the scheduler's own configuration sets one:
# smaller than the suite's 512, so that the demo's short responses are dispatched in several chunks.
DEMO_CHUNK_SIZE = 32
# The signal the watch thread (_Watch) wakes the main thread with when a service failed: the main
# thread is blocked in the result stream, which only a signal handler's exception ends.
WAKE_SIGNAL = signal.SIGUSR1
# How often the watch thread looks for exited services (its health checks are HealthSupervisor's).
_WATCH_INTERVAL = 0.5


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="seer demo", description="start the suite, run a sample rollout, stop", allow_abbrev=False,
        epilog="Each service also reads SEER_<SERVICE>_<FIELD> variables (and SEER_<SERVICE>_CONFIG, a JSON "
               "file): --policy, --chunk-size and --speculation left out here yield to them, given here override "
               "them (with a warning). Every service's configuration is checked before anything starts.")
    # At least 1: a suite without workers would wait out the rollout's hour-long timeout.
    p.add_argument("--workers", type=positive_int, default=1)
    p.add_argument("--prompts", default=str(EXAMPLE_PROMPTS))
    p.add_argument("--limit", type=int, default=8, help="prompts to use")
    p.add_argument("--group-size", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    # Suite settings: None = not chosen, so that a SEER_SCHEDULER_* / SEER_WORKER_* variable (or a
    # config file) applies; a value given here overrides it. Before, the defaults below were always
    # passed as chosen values and silently beat the variables.
    p.add_argument("--policy", choices=policy_choices(), default=None,
                   help=f"scheduling policy (default {DEFAULT_POLICY}, or SEER_SCHEDULER_POLICY)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help=f"max new tokens per chunk (default {DEMO_CHUNK_SIZE}, or SEER_SCHEDULER_CHUNK_SIZE)")
    p.add_argument("--speculation", choices=["on", "off"], default=None,
                   help="grouped speculative decoding (default on, or SEER_WORKER_SPECULATION)")
    p.add_argument("--base-port", type=int, default=0, help="first port (0 = any free ports)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON only")
    p.add_argument("--health-grace", type=positive_seconds, default=HEALTH_GRACE_SECONDS,
                   help="end the demo when a service's gRPC health answers NOT_SERVING for longer than this "
                        f"(default {HEALTH_GRACE_SECONDS:.0f} s, as `seer up`, which restarts it instead; inf: never)")
    return p.parse_args(list(argv))


class _Interrupted(BaseException):
    """Raised by the signal handler to end a rollout that is waiting on the result stream.

    A BaseException, as KeyboardInterrupt: rollout.run cancels the batch on its way out, and no
    `except Exception` on the way swallows it."""


class _DemoStop(StopRequest):
    """`seer up`'s stop request (polled by Suite.start), plus `armed`: while set, the handler also
    raises _Interrupted. A flag alone is not enough there: rollout.run blocks in the result stream,
    which polls nothing, and could wait out its one-hour timeout. `failed`: set by the watch thread
    (_Watch) when a service failed; its WAKE_SIGNAL ends the rollout the same way (wake).
    `wakeable`: whether wake is WAKE_SIGNAL's handler (main() on the main thread: signals_to); without
    it a failed service is reported once the rollout ends, not as it fails."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.failed = False
        self.wakeable = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        super().handle(signum, frame)
        self._raise_once(signum)

    def wake(self, signum: int, _frame: FrameType | None) -> None:
        """WAKE_SIGNAL's handler: ends the rollout when a service failed (a WAKE_SIGNAL from
        elsewhere, with none failed, changes nothing)."""
        if self.failed:
            self._raise_once(signum)

    def _raise_once(self, signum: int) -> None:
        if self.armed:
            self.armed = False  # raised once only: a second signal must not break the cancel or the stop
            raise _Interrupted(signum)


class _Watch:
    """`seer up`'s HealthSupervisor on a thread while the rollout runs (the main thread is blocked in
    the result stream): a service that exits, or answers NOT_SERVING for longer than the grace, is
    reported on stderr with its log files, and ends the rollout (stop.failed, then WAKE_SIGNAL to the
    main thread). Before, the demo noticed neither: a dead or broken worker left the batch waiting
    out the rollout's one-hour timeout.

    Never a restart (HealthSupervisor's limit 0): the demo is a one-shot check that the suite
    works, so a service that broke is its result, to be shown with an exit status 1, not papered
    over with a summary that looks normal; and a restart waits out the grace and a model load,
    longer than the demo's batch. `seer up`, which serves for hours, restarts instead."""

    def __init__(self, suite: Suite, stop: _DemoStop, grace: float) -> None:
        self._stop = stop
        self._say = lambda line: print(line, file=sys.stderr, flush=True)
        self.health = HealthSupervisor(suite.services, self._say, command="seer demo", grace=grace, limit=0)
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="seer-demo-watch", daemon=True)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        # Before the suite is stopped: its own SIGTERMs are no failures.
        self._done.set()
        self._thread.join()

    def failed(self) -> list[str]:
        return sorted(self.health.failed())

    def _run(self) -> None:
        while not self._done.wait(_WATCH_INTERVAL):
            # An exit is said by the supervisor itself (limit 0: "seer demo: <name> exited with code
            # N; see <logs>") and counts in failed().
            self.health.tick(self._done)
            if self.health.failed():
                self._stop.failed = True
                if self._stop.wakeable and self._main is not None:
                    signal.pthread_kill(self._main, WAKE_SIGNAL)
                return


def _rollout(stop: _DemoStop, address: str, groups: Sequence[Any], progress: bool) -> tuple[list[Any], float] | None:
    """rollout.run, or None when a signal or a failed service stopped it (the batch is cancelled by then)."""
    try:
        # Armed before the check: a signal in between either set the flag (seen here) or raises.
        stop.armed = True
        try:
            if stop.is_set() or stop.failed:  # after the suite was up but before the rollout
                return None
            return rollout.run(address, groups, f"demo-{uuid.uuid4().hex[:8]}", progress=progress)
        finally:
            stop.armed = False
    except _Interrupted:  # also when it lands in the finally above, before the disarm
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    say = (lambda *_a: None) if args.json else (lambda *a: print(*a, flush=True))

    try:
        # Before the model and the suite: a bad --limit or prompts file should cost neither.
        prompts = rollout.load_prompts(args.prompts, args.limit)
    except (ValueError, OSError) as e:
        print(f"seer demo: {e}", file=sys.stderr)
        return 1
    say("preparing the embedded model ...")
    # A lambda: ensure_embedded_model is looked up when called (tests replace it in this module).
    model_dir = prepare_model("seer demo", lambda: ensure_embedded_model())
    if model_dir is None:
        return 128 + signal.SIGINT
    stop = _DemoStop()
    # From before Suite(), which creates the temporary data directory: from here on a signal must
    # not end the process before that directory is removed.
    # WAKE_SIGNAL too: only the watch thread sends it (installed from here on: its default action
    # would end the process).
    with signals_to(stop.handle), signals_to(stop.wake, (WAKE_SIGNAL,)) as stop.wakeable:
        try:
            # Only the options given are chosen values (as in `seer up`); the embedded model is a
            # default too, which SEER_WORKER_MODEL_DIR / SEER_BUFFER_MODEL_DIR override.
            suite = Suite(workers=args.workers, base_port=args.base_port, policy=args.policy,
                          default_model_dir=model_dir, chunk_size=args.chunk_size,
                          default_chunk_size=DEMO_CHUNK_SIZE,
                          speculation=None if args.speculation is None else args.speculation == "on",
                          warn=lambda message: print(f"seer demo: warning: {message}", file=sys.stderr))
        except SuiteArgumentError as e:  # a usage error (an option or a variable), as in `seer up`
            print(f"seer demo: {flag_error(e)}", file=sys.stderr)
            return 2
        return _run(args, prompts, suite, stop, say)


def _run(args: argparse.Namespace, prompts: list[dict[str, Any]], suite: Suite, stop: _DemoStop,
         say: Callable[..., None]) -> int:
    from seer_client import BatchCancelled, SeerError

    say(f"starting the suite ({args.workers} worker(s)) ...")
    try:
        # The stop flag is polled while the workers load (as in `seer up`), so a signal does not wait
        # for the start timeout.
        suite.start(stop=stop, keep_data_on_error=True)
    except SuiteInterrupted:  # Suite.start has stopped the services and removed the temporary data
        print(f"seer demo: stopped by {stop.describe()} before the suite was up", file=sys.stderr)
        return 128 + stop.signum
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
        done: tuple[list[Any], float] | None = None
        watch = _Watch(suite, stop, args.health_grace)
        with watch:
            try:
                done = _rollout(stop, suite.address, groups, progress=not args.json)
            except BatchCancelled as e:  # by someone else (an operator): said so, as `seer rollout` does
                print(f"seer demo: {rollout.cancelled_elsewhere(e)}", file=sys.stderr)
                failed = True
            except (ValueError, TimeoutError, SeerError) as e:
                print(f"seer demo: {e}", file=sys.stderr)
                failed = True
        if done is not None and not stop.is_set():
            _show(args, *done, say)
        # After the watch ended: its findings are final. A failure that came as the rollout ended
        # (the wake then raised nothing) fails the demo as well.
        broken = watch.failed()
        if broken:
            stopped = "" if done is not None or failed or stop.is_set() else "; the rollout was stopped"
            print(f"seer demo: service(s) failed while the demo ran ({', '.join(broken)}){stopped}",
                  file=sys.stderr)
            failed = True
    except Exception:
        failed = True
        raise
    finally:
        say("stopping the suite ...")
        # The logs outlive the temporary data directory when something went wrong.
        bad = stop_keeping_data(suite, say)
        if bad or failed:
            print(f"seer demo: logs kept in {suite.log_dir}", file=sys.stderr)
        else:
            suite.remove_data()
        if stop.is_set():
            print(f"seer demo: stopped by {stop.describe()}", file=sys.stderr)
    if stop.is_set():
        return 128 + stop.signum
    return 1 if bad or failed else 0


def _show(args: argparse.Namespace, results: list[Any], wall: float, say: Callable[..., None]) -> None:
    summary = rollout.summarize_with_accuracy(results, wall)
    if args.json:
        print(json.dumps(summary))
        return
    if results:  # none only for an empty batch (a cancelled one raises BatchCancelled before this)
        best = max(results, key=lambda r: len(r.token_ids))
        say(f"\nsample response ({best.prompt_key}, answer {best.labels.get('answer', '?')}): {best.text!r}\n")
    say(rollout.format_summary(summary))


if __name__ == "__main__":
    raise SystemExit(main())
