from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
from services.common import telemetry
with telemetry.tracer("seer.scheduler").start_as_current_span("scheduler.dispatch", context=None) as span:
    span.set_attribute("seer.request_id", "r1")
print(sorted(m for m in sys.modules if m.startswith("opentelemetry"))[:1])
"""


@pytest.mark.parametrize(("mode", "imported"), [("", False), ("none", False), ("console", True)])
def test_tracing_off_does_not_load_opentelemetry(mode: str, imported: bool) -> None:
    env = dict(os.environ, SEER_TRACING=mode, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert (out.strip() != "[]") is imported, out


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_metrics_are_served_over_ipv6_and_ipv4() -> None:
    """Before: prometheus_client's start_http_server bound 0.0.0.0 only, so a scrape over IPv6
    (an IPv6-only pod network) was refused while the service's gRPC port answered on it."""
    from prometheus_client import CollectorRegistry, Counter

    from services.cli.up import free_port
    from services.common.telemetry import start_metrics_server

    registry = CollectorRegistry()
    Counter("seer_probe_total", "a counter only this test registers", registry=registry).inc()
    port = start_metrics_server(free_port(), registry)
    assert "seer_probe_total 1.0" in _scrape("[::1]", port)
    assert "seer_probe_total 1.0" in _scrape("127.0.0.1", port)


def test_a_taken_metrics_port_names_the_field() -> None:
    from prometheus_client import CollectorRegistry

    from services.common.telemetry import start_metrics_server

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics_port {taken}: .*Address already in use"):
            start_metrics_server(taken, CollectorRegistry())


def test_metrics_fall_back_to_ipv4_without_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with IPv6 disabled (no dual-stack socket) still serves /metrics, on 0.0.0.0."""
    from prometheus_client import CollectorRegistry, Counter

    import services.common.telemetry as telemetry
    from services.cli.up import free_port

    class _NoIPv6(telemetry._DualStackServer):
        def server_bind(self) -> None:  # as socket(AF_INET6) where ipv6.disable=1
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(telemetry, "_DualStackServer", _NoIPv6)
    registry = CollectorRegistry()
    Counter("seer_probe_total", "a counter only this test registers", registry=registry).inc()
    port = telemetry.start_metrics_server(free_port(), registry)
    assert "seer_probe_total 1.0" in _scrape("127.0.0.1", port)
