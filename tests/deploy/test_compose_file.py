"""docker-compose.yml is well formed and wired the same way as the Helm chart: health-gated startup,
named volumes for RocksDB, and only SEER_* variables the services' configs know."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
import yaml
from deploy_render import COMPOSE, REPO, config_fields, render

REQUIRED = {"buffer", "scheduler", "draft", "kvstore"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def _service_of(name: str) -> str:
    return "worker" if name.startswith("worker") else name


def test_services_health_and_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = sorted(n for n in services if n.startswith("worker"))
    assert set(services) >= REQUIRED and len(workers) == 2
    for name, svc in services.items():
        assert "/opt/seer/healthcheck.py" in svc["healthcheck"]["test"], f"{name}: gRPC health check"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: start only once healthy"
    for w in workers:
        assert set(services[w]["depends_on"]) == {"scheduler", "draft", "kvstore"}
    assert set(services["scheduler"]["depends_on"]) == {"buffer"}
    # RocksDB state on named volumes, mounted where the service's data_dir points.
    for name in ("buffer", "kvstore"):
        volume, path = services[name]["volumes"][0].split(":")[:2]
        assert volume in compose["volumes"]
        assert services[name]["environment"][f"SEER_{name.upper()}_DATA_DIR"] == path
    # Distinct worker identities and advertised addresses the scheduler can dial.
    ids = {services[w]["environment"]["SEER_WORKER_WORKER_ID"] for w in workers}
    adverts = {services[w]["environment"]["SEER_WORKER_ADVERTISE_ADDRESS"] for w in workers}
    assert len(ids) == len(adverts) == 2
    assert all(a.split(":")[0] in services for a in adverts)


def test_env_names_are_real_config_fields(compose: dict[str, Any]) -> None:
    checked = 0
    for name, svc in compose["services"].items():
        service = _service_of(name)
        fields = config_fields(service)
        if fields is None:
            continue
        prefix = f"SEER_{service.upper()}_"
        env = svc.get("environment", {})
        unknown = sorted(k for k in env if k.startswith(prefix) and k[len(prefix):].lower() not in fields)
        assert not unknown, f"{name}: {unknown} are not fields of services.{service}.config"
        # Cross-service prefixes would be silently ignored by the loader of this service.
        foreign = sorted(k for k in env if k.startswith("SEER_") and not k.startswith(prefix)
                         and k not in {"SEER_TRACING", "SEER_MODEL_DIR"})
        assert not foreign, f"{name}: {foreign} belong to another service"
        checked += 1
    assert checked >= 4


def test_scheduler_epoch_file_is_on_a_named_volume(compose: dict[str, Any]) -> None:
    """read_only: true: the epoch file must sit on a volume, and a named one keeps it across
    `docker-compose up` recreating the container."""
    svc = compose["services"]["scheduler"]
    path = svc["environment"]["SEER_SCHEDULER_EPOCH_FILE"]
    mounts = dict(v.split(":", 1)[::-1] for v in svc["volumes"])
    directory = path.rsplit("/", 1)[0]
    assert directory in mounts, f"{path} is not on a volume: {svc['volumes']}"
    assert mounts[directory] in compose["volumes"]


def test_same_wiring_as_the_helm_chart(compose: dict[str, Any], chart: Any) -> None:
    """Each service gets the same address variables from compose as from the chart."""
    objects = render(chart)
    workloads = {o["metadata"]["name"].removeprefix("seer-"): o for o in objects
                 if o["kind"] in ("Deployment", "StatefulSet")}
    for name, svc in compose["services"].items():
        service = _service_of(name)
        container = workloads[service]["spec"]["template"]["spec"]["containers"][0]
        chart_keys = {e["name"] for e in container["env"] if e["name"].endswith(("_ADDRESS", "_ADDRESSES"))}
        compose_keys = {k for k in svc.get("environment", {}) if k.endswith(("_ADDRESS", "_ADDRESSES"))}
        assert chart_keys == compose_keys, f"{name}: chart {sorted(chart_keys)} vs compose {sorted(compose_keys)}"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file() -> None:
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
