"""A worker's advertised address must be a dialable gRPC target: on an IPv6 cluster the Helm
chart's `$(POD_IP):port` is a bare IPv6 literal, which the scheduler could not dial."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from services.common.grpcutil import bracket_ipv6


@pytest.mark.parametrize(("given", "want"), [
    ("fd00::5:50061", "[fd00::5]:50061"),
    ("::1:50061", "[::1]:50061"),
    ("[fd00::5]:50061", "[fd00::5]:50061"),
    ("10.0.0.7:50061", "10.0.0.7:50061"),
    ("worker-0.seer:50061", "worker-0.seer:50061"),
    # Targets with a scheme stay as given (they were bracketed whole).
    ("dns:///worker-0.seer:50061", "dns:///worker-0.seer:50061"),
    ("ipv4:10.0.0.5:50061", "ipv4:10.0.0.5:50061"),
    ("ipv6:[fd00::5]:50061", "ipv6:[fd00::5]:50061"),
])
def test_bracket_ipv6(given: str, want: str) -> None:
    assert bracket_ipv6(given) == want


def test_the_bracketed_form_is_dialable_over_ipv6_loopback() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    try:
        port = server.add_insecure_port("[::1]:0")
    except RuntimeError:
        pytest.skip("no IPv6 loopback here")
    if not port:
        pytest.skip("no IPv6 loopback here")
    server.start()
    try:
        with grpc.insecure_channel(bracket_ipv6(f"::1:{port}")) as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    finally:
        server.stop(0)
