"""Whether a service could bind its ports now: probes that bind the same addresses, with the same
socket options, as the service's own servers will (`seer up` checks a fixed port layout with them
before starting anything), and the host a client dials such a server on. No grpc import: the probes
are plain sockets (the containers' healthcheck imports this module every few seconds)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

# errno of an IPv6 socket on a host without IPv6 (ipv6.disable=1, some containers): only these fall
# back to IPv4; any other failure (the port taken) is the bind's answer.
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL, errno.ENOPROTOOPT})


def is_wildcard_host(host: str) -> bool:
    """Whether a bind host means "every address" (0.0.0.0, ::, [::], ::0 and other spellings of an
    unspecified address): gRPC binds it dual-stack on [::] (IPv4 0.0.0.0 where the host has no
    IPv6), not the literal address. The one definition for the port probe, `seer up`'s and the
    containers' healthcheck's dialling (dial_host) and the worker's advertised address."""
    literal = host.strip()
    literal = literal[1:-1] if literal.startswith("[") and literal.endswith("]") else literal
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        return False
    # ::ffff:0.0.0.0 too: gRPC binds the IPv4-mapped unspecified address on every address as well.
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def ipv6_unavailable(e: OSError) -> bool:
    """Whether an IPv6 socket's error means the host has no IPv6 (not that the port is taken)."""
    return not socket.has_ipv6 or e.errno in _NO_IPV6


def _binds(family: socket.AddressFamily, host: str, port: int, dual_stack: bool = False) -> bool:
    """One bind with SO_REUSEADDR, as gRPC's and the metrics server's own: a port left in TIME_WAIT
    by the previous run counts as free, one another socket listens on does not."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((host, port))
    return True


def wildcard_port_is_free(port: int) -> bool:
    """Whether `port` could be bound on every address of the host now: dual-stack on "::" (IPv4
    "0.0.0.0" only where the host has no IPv6), so a listener on any one address (127.0.0.1 only,
    [::1] only) counts as taken."""
    try:
        return _binds(socket.AF_INET6, "::", port, dual_stack=True)
    except OSError as e:
        if not ipv6_unavailable(e):
            return False
    try:
        return _binds(socket.AF_INET, "0.0.0.0", port)
    except OSError:
        return False


@dataclass(frozen=True, order=True)
class BindAddress:
    """One address a gRPC server binds for its host (see host_addresses): `wildcard` for every
    address of the host (dual-stack [::], IPv4 0.0.0.0 where the host has no IPv6: the probe finds
    out which), else `address` in `family`."""

    family: socket.AddressFamily
    address: str
    wildcard: bool = False


# What a wildcard host binds: every address (family and address only name it; see BindAddress).
WILDCARD = BindAddress(socket.AF_INET6, "::", wildcard=True)


def _literal(host: str) -> str:
    """`host` without the brackets of an IPv6 literal ("[::1]" is how gRPC wants one)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_addresses(host: str) -> list[BindAddress]:
    """The addresses a gRPC server given `host` (ServiceConfig.host, as services/common/server.py
    passes it to add_insecure_port) binds, resolved once: a wildcard host (0.0.0.0, ::) WILDCARD;
    an IP literal (bracketed or not) that address; a name every address it resolves to, an
    unspecified one (a name for 0.0.0.0) WILDCARD, as gRPC's own bind takes each resolved address
    (tcp_server_add_port); [] for a name that does not resolve (gRPC cannot bind it either).
    The one resolution for grpc_port_is_free and `seer up`'s free_port: they each had a copy, and
    a name for 0.0.0.0 was a wildcard to free_port but a plain IPv4 bind to grpc_port_is_free,
    which then missed a port taken on [::1]."""
    if is_wildcard_host(host):
        return [WILDCARD]
    literal = _literal(host)
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        pass
    else:
        return [BindAddress(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, literal)]
    try:
        infos = socket.getaddrinfo(literal, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    resolved = {(info[0], str(info[4][0])) for info in infos}
    return sorted({WILDCARD if is_wildcard_host(address) else BindAddress(family, address)
                   for family, address in resolved})


def _probe(address: BindAddress, port: int) -> bool | None:
    """True when `port` binds on `address` now, False when it does not (taken, or refused for
    another reason), None when this host does not have the address at all (::1 in /etc/hosts with
    IPv6 off, an interface that is gone)."""
    if address.wildcard:
        return wildcard_port_is_free(port)
    try:
        return _binds(address.family, address.address, port)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL or (address.family == socket.AF_INET6 and ipv6_unavailable(e)):
            return None
        return False


def addresses_port_is_free(addresses: Sequence[BindAddress], port: int) -> bool:
    """Whether `port` binds on `addresses` (host_addresses' answer) as gRPC binds them: gRPC binds
    every address it can and fails only when none binds, so an address this host does not have is
    skipped (it made `seer up` refuse a free port for "localhost" where ::1 is in /etc/hosts but
    IPv6 is off), one taken counts as taken (another process would answer some of the service's
    clients), and none at all (a name that does not resolve) is not free."""
    bound = False
    for address in addresses:
        result = _probe(address, port)
        if result is False:
            return False
        bound = bound or result is True
    return bound


def grpc_port_is_free(host: str, port: int) -> bool:
    """Whether a gRPC server given `host:port` could bind it now, probing the addresses gRPC binds
    (host_addresses): a wildcard host dual-stack on every address; an IP literal that address; a
    name every address it resolves to that this host has. `seer up` used to probe 127.0.0.1
    whatever the host, and missed a port taken on [::1] or on another interface's address for a
    service configured to bind there: it failed after the start, with the bind error only in its
    log. Stricter than gRPC on purpose where gRPC binds part of what it was given (a wildcard host
    on IPv4 only when [::] is taken, a name on those of its addresses that are free): another
    process then answers some of the service's clients, so the port counts as taken."""
    return addresses_port_is_free(host_addresses(host), port)


def dial_host(host: str | None) -> str:
    """The host a client dials a server on, given the host it binds: 127.0.0.1 for a wildcard
    (0.0.0.0, ::, [::]: it binds every address, loopback included), for "" or None (an unset or
    unreadable configuration: the service then exits naming it; nothing to dial); an IPv6 literal
    bracketed, as gRPC targets need it; any other host (an interface's address, a name) as given.
    The one definition for `seer up` and the containers' healthcheck (docker/healthcheck.py)."""
    if host is None or host == "" or is_wildcard_host(host):
        return "127.0.0.1"
    literal = _literal(host)
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        return host  # a name (localhost): gRPC resolves it as the service's bind did
    return f"[{literal}]" if ip.version == 6 else literal


__all__ = [
    "WILDCARD",
    "BindAddress",
    "addresses_port_is_free",
    "dial_host",
    "grpc_port_is_free",
    "host_addresses",
    "ipv6_unavailable",
    "is_wildcard_host",
    "wildcard_port_is_free",
]
