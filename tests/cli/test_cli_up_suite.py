"""Suite's port plan and its relaunch of a service whose port was taken."""

from __future__ import annotations

import collections
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import outgoing_ipv4

from services.cli import up
from tests.common.test_telemetry import _has_ipv6_loopback


def _ports(s: up.Suite) -> list[tuple[int, str]]:
    out = []
    for name, sp in s.services.items():
        out.append((sp.port, name))
        if sp.metrics_port:
            out.append((sp.metrics_port, f"{name}:metrics"))
    return out


def _dupes(s: up.Suite) -> list[tuple[int, str]]:
    count = collections.Counter(p for p, _ in _ports(s))
    return [x for x in _ports(s) if count[x[0]] > 1]


def test_free_ports_handed_out_twice_by_the_kernel_are_picked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port() binds port 0 and closes the socket, so the kernel may return the same number to
    the next call (before: 1.5% of 8-worker suites had two services on one port). The kernel's
    choice is random; here it repeats every number once, deterministically."""
    picks: Iterator[int] = (40000 + i // 2 for i in range(10_000))
    monkeypatch.setattr(up, "free_port", lambda host: next(picks))
    s = up.Suite(workers=8, base_port=0, data_dir=tmp_path, model_dir="/x")
    assert _dupes(s) == []
    # A metrics port picked again after a clash is new to the suite as well.
    assert s._free_port(up.METRICS_HOST) not in {p for p, _ in _ports(s)}


def test_fixed_layout_has_no_clash_with_many_workers(tmp_path: Path) -> None:
    """Before: worker i's port base+10+i was also a metrics port (base+100+offset) from 91 workers on."""
    s = up.Suite(workers=91, base_port=50051, data_dir=tmp_path, model_dir="/x")
    assert _dupes(s) == []
    assert max(p for p, _ in _ports(s)) <= 65535
    small = up.Suite(workers=2, base_port=50051, data_dir=tmp_path, model_dir="/x")
    # The documented layout is unchanged where it fits: metrics on port + 100.
    assert all(sp.metrics_port == sp.port + 100 for sp in small.services.values())


def test_fixed_layout_that_overflows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers"):
        up.Suite(workers=500, base_port=65000 - 200, data_dir=tmp_path, model_dir="/x")


def test_an_old_port_clash_in_the_log_does_not_relaunch_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is appended to across runs (same --data-dir); before, yesterday's "Address already
    in use" made today's config error look like a port clash: 3 pointless relaunches, and the
    error message showed the stale line."""
    starts: list[str] = []

    def command(self: up.ServiceProcess) -> list[str]:
        starts.append(self.name)
        if self.name != "scheduler":
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        return [sys.executable, "-c", "import sys; sys.stderr.write('config error: bad value\\n'); sys.exit(2)"]

    monkeypatch.setattr(up.ServiceProcess, "command", command)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "scheduler.log").write_text(
        "RuntimeError: Failed to bind to address 127.0.0.1:50052; Address already in use\n")
    s = up.Suite(workers=0, data_dir=tmp_path, base_port=0, model_dir="/x", draft=False, kvstore=False)
    with pytest.raises(up.SuiteError, match="scheduler: exited with code 2") as e:
        s.start(timeout=20)
    assert starts.count("scheduler") == 1, "a config error was retried as a port clash"
    assert "config error: bad value" in str(e.value) and "Address already in use" not in str(e.value)


def test_a_port_clash_of_this_launch_is_still_relaunched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the test above: the clash written by the launch that just failed counts."""
    ok = tmp_path / "scheduler-ok"
    starts: list[str] = []

    def command(self: up.ServiceProcess) -> list[str]:
        starts.append(self.name)
        if self.name != "scheduler":
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        if starts.count("scheduler") == 1:
            return [sys.executable, "-c", "import sys; sys.stderr.write('Failed to bind: Address already in use\\n');"
                                          " sys.exit(1)"]
        return [sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(ok)!r}).touch(); time.sleep(60)"]

    monkeypatch.setattr(up.ServiceProcess, "command", command)
    s = up.Suite(workers=0, data_dir=tmp_path, base_port=0, model_dir="/x", draft=False, kvstore=False)
    scheduler = s.services["scheduler"].address
    # The scheduler is SERVING once its second launch runs; the buffer's stand-in at once.
    monkeypatch.setattr(up, "health_status", lambda address, timeout=1.0:
                        "SERVING" if address != scheduler or ok.exists() else "UNREACHABLE")
    monkeypatch.setattr(s, "wait_workers", lambda count, timeout=120.0, stop=None: None)
    s.start(timeout=20)
    try:
        assert starts.count("scheduler") == 2
        assert s.services["scheduler"].alive()
    finally:
        s.stop(timeout=5)


