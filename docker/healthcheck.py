"""Container healthcheck: asks the gRPC health service (grpc.health.v1) whether the server is SERVING.

Usage: python /opt/seer/healthcheck.py [ADDRESS] [--service NAME] [--timeout SECONDS]
ADDRESS defaults to $SEER_<SERVICE>_HOST:$SEER_<SERVICE>_PORT (127.0.0.1 for a wildcard or unset
host) where SERVICE comes from $SEER_IMAGE_SERVICE (set by the image). Exit 0 when SERVING, 1
otherwise (compose and Docker read only the exit code; the reason goes to stdout, which `docker
inspect` shows).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

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


def default_address() -> str:
    service = os.environ.get("SEER_IMAGE_SERVICE", "")
    if not service:
        return "127.0.0.1:50051"
    port = os.environ.get(f"SEER_{service.upper()}_PORT", "50051")
    return f"{dial_host(os.environ.get(f'SEER_{service.upper()}_HOST', ''))}:{port}"


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
