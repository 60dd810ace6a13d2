"""Suite(cpu_affinity=...): each worker pinned to its own core (bench.sched_real needs it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
        # The launcher pins itself before it runs the module (so before any thread starts).
        deadline = time.monotonic() + 20
        while os.sched_getaffinity(p.pid) != {cpu} and time.monotonic() < deadline and p.alive():
            time.sleep(0.05)
        assert os.sched_getaffinity(p.pid) == {cpu}
        assert p.alive(), "the module did not run"
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


def test_service_cpus_pin_every_other_service(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    s = Suite(workers=2, data_dir=tmp_path, cpu_affinity=cpus[-1:], service_cpus=cpus[:1], model_dir=sys.prefix)
    assert [s.services[n].cpus for n in s.worker_names] == [(cpus[-1],), (cpus[-1],)]
    others = [n for n in s.services if n not in s.worker_names]
    assert sorted(others) == ["buffer", "draft", "kvstore", "scheduler"]
    assert all(s.services[n].cpus == (cpus[0],) for n in others)


def test_unavailable_cpu_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpu_affinity"):
        Suite(workers=1, data_dir=tmp_path, cpu_affinity=[max(os.sched_getaffinity(0)) + 1000])
    with pytest.raises(ValueError, match="service_cpus"):
        Suite(workers=1, data_dir=tmp_path, service_cpus=[max(os.sched_getaffinity(0)) + 1000])


def test_service_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent that crashes (here: exits without stopping anything) takes its services with it."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from services.cli.up import ServiceProcess\n"
        f"p = ServiceProcess('p', 'timeit', ['-n', '1', 'import time; time.sleep(60)'], 0, 0, Path({str(tmp_path)!r}),"
        " dict(os.environ))\n"
        "p.start()\n"
        "print(p.pid, flush=True)\n"
        "import time; time.sleep(1.5)\n"  # the child is past its launcher setup
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init soon) counts as gone
                if f.read().split(")")[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail(f"service {pid} outlived its parent")