def test_a_scheduler_that_dies_while_the_workers_register_is_a_suite_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: wait_workers let the scheduler's grpc.RpcError escape (UNAVAILABLE: its stand-in
    serves nothing, as a crashed scheduler), so `seer up` died with a traceback and Suite.start's
    catch-all removed the data directory with the logs that explain the crash."""

    def command(self: up.ServiceProcess) -> list[str]:
        if self.name == "scheduler":
            return [sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.stderr.write('scheduler boom\\n');"
                                          " sys.exit(3)"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(up.ServiceProcess, "command", command)
    monkeypatch.setattr(up, "health_status", lambda address, timeout=1.0: "SERVING")
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))  # the suite's own temporary data dir
    s = up.Suite(workers=1, base_port=0, model_dir="/x", draft=False, kvstore=False)
    with pytest.raises(up.SuiteError, match="scheduler: exited with code 3") as e:
        s.start(timeout=20, keep_data_on_error=True)
    assert "scheduler boom" in str(e.value)
    assert (s.log_dir / "scheduler.log").exists(), "the logs of the failed start were removed"
    assert not any(sp.alive() for sp in s.services.values())
    s.remove_data()


def test_a_fixed_port_in_use_is_refused_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: with a second `seer up` on the same --base-port, the health checks reached the first
    suite's services (SERVING) while this suite's were still importing, so "suite is up" came before
    they failed to bind. Here the other suite's scheduler answers every health check."""
    started: list[str] = []

    def command(self: up.ServiceProcess) -> list[str]:
        started.append(self.name)
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(up.ServiceProcess, "command", command)
    monkeypatch.setattr(up, "health_status", lambda address, timeout=1.0: "SERVING")
    base = up.free_port()
    while base > 65535 - 400:
        base = up.free_port()
    s = up.Suite(workers=0, base_port=base, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False)
    with socket.socket() as other:  # the other suite's scheduler
        other.bind(("127.0.0.1", s.services["scheduler"].port))
        other.listen()
        with pytest.raises(up.SuiteError, match=f"scheduler port {s.services['scheduler'].port}"):
            s.start(timeout=5)
    assert started == [], "services were launched onto ports another process holds"


