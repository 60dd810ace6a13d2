"""services/common/ports.py: the probes answer as the real binds would (gRPC's, for the gRPC port),
and config.load_field resolves a service's host as its own `load` does."""

from __future__ import annotations

import json
import socket
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.common.config import ConfigError, ServiceConfig, load, load_field
from services.common.ports import (
    WILDCARD,
    BindAddress,
    addresses_port_is_free,
    grpc_port_is_free,
    host_addresses,
    is_wildcard_host,
)
from tests.common.test_telemetry import _has_ipv6_loopback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _grpc_binds(host: str, port: int) -> bool:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=[("grpc.so_reuseport", 0)])
    try:
        return server.add_insecure_port(f"{host}:{port}") == port
    except RuntimeError:  # older grpcio raises instead of returning 0
        return False
    finally:
        server.stop(None).wait()


_TAKERS = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")]
_HOSTS = ["127.0.0.1", "0.0.0.0"]
if _has_ipv6_loopback():
    _TAKERS += [(socket.AF_INET6, "::1")]
    _HOSTS += ["[::1]", "::1"]


@pytest.mark.parametrize("taker", _TAKERS, ids=lambda t: t[1])
@pytest.mark.parametrize("host", _HOSTS)
def test_the_grpc_probe_agrees_with_grpc(taker: tuple[socket.AddressFamily, str], host: str) -> None:
    """Where gRPC binds all it was given, the probe's answer is gRPC's own bind's (the wildcard
    host with only [::1] taken is the one case where the probe is stricter: see the next test)."""
    family, address = taker
    if host == "0.0.0.0" and address == "::1":
        pytest.skip("the stricter case")
    port = _free_port()
    with socket.socket(family, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((address, port))
        other.listen()
        # ServiceConfig.host is passed to gRPC as "{host}:{port}": an unbracketed IPv6 literal is
        # bracketed here for gRPC (the probe takes either form).
        target = f"[{host}]" if ":" in host and not host.startswith("[") else host
        assert grpc_port_is_free(host, port) == _grpc_binds(target, port)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_counts_a_listener_on_ipv6_loopback(host: str) -> None:
    """gRPC would bind 0.0.0.0 only, leaving [::1] clients to the other process: taken."""
    port = _free_port()
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind(("::1", port))
        other.listen()
        assert not grpc_port_is_free(host, port)


def test_an_unresolvable_host_is_not_free() -> None:
    assert not grpc_port_is_free("no-such-host.invalid", _free_port())


def test_load_field_resolves_the_host_as_load_does(tmp_path: Path) -> None:
    """Precedence default < file < environment < flag; other flags (a service's own) are left alone."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"host": "10.0.0.1", "port": 5}))
    argv = ["--data-dir", "/d", "--config", str(config)]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["--data-dir", "/d"], {}, "127.0.0.1"),
        (argv, {}, "10.0.0.1"),
        (argv, {"SEER_BUFFER_HOST": "::1"}, "::1"),
        ([*argv, "--host", "[::]"], {"SEER_BUFFER_HOST": "::1"}, "[::]"),
        (["--host=0.0.0.0"], {}, "0.0.0.0"),
        ([], {"SEER_BUFFER_CONFIG": str(config)}, "10.0.0.1"),
    ]
    for given, env, want in cases:
        assert load_field(ServiceConfig, "buffer", "host", given, env) == want, (given, env)
        own = [a for a in given if a not in ("--data-dir", "/d")]
        assert load(ServiceConfig, "buffer", own, env).host == want


def test_a_name_skips_the_addresses_this_host_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name resolving to an address this host lacks (::1 in /etc/hosts with IPv6 off; here
    TEST-NET-1, 192.0.2.1) besides a free one: gRPC binds the free one, so the port is free. It
    was refused (every resolved address had to bind), and `seer up` refused a free port for
    "localhost" on such a host. A taken address still counts."""
    real = socket.getaddrinfo

    def resolve(host: str, port: int, *args: object, **kwargs: object) -> list:  # type: ignore[type-arg]
        if host != "two.example":
            return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    port = _free_port()
    assert grpc_port_is_free("two.example", port)
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", port))
        taker.listen()
        assert not grpc_port_is_free("two.example", port)


def test_load_field_names_a_flag_without_its_value() -> None:
    """`--host` last (no value): a ConfigError naming the section, not argparse's exit (SystemExit
    went through `seer up`'s port check and printed a two-flag parser's usage)."""
    with pytest.raises(ConfigError, match="buffer"):
        load_field(ServiceConfig, "buffer", "host", ["--data-dir", "/d", "--host"], {})


@pytest.mark.parametrize(("host", "wild"), [
    ("0.0.0.0", True), ("::", True), ("[::]", True), ("::0", True), ("0:0:0:0:0:0:0:0", True), ("::ffff:0.0.0.0", True),
    ("127.0.0.1", False), ("::1", False), ("[::1]", False), ("localhost", False), ("", False),
])
def test_one_definition_of_a_wildcard_host(host: str, wild: bool) -> None:
    """The port probe, `seer up`'s dialling and the worker's advertised address share it: they
    disagreed on spellings like ::0 (a wildcard to one, an address to the others)."""
    assert is_wildcard_host(host) is wild


# ---- one resolution of a bind host (host_addresses) for the probe and `seer up`'s free_port ------

def _fake_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names as /etc/hosts could give them: two.example an address this host lacks (TEST-NET-1)
    and 127.0.0.1; lacking.example the lacking one only; any.example 0.0.0.0."""
    real = socket.getaddrinfo
    names = {"two.example": ["192.0.2.1", "127.0.0.1"], "lacking.example": ["192.0.2.1"], "any.example": ["0.0.0.0"]}

    def resolve(host: str, port: int | None, *args: object, **kwargs: object) -> list:  # type: ignore[type-arg]
        if host not in names:
            return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0)) for a in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def test_the_probe_and_free_port_take_a_name_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc_port_is_free and `seer up`'s free_port (its _probe_addresses) resolve a host through
    host_addresses alone: an address this host lacks is skipped by both, a taken one counts for
    both; a name with no address this host has is not free, and free_port leaves it to the service
    (None: its 127.0.0.1 pick unchecked)."""
    from services.cli import up

    _fake_names(monkeypatch)
    here = BindAddress(socket.AF_INET, "127.0.0.1")
    assert host_addresses("two.example") == [here, BindAddress(socket.AF_INET, "192.0.2.1")]
    assert up._probe_addresses("two.example") == [here]
    assert host_addresses("lacking.example") == [BindAddress(socket.AF_INET, "192.0.2.1")]
    assert up._probe_addresses("lacking.example") is None
    assert host_addresses("no-such-host.invalid") == []
    assert up._probe_addresses("no-such-host.invalid") is None
    port = _free_port()
    assert grpc_port_is_free("two.example", port)
    assert not grpc_port_is_free("lacking.example", port)
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", port))
        taker.listen()
        assert not grpc_port_is_free("two.example", port)
        assert not all(addresses_port_is_free([a], port) for a in up._probe_addresses("two.example") or [])


@pytest.mark.parametrize(("host", "want"), [
    ("0.0.0.0", [WILDCARD]), ("[::]", [WILDCARD]), ("::ffff:0.0.0.0", [WILDCARD]),
    ("127.0.0.1", [BindAddress(socket.AF_INET, "127.0.0.1")]), ("[::1]", [BindAddress(socket.AF_INET6, "::1")]),
    ("::1", [BindAddress(socket.AF_INET6, "::1")]), ("", []),
])
def test_host_addresses_of_literals(host: str, want: list[BindAddress]) -> None:
    assert host_addresses(host) == want


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
def test_a_name_for_the_unspecified_address_is_probed_as_a_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC binds each address a name resolves to, and an unspecified one (0.0.0.0) as a wildcard
    host, dual-stack on every address (tcp_server_add_port: grpc_sockaddr_is_wildcard). free_port
    took it so; grpc_port_is_free bound plain IPv4 0.0.0.0 and called a port taken on [::1] free
    (where "0.0.0.0" itself is taken), so `seer up --base-port` let such a service start on it."""
    _fake_names(monkeypatch)
    assert host_addresses("any.example") == [WILDCARD]
    port = _free_port()
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind(("::1", port))
        other.listen()
        assert not grpc_port_is_free("0.0.0.0", port)
        assert not grpc_port_is_free("any.example", port)
    assert grpc_port_is_free("any.example", port)
