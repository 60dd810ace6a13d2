"""`seer up`: the whole suite on loopback, one process per service; and `Suite`, the same as a
context manager for tests and benchmarks.

    seer up [--workers N] [--data-dir D] [--base-port P] [--policy P] [--speculation on|off]

Starts kvstore, draft, scheduler, buffer and N workers (`python -m services.<name>`), each on a
port chosen here (base port + offset, or a free one), waits until every service reports SERVING on
the standard gRPC health service and every worker has registered with the scheduler, prints the
endpoints, and on Ctrl-C stops everything: SIGTERM (each service drains and exits 0), then
SIGKILL after a timeout. Ctrl-C / SIGTERM while the suite is still starting stops it too.

Each service binds 127.0.0.1 unless its configuration says otherwise (SEER_<SERVICE>_HOST, or a
--host / --config in a Suite's extra_args); the suite dials it, for health checks and for the
other services' wiring, on that host (127.0.0.1 for a wildcard host: see dial_host).

While the suite runs, `seer up` supervises it (see HealthSupervisor, which `seer demo` shares with
no restarts at all): a service that exits on its own (a crash, a kill -9), any of them, the buffer
and the scheduler included, is started again with the same command line, ports and data directory (a
line on stderr names its exit code and log files; a port another process took meanwhile moves a
worker, which registers its new address with the scheduler, and any /metrics port to a free one; the
buffer, scheduler, draft and kvstore keep theirs, which the others and the clients dial: that try
fails, its line naming the port and the process holding it, or that it is a connection's local port,
which frees itself; under --base-port every /metrics port is kept likewise, on port+100 where
scrapers look, as at the start; a moved port is never one the suite uses); a service whose gRPC
health answers NOT_SERVING for longer than --health-grace (default 60 s, as the Helm liveness probe:
a worker whose engine a failed weight load broke stays NOT_SERVING for good) is restarted likewise.
Both count towards one limit, HEALTH_RESTART_LIMIT restarts of a service in a row without a SERVING
answer in between (a service that crashes at once in a loop is not restarted for ever). Past it a
service that exited is left down and reported, except the buffer or the scheduler, whose exit then
stops the suite (nothing works without them; the state is kept and the line says how to resume it),
and so does the last worker left down (the suite would accept batches and finish none); one that
stays NOT_SERVING is reported and left as it is (every worker so: an error line, once). A restart
rebuilds what the service held (the documented paths, as after a rerun of `seer up --data-dir` by
hand): the buffer from RocksDB in the data directory, the scheduler from the buffer's work snapshot,
the kvstore from its RocksDB tier (pages a crash caught in DRAM only are misses: re-prefilled), the
draft's groups from the workers, which register them again, and its history from the buffer; a
worker registers again and its chunks re-run. Nothing else is restarted: the others reconnect to the
same address. A service that does not answer at all is left alone while its process lives: it may
only be busy.

Exit status: 0 when every service ran until the stop (or was restarted and answered SERVING since:
the restart mended it) and drained cleanly; 1 when the suite could not start, a service exited or
stayed NOT_SERVING past the restart limit (a buffer, scheduler or last worker left down past it also
stops the suite), a restart did not mend a service (not SERVING since its last restart at the stop),
or a service did not stop cleanly. The data directory, with the services' logs, is then kept even
when it is the default temporary one (`seer up --data-dir <it>` resumes that state); so it is after
a restart that mended its service (the broken launch's log tells why). 128 + the signal number when
stopped by a signal before the suite was up; 2 when a flag, or a service's configuration (its
SEER_<SERVICE>_* variables included), is refused (before anything starts).

The data directories such failures keep in the temporary directory (seer-suite-*) are never removed
automatically (each resumes its run); `seer up` says at start how many there are and where. Each
worker gets OMP/MKL threads for its share of the CPUs this process may use: its affinity mask
(taskset, a cpuset) capped by a cgroup v2 CPU quota (services/cli/sysinfo.py), not the host's count.

An option given here is passed to its services as a flag and overrides their SEER_<SERVICE>_<FIELD>
variable (a warning names both); one left out yields to that variable or a config file, else the
suite's default applies.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from services.cli.flags import positive_int, positive_seconds
from services.cli.signals import StopRequest, signals_to
from services.cli.sysinfo import available_cpus, describe_holders, format_holders, holders_remedy, port_holders
from services.common.log import get_logger, kv
from services.common.ports import BindAddress, addresses_port_is_free, dial_host, host_addresses
from services.common.service_configs import config_class

log = get_logger(__name__)

# Offsets from --base-port; metrics ports are base + 100 + offset (base + 200 + offset, 300, ...
# when there are so many workers that their gRPC ports would reach base + 100: see _metrics_offset).
_BUFFER, _SCHEDULER, _DRAFT, _KVSTORE, _WORKER0 = 0, 1, 2, 3, 10
_METRICS_OFFSET = 100

# The services without which the suite does no work at all: `seer up` stops when one of them is down
# past the restart limit (a worker, the draft or the kvstore left down only degrade it: the scheduler
# re-runs a lost worker's chunks).
CENTRAL_SERVICES = ("buffer", "scheduler")


def stop_together(procs: Sequence[ServiceProcess], timeout: float) -> dict[str, int | None]:
    """SIGTERM every process, wait for all of them against one deadline, SIGKILL the rest; returns
    exit codes by name. One deadline: N processes that ignore SIGTERM cost `timeout` once, not N
    times (each waiting its own full timeout after the previous one's)."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    return {proc.name: proc.stop(max(0.0, deadline - time.monotonic())) for proc in procs}


# The temporary data directories' prefix (in tempfile.gettempdir()): see earlier_state_dirs.
STATE_DIR_PREFIX = "seer-suite-"


def earlier_state_dirs(own: Path) -> list[Path]:
    """The temporary data directories in the temporary directory other than `own`: kept by earlier
    runs (after a failure, or a restart that mended its service), or in use by a suite running now;
    oldest first."""
    try:
        # Resolved: a run resumed with a relative (or symlinked) --data-dir named its own directory
        # otherwise than the glob does, and counted it as an earlier one.
        own = own.resolve()
        found = [p for p in Path(tempfile.gettempdir()).glob(STATE_DIR_PREFIX + "*")
                 if p.is_dir() and p.resolve() != own]
        return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))
    except OSError:  # one removed meanwhile: not worth failing the start for
        return []


def earlier_state_note(dirs: Sequence[Path]) -> str:
    """`seer up`'s line at start about earlier kept state directories ("" for none). They are not
    removed: each holds a run's state and logs, which `seer up --data-dir <dir>` resumes (and one
    may belong to a suite running now); so they pile up until someone removes them."""
    if not dirs:
        return ""
    where = dirs[0].parent
    return (f"seer up: note: {len(dirs)} state director{'y' if len(dirs) == 1 else 'ies'} of earlier runs in {where} "
            f"({STATE_DIR_PREFIX}*, the newest {dirs[-1].name}): kept after a failure or a restart (or in use by "
            "a suite running now); `seer up --data-dir <dir>` resumes one, `rm -r <dir>` removes one not needed")


class SuiteError(RuntimeError):
    """The suite could not start (a service exited or never became healthy); names the service."""


class SuiteArgumentError(ValueError):
    """A Suite argument, or a service configuration the suite would start, refused before anything
    was started; `field` names the Suite argument (the `seer` commands report it by its flag: see
    flag_error). setting: for a value that came from elsewhere, what the user set it with (an
    environment variable, a config file, an extra argument), named instead of a flag."""

    def __init__(self, field: str, detail: str, *, setting: str | None = None) -> None:
        super().__init__(f"{setting or field}: {detail}")
        self.field = field
        self.detail = detail
        self.setting = setting


def flag_error(e: SuiteArgumentError) -> str:
    """The refusal as `seer up` and `seer demo` print it: by the flag that set the argument
    (--base-port, not base_port, which no user typed), or by the variable or file that did."""
    if e.setting is not None:
        return f"{e.setting}: {e.detail}"
    return f"--{e.field.replace('_', '-')}: {e.detail}"


class SuiteInterrupted(Exception):
    """Suite.start was asked to stop (its stop flag was set) before the suite was up."""


class StopFlag(Protocol):
    """What Suite.start polls for a stop request: a threading.Event, or StopRequest (`seer up`, `seer demo`)."""

    def is_set(self) -> bool: ...


