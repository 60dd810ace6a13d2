"""What `seer up` asks the host (Linux /proc and /sys, read-only; an empty answer elsewhere): how
many CPUs this process may really use, and which process listens on a port. No grpc import."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")


def cgroup_cpu_quota(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` grants ("<quota> <period>" in microseconds: "200000 100000" is
    2 CPUs); None for no limit ("max ...") or a text that is not one."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def _cgroup_cpu_max_texts(proc: Path = PROC, root: Path = CGROUP_ROOT) -> list[str]:
    """The cpu.max files (cgroup v2) of this process's cgroup and of every ancestor up to the root:
    a limit on any of them applies. Empty without cgroup v2 (v1 has no cpu.max)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    # v2 is the one line "0::<path>" (a v1 hierarchy has a controller list between the colons).
    paths = [line[3:] for line in lines if line.startswith("0::")]
    if not paths:
        return []
    texts = []
    # Inside a container with its own cgroup namespace the path is "/" and the container's limit is
    # at the root of the mount; on a host the path names the leaf under the root.
    rel = Path(paths[0].lstrip("/"))
    for d in [rel, *rel.parents]:
        try:
            texts.append((root / d / "cpu.max").read_text())
        except OSError:
            continue
    return texts


def _own_affinity() -> set[int]:
    return os.sched_getaffinity(0)


def available_cpus(affinity: Callable[[], Iterable[int]] | None = None,
                   cpu_max_texts: Callable[[], list[str]] | None = None,
                   cpu_count: Callable[[], int | None] = os.cpu_count) -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), capped by
    the cgroup v2 CPU quota (a container's --cpus, a Kubernetes limit) rounded up, at least 1.
    os.cpu_count() counts the host's CPUs whatever the mask or quota: threads sized by it
    oversubscribe a container given 2 of 64 CPUs 32 times over. cpu_count is the fallback where
    there is no affinity call (not Linux)."""
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = _own_affinity
    try:
        n = len(set(affinity())) if affinity is not None else (cpu_count() or 1)
    except OSError:
        n = cpu_count() or 1
    quotas = [q for q in map(cgroup_cpu_quota, (cpu_max_texts or _cgroup_cpu_max_texts)()) if q is not None]
    if quotas:
        n = min(n, math.ceil(min(quotas)))
    return max(1, n)


def _listening_inodes(port: int, proc: Path = PROC) -> set[str]:
    """The socket inodes listening on TCP `port` (IPv4 and IPv6, any address)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is "<hex ip>:<hex port>"; state 0A is LISTEN; the inode is field 9.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_holders(port: int, proc: Path = PROC) -> list[tuple[int, str]]:
    """(pid, command line) of each process listening on TCP `port` that this user may look at; an
    empty list when none is found (not Linux, or another user's process: its fds are not readable)."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:  # gone meanwhile, or not ours
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in wanted:
                try:
                    # One line: arguments (a `python -c` program's newlines too) joined by spaces.
                    cmd = " ".join((d / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
                except OSError:
                    cmd = ""
                found.append((int(d.name), cmd))
                break
    return sorted(found)


def describe_holders(port: int, proc: Path = PROC, limit: int = 80) -> str:
    """Who holds `port`, for an error line: "pid 123 (nc -l 50051)", or that it is not knowable."""
    holders = port_holders(port, proc)
    if not holders:
        return "a process this user cannot see"
    shown = [f"pid {pid} ({cmd[:limit] + ('...' if len(cmd) > limit else '') or '?'})" for pid, cmd in holders]
    return ", ".join(shown)
