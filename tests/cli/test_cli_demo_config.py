"""`seer demo` and the services' own configuration, as `seer up`: SEER_<SERVICE>_<FIELD> variables
apply unless an option given to `seer demo` overrides them (with a `seer demo: warning:` line), and a
bad setting is refused before anything starts.

demo.main runs in process with the real Suite, which builds every service's command line and
environment and checks them with the real loader; the test reads each configuration the same way
from them, and stops before the suite would start (a real start costs a model load per worker).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from services.cli import demo
from services.cli.up import Suite
from services.common import config
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

_VARIABLES = ("SEER_SCHEDULER_POLICY", "SEER_SCHEDULER_CHUNK_SIZE", "SEER_WORKER_SPECULATION",
              "SEER_WORKER_MODEL_DIR", "SEER_BUFFER_MODEL_DIR", "SEER_SCHEDULER_CONFIG", "SEER_WORKER_CONFIG")


@pytest.fixture()
def demo_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A runner of demo.main(flags) under `env` that returns (exit code, the configurations its
    scheduler and worker-0 would load or None when no suite was made); the suite's temporary
    directory goes under tmp_path, and is removed."""
    monkeypatch.setattr(demo, "ensure_embedded_model", lambda: "/embedded")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made: list[Suite] = []

    def no_start(args: Any, prompts: Any, suite: Suite, stop: Any, say: Any) -> int:
        made.append(suite)
        suite.remove_data()
        return 0

    monkeypatch.setattr(demo, "_run", no_start)

    def run(flags: list[str], env: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
        made.clear()
        for name in _VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code = demo.main(["--limit", "1", "--base-port", "0", *flags])
        assert list(tmp_path.iterdir()) == [], "a state directory was left behind"
        if not made:
            return code, None
        sched, worker = made[0].services["scheduler"], made[0].services["worker-0"]
        s = config.load(SchedulerConfig, "scheduler", sched.args, sched.env)
        w = config.load(WorkerConfig, "worker", worker.args, worker.env)
        return code, {"policy": s.policy, "chunk_size": s.chunk_size, "speculation": w.speculation,
                      "model_dir": w.model_dir}

    return run


def test_demo_leaves_settings_to_the_services_environment_unless_an_option_is_given(
        demo_suite: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `seer demo` always passed --policy seer --chunk-size 32 --speculation true and the
    embedded model's directory as chosen values, and a flag outranks the environment:
    SEER_SCHEDULER_POLICY=baseline and the others were silently ignored."""
    env = {"SEER_SCHEDULER_POLICY": "baseline", "SEER_SCHEDULER_CHUNK_SIZE": "64",
           "SEER_WORKER_SPECULATION": "false", "SEER_WORKER_MODEL_DIR": "/mine", "SEER_BUFFER_MODEL_DIR": "/mine"}
    code, cfg = demo_suite([], env)
    assert code == 0
    assert cfg == {"policy": "baseline", "chunk_size": 64, "speculation": False, "model_dir": "/mine"}
    assert "warning" not in capsys.readouterr().err
    # An option given to `seer demo` wins, with one warning line naming both.
    code, cfg = demo_suite(["--policy", "divided", "--speculation", "on", "--chunk-size", "16"], env)
    assert code == 0
    assert cfg == {"policy": "divided", "chunk_size": 16, "speculation": True, "model_dir": "/mine"}
    err = capsys.readouterr().err
    assert err.count("seer demo: warning: --policy divided overrides SEER_SCHEDULER_POLICY=baseline") == 1, err
    assert err.count("seer demo: warning: --chunk-size 16 overrides SEER_SCHEDULER_CHUNK_SIZE=64") == 1, err
    assert err.count("seer demo: warning: --speculation true overrides SEER_WORKER_SPECULATION=false") == 1, err


def test_demo_without_options_or_variables_keeps_its_defaults(demo_suite: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, cfg = demo_suite([], {})
    assert code == 0
    assert cfg == {"policy": "seer", "chunk_size": 32, "speculation": True,
                   "model_dir": "/embedded"}
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--chunk-size", "-5"], {}, "seer demo: --chunk-size: must be >= 1, got -5"),
    ([], {"SEER_SCHEDULER_CHUNK_SIZE": "-5"}, "seer demo: SEER_SCHEDULER_CHUNK_SIZE=-5: must be >= 1, got -5"),
    ([], {"SEER_SCHEDULER_POLICY": "foo"}, "seer demo: SEER_SCHEDULER_POLICY=foo: 'foo' is not one of"),
    # The workers on another model than the buffer's (which tokenizes and checks ids with its own).
    ([], {"SEER_WORKER_MODEL_DIR": "/mine"},
     "seer demo: model_dir: the buffer uses /embedded (flag --model-dir) but worker-0 uses /mine "
     "(env SEER_WORKER_MODEL_DIR)"),
    ([], {"SEER_BUFFER_MODEL_DIR": "/mine"},
     "seer demo: model_dir: the buffer uses /mine (env SEER_BUFFER_MODEL_DIR) but worker-0 uses /embedded"),
])
def test_demo_refuses_a_bad_setting_before_starting_anything(
        demo_suite: Any, capsys: pytest.CaptureFixture[str], flags: list[str], env: dict[str, str],
        message: str) -> None:
    code, cfg = demo_suite(flags, env)
    assert code == 2 and cfg is None
    assert message in capsys.readouterr().err


def test_demo_policy_has_seer_ups_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: any string was taken, and a typo failed only when the scheduler exited at start."""
    with pytest.raises(SystemExit) as e:
        demo.main(["--policy", "oracle"])
    assert e.value.code == 2
    assert "argument --policy: invalid choice: 'oracle'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "{baseline,divided,seer,seer_history}" in capsys.readouterr().out
