"""The CPUs `seer up` sizes its workers' threads by (services/cli/sysinfo.py available_cpus): the
process's affinity mask and the cgroup v2 CPU quota, not os.cpu_count() (the host's CPUs, whatever
taskset or a container's limit allow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cli import sysinfo
from services.cli.up import Suite


@pytest.mark.parametrize(("text", "cpus"), [
    ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("max 100000\n", None), ("", None), ("x 100000", None),
    ("0 100000", None), ("100000", None)])
def test_cgroup_cpu_quota(text: str, cpus: float | None) -> None:
    assert sysinfo.cgroup_cpu_quota(text) == cpus


@pytest.mark.parametrize(("affinity", "quotas", "cpus"), [
    ({0, 1, 2, 3}, [], 4),
    ({0, 1, 2, 3}, ["max 100000"], 4),
    ({0, 1, 2, 3}, ["150000 100000"], 2),  # 1.5 CPUs of time: 2 threads, rounded up
    ({0, 1, 2, 3}, ["max 100000", "100000 100000"], 1),  # an ancestor's limit applies too
    ({5}, ["800000 100000"], 1),  # taskset -c 5: the quota does not add CPUs
    ({0, 1, 2, 3}, ["10000 100000"], 1),  # a tenth of a CPU: still one thread
])
def test_available_cpus_is_the_affinity_capped_by_the_quota(affinity: set[int], quotas: list[str], cpus: int) -> None:
    assert sysinfo.available_cpus(lambda: affinity, lambda: quotas, cpu_count=lambda: 64) == cpus


def test_cpu_max_is_read_for_the_process_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/x\n0::/kubepods/pod1/c1\n")
    for d, text in (("", "max 100000\n"), ("kubepods/pod1", "300000 100000\n"), ("kubepods/pod1/c1", "max 100000\n")):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "cpu.max").write_text(text)
    texts = sysinfo._cgroup_cpu_max_texts(proc, root)
    assert sorted(texts) == sorted(["max 100000\n", "300000 100000\n", "max 100000\n"])
    (proc / "self" / "cgroup").write_text("4:memory:/x\n")  # cgroup v1 only: no cpu.max
    assert sysinfo._cgroup_cpu_max_texts(proc, root) == []


def test_suite_sizes_worker_threads_by_the_cpus_it_may_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: os.cpu_count() // workers, 32 threads per worker here where 4 CPUs (and a 3-CPU
    quota) are all there is: each worker's torch ran 8 times as many threads as CPUs."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr(sysinfo, "_cgroup_cpu_max_texts", lambda: ["300000 100000\n"])
    suite = Suite(workers=2, data_dir=tmp_path, metrics=False, draft=False, kvstore=False)
    assert suite.threads_per_worker == 1  # 3 CPUs of quota over 2 workers
    assert suite.services["worker-0"].env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(sysinfo, "_cgroup_cpu_max_texts", lambda: [])
    assert Suite(workers=2, data_dir=tmp_path, metrics=False, draft=False, kvstore=False).threads_per_worker == 2
