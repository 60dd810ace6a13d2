"""docker/healthcheck.py dials the address the service binds: a service given one interface's
address (SEER_<SERVICE>_HOST) does not answer on 127.0.0.1, where the check always asked."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.buffer.config import BufferConfig
from services.cli import up
from services.common import ports
from services.common.config import ServiceConfig, load_field

ROOT = Path(__file__).resolve().parents[2]


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seer_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("host", "want"), [
    (None, "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("[::]", "127.0.0.1"),
    ("::0", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("::1", "[::1]"), ("[fd00::5]", "[fd00::5]"),
    ("localhost", "localhost"),
])
def test_the_default_address_follows_the_bind_host(monkeypatch: pytest.MonkeyPatch, host: str | None,
                                                   want: str) -> None:
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "buffer")
    monkeypatch.setenv("SEER_BUFFER_PORT", "50051")
    if host is None:
        monkeypatch.delenv("SEER_BUFFER_HOST", raising=False)
    else:
        monkeypatch.setenv("SEER_BUFFER_HOST", host)
    assert _healthcheck().default_address() == f"{want}:50051"


# ---- docker/healthcheck.py resolves the service's host and port as the service does ----------------

def _cmdline(path: Path, *argv: str) -> str:
    path.write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    return str(path)


@pytest.fixture
def health_server() -> Iterator[tuple[str, int]]:
    """A real gRPC health service (SERVING) on 127.0.0.2, a loopback address the healthcheck's
    fallback (127.0.0.1:50051, or the image's SEER_<SERVICE>_PORT) does not reach."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.2:0")
    if not port:
        pytest.skip("cannot bind 127.0.0.2")
    server.start()
    yield "127.0.0.2", port
    server.stop(0)


@pytest.mark.parametrize("how", ["flags", "equals-flags", "config-flag", "config-env", "under-init"])
def test_the_healthcheck_dials_the_host_and_port_the_service_binds(
        how: str, health_server: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the check read SEER_<SERVICE>_HOST / _PORT only, so a service given its host or port
    by flags after the image name (`docker run seer-buffer --host 10.0.0.5`) or by a --config file
    was dialled where it does not listen, and the container reported unhealthy for ever."""
    host, port = health_server
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "buffer")
    for name in ("SEER_BUFFER_HOST", "SEER_BUFFER_PORT", "SEER_BUFFER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "buffer.json"
    config.write_text(json.dumps({"host": host, "port": port, "data_dir": "/d"}))
    service = ["python", "-m", "services.buffer", "--data-dir", "/d"]
    if how == "flags":
        argv = [*service, "--host", host, "--port", str(port)]
        monkeypatch.setenv("SEER_BUFFER_HOST", "0.0.0.0")  # as the image sets them: the flags win
        monkeypatch.setenv("SEER_BUFFER_PORT", "50051")
    elif how == "equals-flags":
        argv = [*service, f"--host={host}", f"--port={port}"]
    elif how == "config-flag":
        argv = [*service, "--config", str(config)]
    elif how == "config-env":
        argv = service
        monkeypatch.setenv("SEER_BUFFER_CONFIG", str(config))
    else:  # docker run --init: tini is pid 1, the service its child
        argv = ["/sbin/docker-init", "--", *service, "--host", host, "--port", str(port)]
    hc = _healthcheck()
    monkeypatch.setattr(hc, "CMDLINE", _cmdline(tmp_path / "cmdline", *argv), raising=False)
    assert hc.main(["--timeout", "5"]) == 0


def test_the_healthcheck_resolves_with_the_services_own_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flag > environment > config file > default, by services.common.config.load_field itself and
    dialled by services.common.ports.dial_host itself (the check kept copies of both: they could
    drift from the services silently); host and port alike, the service's own default port when none
    is set."""
    hc = _healthcheck()
    assert hc.load_field is load_field
    assert hc.dial_host is ports.dial_host is up.dial_host
    cases: list[tuple[list[str], dict[str, str]]] = [
        ([], {}),
        (["--host", "10.0.0.9", "--port", "7"], {"SEER_BUFFER_HOST": "::1", "SEER_BUFFER_PORT": "8"}),
        (["--port=9"], {"SEER_BUFFER_PORT": "8", "SEER_BUFFER_HOST": "::"}),
        ([], {"SEER_BUFFER_HOST": "", "SEER_BUFFER_PORT": "8"}),
        ([], {"SEER_BUFFER_HOST": "fd00::5", "SEER_BUFFER_PORT": " +8"}),
    ]
    for args, env in cases:
        env = {"SEER_IMAGE_SERVICE": "buffer", **env}
        host, port = (load_field(BufferConfig, "buffer", f, args, env) for f in ("host", "port"))
        want = f"{up.dial_host(host)}:{port}"
        monkeypatch.setattr(hc, "service_args", lambda service, path, args=args: list(args))
        assert hc.default_address(env) == want, (args, env)


@pytest.mark.parametrize(("setting", "named"), [
    ({"SEER_BUFFER_PORT": "50052.5"}, "50052.5"),
    ({"SEER_BUFFER_CONFIG": str(ROOT / "pyproject.toml")}, "Expecting value"),  # not JSON
    ({"SEER_BUFFER_CONFIG": "/nonexistent/buffer.json"}, "/nonexistent/buffer.json"),
])
def test_a_configuration_the_service_refuses_is_reported(setting: dict[str, str], named: str,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The service exits on it at start: the check says why instead of dialling a guess (a port it
    refuses was dialled as spelled, an unreadable config file was taken as unset)."""
    for name in ("SEER_BUFFER_HOST", "SEER_BUFFER_PORT", "SEER_BUFFER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "buffer")
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((ValueError, OSError)):
        load_field(ServiceConfig, "buffer", "port", [], dict(os.environ))  # the service's own reading
    assert _healthcheck().main(["--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("configuration: ") and named in out, out


def test_the_healthcheck_runs_as_the_image_runs_it(health_server: tuple[str, int], tmp_path: Path) -> None:
    """`python /opt/seer/healthcheck.py` in the image: the script alone, from another directory, with
    the services importable only as the installed project (here the venv's install of it)."""
    host, port = health_server
    script = tmp_path / "healthcheck.py"
    script.write_bytes((ROOT / "docker" / "healthcheck.py").read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SEER_")}
    env.update(SEER_IMAGE_SERVICE="buffer", SEER_BUFFER_HOST=host, SEER_BUFFER_PORT=str(port))
    done = subprocess.run([sys.executable, str(script), "--timeout", "5"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{host}:{port}: SERVING"


def test_a_command_line_of_another_program_is_not_read(tmp_path: Path) -> None:
    """pid 1 not the service (a shell, another image's entrypoint): its flags are not the service's."""
    hc = _healthcheck()
    path = _cmdline(tmp_path / "cmdline", "python", "-m", "services.scheduler", "--host", "10.0.0.9")
    assert hc.service_args("buffer", path) == []
    assert hc.service_args("buffer", str(tmp_path / "missing")) == []
    assert hc.default_address({"SEER_IMAGE_SERVICE": "buffer", "SEER_BUFFER_PORT": "5"}, path) == "127.0.0.1:5"


@pytest.mark.parametrize(("source", "spelling"), [
    ("config", "float"), ("config", "padded-string"), ("config", "string"),
    ("env", "padded"), ("env", "signed"), ("flag", "padded"),
])
def test_the_port_is_read_as_the_service_reads_it(source: str, spelling: str, health_server: tuple[str, int],
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spellings the service's config parser (_parse_value) takes as the port: a whole JSON number
    (50052.0), a string int() takes (" 50052", "+50052"). Before: dialled as spelled
    ("127.0.0.2:50052.0"), so a service that started on the port was unhealthy for ever."""
    host, port = health_server
    for name in ("SEER_BUFFER_HOST", "SEER_BUFFER_PORT", "SEER_BUFFER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "buffer")
    raw: object = {"float": float(port), "padded-string": f" {port}", "string": str(port),
                   "padded": f" {port} ", "signed": f"+{port}"}[spelling]
    argv = ["python", "-m", "services.buffer", "--host", host]
    if source == "config":
        config = tmp_path / "buffer.json"
        config.write_text(json.dumps({"port": raw}))
        argv += ["--config", str(config)]
    elif source == "env":
        monkeypatch.setenv("SEER_BUFFER_PORT", str(raw))
    else:
        argv += ["--port", str(raw)]
    hc = _healthcheck()
    cmdline = _cmdline(tmp_path / "cmdline", *argv)
    monkeypatch.setattr(hc, "CMDLINE", cmdline, raising=False)
    assert load_field(ServiceConfig, "buffer", "port", argv[3:], dict(os.environ)) == port  # the service's reading
    assert hc.default_address() == f"{host}:{port}"
    assert hc.main(["--timeout", "5"]) == 0


@pytest.mark.parametrize("service", ["buffer", "scheduler", "draft", "kvstore", "worker"])
def test_the_default_port_is_the_services_own(service: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """No port set anywhere: the service binds its own config class's default (the draft server
    50053), and the check dials that one, or says a port picked at start cannot be checked. It read
    ServiceConfig's 0 and dialled 50051 for every service (a draft server on 50053 was checked on
    the buffer's port)."""
    hc = _healthcheck()
    for name in list(os.environ):
        if name.startswith(f"SEER_{service.upper()}_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SEER_IMAGE_SERVICE", service)
    monkeypatch.setattr(hc, "service_args", lambda service, path: [])
    cls = hc.config_class(service)
    assert cls is not ServiceConfig and cls.__name__.lower().startswith(service[:5])
    own = load_field(cls, service, "port", [], {})
    if own:
        assert hc.default_address() == f"127.0.0.1:{own}"
        assert service != "draft" or own == 50053
    else:
        assert hc.main(["--timeout", "1"]) == 1
        assert capsys.readouterr().out.startswith("configuration: port: 0")


def test_an_unknown_image_service_is_named(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "bufer")
    assert _healthcheck().main(["--print-address"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("configuration: SEER_IMAGE_SERVICE") and "'bufer'" in out, out


def test_print_address_prints_what_it_would_dial(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What the image build runs (docker/Dockerfile*): the check's imports and the image's
    configuration are tried once at build time."""
    hc = _healthcheck()
    monkeypatch.setenv("SEER_IMAGE_SERVICE", "draft")
    monkeypatch.setenv("SEER_DRAFT_HOST", "0.0.0.0")
    monkeypatch.setenv("SEER_DRAFT_PORT", "50053")
    monkeypatch.setattr(hc, "service_args", lambda service, path: [])
    assert hc.main(["--print-address"]) == 0
    assert capsys.readouterr().out.strip() == "127.0.0.1:50053"
