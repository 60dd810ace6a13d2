from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common import config
from services.common.pagehash import chain_hashes, page_hash
from services.common.server import ServiceConfig


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    data_dir: str = field(default="/tmp/x", metadata={"help": "where"})
    workers: int = 2
    speculation: bool = True
    ratio: float = 0.5
    addresses: tuple[str, ...] = ()
    optional_path: str | None = None


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"workers": 3, "ratio": 0.25}))
    env = {"SEER_DEMO_WORKERS": "4", "SEER_DEMO_SPECULATION": "off", "OTHER": "x"}
    cfg = config.load(DemoConfig, "demo", ["--config", str(f), "--ratio", "0.75", "--addresses", "a:1,b:2"], env)
    assert cfg.workers == 4  # env beats file
    assert cfg.ratio == 0.75  # flag beats file
    assert cfg.speculation is False
    assert cfg.addresses == ("a:1", "b:2")
    assert cfg.data_dir == "/tmp/x"
    assert cfg.optional_path is None


def test_unknown_env_key_is_rejected() -> None:
    with pytest.raises(config.ConfigError, match="SEER_DEMO_WORKRS"):
        config.load(DemoConfig, "demo", [], {"SEER_DEMO_WORKRS": "3"})


def test_unknown_file_key_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"wrkers": 3}))
    with pytest.raises(config.ConfigError, match="wrkers"):
        config.load(DemoConfig, "demo", ["--config", str(f)], {})


def test_bad_value_names_the_key() -> None:
    with pytest.raises(config.ConfigError, match="workers"):
        config.load(DemoConfig, "demo", ["--workers", "many"], {})
    with pytest.raises(ValueError, match="port"):
        config.load(DemoConfig, "demo", ["--port", "70000"], {})


def test_an_abbreviated_flag_is_refused_not_expanded(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse would read --work as --workers: a flag added later (--work-dir) would then silently
    # change what an old command line sets, so a prefix is an error naming the flag.
    with pytest.raises(SystemExit):
        config.load(DemoConfig, "demo", ["--work", "3"], {})
    assert "--work" in capsys.readouterr().err
    assert config.load(DemoConfig, "demo", ["--workers", "3"], {}).workers == 3


def test_to_env_round_trips() -> None:
    cfg = DemoConfig(workers=7, addresses=("x:1", "y:2"), speculation=False)
    assert config.load(DemoConfig, "demo", [], config.to_env(cfg, "demo")) == cfg


def test_page_hash_chains_and_depends_on_version() -> None:
    toks = list(range(40))
    hs = chain_hashes(toks, 16, "v1")
    assert len(hs) == 2  # partial tail page not hashed
    assert hs[0] == page_hash(None, toks[:16], "v1")
    assert hs[1] == page_hash(hs[0], toks[16:32], "v1")
    assert chain_hashes(toks, 16, "v2")[0] != hs[0]
    # Same page tokens under a different prefix hash differently.
    assert page_hash(b"\x01" * 16, toks[16:32], "v1") != hs[1]


def test_a_config_file_is_validated_with_the_layers_above_it(tmp_path: Path) -> None:
    """Cross-field rules apply to the merged config: the file alone was validated against the
    defaults, so a file's max_streams 100 was refused next to a flag's max_workers 200."""
    from services.buffer.config import BufferConfig

    f = tmp_path / "buffer.json"
    f.write_text(json.dumps({"max_streams": 100}))
    cfg = config.load(BufferConfig, "buffer", ["--config", str(f), "--max-workers", "200"], env={})
    assert (cfg.max_streams, cfg.max_workers) == (100, 200)
    cfg = config.load(BufferConfig, "buffer", [], env={"SEER_BUFFER_CONFIG": str(f), "SEER_BUFFER_MAX_WORKERS": "200"})
    assert cfg.max_streams == 100
    with pytest.raises(ValueError, match="max_streams"):  # and the merged config is still checked
        config.load(BufferConfig, "buffer", ["--config", str(f)], env={})
    f.write_text(json.dumps({"max_streams": "many"}))
    with pytest.raises(config.ConfigError, match=r"buffer\.json:max_streams"):  # types: named in the file
        config.load(BufferConfig, "buffer", ["--config", str(f), "--max-workers", "200"], env={})


@pytest.mark.parametrize("key,value", [
    ("workers", 2.5),  # int() truncated it to 2
    ("workers", [2]),
    ("data_dir", ["a", "b"]),  # became "['a', 'b']"
    ("data_dir", {"a": 1}),
    ("ratio", "nan"),  # nan passes every range check
    ("ratio", "inf"),
    ("ratio", True),
])
def test_values_of_another_kind_are_refused_not_converted(tmp_path: Path, key: str, value: object) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({key: value}))
    with pytest.raises(config.ConfigError, match=key):
        config.load(DemoConfig, "demo", ["--config", str(f)], env={})


def test_whole_numbers_and_strings_still_parse(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"workers": 3.0, "ratio": 1, "data_dir": 7, "addresses": ["a:1", "b:2"]}))
    cfg = config.load(DemoConfig, "demo", ["--config", str(f)], env={"SEER_DEMO_RATIO": "0.5"})
    assert (cfg.workers, cfg.ratio, cfg.data_dir, cfg.addresses) == (3, 0.5, "7", ("a:1", "b:2"))


def test_an_empty_tracing_mode_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helm and compose render an unset value as SEER_TRACING="": every service failed to start."""
    from services.common import telemetry

    monkeypatch.setenv("SEER_TRACING", "")
    assert telemetry.tracing_mode() == "none"


def test_a_service_logs_the_configuration_in_force_once_with_sources(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: nothing said which values were in force, nor which layer set them (a forgotten
    SEER_* variable, or a flag that silently outranked one). One line at start: the fields that
    differ from the defaults, each with its source."""
    import logging

    f = tmp_path / "c.json"
    f.write_text(json.dumps({"ratio": 0.25, "workers": 3}))
    env = {"SEER_DEMO_WORKERS": "4", "SEER_DEMO_CONFIG": str(f)}
    with caplog.at_level(logging.INFO, logger="services.common.config"):
        cfg = config.load_or_exit(DemoConfig, "demo", ["--speculation", "off", "--grace-seconds", "10"], env)
    assert cfg.workers == 4
    records = [r for r in caplog.records if r.name == "services.common.config"]
    assert len(records) == 1 and records[0].getMessage() == "configuration"
    assert records[0].fields == {"config": {  # type: ignore[attr-defined]
        "ratio": {"value": 0.25, "source": f"file {f}"},
        "workers": {"value": 4, "source": "env SEER_DEMO_WORKERS"},
        "speculation": {"value": False, "source": "flag --speculation"},
    }}  # grace_seconds: set, but to its default, so not a difference


def test_a_refused_value_names_its_field_and_source() -> None:
    with pytest.raises(config.ConfigError) as e:
        config.resolve(DemoConfig, "demo", [], {"SEER_DEMO_PORT": "70000"})
    assert (e.value.field, e.value.source) == ("port", config.Source("env", "SEER_DEMO_PORT"))
    with pytest.raises(config.ConfigError) as e:
        config.resolve(DemoConfig, "demo", ["--workers", "x"], {})
    assert (e.value.field, str(e.value.source)) == ("workers", "flag --workers")
    with pytest.raises(config.ConfigError, match="unrecognized arguments: --nope"):  # not an exit
        config.resolve(DemoConfig, "demo", ["--nope"], {}, exit_on_error=False)