def _metrics_offset(workers: int) -> int:
    """The offset of the metrics ports from the base port: 100 unless the workers' gRPC ports
    (base + 10 + i) would reach it, then the next multiple of 100 above them, so that no gRPC port
    of a fixed layout is also a metrics port."""
    last_grpc = _WORKER0 + workers - 1
    return max(_METRICS_OFFSET, (last_grpc // 100 + 1) * 100)


# Relaunches of a service that exited because its port was taken (see Suite._relaunch_after_port_clash).
_PORT_CLASH_RETRIES = 3

# The suite's defaults for the settings a caller may leave unset (None). Unlike a value the caller
# chose, a default is passed to a service only when nothing else sets that field: a
# SEER_<SERVICE>_<FIELD> variable or a config file then applies, as the services document.
DEFAULT_POLICY = "seer"
DEFAULT_CHUNK_SIZE = 512
DEFAULT_SPECULATION = True
# 1 s, not the scheduler's 2 s: a suite on one machine notices a killed worker sooner.
DEFAULT_HEARTBEAT_INTERVAL = 1.0

# Each service's configuration class, by section (module:class), imported when the suite checks
# the configuration it will start (config modules import no grpc and no torch).
# Fields the suite always sets itself: its port plan and the services' wiring. A variable setting
# one is overridden (with a warning): the suite could not reach or wire a service elsewhere.
_WIRING = ("port", "metrics_port", "buffer_address", "scheduler_address", "draft_address", "kv_addresses",
           "worker_id")


def _section(name: str) -> str:
    """The configuration section (SEER_<SECTION>_*) of suite service `name`: "worker" for every
    worker-N (ServiceProcess.section, for a service not built yet)."""
    return "worker" if name.startswith("worker-") else name


def _flag_value(value: object) -> str:
    """A value as a service flag takes it (booleans as true/false, which the config parser reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _configured_host(section: str, args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The host a service of `section` started with `args` and `env` will bind its gRPC port on,
    resolved as the service resolves it (--host, SEER_<SERVICE>_HOST, a --config file, else
    127.0.0.1: extra_args or the caller's environment may set any of them); None when that
    configuration cannot be read (the service itself then exits naming it, reported by
    wait_healthy)."""
    from services.common.config import ServiceConfig, load_field

    try:
        host = str(load_field(ServiceConfig, section, "host", args, env))
    except (ValueError, OSError):
        return None
    # "" is refused by gRPC itself ("host must not be empty"): the service exits naming it; a port
    # probe of "" failed and blamed a taken port.
    return host or None


def _bind_host(s: ServiceProcess) -> str | None:
    """The host service `s` will bind its gRPC port on (see _configured_host)."""
    return _configured_host(s.section, s.args, s.env)


# The host the metrics server binds: every address (services.common.telemetry), probed as a wildcard.
METRICS_HOST = "::"
# Kernel picks free_port checks on the service's host before it gives up.
_FREE_PORT_TRIES = 100


def _probe_addresses(host: str) -> list[BindAddress] | None:
    """The addresses free_port checks a port on for a server bound to `host`, resolved once by
    services.common.ports.host_addresses (as grpc_port_is_free resolves it, so the two cannot
    differ): those this host has; None when `host` cannot be bound at all (an address this host
    does not have, a name that does not resolve). The test is a bind of port 0, which fails only
    for such a reason, never because a port is taken."""
    usable = [a for a in host_addresses(host) if addresses_port_is_free([a], 0)]
    return usable or None


def free_port(host: str = "127.0.0.1") -> int:
    """A port a server bound to `host` could bind now: the kernel's pick of a free port on
    127.0.0.1, checked on the host itself as the service binds it (services.common.ports
    .host_addresses: a wildcard host on every address, an IP literal that address, a name the
    addresses it resolves to, resolved once). Before: the pick on 127.0.0.1 alone, so a service
    bound to [::1], another interface's address or every address could be handed a port taken
    there, and failed at its bind after the start.

    A host that cannot be bound at all (an address this host does not have, a name that does not
    resolve) gets the 127.0.0.1 pick unchecked: the service then exits naming its real bind error
    (as for an unreadable configuration, see _configured_host). Checking every pick there called
    each one taken ("no free port found") and, for a name, resolved it once per pick (15 s of DNS
    lookups for a name that does not resolve)."""
    addresses = _probe_addresses(host)
    for _ in range(_FREE_PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        # Each address on its own: one that went away since the port-0 test counts as taken here.
        if addresses is None or all(addresses_port_is_free([a], port) for a in addresses):
            return port
    raise SuiteError(f"no port free on {host} found in {_FREE_PORT_TRIES} tries")


@dataclass
class ServiceProcess:
    """One service process: its command line, ports and log files; restartable."""

    name: str
    module: str
    args: list[str]
    port: int
    metrics_port: int
    log_dir: Path
    env: dict[str, str]
    # CPUs the process (and every thread it starts) may run on; empty = no restriction.
    cpus: tuple[int, ...] = ()
    # The host the suite dials this service on (dial_host of the host it binds): health checks,
    # the other services' wiring, the endpoints printed.
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    _files: list[IO[bytes]] = field(default_factory=list)
    _term_sent: bool = False
    # Size of the stderr log when this process was launched: the log is opened in append mode and
    # outlives restarts and runs (same --data-dir), so only what follows is this launch's output.
    _log_start: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def section(self) -> str:
        """The service's configuration section (SEER_<SECTION>_*): its module's name, "worker" for
        every worker."""
        return self.module.rsplit(".", 1)[-1]

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"{self.name}.out"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        # Through services.cli.launch: the child sets up die-with-parent and its CPU mask itself
        # (no preexec_fn: see that module for why).
        launch = [sys.executable, "-m", "services.cli.launch", "--parent-pid", str(os.getpid())]
        if self.cpus:
            launch += ["--cpus", ",".join(str(c) for c in self.cpus)]
        return [*launch, "--", self.module, *self.args]

    def start(self) -> None:
        if self.alive():
            return
        self._close_files()
        out = open(self.stdout_path, "ab")  # noqa: SIM115 - held open for the child's lifetime
        try:
            err = open(self.stderr_path, "ab")  # noqa: SIM115
        except OSError:
            out.close()
            raise
        self._files = [out, err]
        self._log_start = os.fstat(err.fileno()).st_size
        # A new session: Ctrl-C in the terminal reaches `seer up` only, which stops the services
        # in order instead of all of them at once.
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=err, env=self.env, start_new_session=True)
        self._term_sent = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            # Once only: a second SIGTERM that lands while the interpreter finalizes (handlers back
            # to default) would turn a clean exit 0 into "killed by SIGTERM".
            if self._term_sent:
                return
            self._term_sent = True
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, SIGKILL; returns the exit code (0 = clean drain)."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        code = self.wait(timeout)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.wait(10.0)
        self._close_files()
        return code

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10.0)

    def _close_files(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files = []

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines the current (or last) launch wrote to stderr; earlier launches'
        output in the same log file is left out (it would blame this launch for an old error)."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def health_status(address: str, timeout: float = 1.0) -> str:
    """SERVING / NOT_SERVING / UNKNOWN / UNREACHABLE from the standard gRPC health service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


# Health supervision while `seer up` runs (HealthSupervisor). The grace is the Helm liveness
# probe's (6 failures 10 s apart: helm/seer/templates/_helpers.tpl), so a worker broken by a failed
# weight load is restarted about as soon here as under Kubernetes.
HEALTH_GRACE_SECONDS = 60.0
# At most one health RPC per service this often (less often than the 0.5 s exit check: each one
# dials a channel); shorter for a grace shorter than 4 of them (see HealthSupervisor).
HEALTH_CHECK_INTERVAL = 5.0
# Restarts of one service in a row without a SERVING answer in between, for its health or after an
# exit: one broken at start, or crashing at once, is then reported and left, not restarted for ever
# (the grace, waited out anew after each restart's start, spaces health restarts out; exits are
# spaced by EXIT_RESTART_BACKOFF).
HEALTH_RESTART_LIMIT = 3
# Seconds before the second restart in a row after an exit, doubled for each further one (the first
# is at once: clients retry for 60 s). No wait for the port: every service's listeners set
# SO_REUSEADDR (gRPC's always, the metrics server's http.server default), so a port the dead process
# left in TIME_WAIT binds again; the backoff is for a crash whose cause may pass (a peer restarting).
EXIT_RESTART_BACKOFF = 1.0
# SIGTERM to SIGKILL for a service being restarted (it drains; a broken worker has nothing to drain).
HEALTH_RESTART_STOP_TIMEOUT = 15.0


def see_logs(s: ServiceProcess) -> str:
    """Where a line about service `s` sends the reader: its structured log (stderr: a crash's
    traceback is there) and its stdout file (what it printed, console tracing's spans)."""
    return f"see {s.stderr_path} (stdout {s.stdout_path})"


def _bind_failed(s: ServiceProcess) -> bool:
    """Whether the last launch of `s` died at a bind of one of its ports (as a gRPC server, or the
    metrics server, logs it: see Suite._relaunch_after_port_clash)."""
    tail = s.tail(40)
    return any(m in tail for m in ("Address already in use", "Failed to bind", ": cannot bind"))


def _set_flag(args: list[str], flag: str, value: int) -> None:
    """Sets every `flag` in `args` ("--port 1" and "--port=1") to `value`, in place."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            args[i + 1] = str(value)
        elif a.startswith(flag + "="):
            args[i] = f"{flag}={value}"


@dataclass
class _HealthState:
    """HealthSupervisor's record of one service."""

    next_check: float = 0.0
    # Monotonic and wall-clock time of the first NOT_SERVING answer of the current unbroken run of
    # them (None: the last answer was something else).
    since: float | None = None
    since_wall: float = 0.0
    restarts: int = 0  # by this supervisor, in all
    in_a_row: int = 0  # since the last SERVING answer
    given_up: bool = False
    # A restart under way: SIGTERM sent; SIGKILL at this monotonic time if it is still alive.
    kill_at: float | None = None
    # Why the last relaunch failed (its log could not be opened, say); the next exit check words
    # its line by it, not by the exit code of the process that died before (a stale code).
    launch_error: str = ""
    # A restart under way whose process is gone (or going: kill_at): started again at this monotonic
    # time (after an exit, EXIT_RESTART_BACKOFF; for its health, at once).
    start_at: float | None = None


class HealthSupervisor:
    """Watches a running suite's services, for `seer up` and `seer demo`. A service that exits on
    its own (not for a restart of ours) is started again (ServiceProcess.start: the same command
    line, ports and data directory, its logs appended to), and one whose gRPC health answers
    NOT_SERVING continuously for longer than `grace` seconds is restarted (a worker whose engine is
    broken, services/worker/README.md, Weights, is alive and useless until restarted); both at most
    `limit` times in a row without a SERVING answer in between, one count for both. Past it a
    service is given up on: one that exited is left down and reported (tick returns it; the caller
    decides what its loss means), one NOT_SERVING is reported once and left as it is.
    limit 0 (`seer demo`): never restarted; an exit is returned at once, NOT_SERVING given up on at
    the first overrun of the grace.
    Only a NOT_SERVING answer counts for health: any other answer (SERVING, no answer in time,
    UNKNOWN) ends the run, so a busy service that does not answer is never killed by this rule.

    tick() does not wait for a restart's SIGTERM: it starts the process again on a later tick, once
    the old one is gone, so a Ctrl-C or another service's exit is still noticed meanwhile. Only a
    process that outlives HEALTH_RESTART_STOP_TIMEOUT is SIGKILLed and waited for (bounded: the
    kill's own wait), and each health check waits up to a second for its answer. `say` gets one line
    per exit, restart or give-up, prefixed with `command`, naming the service's log files.
    fixed_metrics_ports: a /metrics port another process took is kept (see _clear_ports), not moved
    (`seer up --base-port`)."""

    def __init__(self, services: Mapping[str, ServiceProcess], say: Callable[[str], None], *,
                 command: str = "seer up", grace: float = HEALTH_GRACE_SECONDS,
                 interval: float = HEALTH_CHECK_INTERVAL, limit: int = HEALTH_RESTART_LIMIT,
                 stop_timeout: float = HEALTH_RESTART_STOP_TIMEOUT, check: Callable[[str], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, backoff: float = EXIT_RESTART_BACKOFF,
                 pick_port: Callable[[str], int] = free_port, fixed_metrics_ports: bool = False) -> None:
        if limit < 0:
            raise ValueError(f"limit: must be >= 0, got {limit}")
        self._services = services
        self._say = say
        self._command = command
        self.grace = grace
        self.backoff = backoff
        # A few checks within the grace, so that it is not overshot by a whole interval.
        self.interval = max(0.25, min(interval, grace / 4))
        self.limit = limit
        self._stop_timeout = stop_timeout
        # Looked up at each call (not bound here): tests of `seer up` replace up.health_status.
        self._check = check or (lambda address: health_status(address))
        self._clock = clock
        # A free port on a host, for a port another process took while its service was down
        # (`seer up`: Suite.pick_port, which never hands out a port of the suite's own).
        self._pick_port = pick_port
        # `seer up --base-port`: the layout puts each /metrics on its gRPC port + 100, where scrapers
        # are pointed, as the start does (Suite._relaunch_after_port_clash): a taken one is kept, the
        # relaunch refused naming its holder like a central service's gRPC port, not moved.
        self._fixed_metrics_ports = fixed_metrics_ports
        self._state = {name: _HealthState() for name in services}
        # Services that exited on their own (not for a restart of ours) and were not started again
        # (the limit reached, limit 0, or a stop requested), in the order noticed.
        self.exited: list[str] = []

    def restarting(self, name: str) -> bool:
        """Whether `name` is being restarted (its process may be gone: no exit to report)."""
        st = self._state[name]
        return st.kill_at is not None or st.start_at is not None

    def given_up(self) -> set[str]:
        """The services left as they are, NOT_SERVING past the limit (until a SERVING answer)."""
        return {n for n, st in self._state.items() if st.given_up}

    def failed(self) -> set[str]:
        """The services that failed: exited on their own, given up on, or restarted for their
        health and not seen SERVING since the last restart (one still restarting, or broken again).
        A service that a restart mended (SERVING since) is no failure: see recovered()."""
        return set(self.exited) | {n for n, st in self._state.items() if st.given_up or st.in_a_row}

    def recovered(self) -> set[str]:
        """The services restarted (after an exit or for their health) that answered SERVING since
        (and were not left down)."""
        return {n for n, st in self._state.items() if st.restarts and not st.in_a_row and not st.given_up} - set(
            self.exited)

    def check_restarted(self) -> None:
        """A health check now of each service restarted (or given up on) and not seen SERVING since
        (before the suite is stopped): the last restart may have mended it less than a check
        interval ago."""
        for name, s in self._services.items():
            st = self._state[name]
            # Only a SERVING answer is taken: no restart or give-up is started on the way out.
            # A service given up on is checked too: a SERVING answer clears it as a tick's does
            # (_observe), so the verdict does not hang on which of the two saw the answer.
            if (st.in_a_row or st.given_up) and not self.restarting(name) and s.alive() \
                    and self._check(s.address) == "SERVING":
                st.in_a_row, st.given_up, st.since = 0, False, None

    def tick(self, stop: StopFlag | None = None) -> list[str]:
        """One round of health checks (each service at most once per interval) and restarts, then
        the exit check, which restarts a service that exited within the limit; returns the services
        that exited on their own since the last tick and are left down (past the limit, limit 0, or
        a stop requested: no restart is started on the way out)."""
        for name, s in self._services.items():
            if stop is not None and stop.is_set():
                break  # each check may take a second: a Ctrl-C is not held up by the rest
            st = self._state[name]
            now = self._clock()
            if self.restarting(name):
                self._continue_restart(s, st, now)
            elif s.alive() and now >= st.next_check:
                st.next_check = now + self.interval
                self._observe(s, st, self._check(s.address), now)
        exited = []
        for name, s in self._services.items():
            # A process being restarted here did not exit on its own.
            if s.alive() or name in self.exited or self.restarting(name):
                continue
            stopping = stop is not None and stop.is_set()
            if stopping or not self._restart_exited(s, self._state[name], self._clock()):
                self.exited.append(name)
                exited.append(name)
        return exited

    def _restart_exited(self, s: ServiceProcess, st: _HealthState, now: float) -> bool:
        """Service `s` exited on its own: started again (at once for the first restart in a row,
        then after a doubling backoff) unless the limit is reached; whether it is. The restart is
        `seer up`'s rerun by hand, done for the user: the same command line and data directory,
        so the same ports (workers and clients hold those addresses) and the same state; only a
        port another process took meanwhile may change (see _clear_ports)."""
        if st.launch_error:
            what = f"could not be started again ({st.launch_error})"
        else:
            # A launch that died at its bind (the port free when probed, taken before the child's
            # bind): said as such, not as a bare "exited with code 1". Only then: a port taken after
            # a crash of another cause is no cause (the relaunch says it, see _clear_ports).
            taken = self._taken_ports(s) if _bind_failed(s) else []
            what = f"exited with code {s.returncode}" + (f" ({'; '.join(taken)})" if taken else "")
        st.launch_error = ""
        delay = self.backoff * 2 ** (st.in_a_row - 1) if st.in_a_row else 0.0
        return self._restart(s, st, now, what, delay=delay, code=s.returncode)

    def _observe(self, s: ServiceProcess, st: _HealthState, status: str, now: float) -> None:
        if status != "NOT_SERVING":
            st.since = None
            if status == "SERVING":
                st.in_a_row, st.given_up = 0, False
            return
        if st.since is None:
            st.since, st.since_wall = now, time.time()
            return
        if now - st.since <= self.grace or st.given_up:
            return
        since = f"NOT_SERVING since {datetime.fromtimestamp(st.since_wall):%H:%M:%S} ({now - st.since:.0f} s)"
        if not self._restart(s, st, now, since, delay=0.0, stop_first=True):
            st.given_up = True

    def _restart(self, s: ServiceProcess, st: _HealthState, now: float, what: str, *, delay: float,
                 stop_first: bool = False, code: int | None = None) -> bool:
        """The one restart path, after an exit and for health: within the limit, counts the restart
        (in all and in a row: only a SERVING answer, _observe, resets the row), says it and starts
        it (stop_first: SIGTERM the live process first, SIGKILL after the stop timeout; the new
        launch `delay` seconds from now); past the limit, says so and returns False (the caller
        records what giving up means: left down after an exit, left as it is for health).
        `what` is what happened, as the line says it."""
        if st.in_a_row >= self.limit:
            if self.limit:
                why = f"; not restarted again: {st.in_a_row} restart(s) in a row did not mend it"
            else:  # `seer demo`: never restarted; an exit is only said, NOT_SERVING by its grace
                why = f"; longer than the {self.grace:g} s grace" if stop_first else ""
            self._say(f"{self._command}: {s.name} {what}{why}; {see_logs(s)}")
            return False
        st.restarts += 1
        st.in_a_row += 1
        st.since = None
        when = f" in {delay:g} s" if delay else ""
        self._say(f"{self._command}: {s.name} {what}; restarting it{when} (restart {st.restarts}, "
                  f"{st.in_a_row} of at most {self.limit} in a row); {see_logs(s)}")
        log.warning("restarting a service", extra=kv(service=s.name, reason="health" if stop_first else "exit",
                                                     code=code, pid=s.pid, restarts=st.restarts, delay_s=delay))
        if stop_first:
            s.signal(signal.SIGTERM)
            st.kill_at = now + self._stop_timeout
        st.start_at = now + delay
        self._continue_restart(s, st, now)
        return True

    def _taken_ports(self, s: ServiceProcess) -> list[str]:
        """The ports of `s` (not running) that another process holds now, each with who holds it
        (as far as this user can see): "port 50061 on 127.0.0.1 is taken by pid 42 (nc -l 50061)"."""
        from services.common.ports import grpc_port_is_free
        from services.common.telemetry import metrics_port_is_free

        taken = []
        host = _bind_host(s) if s.port else None
        if host is not None and not grpc_port_is_free(host, s.port):
            taken.append(f"port {s.port} on {host} is taken by {describe_holders(s.port)}")
        if s.metrics_port and not metrics_port_is_free(s.metrics_port):
            taken.append(f"metrics port {s.metrics_port} is taken by {describe_holders(s.metrics_port)}")
        return taken

    def _movable(self, s: ServiceProcess) -> bool:
        """Whether `s` may be relaunched on another gRPC port: a worker, which registers its address
        with the scheduler at each start (the scheduler dials it there, nothing else holds it),
        unless it advertises a fixed address (advertise_address: whoever set it expects that port).
        The buffer, scheduler, draft and kvstore keep theirs: the other services were started with
        their addresses and the clients dial them."""
        if s.section != "worker":
            return False
        from services.common.config import load_field

        try:
            return not load_field(config_class("worker"), "worker", "advertise_address", s.args, s.env)
        except (ValueError, OSError):
            return False  # unreadable: the service itself names the error at its start

    def _clear_ports(self, s: ServiceProcess) -> str:
        """Before a relaunch of `s`: a port that another process took since its last launch (its own
        is gone) would make the launch fail at its bind. A worker's gRPC port and any service's
        metrics port (nothing in the suite dials it; not with fixed_metrics_ports) are picked anew,
        said in a line; a central service's gRPC port is kept (a fixed metrics port too), and the
        returned reason (the port and who holds it) stands in for the launch, counted as a try like a
        launch that failed. "" when the launch may go."""
        from services.common.ports import grpc_port_is_free
        from services.common.telemetry import metrics_port_is_free

        if s.metrics_port and not metrics_port_is_free(s.metrics_port):
            if self._fixed_metrics_ports:
                holders = port_holders(s.metrics_port)
                return (f"its metrics port {s.metrics_port} is taken by {format_holders(holders)}; it keeps that "
                        f"port (--base-port: /metrics on port+100, where scrapers look): {holders_remedy(holders)}")
            try:
                new = self._pick_port(METRICS_HOST)
            except SuiteError as e:
                return f"its metrics port {s.metrics_port} is taken by {describe_holders(s.metrics_port)}: {e}"
            old, s.metrics_port = s.metrics_port, new
            _set_flag(s.args, "--metrics-port", s.metrics_port)
            self._say(f"{self._command}: {s.name}'s metrics port {old} is taken by {describe_holders(old)}: "
                      f"its /metrics moves to port {s.metrics_port}")
        host = _bind_host(s) if s.port else None
        if host is None or grpc_port_is_free(host, s.port):
            return ""
        holders = port_holders(s.port)
        holder = format_holders(holders)
        if not self._movable(s):
            return (f"its port {s.port} on {host} is taken by {holder}; it keeps that port (the other services "
                    f"and the clients dial it): {holders_remedy(holders)}")
        try:
            new = self._pick_port(host)
        except SuiteError as e:  # none free: counted as a failed try, as a launch that failed
            return f"its port {s.port} on {host} is taken by {holder} and no other is free: {e}"
        old, s.port = s.port, new
        _set_flag(s.args, "--port", s.port)
        self._say(f"{self._command}: {s.name}'s port {old} on {host} is taken by {holder}: starting it on port "
                  f"{s.port} (it registers its new address with the scheduler)")
        return ""

    def _continue_restart(self, s: ServiceProcess, st: _HealthState, now: float) -> None:
        if st.kill_at is not None:
            if s.alive():
                if now < st.kill_at:
                    return
                s.kill()  # SIGKILL, waited for (bounded)
                if s.alive():
                    return  # not reaped yet: the next tick looks again
            st.kill_at = None
        if st.start_at is not None and now < st.start_at:
            return
        st.start_at = None
        s.wait(0.0)  # reap it
        blocked = self._clear_ports(s)
        if blocked:
            # Not launched (it would die at its bind): the next tick's exit check counts it as a
            # try, worded by launch_error, with the backoff that gives the other process time to go.
            st.launch_error = blocked
            return
        try:
            s.start()  # a new launch: same ports and arguments, log appended to
        except OSError as e:
            # Its log cannot be opened (a full disk), say: left dead, the next tick's exit check
            # counts it as another try (towards the limit, worded by launch_error) instead of a
            # traceback ending `seer up`.
            st.launch_error = str(e)
            return
        # Its start (a worker loads its model) is not NOT_SERVING time: the grace is waited out anew.
        st.next_check = now + self.interval


class Suite:
    """The whole suite as subprocesses on loopback.

    with Suite(workers=2, data_dir=tmp) as suite:
        client = SeerClient(suite.address)
        ...
        suite.kill("buffer"); suite.restart("buffer")
    """

    def __init__(
        self,
        workers: int = 1,
        data_dir: str | os.PathLike[str] | None = None,
        base_port: int = 0,
        policy: str | None = None,
        speculation: bool | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        chunk_size: int | None = None,
        heartbeat_interval: float | None = None,
        tracing: str | None = None,
        metrics: bool = True,
        env: Mapping[str, str] | None = None,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        threads_per_worker: int | None = None,
        draft: bool = True,
        kvstore: bool = True,
        cpu_affinity: Sequence[int] | None = None,
        service_cpus: Sequence[int] | None = None,
        default_model_dir: str | os.PathLike[str] | None = None,
        default_chunk_size: int = DEFAULT_CHUNK_SIZE,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """policy, speculation, chunk_size, heartbeat_interval, model_dir, data_dir: None = not
        chosen: the services' own configuration (SEER_<SERVICE>_<FIELD>, a config file, extra_args)
        applies where it sets the field, else the suite's default (DEFAULT_*; default_chunk_size for
        chunk_size; default_model_dir for model_dir, nothing when that is None; a temporary
        directory for data_dir). A value given here is passed as the service's flag, which
        outranks its environment: a variable it overrides is reported through warn (default: a
        warning log line), naming both.
        Every service's configuration is checked, as the service will load it, before anything is
        created: a bad value is a SuiteArgumentError naming the argument or the variable that set it.

        cpu_affinity: pin worker i to CPU cpu_affinity[i % len(cpu_affinity)] (benchmarks: one
        core per worker, so workers do not steal each other's cores); None = no pinning.
        service_cpus: the CPUs every other service (buffer, scheduler, draft, kvstore) may run on;
        None = no restriction. Benchmarks that compare worker-side costs keep those processes off
        the worker's core (bench.spec --suite: their CPU otherwise lands on the timed worker)."""
        if workers < 0:
            raise SuiteArgumentError("workers", f"must be >= 0, got {workers}")
        self._metrics_offset = _metrics_offset(workers)
        # The highest port of the fixed layout: the last worker's metrics port.
        span = self._metrics_offset + _WORKER0 + workers - 1
        if not 0 <= base_port <= 65535 - 200:
            raise SuiteArgumentError("base_port", f"{base_port} leaves no room for the suite's ports "
                                     f"(0 for any free ports, or at most {65535 - 200})")
        if base_port and base_port + span > 65535:
            raise SuiteArgumentError("base_port", f"{base_port} leaves no room for the suite's ports "
                                     f"(with {workers} workers the last would be {base_port + span}, above 65535)")
        self.num_workers = workers
        # Every port handed out by free_port(): the kernel may return a number it returned a moment
        # ago (the socket was closed), and two services given one port cannot both start.
        self._picked_ports: set[int] = set()
        self.cpu_affinity = tuple(cpu_affinity or ())
        self.service_cpus = tuple(service_cpus or ())
        # Every argument check before mkdtemp below: a refused Suite leaked its temporary directory.
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name, pinned in (("cpu_affinity", self.cpu_affinity), ("service_cpus", self.service_cpus)):
            for cpu in pinned:
                if cpu not in allowed:
                    raise SuiteArgumentError(name, f"CPU {cpu} is not available (allowed: {sorted(allowed)})")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix=STATE_DIR_PREFIX))
        self.base_port = base_port
        self.policy = policy
        self.speculation = speculation
        self.model_dir = str(model_dir) if model_dir is not None else ""
        self.default_model_dir = str(default_model_dir) if default_model_dir is not None else ""
        self.chunk_size = chunk_size
        # `seer demo` has a default of its own (small chunks, so its short responses span several).
        self.default_chunk_size = default_chunk_size
        self.heartbeat_interval = heartbeat_interval
        self._data_dir_chosen = data_dir is not None
        self._warn = warn or (lambda message: log.warning(message))
        self._warned: set[str] = set()
        # Per service: the Suite argument behind each flag the suite passed for a chosen value
        # (an error in that field is then reported by the argument, i.e. `seer up`'s option).
        self._chosen_flags: dict[str, dict[str, str]] = {}
        self.tracing = tracing
        self.metrics = metrics
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.with_draft, self.with_kvstore = draft, kvstore
        self.log_dir = self.data_dir / "logs"
        self.services: dict[str, ServiceProcess] = {}
        # The CPUs this process may use (its affinity mask, a cgroup CPU quota), not the host's:
        # os.cpu_count() in a container given 2 of 64 CPUs gave each worker 64 threads.
        cpus = available_cpus()
        self.threads_per_worker = threads_per_worker or max(1, cpus // max(1, workers))
        try:
            self._env = self._child_env(env)
            self._build()  # may run out of free ports (SuiteError)
            self._check_configs()
        except BaseException:
            # No Suite to stop() later: the directory created above would outlive the failure.
            self.remove_data()
            raise

    # ---- construction --------------------------------------------------------------------------

    def _child_env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        # Children must import services/ and seer.v1 even when the project is not installed.
        root = Path(__file__).resolve().parents[2]
        paths = [str(root), str(root / "protos"), str(root / "clients" / "python")]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if self.tracing is not None:
            if env.get("SEER_TRACING", self.tracing) != self.tracing:
                self._warn_once(f"--tracing {self.tracing} overrides SEER_TRACING={env['SEER_TRACING']}")
            env["SEER_TRACING"] = self.tracing
        env.update(extra or {})
        return env

    def _warn_once(self, message: str) -> None:
        # Once per message: N workers share one section, so one variable, and one warning.
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)

    def _others(self, name: str) -> dict[str, Any]:
        """The fields of service `name` that its extra_args, the suite's environment or a config
        file set (services.common.config.configured)."""
        from services.common.config import configured

        section = _section(name)
        return configured(config_class(section), section, self.extra_args.get(name, []), self._env)

    def _setting(self, name: str, field: str, chosen: object, default: object, argument: str) -> list[str]:
        """The flag for `field` of service `name`: the chosen value (Suite argument `argument`; a
        variable or file it overrides is reported), else the default when nothing else sets the
        field, else none (the service's own configuration applies)."""
        flag = "--" + field.replace("_", "-")
        source = self._others(name).get(field)
        if chosen is None:
            return [] if source is not None or default is None else [flag, _flag_value(default)]
        if source is not None and source.kind == "env":
            self._warn_once(f"--{argument.replace('_', '-')} {_flag_value(chosen)} overrides "
                            f"{source.name}={self._env.get(source.name, '')}")
        elif source is not None and source.kind == "file":
            self._warn_once(f"--{argument.replace('_', '-')} {_flag_value(chosen)} overrides {field} in {source.name}")
        if source is None or source.kind != "flag":  # an extra argument comes later and wins
            self._chosen_flags.setdefault(name, {})[field] = argument
        return [flag, _flag_value(chosen)]

    def _warn_wiring(self, s: ServiceProcess) -> None:
        """A variable or file setting a field the suite sets itself (a port, an address) is
        overridden: said once, so that the user does not wonder why it has no effect."""
        others = self._others(s.name)
        for key in _WIRING:
            source = others.get(key)
            if ("--" + key.replace("_", "-")) in s.args and source is not None and source.kind != "flag":
                shown = f"{source.name}={s.env.get(source.name, '')}" if source.kind == "env" else \
                    f"{key} in {source.name}"
                self._warn_once(f"{shown} is overridden: the suite sets the {s.section}'s {key.replace('_', ' ')}")

    def _check_configs(self) -> None:
        """Loads every service's configuration as the service will (its flags, its environment, a
        config file) and validates it, before anything starts: a bad value was found only when the
        service exited at start ("exited with code 2 before becoming healthy"), after the others
        had started and with a data directory left behind."""
        from services.common.config import ConfigError, Resolved, resolve

        models: dict[str, tuple[str, str]] = {}  # service -> (model_dir, where it came from)
        for name, s in self.services.items():
            self._warn_wiring(s)
            try:
                resolved: Resolved[Any] = resolve(config_class(s.section), s.section, s.args, s.env,
                                                  exit_on_error=False)
            except ConfigError as e:
                raise self._refusal(name, e) from None
            except OSError as e:  # a config file that cannot be read
                raise SuiteArgumentError(name, f"configuration: {e}", setting=f"{name} configuration") from None
            if s.section in ("buffer", "worker"):
                source = resolved.sources.get("model_dir")
                models[name] = (str(getattr(resolved.config, "model_dir", "") or ""),
                                str(source) if source is not None else "default")
        self._check_one_model(models)

    def _check_one_model(self, models: Mapping[str, tuple[str, str]]) -> None:
        """The buffer and the workers on one model: the buffer tokenizes prompt_text and checks
        token ids and lengths with its model_dir's vocabulary and context, so a worker on another
        model generates from ids checked against the wrong model, silently. Each side's model_dir
        can come from its own variable or config file (SEER_WORKER_MODEL_DIR alone, say) when
        --model-dir is not given: refused here, naming both. Compared as each resolves it: the
        buffer's "auto" (its default) and a worker's "" are the embedded model's directory; a
        buffer's "" is no model (no tokenizer, nothing checked against one), never refused."""
        from services.common.model_paths import default_model_dir

        buffer = models.get("buffer")
        if buffer is None or not buffer[0]:
            return

        # The services' own environment decides where the embedded model is (SEER_MODEL_DIR,
        # XDG_CACHE_HOME), not this process's: Suite(env=...) can set them for the services only.
        embedded = default_model_dir(self._env)

        def path(setting: str, embedded_word: str) -> str:
            return os.path.realpath(embedded if setting == embedded_word else setting)

        theirs = path(buffer[0], "auto")
        for name, (model, source) in models.items():
            if name == "buffer" or path(model, "") == theirs:
                continue
            raise SuiteArgumentError(
                "model_dir", f"the buffer uses {buffer[0]} ({buffer[1]}) but {name} uses "
                f"{model or 'the embedded model'} ({source}): the buffer tokenizes prompts and checks "
                "token ids and lengths with its model; give both the same (--model-dir, or SEER_BUFFER_MODEL_DIR "
                "and SEER_WORKER_MODEL_DIR)", setting="model_dir")

    def _refusal(self, name: str, e: Any) -> SuiteArgumentError:
        """The SuiteArgumentError for service `name`'s refused configuration (a ConfigError): by
        the Suite argument whose flag set the field, else by the variable, file or extra argument."""
        message = str(e)
        field, source = e.field, e.source
        detail = message
        if field:
            for prefix in (f"{e.field}: ", f"{name}:{field}: ", f"worker:{field}: "):
                if message.startswith(prefix):
                    detail = message[len(prefix):]
        argument = self._chosen_flags.get(name, {}).get(field or "")
        if source is not None and source.kind == "flag" and argument is not None:
            return SuiteArgumentError(argument, detail)
        if source is not None and source.kind == "env":
            return SuiteArgumentError(field or name, detail, setting=f"{source.name}={self._env.get(source.name, '')}")
        if source is not None and source.kind == "file":
            return SuiteArgumentError(field or name, detail, setting=f"{source.name} ({name}: {field})")
        if source is not None:  # an extra argument
            return SuiteArgumentError(field or name, detail, setting=f"{name} {source.name}")
        return SuiteArgumentError(field or name, message, setting=f"{name} configuration")

    def pick_port(self, host: str) -> int:
        """A port free on `host` that no other service of this suite was given (HealthSupervisor's
        pick_port: a worker whose port another process took is relaunched on it)."""
        return self._free_port(host)

    def supervisor(self, say: Callable[[str], None], **options: Any) -> HealthSupervisor:
        """`seer up`'s HealthSupervisor of this suite (options: HealthSupervisor's): a port another
        process took is moved to one of pick_port's, never one the suite uses; under --base-port a
        /metrics port is kept at port+100, as the start keeps it (_relaunch_after_port_clash)."""
        return HealthSupervisor(self.services, say, pick_port=self.pick_port,
                                fixed_metrics_ports=bool(self.base_port), **options)

    def _suite_ports(self) -> set[int]:
        """Every port the suite's services have now, gRPC and /metrics: under --base-port none was
        handed out by _free_port (so none is in _picked_ports), and a service that is down (being
        restarted) leaves its port free, so a free port alone could be its."""
        return {p for s in self.services.values() for p in (s.port, s.metrics_port) if p}

    def _free_port(self, host: str) -> int:
        """A port free on `host` that no other service of this suite was given."""
        for _ in range(1000):
            port = free_port(host)
            if port not in self._picked_ports and port not in self._suite_ports():
                self._picked_ports.add(port)
                return port
        raise SuiteError(f"no free port found that this suite does not use yet ({len(self._picked_ports)} in use)")

    def _port(self, offset: int, name: str) -> int:
        """Service `name`'s gRPC port: base + offset, or a port free on the host it will bind (from
        its extra_args and the suite's environment, as _planned_address: the arguments _add puts
        first set no host); 127.0.0.1 when that configuration cannot be read (the service then
        exits naming it)."""
        if self.base_port:
            return self.base_port + offset
        return self._free_port(_configured_host(_section(name), self.extra_args.get(name, []), self._env)
                               or "127.0.0.1")

    def _metrics_port(self, offset: int) -> int:
        if not self.metrics:
            return 0
        return self.base_port + self._metrics_offset + offset if self.base_port else self._free_port(METRICS_HOST)

    def _add(
        self,
        name: str,
        module: str,
        port: int,
        offset: int,
        args: list[str],
        env: Mapping[str, str] | None = None,
        cpus: tuple[int, ...] | None = None,
    ) -> None:
        """cpus: the service's CPU mask; None = service_cpus (the workers pass their own pin)."""
        mport = self._metrics_port(offset)
        child_env = dict(self._env)
        child_env.update(env or {})
        full = ["--port", str(port), "--metrics-port", str(mport), *args, *self.extra_args.get(name, [])]
        if cpus is None:
            cpus = self.service_cpus
        s = ServiceProcess(name, module, full, port, mport, self.log_dir, child_env, cpus)
        s.host = dial_host(_bind_host(s))
        self.services[name] = s

    def _planned_address(self, name: str, section: str, port: int) -> str:
        """The address service `name` will have (ServiceProcess.address), for wiring the services
        added before it: its host comes from its extra_args and the suite's environment alone (the
        arguments _add puts first set no host)."""
        return f"{dial_host(_configured_host(section, self.extra_args.get(name, []), self._env))}:{port}"

    def _data_dir_setting(self, name: str, path: Path) -> list[str]:
        """--data-dir of service `name`: under the suite's data directory, unless the suite's is a
        temporary one and the service's own configuration sets another."""
        return self._setting(name, "data_dir", str(path) if self._data_dir_chosen else None, str(path), "data_dir")

    def _model_dir_setting(self, name: str) -> list[str]:
        return self._setting(name, "model_dir", self.model_dir or None, self.default_model_dir or None, "model_dir")

    def _build(self) -> None:
        d = self.data_dir
        if self.with_kvstore:
            self._add("kvstore", "services.kvstore", self._port(_KVSTORE, "kvstore"), _KVSTORE,
                      self._data_dir_setting("kvstore", d / "kvstore"))
        buffer_port = self._port(_BUFFER, "buffer")
        # The buffer is added last of the central services (it needs the scheduler's address):
        # the draft and the scheduler dial the address it will have.
        buffer_address = self._planned_address("buffer", "buffer", buffer_port)
        if self.with_draft:
            self._add("draft", "services.draft", self._port(_DRAFT, "draft"), _DRAFT,
                      ["--buffer-address", buffer_address])
        scheduler_port = self._port(_SCHEDULER, "scheduler")
        self._add("scheduler", "services.scheduler", scheduler_port, _SCHEDULER, [
            "--buffer-address", buffer_address,
            *self._setting("scheduler", "policy", self.policy, DEFAULT_POLICY, "policy"),
            *self._setting("scheduler", "chunk_size", self.chunk_size, self.default_chunk_size, "chunk_size"),
            *self._setting("scheduler", "heartbeat_interval", self.heartbeat_interval, DEFAULT_HEARTBEAT_INTERVAL,
                           "heartbeat_interval"),
        ])
        buffer_args = [
            *self._data_dir_setting("buffer", d / "buffer"),
            "--scheduler-address", self.scheduler_address,
            *self._model_dir_setting("buffer"),
        ]
        self._add("buffer", "services.buffer", buffer_port, _BUFFER, buffer_args)
        # The wiring above used the planned address: the buffer's own arguments must not move it.
        if self.address != buffer_address:  # the wiring above dialled another address
            raise SuiteError(f"buffer: wired to {buffer_address} but it binds {self.address}")
        for i in range(self.num_workers):
            name = f"worker-{i}"
            args = [
                "--worker-id", name,
                "--scheduler-address", self.scheduler_address,
                *self._setting(name, "speculation", self.speculation, DEFAULT_SPECULATION, "speculation"),
            ]
            if self.with_draft:
                args += ["--draft-address", self.services["draft"].address]
            if self.with_kvstore:
                args += ["--kv-addresses", self.services["kvstore"].address]
            args += self._model_dir_setting(name)
            threads = str(self.threads_per_worker)
            pin = (self.cpu_affinity[i % len(self.cpu_affinity)],) if self.cpu_affinity else ()
            self._add(name, "services.worker", self._port(_WORKER0 + i, name), _WORKER0 + i, args,
                      env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}, cpus=pin)

    # ---- endpoints -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The public RolloutService (served by the buffer)."""
        return self.services["buffer"].address

    @property
    def scheduler_address(self) -> str:
        return self.services["scheduler"].address

    @property
    def worker_names(self) -> list[str]:
        return [n for n in self.services if n.startswith("worker-")]

    def endpoints(self) -> dict[str, dict[str, str | int]]:
        return {
            name: {
                "address": s.address,
                "metrics": f"http://127.0.0.1:{s.metrics_port}/metrics" if s.metrics_port else "",
                "pid": s.pid or 0,
                "log": str(s.stderr_path),
                "out": str(s.stdout_path),
            }
            for name, s in self.services.items()
        }

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout: float = 300.0, stop: StopFlag | None = None, keep_data_on_error: bool = False) -> Suite:
        """Starts every service and waits until all are healthy and the workers registered.

        stop: when set (from a signal handler or another thread), the wait ends with
        SuiteInterrupted within about a second, instead of running until `timeout`.
        keep_data_on_error: keep the data directory (the services' logs) when a service failed,
        even a temporary one (`seer up`: the error points at the logs).
        """
        try:
            self._check_fixed_ports()
        except SuiteError:
            self.remove_data()  # nothing started: no logs to keep (they were an empty directory)
            raise
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            # A signal that came while the suite was built (`seer up`, `seer demo` install their
            # handlers before Suite()): no service is started only to be killed.
            self._check_stop(stop)
            # Inside the try: a launch that fails part way stops the services already started.
            for s in self.services.values():
                s.start()
            self.wait_healthy(timeout=timeout, stop=stop)
            self.wait_workers(self.num_workers, timeout=timeout, stop=stop)
        except SuiteError:
            self.stop(keep_data=keep_data_on_error)
            raise
        except BaseException:
            self.stop()
            raise
        return self

    def _check_fixed_ports(self) -> None:
        """With a fixed --base-port, every port of the layout must be free before anything starts.
        Otherwise (a second `seer up` on the default ports) the health checks reached the *other*
        suite's services, which answered SERVING while this suite's processes were still importing,
        so "suite is up" was printed with the other suite's addresses just before this suite's
        services failed to bind and stopped it. Free ports (base port 0) were just picked unused."""
        if not self.base_port:
            return
        from services.common.ports import grpc_port_is_free
        from services.common.telemetry import metrics_port_is_free

        taken = []
        for name, s in self.services.items():
            # Each port checked as its service binds it: gRPC on its configured host (127.0.0.1 by
            # default; a probe of 127.0.0.1 whatever the host missed a port taken on [::1] or on
            # another interface), /metrics on every address, IPv6 included.
            host = _bind_host(s)
            if host is not None and not grpc_port_is_free(host, s.port):
                taken.append(f"{name} port {s.port} (on {host})")
            if s.metrics_port and not metrics_port_is_free(s.metrics_port):
                taken.append(f"{name} metrics port {s.metrics_port}")
        if taken:
            raise SuiteError(f"base_port {self.base_port}: in use already: {', '.join(taken)} (another `seer up`? "
                             "stop it, or choose another --base-port, or 0 for any free ports)")

    @staticmethod
    def _check_stop(stop: StopFlag | None) -> None:
        if stop is not None and stop.is_set():
            raise SuiteInterrupted("stop requested before the suite was up")

    def wait_healthy(self, names: Sequence[str] | None = None, timeout: float = 300.0,
                     stop: StopFlag | None = None) -> None:
        pending = list(names or self.services)
        deadline = time.monotonic() + timeout
        relaunched: dict[str, int] = {}
        while pending:
            self._check_stop(stop)
            for name in list(pending):
                s = self.services[name]
                if not s.alive():
                    if relaunched.get(name, 0) < _PORT_CLASH_RETRIES and self._relaunch_after_port_clash(s):
                        relaunched[name] = relaunched.get(name, 0) + 1
                        continue
                    raise SuiteError(f"{name}: exited with code {s.returncode} before becoming healthy\n{s.tail()}")
                if health_status(s.address) == "SERVING":
                    pending.remove(name)
                # Per service too: each health check can take up to a second, with many workers
                # one round would otherwise delay a Ctrl-C by as many seconds.
                self._check_stop(stop)
            if pending:
                if time.monotonic() > deadline:
                    raise SuiteError(f"not healthy after {timeout:.0f}s: {', '.join(pending)}")
                time.sleep(0.2)

    def _relaunch_after_port_clash(self, s: ServiceProcess) -> bool:
        """A service that exited because its port was taken is started again. Ports are picked
        here (free_port binds port 0 and closes it) and bound by the child seconds later, after its
        imports; meanwhile the kernel may hand the number to another socket (seen under load: the
        buffer's metrics port, "Address already in use"). A picked metrics port is picked again
        (nothing refers to it); a gRPC port is kept (the other services were given it) and retried
        after a moment, when the other socket is usually gone."""
        tail = s.tail(40)  # this launch's output only: an old clash in the log is not this exit's cause
        if "Address already in use" not in tail and "Failed to bind" not in tail:
            return False
        from services.common.telemetry import metrics_bind_error

        # The metrics server names its port in the error.
        if s.metrics_port and not self.base_port and metrics_bind_error(s.metrics_port) in tail:
            s.metrics_port = self._free_port(METRICS_HOST)
            _set_flag(s.args, "--metrics-port", s.metrics_port)
        log.warning("a service could not bind its port; starting it again", extra=kv(service=s.name, port=s.port))
        time.sleep(0.5)
        s.start()
        return True

    def wait_workers(self, count: int, timeout: float = 120.0, stop: StopFlag | None = None) -> None:
        """Until `count` workers are registered and healthy at the scheduler."""
        import grpc

        deadline = time.monotonic() + timeout
        last_error = ""
        while True:
            self._check_stop(stop)
            try:
                n = sum(1 for w in self.scheduler_stats().workers if w.healthy)
            except grpc.RpcError as e:
                # A scheduler that crashed (or stalls) while the workers load: before, the RpcError
                # escaped as a traceback and the data directory, logs included, was removed.
                sched = self.services["scheduler"]
                if not sched.alive():
                    raise SuiteError(f"scheduler: exited with code {sched.returncode}\n{sched.tail()}") from None
                code = getattr(e, "code", None)
                n, last_error = 0, f" (the scheduler did not answer: {code().name if callable(code) else e})"
            if n >= count:
                return
            for name in self.worker_names:
                s = self.services[name]
                if not s.alive():
                    raise SuiteError(f"{name}: exited with code {s.returncode}\n{s.tail()}")
            if time.monotonic() > deadline:
                raise SuiteError(f"only {n} of {count} workers registered after {timeout:.0f}s{last_error}")
            time.sleep(0.2)

    def scheduler_stats(self) -> Any:
        from seer.v1 import scheduler_pb2, scheduler_pb2_grpc

        from services.common.grpcutil import channel

        ch = channel(self.scheduler_address)
        try:
            return scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                scheduler_pb2.GetSchedulerStatsRequest(), timeout=5.0
            )
        finally:
            ch.close()

    def kill(self, name: str) -> None:
        """SIGKILL one service (crash tests)."""
        self.services[name].kill()

    def restart(self, name: str, timeout: float = 120.0) -> None:
        s = self.services[name]
        if s.alive():
            s.stop()
        s.start()
        self.wait_healthy([name], timeout=timeout)

    def stop(self, timeout: float = 15.0, keep_data: bool = False) -> dict[str, int | None]:
        """Stops workers first, then the buffer, scheduler, draft and kvstore; returns exit codes.

        keep_data: keep the data directory even when it is this suite's temporary one."""
        codes: dict[str, int | None] = {}
        # All workers at once (each drains its own chunks), then the central services.
        for group in (self.worker_names, ["buffer", "scheduler"], ["draft", "kvstore"]):
            codes.update(stop_together([self.services[n] for n in group if n in self.services], timeout))
        if not keep_data:
            self.remove_data()
        return codes

    def remove_data(self) -> None:
        """Removes the data directory if this suite created it (unless SEER_KEEP_DATA=1)."""
        if self._own_dir and os.environ.get("SEER_KEEP_DATA", "") not in ("1", "true"):
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Suite:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def policy_choices() -> list[str]:
    """The --policy choices of `seer up` and `seer demo`: the scheduler's policies but "oracle",
    which needs true lengths that only the simulator has (the scheduler refuses it)."""
    from services.scheduler.core.config import POLICIES

    return [x for x in POLICIES if x != "oracle"]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="seer up", description="start the whole suite on loopback",
        epilog="Each service also reads SEER_<SERVICE>_<FIELD> variables (and SEER_<SERVICE>_CONFIG, a JSON "
               "file): an option left out here yields to them, one given here overrides them (with a warning). "
               "Every service's configuration is checked before anything starts.")
    # At least 1: a suite with no worker accepts batches and never finishes one (Suite(workers=0)
    # remains for tests that play the worker themselves).
    p.add_argument("--workers", type=positive_int, default=1, help="number of workers (default 1)")
    p.add_argument("--data-dir", default=None,
                   help="state directory (default: a temporary one, removed on a clean exit; kept, with the "
                        "services' logs, when a service failed: `seer up --data-dir <it>` then resumes that state)")
    p.add_argument("--base-port", type=int, default=50051, help="first port (0 = any free ports)")
    p.add_argument("--policy", choices=policy_choices(), default=None,
                   help=f"scheduling policy (default {DEFAULT_POLICY}, or SEER_SCHEDULER_POLICY)")
    p.add_argument("--speculation", choices=["on", "off"], default=None,
                   help="grouped speculative decoding (default on, or SEER_WORKER_SPECULATION)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help=f"max new tokens per chunk (default {DEFAULT_CHUNK_SIZE}, or SEER_SCHEDULER_CHUNK_SIZE)")
    p.add_argument("--model-dir", default=None, help="safetensors model dir (default: the embedded model, or "
                                                     "SEER_WORKER_MODEL_DIR / SEER_BUFFER_MODEL_DIR)")
    p.add_argument("--tracing", choices=["none", "console", "otlp"], default=None,
                   help="OpenTelemetry spans (default: SEER_TRACING, else none); console: to each service's "
                        "<data dir>/logs/<service>.out")
    p.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds to wait for the suite to be healthy")
    p.add_argument("--health-grace", type=positive_seconds, default=HEALTH_GRACE_SECONDS,
                   help=f"restart a running service whose gRPC health answers NOT_SERVING for longer than this "
                        f"(default {HEALTH_GRACE_SECONDS:.0f} s; inf: never). A service that exits is restarted "
                        f"too; at most {HEALTH_RESTART_LIMIT} restarts of a service in a row without SERVING in "
                        "between")
    return p.parse_args(list(argv))


def ensure_embedded_model() -> str:
    from services.worker.model.prepare import ensure_model

    return str(ensure_model())


def prepare_model(command: str, prepare: Callable[[], str]) -> str | None:
    """prepare() (the model directory), or None after a Ctrl-C, reported as `command`'s
    interruption (`seer up`, `seer demo`; exit 128 + SIGINT): the first conversion takes a while and
    removes its partial output itself, so a traceback would only hide that line."""
    try:
        return prepare()
    except KeyboardInterrupt:
        print(f"{command}: interrupted while preparing the model", file=sys.stderr)
        return None


def stop_keeping_data(suite: Suite, say: Callable[[str], None]) -> dict[str, int]:
    """Stops the suite (`seer up`, `seer demo`), says whether every service stopped cleanly and
    returns those that did not, by name. The data directory is kept: until the caller knows the
    outcome, a failure's logs must outlive the temporary directory (then suite.remove_data())."""
    codes = suite.stop(keep_data=True)
    bad = {n: c for n, c in codes.items() if c not in (0, None)}
    say("stopped" + (f" (non-zero exits: {bad})" if bad else " cleanly"))
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv_list)
    model_dir = prepare_model("seer up", lambda: args.model_dir or ensure_embedded_model())
    if model_dir is None:
        return 128 + signal.SIGINT
    stop = StopRequest()
    # From before Suite(), which creates the temporary data directory (as in `seer demo`): a signal
    # between the two left that directory behind.
    with signals_to(stop.handle):
        try:
            # Only the options given are chosen values; the others are defaults that a service's
            # SEER_<SERVICE>_<FIELD> (or config file) setting overrides.
            suite = Suite(
                workers=args.workers, data_dir=args.data_dir, base_port=args.base_port, policy=args.policy,
                speculation=None if args.speculation is None else args.speculation == "on",
                model_dir=args.model_dir, default_model_dir=model_dir, chunk_size=args.chunk_size,
                tracing=args.tracing, warn=lambda message: print(f"seer up: warning: {message}", file=sys.stderr),
            )
        except SuiteArgumentError as e:
            print(f"seer up: {flag_error(e)}", file=sys.stderr)
            return 2
        return _supervise(args, suite, stop, resume=resume_command(argv_list, suite.data_dir))


