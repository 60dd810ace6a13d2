"""The Suite dials each service on the host it binds (--host, SEER_<SERVICE>_HOST, a config file):
health checks, the endpoints printed and the wiring between services (the scheduler's
--buffer-address, the buffer's and the workers' --scheduler-address, ...). Before: 127.0.0.1
whatever the host, so a service bound to [::1] never answered the health checks and `seer up`
failed with "not healthy after ...s"."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from seer.v1 import rollout_pb2, rollout_pb2_grpc

from services.cli import up
from services.common.grpcutil import channel
from tests.common.test_telemetry import _has_ipv6_loopback

needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")


@pytest.mark.parametrize(("bind", "dial"), [
    (None, "127.0.0.1"),  # an unreadable configuration: the service exits naming it, nothing to dial
    ("", "127.0.0.1"),
    ("0.0.0.0", "127.0.0.1"),
    ("::", "127.0.0.1"),
    ("[::]", "127.0.0.1"),
    ("127.0.0.1", "127.0.0.1"),
    ("10.1.2.3", "10.1.2.3"),
    ("::1", "[::1]"),
    ("[::1]", "[::1]"),
    ("fd00::5", "[fd00::5]"),
    ("localhost", "localhost"),
])
def test_dial_host(bind: str | None, dial: str) -> None:
    assert up.dial_host(bind) == dial


def _arg(s: up.ServiceProcess, flag: str) -> str:
    return s.args[s.args.index(flag) + 1]


def _built(tmp_path: Path, extra_args: Mapping[str, Sequence[str]] | None = None,
           env: Mapping[str, str] | None = None) -> up.Suite:
    return up.Suite(workers=2, base_port=0, data_dir=tmp_path, model_dir="/x", metrics=False,
                    extra_args=extra_args, env=env)


def test_every_service_is_wired_to_the_addresses_the_others_bind(tmp_path: Path) -> None:
    """Each way of setting a host (flag, environment, config file), one service each; wildcard hosts
    and the default are dialled on 127.0.0.1."""
    config = tmp_path / "kvstore.json"
    config.write_text(json.dumps({"host": "::1"}))
    s = _built(tmp_path, extra_args={"buffer": ["--host", "[::1]"], "kvstore": ["--config", str(config)],
                                     "worker-0": ["--host", "0.0.0.0"]},
               env={"SEER_SCHEDULER_HOST": "localhost", "SEER_DRAFT_HOST": "::"})
    sv = s.services
    buffer, scheduler = f"[::1]:{sv['buffer'].port}", f"localhost:{sv['scheduler'].port}"
    assert s.address == sv["buffer"].address == buffer
    assert s.scheduler_address == sv["scheduler"].address == scheduler
    assert sv["draft"].address == f"127.0.0.1:{sv['draft'].port}"
    assert sv["kvstore"].address == f"[::1]:{sv['kvstore'].port}"
    assert sv["worker-0"].address == f"127.0.0.1:{sv['worker-0'].port}"
    assert _arg(sv["draft"], "--buffer-address") == buffer
    assert _arg(sv["scheduler"], "--buffer-address") == buffer
    assert _arg(sv["buffer"], "--scheduler-address") == scheduler
    for w in ("worker-0", "worker-1"):
        assert _arg(sv[w], "--scheduler-address") == scheduler
        assert _arg(sv[w], "--draft-address") == sv["draft"].address
        assert _arg(sv[w], "--kv-addresses") == sv["kvstore"].address
    assert {n: e["address"] for n, e in s.endpoints().items()} == {n: p.address for n, p in sv.items()}


def test_the_default_host_is_dialled_on_127_0_0_1(tmp_path: Path) -> None:
    s = _built(tmp_path)
    assert all(p.address == f"127.0.0.1:{p.port}" for p in s.services.values())
    assert _arg(s.services["scheduler"], "--buffer-address") == s.address


@needs_ipv6
def test_services_bound_to_ipv6_loopback_become_healthy_and_reach_each_other(tmp_path: Path) -> None:
    """A real buffer and scheduler bound to [::1] (one by flag, one by environment): the suite comes
    up (before: "not healthy after 30s"), and the buffer reaches the scheduler on the address it was
    given (UpdateWeights switches the scheduler's policy version)."""
    s = up.Suite(workers=0, draft=False, kvstore=False, data_dir=tmp_path, model_dir="", metrics=False,
                 extra_args={"buffer": ["--host", "[::1]"]}, env={"SEER_SCHEDULER_HOST": "[::1]"})
    s.start(timeout=30)
    try:
        assert s.address.startswith("[::1]:") and s.scheduler_address.startswith("[::1]:")
        assert up.health_status(f"127.0.0.1:{s.services['buffer'].port}") == "UNREACHABLE"  # bound to ::1 only
        ch = channel(s.address)
        try:
            reply = rollout_pb2_grpc.RolloutServiceStub(ch).UpdateWeights(
                rollout_pb2.UpdateWeightsRequest(version=1), timeout=20)
        finally:
            ch.close()
        assert reply.version == 1
        assert s.scheduler_stats().policy_version == 1
    finally:
        codes = s.stop()
    assert codes == {"buffer": 0, "scheduler": 0}
