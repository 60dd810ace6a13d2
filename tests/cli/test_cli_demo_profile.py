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
    monkeypatch.setattr(demo, "ensure_embedded_model", _no_model)
    assert demo.main(["--limit", "0"]) == 1
    assert "--limit" in capsys.readouterr().err


class _NoSuite:
    """Stands in for the suite: the path under test is what demo does with an empty result list,
    which a real suite gives only when every group is cancelled mid-run."""

    def __init__(self, **_kw: Any) -> None:
        self.address = "127.0.0.1:1"
        self.log_dir = Path("/nonexistent")
        self.services: dict[str, Any] = {}  # nothing for the demo's health supervision to watch

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


def test_profile_names_a_malformed_list_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a ValueError traceback from int() ("invalid literal for int() with base 10: 'a'")."""
    for flag in ("--batch-sizes", "--gammas"):
        with pytest.raises(SystemExit) as e:
            profile.main([flag, "1,a", "--model-dir", "/nonexistent"])
        assert e.value.code == 2
        assert f"argument {flag}: need comma-separated integers, got '1,a'" in capsys.readouterr().err


def _no_model() -> str:
    raise AssertionError("the model was prepared for a demo that cannot run")


@pytest.mark.parametrize("flag", ["--workers", "--group-size", "--max-tokens"])
def test_demo_refuses_a_zero_count_before_starting_anything(
        flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --group-size 0 and --max-tokens 0 went through the model, the suite's start and the
    submission; the buffer then refused the batch by groups[0].group_size, not by the flag."""
    monkeypatch.setattr(demo, "ensure_embedded_model", _no_model)
    monkeypatch.setattr(demo, "Suite", _NoSuite)
    monkeypatch.setattr(demo.rollout, "run", lambda *a, **kw: ([], 1.0))
    with pytest.raises(SystemExit) as e:
        demo.main(["--limit", "1", flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_demo_reports_a_bad_base_port_by_its_flag_without_a_traceback(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --base-port 70000 escaped Suite() as a ValueError traceback, where `seer up` prints the
    message and exits 2; then the message named Suite's base_port, not the flag."""
    monkeypatch.setattr(demo, "ensure_embedded_model", lambda: "/x")
    assert demo.main(["--limit", "1", "--base-port", "70000"]) == 2
    assert "seer demo: --base-port: 70000 leaves no room" in capsys.readouterr().err
