"""`seer up` with the real suite: a worker whose engine breaks is restarted for its health, the
suite serves on, and a normal stop then exits 0.

Every service is the real one on loopback with the embedded model; the only change is the worker's
engine, which reports itself broken on cue (breakable_worker.py: a real engine cannot be broken on
cue), so the worker turns its gRPC health NOT_SERVING for good as after a failed weight load.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import BREAKABLE_WORKERS, breakable_env, finish, launches, run_up, wait_for_line

_UP = BREAKABLE_WORKERS + """
import sys
sys.exit(_up.main(["--base-port", "0", "--workers", "1", "--health-grace", "1"]))
"""


@pytest.fixture
def up(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    yield from run_up(_UP, breakable_env(tmp_path))


def test_up_exits_0_after_a_restart_that_mended_a_broken_worker(up: subprocess.Popen[str], tmp_path: Path) -> None:
    """Before: every service the health supervision had restarted counted as failed, so a suite
    whose restarted worker served on (both batches below done on it) and whose services all
    drained cleanly exited 1 ("service(s) failed (worker-0)")."""
    from seer_client import PromptGroup, SeerClient

    head = wait_for_line(up, "trainer API", timeout=120)
    m = re.search(r"RolloutService\): (\S+)", head[-1])
    assert m, head
    [first] = launches(tmp_path, "worker-0")
    (tmp_path / "marks" / "worker-0.break").write_text("1")  # the first launch only: a restart mends it
    with SeerClient(m.group(1)) as client:
        # Its first engine step breaks the worker's engine: NOT_SERVING, restarted after 1 s.
        client.submit_batch("before", [PromptGroup(prompt="Say hello.", group_size=1, max_tokens=8)])
        deadline = time.monotonic() + 60
        while len(launches(tmp_path, "worker-0")) < 2:
            assert time.monotonic() < deadline and up.poll() is None, "worker-0 was not restarted"
            time.sleep(0.2)
        # The suite serves on: the restarted worker registers and generates.
        after = client.run_batch("after", [PromptGroup(prompt="Say hi.", group_size=2, max_tokens=8)], timeout=90)
        assert len(after) == 2
        assert len(client.collect("before", timeout=60)) == 1
    assert launches(tmp_path, "worker-0")[0] == first and len(launches(tmp_path, "worker-0")) == 2
    up.send_signal(signal.SIGINT)
    code, out, err = finish(up, timeout=60)
    assert code == 0, f"exit status {code}\n{out}\n{err}"
    assert "stopped cleanly" in out and "exited" not in out, out
    restarts = re.findall(r"seer up: worker-0 NOT_SERVING since .*; restarting it \(restart 1, 1 of at most 3 in a "
                          r"row\); see (\S+) \(stdout (\S+)\)", err)
    assert len(restarts) == 1, err
    log, stdout = (Path(x) for x in restarts[0])
    assert stdout == log.with_suffix(".out"), restarts
    assert f"seer up: restarted and SERVING since: worker-0; logs kept in {log.parent}" in err, err
    assert "failed" not in err, err
    # The broken launch's log is what tells why the worker was restarted: kept.
    assert "the engine is broken" in log.read_text()
