"""`seer up` and the services' own configuration: SEER_<SERVICE>_<FIELD> variables apply unless an
option given to `seer up` overrides them (with a warning), and every service's configuration is
checked before anything starts.

The first tests run `seer up` for real in a subprocess; its services are stand-ins that load their
configuration with the real loader from the command line and environment `seer up` gave them, and
record it (a real scheduler and worker would cost a model load for one value).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import wait_for_line

from services.cli import up
from services.common import config
from services.common.model_paths import default_model_dir
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]

# A stand-in service: the scheduler and the worker write the configuration they would run with
# (the real loader over their argv and environment) to <out dir>/<name>.cfg; then all sleep until
# SIGTERM.
_SERVICE = (
    "import json, signal, sys, time\n"
    "from services.common import config\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "name, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
    "if name in ('scheduler', 'worker-0'):\n"
    "    from services.scheduler.config import SchedulerConfig\n"
    "    from services.worker.config import WorkerConfig\n"
    "    cls, section = (SchedulerConfig, 'scheduler') if name == 'scheduler' else (WorkerConfig, 'worker')\n"
    "    cfg = config.load(cls, section, args)\n"
    "    keys = ('policy', 'chunk_size', 'heartbeat_interval') if section == 'scheduler' else ('speculation',)\n"
    "    open(f'{out}/{name}.cfg', 'w').write(json.dumps({k: getattr(cfg, k) for k in keys}))\n"
    "time.sleep(600)\n"
)

_UP = """
import sys
from services.cli import up
up.ensure_embedded_model = lambda: "/nonexistent-model"
up.health_status = lambda address, timeout=1.0: "SERVING"
up.Suite.wait_workers = lambda self, count, timeout=120.0, stop=None: None
up.ServiceProcess.command = lambda self: [sys.executable, "-c", {service!r}, self.name, {out!r}, *self.args]
sys.exit(up.main(["--base-port", "0", "--workers", "1", "--timeout", "30", *{flags!r}]))
"""


def _run_up(tmp_path: Path, flags: list[str], env: dict[str, str]) -> tuple[dict[str, dict[str, object]], str]:
    """Runs `seer up` until the suite is up, stops it; the configurations its stand-ins loaded
    and its stderr."""
    import json
    import tempfile

    # A fresh directory per run: a second run found the first one's .cfg files, stopped the suite
    # before its stand-ins had set their SIGTERM handler, and they died of the signal (flaky).
    out = Path(tempfile.mkdtemp(dir=tmp_path, prefix="cfg-"))
    code = _UP.format(service=_SERVICE, out=str(out), flags=flags)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path), **env},
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_line(p, "suite is up")
        for name in ("scheduler", "worker-0"):
            path = out / f"{name}.cfg"
            for _ in range(200):
                if path.exists() and path.read_text():
                    break
                time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert p.returncode == 0, err
    return {n: json.loads((out / f"{n}.cfg").read_text()) for n in ("scheduler", "worker-0")}, err


def test_up_leaves_settings_to_the_services_environment_unless_an_option_is_given(tmp_path: Path) -> None:
    """Before: `seer up` always passed --policy seer --chunk-size 512 --heartbeat-interval 1.0 and
    --speculation true, and a flag outranks the environment: SEER_SCHEDULER_POLICY=baseline and
    the others were silently ignored."""
    env = {"SEER_SCHEDULER_POLICY": "baseline", "SEER_SCHEDULER_CHUNK_SIZE": "64",
           "SEER_SCHEDULER_HEARTBEAT_INTERVAL": "0.5", "SEER_WORKER_SPECULATION": "false"}
    cfgs, err = _run_up(tmp_path, [], env)
    assert cfgs["scheduler"] == {"policy": "baseline", "chunk_size": 64, "heartbeat_interval": 0.5}
    assert cfgs["worker-0"] == {"speculation": False}
    assert "warning" not in err
    # An option given to `seer up` wins, with one warning line naming both.
    cfgs, err = _run_up(tmp_path, ["--policy", "divided", "--speculation", "on"], env)
    assert cfgs["scheduler"] == {"policy": "divided", "chunk_size": 64, "heartbeat_interval": 0.5}
    assert cfgs["worker-0"] == {"speculation": True}
    assert err.count("seer up: warning: --policy divided overrides SEER_SCHEDULER_POLICY=baseline") == 1
    assert err.count("seer up: warning: --speculation true overrides SEER_WORKER_SPECULATION=false") == 1


def test_up_without_options_or_variables_keeps_the_suite_defaults(tmp_path: Path) -> None:
    s = up.Suite(workers=1, base_port=0, data_dir=tmp_path, model_dir="/x")
    sched = config.load(SchedulerConfig, "scheduler", s.services["scheduler"].args, {})
    worker = config.load(WorkerConfig, "worker", s.services["worker-0"].args, {})
    assert (sched.policy, sched.chunk_size, sched.heartbeat_interval) == ("seer", 512, 1.0)
    assert worker.speculation is True and worker.model_dir == "/x"


def test_a_variable_for_a_field_the_suite_wires_is_reported(tmp_path: Path) -> None:
    warnings: list[str] = []
    up.Suite(workers=1, base_port=0, data_dir=tmp_path, model_dir="/x", env={"SEER_SCHEDULER_PORT": "1"},
             warn=warnings.append)
    assert warnings == ["SEER_SCHEDULER_PORT=1 is overridden: the suite sets the scheduler's port"]


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--chunk-size", "-5"], {}, "seer up: --chunk-size: must be >= 1, got -5"),
    ([], {"SEER_SCHEDULER_CHUNK_SIZE": "-5"}, "seer up: SEER_SCHEDULER_CHUNK_SIZE=-5: must be >= 1, got -5"),
    ([], {"SEER_SCHEDULER_POLICY": "foo"}, "seer up: SEER_SCHEDULER_POLICY=foo: 'foo' is not one of"),
    ([], {"SEER_WORKER_MAX_BATCH_SIZ": "4"}, "unknown variable SEER_WORKER_MAX_BATCH_SIZ"),
    (["--policy", "foo"], {}, "argument --policy: invalid choice: 'foo'"),
    (["--workers", "0"], {}, "argument --workers: must be at least 1, got 0"),
])
def test_up_refuses_a_bad_configuration_before_starting_anything(
        tmp_path: Path, flags: list[str], env: dict[str, str], message: str) -> None:
    """Before: the suite started, the scheduler exited with code 2 ("configuration error: ...")
    and a seer-suite-* directory with the logs was left behind; --workers 0 started a suite that
    hangs every batch. A real `seer up`: exit 2, the option or variable named, nothing left."""
    p = subprocess.run([sys.executable, "-m", "services.cli", "up", "--base-port", "0", "--model-dir", "/nonexistent",
                        *flags], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path), **env},
                       text=True, capture_output=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "starting the suite" not in p.stdout
    assert list(tmp_path.iterdir()) == [], "a state directory was left behind"


def test_up_help_lists_the_policies(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        up.main(["--help"])
    out = capsys.readouterr().out
    assert "{baseline,divided,seer,seer_history}" in out


def test_the_banner_lists_each_services_stdout_file(tmp_path: Path) -> None:
    """Console tracing's spans go to each service's stdout, <state dir>/logs/<service>.out: the
    banner listed only the .log files."""
    s = up.Suite(workers=0, base_port=0, data_dir=tmp_path, model_dir="/x", draft=False, kvstore=False)
    assert s.endpoints()["scheduler"]["out"] == str(tmp_path / "logs" / "scheduler.out")


@pytest.mark.parametrize("env", [{}, {"SEER_BUFFER_MODEL_DIR": "auto"}, {"SEER_WORKER_MODEL_DIR": ""}],
                         ids=["defaults", "buffer-auto", "worker-embedded"])
def test_the_embedded_model_on_both_sides_is_one_model(tmp_path: Path, env: dict[str, str]) -> None:
    """The buffer's "auto" (its default) and a worker's "" both mean the embedded model: not
    refused as two models (the first version of the check compared the words, and refused a plain
    Suite(workers=1) and SEER_BUFFER_MODEL_DIR=auto)."""
    from services.common.model_paths import default_model_dir

    for default in (None, str(default_model_dir())):
        s = up.Suite(workers=1, base_port=0, data_dir=tmp_path / f"d{len(str(default))}", env=env,
                     default_model_dir=default)
        s._check_configs()


def test_a_worker_on_another_model_than_the_buffers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(up.SuiteArgumentError) as info:
        up.Suite(workers=1, base_port=0, data_dir=tmp_path, env={"SEER_WORKER_MODEL_DIR": str(tmp_path)})
    assert "the buffer uses auto (default) but worker-0 uses" in str(info.value), info.value


def test_the_embedded_model_is_where_the_services_environment_puts_it(tmp_path: Path) -> None:
    """SEER_MODEL_DIR set for the services only (Suite(env=...)): their "auto" / "" resolve there,
    and so does the check (it read this process's environment: refused a suite on one model,
    accepted one on two)."""
    d = tmp_path / "model"
    d.mkdir()
    up.Suite(workers=1, base_port=0, data_dir=tmp_path / "a", env={"SEER_MODEL_DIR": str(d),
                                                                   "SEER_WORKER_MODEL_DIR": str(d)})
    with pytest.raises(up.SuiteArgumentError):
        up.Suite(workers=1, base_port=0, data_dir=tmp_path / "b", env={"SEER_MODEL_DIR": str(d),
                 "SEER_WORKER_MODEL_DIR": str(default_model_dir())})