@pytest.mark.parametrize("family", [
    pytest.param(socket.AF_INET6, marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")),
    socket.AF_INET,
])
def test_a_metrics_port_taken_on_one_loopback_address_is_refused(
        family: socket.AddressFamily, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics servers bind every address, [::] dual-stack (services/common/telemetry.py).
    Before: their ports were probed on 0.0.0.0 only, so a listener on [::1] alone was not seen and
    the service failed to bind after the suite had started."""
    monkeypatch.setattr(up.ServiceProcess, "start", lambda *a, **k: pytest.fail("a service was started"))
    base = up.free_port()
    while base > 65535 - 400:
        base = up.free_port()
    s = up.Suite(workers=0, base_port=base, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False)
    port = s.services["buffer"].metrics_port
    with socket.socket(family, socket.SOCK_STREAM) as other:
        if family == socket.AF_INET6:
            other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
        other.listen()
        with pytest.raises(up.SuiteError, match=f"buffer metrics port {port}"):
            s.start(timeout=5)


@pytest.mark.parametrize("timeout", ["nan", "0", "-1"])
def test_seer_up_refuses_a_bad_timeout(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: NaN was taken, and a suite that never became healthy was waited on for ever.
    from services.cli import up

    with pytest.raises(SystemExit) as e:  # refused by argparse, as every other malformed flag
        up.main(["--timeout", timeout, "--model-dir", "/nonexistent"])
    assert e.value.code == 2
    assert "--timeout: must be a positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--base-port", "70000"], "seer up: --base-port: 70000 leaves no room for the suite's ports"),
    (["--base-port", "65000", "--workers", "500"], "seer up: --base-port: 65000 leaves no room for the suite's ports "
                                                    "(with 500 workers"),
])
def test_up_names_the_flag_of_a_refused_suite_argument(
        flags: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the message named Suite's argument (workers, base_port), which no user typed."""
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))
    assert up.main([*flags, "--model-dir", "/nonexistent"]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field", ["cpu_affinity", "service_cpus"])
def test_a_refused_cpu_list_leaves_no_temporary_directory(
        field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the CPU lists were checked after mkdtemp, so each refused Suite leaked a
    seer-suite-* directory (a benchmark retrying with other CPUs left one per try)."""
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))  # the suite's own temporary data dir
    bad = max(up.os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"{field}: CPU {bad} is not available"):
        if field == "cpu_affinity":
            up.Suite(workers=1, base_port=0, model_dir="/x", cpu_affinity=[bad])
        else:
            up.Suite(workers=1, base_port=0, model_dir="/x", service_cpus=[bad])
    assert list(tmp_path.iterdir()) == []


def test_a_suite_that_fails_to_build_removes_its_temporary_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after mkdtemp (no free port left) leaves no directory behind either: the caller
    got no Suite whose stop() would remove it."""
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(up, "free_port", lambda host: 40000)  # every pick is a port the suite already uses
    with pytest.raises(up.SuiteError, match="no free port"):
        up.Suite(workers=1, base_port=0, model_dir="/x")
    assert list(tmp_path.iterdir()) == []


def test_a_fixed_port_in_use_leaves_no_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal above came after the log directory was made, and `seer up` keeps a failed
    suite's data (keep_data_on_error): an empty seer-suite-* directory was left behind, with "logs
    kept in" pointing at nothing."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        s = up.Suite(workers=1, base_port=holder.getsockname()[1], metrics=False, model_dir="/x")
        with pytest.raises(up.SuiteError):
            s.start(keep_data_on_error=True)
    assert list(tmp_path.glob("seer-suite-*")) == []


def test_a_metrics_port_held_on_another_address_is_refused(tmp_path: Path) -> None:
    """The metrics servers bind every address: a listener on any non-loopback address takes the
    port from them, and a check on 127.0.0.1 alone did not see it."""
    address = outgoing_ipv4()
    if address is None:
        pytest.skip("no non-loopback IPv4 address")
    base = up.free_port()
    while base > 65535 - 400:
        base = up.free_port()
    s = up.Suite(workers=0, base_port=base, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False)
    port = s.services["scheduler"].metrics_port
    assert port
    with socket.socket() as other:
        other.bind((address, port))
        other.listen()
        with pytest.raises(up.SuiteError, match=f"scheduler metrics port {port}"):
            s.start(timeout=5)


def test_up_stops_before_starting_anything_when_signalled_while_the_suite_was_built(tmp_path, monkeypatch):
    """A signal that came while Suite() was built: no service is started only to be killed, the
    temporary data directory goes, and the exit status is 128 + the signal (review, session 27)."""
    import argparse
    import signal

    from services.cli.signals import StopRequest

    monkeypatch.setattr(up.ServiceProcess, "start", lambda *a, **k: pytest.fail("a service was started"))
    suite = up.Suite(workers=1, base_port=0, model_dir=str(tmp_path / "model"))
    stop = StopRequest()
    stop.handle(signal.SIGTERM, None)
    assert up._supervise(argparse.Namespace(workers=1, timeout=30.0), suite, stop) == 128 + signal.SIGTERM
    assert not suite.data_dir.exists()


def test_up_reports_an_interrupt_while_preparing_the_model(monkeypatch, capsys):
    """Ctrl-C during the first model conversion: one line and 130, not a traceback (as `seer demo`)."""

    def interrupted() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(up, "ensure_embedded_model", interrupted)
    assert up.main(["--base-port", "0"]) == 130
    assert "interrupted while preparing the model" in capsys.readouterr().err


def test_a_clashing_metrics_port_is_picked_again_by_the_metrics_servers_own_error(tmp_path, monkeypatch):
    """The metrics server names its port when the bind fails (services/common/telemetry.py); `seer
    up` picks a new metrics port by that text, and keeps a gRPC port that clashed."""
    from services.common.telemetry import start_metrics_server

    taken = socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("::" if socket.has_ipv6 else "0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(OSError) as err:
        start_metrics_server(port)
    taken.close()
    suite = up.Suite(workers=0, base_port=0, model_dir=str(tmp_path / "model"))
    s = up.ServiceProcess(name="buffer", module="services.buffer", args=["--metrics-port", str(port)], port=1,
                          metrics_port=port, log_dir=tmp_path, env={})
    (tmp_path / "buffer.log").write_text(f"Traceback ...\nOSError: [Errno 98] {err.value}\n")
    started: list[int] = []
    monkeypatch.setattr(up.ServiceProcess, "start", lambda self: started.append(self.metrics_port))
    monkeypatch.setattr(up.time, "sleep", lambda _s: None)
    assert suite._relaunch_after_port_clash(s)
    assert s.metrics_port != port and s.args == ["--metrics-port", str(s.metrics_port)] and started == [s.metrics_port]
    suite.remove_data()