# How long the clients (Python and Node) retry an unreachable service by default: a suite resumed
# within it is not noticed by a trainer at all.
CLIENT_RETRY_SECONDS = 60


def resume_command(argv: Sequence[str], data_dir: Path) -> str:
    """The command line that resumes this suite's state: `argv` (the same workers, ports, model,
    policy) with --data-dir set to `data_dir` (the temporary one too: it is kept on failure)."""
    import shlex

    kept: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--data-dir":
            skip = True
        elif not a.startswith("--data-dir="):
            kept.append(a)
    return shlex.join(["seer", "up", *kept, "--data-dir", str(data_dir)])


def resume_hint(resume: str, base_port: int) -> str:
    """What `seer up` says when it gives up and stops: the state is kept, and how to resume it."""
    ports = (f"on the same ports, so clients that retry (for {CLIENT_RETRY_SECONDS} s by default) carry on"
             if base_port else "(--base-port 0: the new ports differ, give them to the clients)")
    return f"the state is kept: `{resume}` resumes it {ports}"


def _supervise(args: argparse.Namespace, suite: Suite, stop: StopRequest, resume: str = "") -> int:
    """Starts the suite, watches it until a signal (or a central service left down), stops it."""
    print(f"starting the suite ({args.workers} worker(s), state in {suite.data_dir}) ...", flush=True)
    note = earlier_state_note(earlier_state_dirs(suite.data_dir))
    if note:
        print(note, file=sys.stderr, flush=True)
    try:
        # The stop flag is polled while starting: workers can take minutes to load, and a Ctrl-C
        # must not wait for --timeout.
        suite.start(timeout=args.timeout, stop=stop, keep_data_on_error=True)
    except SuiteInterrupted:
        print("seer up: stopped before the suite was up", file=sys.stderr)
        return 128 + stop.signum
    except SuiteError as e:
        print(f"seer up: {e}", file=sys.stderr)
        print(f"seer up: logs kept in {suite.log_dir}", file=sys.stderr)
        return 1
    print("suite is up:")
    for name, ep in suite.endpoints().items():
        metrics = f"  metrics {ep['metrics']}" if ep["metrics"] else ""
        # Both files: a service's stdout (.out) holds what it prints there, console tracing's
        # spans included (SEER_TRACING=console); the .log holds its structured log (stderr).
        print(f"  {name:<10} {ep['address']}{metrics}  (pid {ep['pid']}, log {ep['log']}, stdout {ep['out']})")
    print(f"trainer API (RolloutService): {suite.address}   -- Ctrl-C to stop", flush=True)
    # Why the suite stops by itself: a buffer or scheduler, or every worker, left down.
    down = ""
    hint = resume_hint(resume or resume_command([], suite.data_dir), suite.base_port)
    health = suite.supervisor(lambda line: print(line, file=sys.stderr, flush=True), grace=args.health_grace)
    workers = set(suite.worker_names)
    idle_said = False
    while not stop.is_set() and not down:
        time.sleep(0.5)
        # An exit is restarted by the supervisor (a line on stderr); returned only when left down
        # (past the restart limit), which the supervisor has said as well.
        for name in health.tick(stop):
            # Not on a stop requested meanwhile: that exit was not restarted because of the stop.
            if name in CENTRAL_SERVICES and not stop.is_set():
                down = down or f"{name} is down (not restarted again); the suite cannot work without it"
        if down or stop.is_set() or not workers:
            continue
        if workers <= set(health.exited):
            # As for a central service: the buffer accepts batches and the scheduler places nothing,
            # so serving on would look up while finishing nothing (with --workers 1 the one worker's
            # give-up line was the only sign).
            down = (f"no worker is left ({', '.join(sorted(workers))} down, not restarted again); the suite "
                    "cannot finish a batch without one")
        elif workers <= set(health.exited) | health.given_up():
            # Every worker NOT_SERVING past the limit (left as it is: it may still come back, a SERVING
            # answer clears it): said once per such spell, as the error it is, but not stopped.
            if not idle_said:
                idle_said = True
                print(f"seer up: error: no worker is serving ({', '.join(sorted(workers))} left down or "
                      "NOT_SERVING, not restarted again): batches wait until one answers SERVING again",
                      file=sys.stderr, flush=True)
        else:
            idle_said = False
    if down:
        # Serving on with no buffer, scheduler or worker would accept batches and never finish one
        # while looking up: stop, so that whoever runs `seer up` sees the failure. Its state is on
        # disk (kept below: a failure keeps the data directory), so a rerun resumes it.
        print(f"seer up: {down}: stopping; {hint}", file=sys.stderr, flush=True)
    # A service restarted shortly before the stop may serve again without a check having seen it.
    health.check_restarted()
    print("stopping ...", flush=True)
    bad = stop_keeping_data(suite, lambda line: print(line, flush=True))
    # A restart that mended its service (SERVING since) is no failure: the suite served on. Before,
    # every service ever restarted counted as failed, and a recovered suite stopped cleanly exited 1.
    failed = health.failed() | set(bad)
    if failed:
        print(f"seer up: service(s) failed ({', '.join(sorted(failed))}); logs kept in {suite.log_dir}",
              file=sys.stderr)
        if not down and failed & set(CENTRAL_SERVICES):
            # A stop that came while the buffer or scheduler was down (in its restart backoff, or
            # given up on in the same tick): its state is kept all the same; say how to resume.
            print(f"seer up: {hint}",
                  file=sys.stderr)
        return 1
    recovered = health.recovered()
    if recovered:
        # Exit 0, but the broken launch's log (appended to by the new launch) is the only record of
        # what broke: kept, even in the temporary data directory.
        print(f"seer up: restarted and SERVING since: {', '.join(sorted(recovered))}; "
              f"logs kept in {suite.log_dir}", file=sys.stderr)
        return 0
    suite.remove_data()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
