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
