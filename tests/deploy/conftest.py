"""Fixtures of the deployment tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from deploy_render import CHART


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    """The chart loaded once through Helm's Go SDK."""
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(str(CHART)) as ch:
        yield ch
