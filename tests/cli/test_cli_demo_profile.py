"""`seer demo` and `seer profile`: bad flags are refused with a message, an empty rollout is shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.cli import demo, profile


def test_profile_refuses_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --steps 0 loaded the model, then failed in statistics.median of no timings."""
    with pytest.raises(SystemExit) as e:
        profile.main(["--steps", "0", "--model-dir", "/nonexistent"])
    assert e.value.code == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps"):
        profile.measure(None, [1], [0], steps=0)


def test_demo_refuses_a_bad_limit_before_starting_anything(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model() -> str:
        raise AssertionError("the model was prepared for a demo that cannot run")

    monkeypatch.setattr(demo, "ensure_embedded_model", no_model)
    assert demo.main(["--limit", "0"]) == 1
    assert "--limit" in capsys.readouterr().err


class _NoSuite:
    """Stands in for the suite: the path under test is what demo does with an empty result list,
    which a real suite gives only when every group is cancelled mid-run."""

    def __init__(self, **_kw: Any) -> None:
        self.address = "127.0.0.1:1"
        self.log_dir = Path("/nonexistent")

    def start(self, **_kw: Any) -> _NoSuite:
        return self

    def endpoints(self) -> dict[str, dict[str, str]]:
        return {}

    def stop(self, **_kw: Any) -> dict[str, int | None]:
        return {}

    def remove_data(self) -> None:
        pass


def test_demo_shows_an_empty_rollout(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: max() of the empty result list raised ValueError after the rollout."""
    monkeypatch.setattr(demo, "ensure_embedded_model", lambda: "/x")
    monkeypatch.setattr(demo, "Suite", _NoSuite)
    monkeypatch.setattr(demo.rollout, "run", lambda *a, **kw: ([], 1.0))
    monkeypatch.setattr(demo.rollout, "accuracy", lambda results: None)
    assert demo.main(["--limit", "1"]) == 0
    assert "responses            0" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "needle", "model_prepared"), [
    (["--workers", "0"], "--workers", False),
    (["--base-port", "70000"], "base_port", True),
])
def test_demo_reports_bad_suite_flags_without_a_traceback(
        flags: list[str], needle: str, model_prepared: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --base-port 70000 (or --workers -1) escaped Suite() as a ValueError traceback, where
    `seer up` prints the message and exits 2; --workers 0 started a suite that no rollout can finish
    and waited out the rollout's one-hour timeout."""
    prepared: list[bool] = []

    def model() -> str:
        prepared.append(True)
        return "/x"

    monkeypatch.setattr(demo, "ensure_embedded_model", model)
    assert demo.main(["--limit", "1", *flags]) == 2
    assert needle in capsys.readouterr().err
    assert bool(prepared) == model_prepared
