"""Suite(cpu_affinity=...): each worker pinned to its own core (bench.sched_real needs it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from services.cli.up import ServiceProcess, Suite

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")


def test_service_process_starts_pinned(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    p = ServiceProcess(
        "p", "timeit", ["-n", "1", "import time; time.sleep(20)"], 0, 0, tmp_path, dict(os.environ), cpus=(cpu,)
    )
    p.start()
    try:
        assert p.pid is not None
        assert os.sched_getaffinity(p.pid) == {cpu}
    finally:
        p.kill()
        p.wait(10)


def test_suite_assigns_one_cpu_per_worker(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    s = Suite(workers=3, data_dir=tmp_path, cpu_affinity=cpus[:2], model_dir=sys.prefix)
    assert [s.services[n].cpus for n in s.worker_names] == [(cpus[0],), (cpus[1 % len(cpus[:2])],), (cpus[0],)]
    assert s.services["scheduler"].cpus == () and s.services["buffer"].cpus == ()
    unpinned = Suite(workers=1, data_dir=tmp_path)
    assert unpinned.services["worker-0"].cpus == ()


def test_unavailable_cpu_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpu_affinity"):
        Suite(workers=1, data_dir=tmp_path, cpu_affinity=[max(os.sched_getaffinity(0)) + 1000])
