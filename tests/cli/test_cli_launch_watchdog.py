"""services.cli.launch: a service dies with the parent *process*, not with the thread that started
it (tests/scheduler/test_suite_affinity.py::test_service_dies_with_its_parent covers the former)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from services.cli.up import ServiceProcess


def test_service_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    """Before: PR_SET_PDEATHSIG, which Linux fires when the forking *thread* exits: a service
    (re)started from a helper thread (a thread pool, a test's restart thread) got SIGTERM as soon
    as that thread ended, its parent process alive."""
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), str(tmp_path)])
    sp = ServiceProcess("svc", "sleeper", [], 0, 0, tmp_path, env)

    def starter() -> None:
        sp.start()
        time.sleep(2.0)  # the child is past its launcher setup (where the death signal was armed)

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    try:
        time.sleep(2.0)
        assert sp.alive(), f"the service exited ({sp.returncode}) when the thread that started it ended"
    finally:
        sp.stop(5)


def test_a_malformed_cpu_list_is_refused_by_its_flag(capsys) -> None:  # type: ignore[no-untyped-def]
    """`--cpus abc` was a ValueError traceback after parsing; now argparse names the flag (exit 2)."""
    import pytest

    from services.cli import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(["--cpus", "0,abc", "services.buffer"])
    assert exit_.value.code == 2
    assert "--cpus" in capsys.readouterr().err
