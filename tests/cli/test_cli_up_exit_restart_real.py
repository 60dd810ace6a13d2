"""`seer up` with the real suite restarts services that are killed: a worker and then the scheduler
are SIGKILLed while a batch runs, `seer up` starts each again on its own address, the batch
completes with every response exactly once, and a Ctrl-C afterwards exits 0.

Every service is the real one on loopback with the embedded model; nothing is stubbed. Before, a
worker's kill was only reported (the worker left down, exit 1 at the end) and the scheduler's
stopped the whole suite (exit 1), though a rerun of `seer up --data-dir` recovers every response.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import finish, pids_with, run_up, wait_for_line

# Small chunks: each response spans several, so a kill lands between a response's chunks.
_UP = """
import sys
from services.cli import up
sys.exit(up.main(["--base-port", "0", "--workers", "2", "--chunk-size", "8"]))
"""


@pytest.fixture
def up(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    yield from run_up(_UP, dict(os.environ, TMPDIR=str(tmp_path)))


def _pid(up: subprocess.Popen[str], module: str, *args: str) -> int:
    """The pid of `seer up`'s launch of `module` (with `args` on its command line)."""
    [pid] = pids_with("services.cli.launch", "--parent-pid", str(up.pid), module, *args)
    return pid


def _relaunched(up: subprocess.Popen[str], old: int, module: str, *args: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        assert up.poll() is None, "seer up stopped"
        found = [p for p in pids_with("services.cli.launch", "--parent-pid", str(up.pid), module, *args) if p != old]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{module} {args} was not started again"
        time.sleep(0.1)


def test_a_killed_worker_and_scheduler_are_restarted_and_the_batch_completes_once(
        up: subprocess.Popen[str]) -> None:
    from seer_client import PromptGroup, SeerClient

    head = "".join(wait_for_line(up, "trainer API", timeout=120))
    m = re.search(r"RolloutService\): (\S+)", head)
    assert m, head
    address = m.group(1)
    sched_address = re.search(r"  scheduler\s+(\S+)", head)
    assert sched_address, head
    # Long enough that the batch is still running when the scheduler is killed (~0.4 s after the
    # worker's relaunch is seen): 48 tokens left ~2 s of margin here, less on a faster CPU.
    groups = [PromptGroup(prompt=f"Count from 1 to 100, number {i}.", group_size=2, max_tokens=128) for i in range(4)]
    with SeerClient(address) as client:
        client.submit_batch("b", groups)
        deadline = time.monotonic() + 60
        # Mid-batch: some tokens generated, not all.
        while sum(r.generated_tokens for r in client.get_batch("b", include_requests=True).requests) == 0:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.1)
        worker = _pid(up, "services.worker", "worker-0")
        os.kill(worker, signal.SIGKILL)
        _relaunched(up, worker, "services.worker", "worker-0")
        assert client.get_batch("b").state != "completed", "the batch ended before the scheduler's kill"
        scheduler = _pid(up, "services.scheduler")
        os.kill(scheduler, signal.SIGKILL)
        _relaunched(up, scheduler, "services.scheduler")
        results = client.collect("b", timeout=180)
    # The restarted scheduler serves on its old address (the workers and the buffer hold it).
    from services.cli.up import health_status

    assert health_status(sched_address.group(1)) == "SERVING"
    # Every response exactly once, each whole.
    assert sorted((r.group_index, r.sample_index) for r in results) == [(g, s) for g in range(4) for s in range(2)]
    assert len({r.request_id for r in results}) == 8
    assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in results)
    # No wait for a health check: `seer up` checks each restarted service once more at the stop.
    up.send_signal(signal.SIGINT)
    code, out, err = finish(up, timeout=60)
    assert code == 0, f"exit status {code}\n{out}\n{err}"
    assert "stopped cleanly" in out, out
    for name in ("worker-0", "scheduler"):
        assert re.search(rf"seer up: {name} exited with code -9; restarting it \(restart 1, 1 of at most 3 in a "
                         rf"row\); see \S+/{name}.log", err), err
    assert "seer up: restarted and SERVING since: scheduler, worker-0; logs kept in" in err, err
    assert "failed" not in err, err
