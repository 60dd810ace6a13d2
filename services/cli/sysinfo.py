"""What `seer up` asks the host (Linux /proc and /sys, read-only; an empty answer elsewhere): how
many CPUs this process may really use, and which process holds a port. No grpc import."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

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


# /proc/net/tcp's state of a listening socket (include/net/tcp_states.h: TCP_LISTEN).
_LISTEN = "0A"


class PortHolder(NamedTuple):
    """A process holding a TCP port: `listening` on it, or not (the port is the local port of one
    of its connections: an outgoing connection's ephemeral port, which the kernel picks from a range
    that `seer up`'s default ports fall in, or a connection a listener that is gone accepted)."""

    pid: int
    cmd: str
    listening: bool


def _port_inodes(port: int, proc: Path = PROC) -> dict[str, bool]:
    """The inodes of the TCP sockets (IPv4 and IPv6, any address, any state) whose local port is
    `port`, each with whether it listens. Any state: a bind of the port fails beside a connection
    using it as its local port just as beside a listener (services.common.ports.grpc_port_is_free
    counts either as taken). A socket bound but neither listening nor connected is not in
    /proc/net/tcp at all; a TIME_WAIT one has no inode (no process holds it, and SO_REUSEADDR binds
    beside it)."""
    inodes: dict[str, bool] = {}
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is "<hex ip>:<hex port>"; the state is field 3; the inode is field 9.
            if len(fields) <= 9 or fields[9] == "0" or int(fields[1].rsplit(":", 1)[1], 16) != port:
                continue
            inodes[fields[9]] = inodes.get(fields[9], False) or fields[3] == _LISTEN
    return inodes


def port_holders(port: int, proc: Path = PROC) -> list[PortHolder]:
    """Each process holding TCP `port` (listening on it, or with a connection whose local port it
    is) that this user may look at, by pid; `listening` when any of its sockets on the port listens
    (a listener's accepted connections share its port). Empty when none is found (not Linux, another
    user's process: its fds are not readable, or a socket only bound: see _port_inodes)."""
    inodes = _port_inodes(port, proc)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]": listening for i, listening in inodes.items()}
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:  # gone meanwhile, or not ours
            continue
        held: bool | None = None  # None: no socket on the port; else whether one listens
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in wanted:
                held = bool(held) or wanted[target]
                if held:
                    break
        if held is None:
            continue
        try:
            # One line: arguments (a `python -c` program's newlines too) joined by spaces.
            cmd = " ".join((d / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            cmd = ""
        found.append(PortHolder(int(d.name), cmd, held))
    return sorted(found)


def describe_holders(port: int, proc: Path = PROC, limit: int = 80) -> str:
    """Who holds `port`, for an error line (see format_holders)."""
    return format_holders(port_holders(port, proc), limit)


def format_holders(holders: Sequence[PortHolder], limit: int = 80) -> str:
    """port_holders' answer for an error line: "pid 123 (nc -l 50051)"; "pid 7 (python ...) (a
    connection's local port)" for one that does not listen on it (it may be a connection of seer's
    own); or, none visible, what it may be."""
    if not holders:
        # A connection's side that closed first keeps the port in TIME_WAIT (no process, a minute).
        return ("a process this user cannot see (another user's, or a connection's local port, which "
                "frees itself once that connection has closed, up to a minute later)")
    shown = []
    for h in holders:
        cmd = h.cmd[:limit] + ("..." if len(h.cmd) > limit else "") or "?"
        shown.append(f"pid {h.pid} ({cmd})" + ("" if h.listening else " (a connection's local port)"))
    return ", ".join(shown)


def holders_remedy(holders: Sequence[PortHolder]) -> str:
    """What frees a port that `holders` (port_holders' answer) hold, for the line that says a
    service cannot have it back: a listener is stopped; a connection's local port (an outgoing
    connection's ephemeral port, maybe of a service of this very suite: stopping that process is
    no remedy) frees itself when the connection closes."""
    if any(h.listening for h in holders):
        return "stop that process"
    if holders:
        return "it frees itself once that connection has closed (up to a minute later)"
    return "stop that process, or wait for that connection to close"
