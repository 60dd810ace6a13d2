"""Helpers of the deployment tests: render the Helm chart offline and map env vars to service configs.

A plain module (not conftest) so test files import it by name; pytest puts this directory on sys.path."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "seer"
COMPOSE = REPO / "docker-compose.yml"
SERVICES = ("buffer", "scheduler", "draft", "kvstore", "worker")
# kubernetes-validate's newest bundled schemas at the time of writing; also checked against an
# older, still supported release so the chart does not depend on brand-new fields.
KUBE_VERSIONS = ("1.31.0", "1.37.0")


def render(chart: Any, values: dict[str, Any] | None = None, namespace: str = "rollout") -> list[dict[str, Any]]:
    """Renders the chart as `helm template` would and returns every object (empty documents dropped)."""
    manifests = chart.render(values or {}, name="seer", namespace=namespace)
    objects: list[dict[str, Any]] = []
    for text in manifests.values():
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def config_fields(service: str) -> set[str] | None:
    """Field names of a service's frozen config dataclass, or None when the service has none yet."""
    try:
        module = importlib.import_module(f"services.{service}.config")
    except ImportError:
        return None
    from services.common.server import ServiceConfig

    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, ServiceConfig) and obj is not ServiceConfig:
            return {f.name for f in dataclasses.fields(obj)}
    return None
