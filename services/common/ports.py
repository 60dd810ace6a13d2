"""Whether a service could bind its ports now: probes that bind the same addresses, with the same
socket options, as the service's own servers will (`seer up` checks a fixed port layout with them
before starting anything). No grpc import: the probes are plain sockets."""

from __future__ import annotations

import errno
import ipaddress
import socket

# errno of an IPv6 socket on a host without IPv6 (ipv6.disable=1, some containers): only these fall
# back to IPv4; any other failure (the port taken) is the bind's answer.
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL, errno.ENOPROTOOPT})


def is_wildcard_host(host: str) -> bool:
    """Whether a bind host means "every address" (0.0.0.0, ::, [::], ::0 and other spellings of an
    unspecified address): gRPC binds it dual-stack on [::] (IPv4 0.0.0.0 where the host has no
    IPv6), not the literal address. The one definition for the port probe, `seer up`'s dialling
    and the worker's advertised address (docker/healthcheck.py, which runs alone in the image,
    keeps a copy)."""
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


def grpc_port_is_free(host: str, port: int) -> bool:
    """Whether a gRPC server given `host:port` (ServiceConfig.host, as services/common/server.py
    passes it to add_insecure_port) could bind it now, probing the addresses gRPC binds: a wildcard
    host (0.0.0.0, ::) dual-stack on every address; an IP literal that address (gRPC wants an IPv6
    one bracketed; the probe takes either); a name (localhost) every address it resolves to that
    this host has. `seer up` used to probe 127.0.0.1
    whatever the host, and missed a port taken on [::1] or on another interface's address for a
    service configured to bind there: it failed after the start, with the bind error only in its
    log. Stricter than gRPC on purpose where gRPC binds part of what it was given (a wildcard host
    on IPv4 only when [::] is taken, a name on those of its addresses that are free): another
    process then answers some of the service's clients, so the port counts as taken."""
    if is_wildcard_host(host):
        return wildcard_port_is_free(port)
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        ip = None
    if ip is not None:
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    else:
        try:
            infos = socket.getaddrinfo(literal, port, type=socket.SOCK_STREAM)
        except OSError:
            return False  # gRPC cannot bind a name that does not resolve either
        # A name: gRPC binds every address it resolves to that it can and fails only when none
        # binds. An address this host does not have (::1 in /etc/hosts with IPv6 off) is skipped,
        # not counted as taken (it made `seer up` refuse a free port for "localhost" there).
        bound = False
        for fam, address in sorted({(info[0], str(info[4][0])) for info in infos}):
            try:
                bound = _binds(fam, address, port) or bound
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL or (fam == socket.AF_INET6 and ipv6_unavailable(e)):
                    continue
                return False  # taken (or refused otherwise): another process answers on it
        return bound
    try:
        return _binds(family, literal, port)
    except OSError:
        return False


__all__ = ["grpc_port_is_free", "ipv6_unavailable", "is_wildcard_host", "wildcard_port_is_free"]
