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
import os
import runpy
import signal
import sys
import threading
import time

from services.cli.flags import int_list

# How often the watchdog looks for its parent: the delay between the parent's death and the SIGTERM.
_WATCHDOG_INTERVAL = 0.5


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the parent dies, so a crashed `seer up` (or test) never leaves a
    suite running. Exits now if the parent is already gone.

    Not PR_SET_PDEATHSIG: Linux sends that signal when the parent *thread* that forked the child
    exits, not the parent process, so a service started (or restarted) from a helper thread of
    `seer up`, a test or a benchmark was SIGTERMed as soon as that thread ended. A daemon thread
    that polls getppid() is process-scoped and portable: when the parent process dies the child is
    re-parented (to init or a subreaper) and getppid() changes. It sends SIGTERM to this process,
    so the service drains through its own handler as it does on `seer up`'s stop.
    """
    parent = parent_pid or os.getppid()
    if os.getppid() != parent:
        sys.exit(f"launch: parent {parent_pid} exited before the service started")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCHDOG_INTERVAL)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m services.cli.launch")
    ap.add_argument("--parent-pid", type=int, default=0, help="die with this process")
    ap.add_argument("--cpus", type=int_list(minimum=0), default=(), help="comma-separated CPUs to pin to")
    ap.add_argument("module", help="the service module, run as __main__")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cpus:
        # Before the service (or the watchdog below) starts any thread, so every thread inherits
        # the mask.
        os.sched_setaffinity(0, args.cpus)
    die_with_parent(args.parent_pid)
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
