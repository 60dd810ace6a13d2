"""A real worker (`python -m services.worker`) whose engine turns broken on cue, for the tests of
the health supervision of `seer up` and `seer demo`: a real engine cannot be broken on cue (the
reference engine is never broken by a weight load), and nothing else of a worker is changed.

    python -m services.cli.launch ... -- breakable_worker --worker-id worker-0 ...

Each launch appends its pid to $SEER_TEST_MARKS/<worker id>.launches; its engine reports itself
broken (Engine.broken, which the worker reads after each engine step, then turns its gRPC health
NOT_SERVING for good, as after a failed weight load) while $SEER_TEST_MARKS/<worker id>.break holds a
number >= its launch number ("1": the first launch only, so a restart mends it; "99": every launch).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from services.worker.engines.reference.engine import ReferenceEngine


def _worker_id(argv: list[str]) -> str:
    return argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "worker"


def main() -> None:
    marks = Path(os.environ["SEER_TEST_MARKS"])
    name = _worker_id(sys.argv)
    with open(marks / f"{name}.launches", "a") as f:
        f.write(f"{os.getpid()}\n")
    launch = len((marks / f"{name}.launches").read_text().split())
    cue = marks / f"{name}.break"

    def broken(_engine: ReferenceEngine) -> str | None:
        try:
            return "broken on cue by the test" if int(cue.read_text().strip() or 0) >= launch else None
        except (OSError, ValueError):
            return None

    # A class attribute: the engine the worker builds is a ReferenceEngine (the default engine).
    ReferenceEngine.broken = property(broken)  # type: ignore[assignment,method-assign]
    runpy.run_module("services.worker", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
