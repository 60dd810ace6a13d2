"""Starts one service module of `seer up` after setting up its own process:

    python -m services.cli.launch [--parent-pid PID] [--cpus 0,1] -- services.scheduler [args...]

Why not subprocess's preexec_fn: it runs Python between fork and exec in the parent's copy, and the
parent (`seer up`, a test, a benchmark) has gRPC threads. gRPC's fork handlers restart its poller
in the child, and closing the inherited descriptors before exec then made it abort ("epoll_wait
error: Bad file descriptor", SIGABRT): services died at start, intermittently. Here the new process
does the setup itself, before importing anything of gRPC, then runs the module as __main__.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the parent dies, so a crashed `seer up` (or test) never leaves a
    suite running (Linux; elsewhere a no-op). Exits now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent_pid and os.getppid() != parent_pid:
        sys.exit(f"launch: parent {parent_pid} exited before the service started")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.cli.launch")
    ap.add_argument("--parent-pid", type=int, default=0, help="die with this process")
    ap.add_argument("--cpus", default="", help="comma-separated CPUs to pin to")
    ap.add_argument("module", help="the service module, run as __main__")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    if args.cpus:
        # Before the service starts any thread, so every thread inherits the mask.
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
