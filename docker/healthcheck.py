"""Container healthcheck: asks the gRPC health service (grpc.health.v1) whether the server is SERVING.

Usage: python /opt/seer/healthcheck.py [ADDRESS] [--service NAME] [--timeout SECONDS]
ADDRESS defaults to the host and port the service binds (127.0.0.1 for a wildcard or unset host),
resolved as the service resolves them (services/common/config.py): its --host / --port flags (the
arguments after the image name: the container's command line, /proc/1/cmdline, or that of the
process init runs), else $SEER_<SERVICE>_HOST / _PORT, else the JSON file of its --config flag or
$SEER_<SERVICE>_CONFIG, where SERVICE comes from $SEER_IMAGE_SERVICE (set by the image); the
service's own default port when none sets one (a port of 0, picked at start, cannot be checked).
Exit 0 when SERVING, 1 otherwise, also when the service's configuration cannot be read (compose
and Docker read only the exit code; the reason goes to stdout, which `docker inspect` shows).

The resolution is the services' own (services.common.config.load_field, services.common.ports
.dial_host): every image installs the project wheel into the venv its `python` runs, and those two
modules import no grpc, torch or service code (a few milliseconds; the check runs every few
seconds). It kept copies of both, which could drift from the services silently.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import service_configs
from services.common.config import ServiceConfig, load_field
from services.common.ports import dial_host

# The port dialled with no SEER_IMAGE_SERVICE (the script run by hand): the buffer's default.
DEFAULT_PORT = 50051


def config_class(service: str) -> type[ServiceConfig]:
    """The configuration class of `service` (SEER_IMAGE_SERVICE): the service's own defaults apply
    (the draft server's port is 50053 unless set; ServiceConfig's 0 made the check dial 50051).
    ValueError naming SEER_IMAGE_SERVICE for a name no image sets."""
    try:
        return service_configs.config_class(service)
    except ValueError as e:
        raise ValueError(f"SEER_IMAGE_SERVICE: {e}") from None


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


def default_address(env: Mapping[str, str] | None = None, cmdline_path: str | None = None) -> str:
    """host:port of the service this image runs, resolved as the service resolves its own
    configuration; raises ValueError (config.ConfigError, a malformed JSON file) or OSError (a
    config file that cannot be read) where the service itself refuses it at start."""
    env = os.environ if env is None else env
    cmdline_path = cmdline_path or CMDLINE
    service = env.get("SEER_IMAGE_SERVICE", "")
    if not service:
        return f"127.0.0.1:{DEFAULT_PORT}"
    cls = config_class(service)
    args = service_args(service, cmdline_path)
    host = load_field(cls, service, "host", args, env)
    port = load_field(cls, service, "port", args, env)
    if not port:
        # The service binds a port the kernel picks: nothing here knows it, and dialling a default
        # could reach another service there (host networking) and call this one healthy.
        raise ValueError("port: 0 (a port picked at start) cannot be checked; pass the address to dial")
    return f"{dial_host(host)}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address", nargs="?", default=None)
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--print-address", action="store_true",
                        help="print the address the check would dial and exit (the image build runs it: an "
                             "import or configuration the check cannot take fails the build, not every check)")
    args = parser.parse_args(argv)
    try:
        address = args.address or default_address()
    except (ValueError, OSError) as e:
        # The service exits on the same error (or never started): say so rather than dial a guess.
        print(f"configuration: {e}")
        return 1
    if args.print_address:
        print(address)
        return 0
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
