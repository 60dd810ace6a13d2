"""Container healthcheck: asks the gRPC health service (grpc.health.v1) whether the server is SERVING.

Usage: python /opt/seer/healthcheck.py [ADDRESS] [--service NAME] [--timeout SECONDS]
ADDRESS defaults to the host and port the service binds (127.0.0.1 for a wildcard or unset host),
resolved as the service resolves them (services/common/config.py): its --host / --port flags (the
arguments after the image name: the container's command line, /proc/1/cmdline, or that of the
process init runs), else $SEER_<SERVICE>_HOST / _PORT, else the JSON file of its --config flag or
$SEER_<SERVICE>_CONFIG, where SERVICE comes from $SEER_IMAGE_SERVICE (set by the image); port 50051
when none sets one. Exit 0 when SERVING, 1 otherwise (compose and Docker read only the exit code;
the reason goes to stdout, which `docker inspect` shows).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def dial_host(host: str) -> str:
    """Where to reach a server bound to `host`: loopback for a wildcard (it binds every address)
    or none set; an IPv6 literal bracketed; any other host as given (a server bound to one
    interface's address does not answer on 127.0.0.1)."""
    literal = host.strip()
    literal = literal[1:-1] if literal.startswith("[") and literal.endswith("]") else literal
    try:
        ip = ipaddress.ip_address(literal)
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        unspecified = ip.is_unspecified or (mapped is not None and mapped.is_unspecified)
    except ValueError:
        unspecified = False
    if not literal or unspecified:  # as services.common.ports.is_wildcard_host (not importable here)
        return "127.0.0.1"
    return f"[{literal}]" if ":" in literal else literal


# The service's own command line: the image's ENTRYPOINT is `python -m services.<service>`, with
# the arguments after the image name appended; pid 1 unless an init (docker run --init, compose's
# init: true) runs it, whose own command line then ends with the service's.
CMDLINE = "/proc/1/cmdline"


def service_args(service: str, cmdline_path: str) -> list[str]:
    """The arguments the service was started with (after `-m services.<service>`); [] when that
    command line is not there or not the service's (the checks then go by the environment)."""
    try:
        with open(cmdline_path, "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0")]
    except OSError:
        return []
    if argv and argv[-1] == "":
        argv.pop()  # the NUL that ends the last argument
    module = f"services.{service}"
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == module:
            return argv[i + 2:]
    return []


def _flag(args: Sequence[str], name: str) -> str | None:
    """The last value of --name (as argparse takes it: `--name V` or `--name=V`; the services'
    parsers take no abbreviations)."""
    value = None
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def resolve(service: str, field: str, args: Sequence[str], env: Mapping[str, str]) -> object:
    """One field of the service's configuration with the service's precedence (flag > environment >
    config file), as services.common.config.load_field, unparsed: a string from a flag or the
    environment, the JSON value (a number, say) from a config file; None when none sets it. A
    config file that cannot be read sets nothing here (the service itself refuses it at start)."""
    flag = _flag(args, "--" + field.replace("_", "-"))
    if flag is not None:
        return flag
    prefix = f"SEER_{service.upper()}_"
    if prefix + field.upper() in env:
        return env[prefix + field.upper()]
    config = _flag(args, "--config") or env.get(prefix + "CONFIG")
    if config:
        try:
            with open(config, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        if isinstance(data, dict):
            value: object = data.get(field)
            return value
    return None


def port_text(raw: object) -> str:
    """The port a service reads from `raw` (a value resolve found), spelled as a dial target wants
    it: parsed as services.common.config._parse_value parses an int field (not importable here),
    so a JSON 50052.0 is 50052 and " 50052" (a string int() takes: whitespace, a sign, underscores)
    is 50052. Before: the raw spelling was dialled ("127.0.0.1:50052.0"), a service that had started
    on 50052 was unhealthy forever. A value the service refuses is returned as given: the service
    exits naming it, and the check's dial error names it too."""
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    if isinstance(raw, str):
        try:
            return str(int(raw))
        except ValueError:
            return raw
    return str(raw)


def default_address(env: Mapping[str, str] | None = None, cmdline_path: str | None = None) -> str:
    env = os.environ if env is None else env
    cmdline_path = cmdline_path or CMDLINE
    service = env.get("SEER_IMAGE_SERVICE", "")
    if not service:
        return "127.0.0.1:50051"
    args = service_args(service, cmdline_path)
    port = resolve(service, "port", args, env)
    host = resolve(service, "host", args, env)
    # None or "" (unset, or set empty): the default port; for the host 127.0.0.1, as for a wildcard.
    port_part = "50051" if port is None or port == "" else port_text(port)
    return f"{dial_host(str(host) if host else '')}:{port_part}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address", nargs="?", default=None)
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    address = args.address or default_address()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}: {e.details()}")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
