"""`seer up` checks each fixed gRPC port on the host its service will bind (--host,
SEER_<SERVICE>_HOST, a config file; 127.0.0.1 by default). Before: it probed 127.0.0.1 whatever the
host, so a port taken on [::1] or on another interface's address was not seen and the service failed
after the start, with the bind error only in its log."""

from __future__ import annotations

import json
import socket
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import outgoing_ipv4

from services.cli import up
from tests.common.test_telemetry import _has_ipv6_loopback

needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")


def _suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra_args: Mapping[str, Sequence[str]] | None = None,
           env: Mapping[str, str] | None = None) -> up.Suite:
    """A fixed-port suite (buffer and scheduler only, no metrics ports) that must start nothing."""
    monkeypatch.setattr(up.ServiceProcess, "start", lambda *a, **k: pytest.fail("a service was started"))
    base = up.free_port()
    while base > 65535 - 400:
        base = up.free_port()
    return up.Suite(workers=0, base_port=base, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False,
                    metrics=False, extra_args=extra_args, env=env)


def _listen(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def _start_stopped(s: up.Suite) -> None:
    """Suite.start with its stop flag already set: past the port check it ends with SuiteInterrupted
    before launching anything, so a port the check missed shows as that, not as a slow launch."""
    stop = threading.Event()
    stop.set()
    s.start(timeout=5, stop=stop)


@needs_ipv6
@pytest.mark.parametrize("how", ["flag", "env", "config"])
def test_a_port_taken_on_the_configured_ipv6_host_is_refused(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer binds [::1] (set each way a service's host can be): a listener there takes its
    port, which the old 127.0.0.1 probe called free."""
    if how == "flag":
        s = _suite(tmp_path, monkeypatch, extra_args={"buffer": ["--host", "[::1]"]})
    elif how == "env":
        s = _suite(tmp_path, monkeypatch, env={"SEER_BUFFER_HOST": "::1"})
    else:
        config = tmp_path / "buffer.json"
        config.write_text(json.dumps({"host": "[::1]"}))
        s = _suite(tmp_path, monkeypatch, extra_args={"buffer": ["--config", str(config)]})
    port = s.services["buffer"].port
    with _listen(socket.AF_INET6, "::1", port), \
            pytest.raises(up.SuiteError, match=rf"base_port {s.base_port}: in use already: buffer port {port} \(on "):
        _start_stopped(s)


@needs_ipv6
@pytest.mark.parametrize("host", ["[::]", "0.0.0.0"])
def test_a_wildcard_host_counts_a_port_taken_on_any_address(
        host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wildcard host binds every address, dual-stack (gRPC binds [::] for both): a listener on
    [::1] alone answers the service's IPv6 clients."""
    s = _suite(tmp_path, monkeypatch, extra_args={"scheduler": ["--host", host]})
    port = s.services["scheduler"].port
    with _listen(socket.AF_INET6, "::1", port), pytest.raises(up.SuiteError, match=f"scheduler port {port}"):
        _start_stopped(s)


def test_a_port_taken_on_the_configured_interface_address_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer configured to bind a non-loopback address: a listener there takes its port."""
    address = outgoing_ipv4()
    if address is None:
        pytest.skip("no non-loopback IPv4 address")
    s = _suite(tmp_path, monkeypatch, extra_args={"buffer": ["--host", address]})
    port = s.services["buffer"].port
    with _listen(socket.AF_INET, address, port), pytest.raises(up.SuiteError, match=f"buffer port {port}"):
        _start_stopped(s)


@needs_ipv6
def test_the_default_host_is_checked_on_127_0_0_1_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with the default host the service binds 127.0.0.1 only, which a listener on
    [::1] does not take (gRPC binds it): no refusal, the start goes on (here to the stop flag)."""
    s = _suite(tmp_path, monkeypatch)
    with _listen(socket.AF_INET6, "::1", s.services["buffer"].port), pytest.raises(up.SuiteInterrupted):
        _start_stopped(s)


def test_an_empty_host_is_left_to_the_service() -> None:
    """An empty host is the service's configuration error (gRPC refuses it), not a taken port: the
    check skips it (its probe failed on "" and blamed the port)."""
    from services.cli.up import _configured_host

    assert _configured_host("buffer", [], {"SEER_BUFFER_HOST": ""}) is None
    assert _configured_host("buffer", ["--host", ""], {}) is None
    assert _configured_host("buffer", [], {}) == "127.0.0.1"


def _first_pick_is(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """`seer up`'s next kernel pick of a free port (a bind of port 0 on 127.0.0.1) returns `port`:
    a port free on 127.0.0.1 but taken on the service's own host, made certain."""
    picks = [port]

    class _Picking(socket.socket):
        def bind(self, address: Any) -> None:
            if address == ("127.0.0.1", 0) and picks:
                address = ("127.0.0.1", picks.pop())
            super().bind(address)

    # getaddrinfo looked up when called: a test's replacement of socket.getaddrinfo applies.
    monkeypatch.setattr(up, "socket", types.SimpleNamespace(
        socket=_Picking, AF_INET=socket.AF_INET, SOCK_STREAM=socket.SOCK_STREAM,
        getaddrinfo=lambda *a, **k: socket.getaddrinfo(*a, **k)))


def _host_cases() -> list[Any]:
    cases: list[Any] = [pytest.param("[::1]", socket.AF_INET6, "::1", marks=needs_ipv6, id="ipv6-loopback"),
                        pytest.param("0.0.0.0", socket.AF_INET6, "::1", marks=needs_ipv6, id="wildcard")]
    address = outgoing_ipv4()
    cases.append(pytest.param(address or "", socket.AF_INET, address or "", id="interface-address",
                              marks=pytest.mark.skipif(address is None, reason="no non-loopback IPv4 address")))
    return cases


@pytest.mark.parametrize(("host", "family", "taken_on"), _host_cases())
def test_a_free_port_is_free_on_the_services_own_host(host: str, family: socket.AddressFamily, taken_on: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With base port 0 each port is picked free. Before: picked on 127.0.0.1 whatever the host, so
    a service bound to [::1], every address or an interface's address could be handed a port
    another process listens on there (the buffer failed at its bind, after the start)."""
    monkeypatch.setattr(up.ServiceProcess, "start", lambda *a, **k: pytest.fail("a service was started"))
    with _listen(family, taken_on, 0) as other:
        taken = other.getsockname()[1]
        _first_pick_is(monkeypatch, taken)
        s = up.Suite(workers=0, base_port=0, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False,
                     metrics=False, extra_args={"buffer": ["--host", host]})
        port = s.services["buffer"].port
        assert port != taken, f"the buffer (host {host}) was given port {taken}, taken on {taken_on}"
        from services.common.ports import grpc_port_is_free

        assert grpc_port_is_free(host, port)


def _unbindable_address() -> str:
    """An IPv4 address this host does not have (a bind there fails with EADDRNOTAVAIL)."""
    for address in ("10.255.255.1", "192.0.2.77", "198.51.100.77"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
            except OSError:
                return address
    pytest.skip("every candidate address is this host's")


def test_a_host_that_cannot_be_bound_gets_a_port_and_the_service_names_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An address this host does not have: free_port hands out its 127.0.0.1 pick, and the service
    exits naming its real bind error (as for an unreadable configuration). Before: every pick
    counted as taken, and `seer up` failed before starting anything, with a misleading "no free
    port found on 10.255.255.1 in 100 tries"."""
    address = _unbindable_address()
    assert 0 < up.free_port(address) < 65536
    monkeypatch.setattr(up.ServiceProcess, "start", lambda *a, **k: pytest.fail("a service was started"))
    s = up.Suite(workers=0, base_port=0, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False,
                 metrics=False, extra_args={"buffer": ["--host", address]})
    assert s.services["buffer"].host == address


def test_a_name_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that does not resolve: one lookup, and the 127.0.0.1 pick. Before: a lookup per pick,
    100 of them (15 s of DNS timeouts), then "no free port found". A name that resolves is looked
    up once too, and its port checked on each address it resolves to."""
    calls: list[str] = []
    real = socket.getaddrinfo

    def lookup(host: Any, *a: Any, **kw: Any) -> Any:
        calls.append(str(host))
        if host == "seer-no-such-host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "seer-two-addresses":  # resolves to two addresses of this host
            return [info for h in ("127.0.0.1", "127.0.0.2") for info in real(h, *a, **kw)]
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    assert 0 < up.free_port("seer-no-such-host.invalid") < 65536
    assert calls == ["seer-no-such-host.invalid"]
    calls.clear()
    # A port taken on the name's second address only is not handed out.
    with _listen(socket.AF_INET, "127.0.0.2", 0) as other:
        taken = other.getsockname()[1]
        _first_pick_is(monkeypatch, taken)
        port = up.free_port("seer-two-addresses")
    assert port != taken
    assert calls == ["seer-two-addresses"]
